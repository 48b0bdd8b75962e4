"""SynthX: a conditional 3D diffusion tumor generator (sex, age band, contrast phase) built on diffusers.

Layout: :mod:`.model` (denoiser, autoencoder), :mod:`.pipeline` (the DiffusionPipeline),
:mod:`.schedulers`, :mod:`.mask_prior`, :mod:`.config` (the recipe schema), :mod:`.training`
(data, LightningModules, the run), :mod:`.provenance`, :mod:`.targeting`, :mod:`.generation`
(canvases, painting, writing, the run), :mod:`.quality`, :mod:`.workflows` (the study, its
replicates, its report, the sweep) and the command-line front ends in :mod:`.commands`. Builds on :mod:`lightning_modules` (cohorts, splits,
training and evaluation); never the other way round.
"""
