"""BenchX base package: recipes, data, models, evaluation, tracking, training and the commands.

Subpackages: ``config`` (layered recipes), ``data`` (cohorts, splits, datamodule, phantom, importers,
audit), ``models`` (backbones, SegmentationModule, checkpoints), ``evaluation`` (detection, subgroups,
bootstrap, evaluate/compare) and ``commands`` (argparse for ``benchx``). The base never imports
:mod:`synthx` (docs/design.md "Layering"): a synthetic cohort is just a cohort on disk with
``synthetic=1`` rows.
"""

__version__ = "0.1.0"

from lightning_modules.config.numerics import pin_cpu_environment

# Machine-independent CPU arithmetic (lightning_modules.config.numerics), before torch runs anything.
pin_cpu_environment()
