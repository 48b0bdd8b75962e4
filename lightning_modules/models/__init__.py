"""Backbones, the SegmentationModule, checkpoints and planning; importing it turns oneDNN's CPU
convolutions off for machine-independent figures (:mod:`lightning_modules.config.numerics`)."""

from lightning_modules.config.numerics import pin_cpu_kernels

pin_cpu_kernels()
