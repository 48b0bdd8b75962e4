"""BenchX base package: the libraries, the workflows built on them, and the ``benchx`` commands.

Libraries (import no MLflow): ``config`` (the recipe schema, value checks and pinned CPU arithmetic;
imports nothing else of the project), ``data`` (cohorts on disk, metadata, splits, the datamodule,
mixing and exposure), ``cohorts`` (the phantom, importers and the leakage audit), ``models``
(backbones, planning, the SegmentationModule, checkpoints), ``evaluation`` (scan-level detection,
subgroups, thresholds, small-count statistics, the bootstrap and seed pooling) and ``inference``;
``infrastructure`` (atomic file writes, run folders, the process around a run, monitoring, the
warnings filter) sits below the layers that use it.
``recipe`` loads a whole recipe and has each layer check its section. Above them: ``tracking`` (the
MLflow adapter, pyfunc serving and the registry's operating point), ``workflows`` (train, evaluate,
operating points, the comparison table, training overlap), ``trainer``, and ``commands`` with
``cli`` (argparse for ``benchx``). The base never imports :mod:`synthx` (docs/explanation/architecture.md
"Layering"): a synthetic cohort is just a cohort on disk with ``synthetic=1`` rows.

Importing the package pins torch's CPU arithmetic to one path (:mod:`lightning_modules.config.numerics`).
"""

__version__ = "0.1.0"

from lightning_modules.config.numerics import pin_cpu_environment

# Machine-independent CPU arithmetic (lightning_modules.config.numerics), before torch runs anything.
pin_cpu_environment()
