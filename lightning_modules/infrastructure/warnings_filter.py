"""Silence the library messages that say nothing to a ``benchx`` user, one by one, with the reason.

Installed by the ``benchx`` command line when it starts (``lightning_modules.cli``), not on import
of the package: a library user or a test still sees every warning. Each filter matches one message
by its text and the module that emits it, so a new or different warning still shows.

Example::

    from lightning_modules.infrastructure.warnings_filter import install
    install()
"""

from __future__ import annotations

import logging
import warnings

# (message regex, category, module regex, why it is noise here)
WARNING_FILTERS: tuple[tuple[str, type[Warning], str, str], ...] = (
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        FutureWarning,
        r"(lightning|pytorch_lightning|torch)\..*",
        "raised inside Lightning's own pytree helper on torch >= 2.10; nothing in this project to change",
    ),
    (
        r"NvImgCodecPydicomReader: nvImageCodec decoder plugin did not register",
        UserWarning,
        r"monai\..*",
        "an optional GPU DICOM decoder; MONAI falls back to pydicom's own decoders, which read every scan",
    ),
    (
        r"The specified dataset source can be interpreted in multiple ways",
        UserWarning,
        r"mlflow\..*",
        "a cohort folder logged as a dataset source matches both MLflow's local and HTTP resolvers; "
        "MLflow picks the local one, which is right",
    ),
    (
        r"Setting affine, but the applied meta contains an affine",
        UserWarning,
        r"monai\..*",
        "MONAI's MetaTensor when a resampling transform writes the new affine over the one it read; "
        "the new affine is the intended one (the masks and CT stay on one grid)",
    ),
    (
        r"The `srun` command is available on your system but is not used",
        UserWarning,
        r"lightning\..*",
        "Slurm's client tools are installed (the project's own Slurm scripts use them); a run started "
        "without srun is a one-machine run on purpose, and docs/scaling.md says how to start under Slurm",
    ),
    (
        r"When using the `ThroughputMonitor`, you need to define a `flops_per_batch`",
        UserWarning,
        r"lightning\..*",
        "the throughput monitor logs samples and batches per second; FLOPs are not computed for 3D "
        "backbones here",
    ),
    (
        r"Using `DistributedSampler` with the dataloaders. During `trainer.(validate|test)\(\)`",
        UserWarning,
        r"lightning\..*",
        "evaluation under DDP: the sampler's padding repeats a few cases, and the per-case records are "
        "gathered and de-duplicated by case id before any metric, so every case counts exactly once",
    ),
    (
        r"It is recommended to use `self.log\('(val|test)/.*sync_dist=True\)` when logging on epoch level",
        UserWarning,
        r"lightning\..*",
        "the evaluation metrics are computed from the per-case records gathered from every rank, so "
        "every rank holds the same value; syncing would average identical numbers",
    ),
)

# (logger name, message substring, why it is noise here)
LOG_FILTERS: tuple[tuple[str, str, str], ...] = (
    (
        "monai.data.nvimgcodec_pydicom_plugin",
        "nvImageCodec is not available",
        "an optional GPU DICOM decoder; DICOM import falls back to pydicom's own decoders",
    ),
    (
        "lightning.pytorch.utilities.rank_zero",
        "try installing [litlogger]",
        "an advertisement for a cloud logger; runs are tracked in MLflow",
    ),
    (
        "diffusers.models.modeling_utils",
        "Cannot initialize model with low cpu memory usage because `accelerate` was not found",
        "accelerate is not a dependency: SynthX's models are small and load whole, as diffusers then does",
    ),
)


class _DropMessages(logging.Filter):
    """Drops the records whose message contains one of the given substrings."""

    def __init__(self, substrings: list[str]):
        super().__init__()
        self.substrings = substrings

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.substrings)


def install() -> None:
    """Add the filters above to :mod:`warnings` and to the emitting loggers (idempotent)."""
    for message, category, module, _reason in WARNING_FILTERS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    by_logger: dict[str, list[str]] = {}
    for name, text, _reason in LOG_FILTERS:
        by_logger.setdefault(name, []).append(text)
    for name, texts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(texts))
