"""A trained SynthX generator as an MLflow pyfunc model for the registry: :mod:`.pyfunc` (the model
class and its logging) and :mod:`.pyfunc_code` (the models-from-code entry MLflow loads in the
serving process).
"""
