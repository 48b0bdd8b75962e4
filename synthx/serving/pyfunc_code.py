"""Models-from-code entry of the SynthX generator pyfunc: MLflow stores and runs this file to build the
model (instead of pickling an object); the class lives in :mod:`synthx.serving.pyfunc`."""

import mlflow.models

from synthx.serving.pyfunc import GeneratorModel

mlflow.models.set_model(GeneratorModel())
