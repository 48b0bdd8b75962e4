"""SynthX: a conditional 3D diffusion tumor generator (sex, age band, contrast phase) built on diffusers.

Layout, bottom to top: :mod:`.config` (the recipe schema), :mod:`.conditions` and :mod:`.painters`
(vocabularies, no torch); :mod:`.generator` (denoiser, autoencoder, pipeline, schedulers, mask
prior, provenance: the generator as a library); :mod:`.training` (data and LightningModules, then
the run) and :mod:`.generation` (targeting, canvases, painting, writing, then the run);
:mod:`.analysis` (the study's statistics: endpoint, verdict, power, decomposition, realism);
:mod:`.serving` (the pyfunc model); :mod:`.workflows` (the study, its replicates, its report, the
sweep) and the command-line front ends in :mod:`.commands`. Builds on :mod:`lightning_modules`
(cohorts, splits, training and evaluation); never the other way round.
"""
