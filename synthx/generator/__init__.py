"""The SynthX generator as a library: the denoiser and autoencoder (:mod:`.model`, diffusers
``ModelMixin``), the inpainting pipeline (:mod:`.pipeline`, a ``DiffusionPipeline``), its noise
schedulers (:mod:`.schedulers`), the prior that draws tumor masks (:mod:`.mask_prior`) and what a
trained generator records about its training cases (:mod:`.provenance`). No MLflow and no workflow:
training runs are :mod:`synthx.training`, painting cohorts :mod:`synthx.generation`.
"""
