"""BenchX base package: cohorts, splits, backbones, the segmentation module, evaluation, tracking.

The base never imports :mod:`synthx` (DESIGN.md section 0): a synthetic cohort is just a cohort on
disk with ``synthetic=1`` rows.
"""

__version__ = "0.1.0"
