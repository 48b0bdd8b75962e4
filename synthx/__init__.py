"""SynthX: a conditional 3D diffusion tumor generator (sex, age band, contrast phase) built on diffusers.

Builds on :mod:`lightning_modules` (cohorts, splits, training and evaluation); never the other way round.
"""
