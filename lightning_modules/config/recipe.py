"""The segmentation recipe's schema: one typed section per layer, and the checks of its values.

Each layer receives its own section: the data layer ``data`` (:class:`DataConfig`), the model
layer ``model``, ``optim`` and ``loss``, the trainer ``trainer``, the evaluation ``detection``, the
mixing of synthetic cases ``synthx`` (:class:`SynthXMixConfig`). Choices are Enums, so a value
outside them is refused by the schema when the recipe is loaded, naming the key. This module
imports nothing else of the project: every layer may read the schema.

The recipe is loaded (and each layer's own checks run, once) by :mod:`lightning_modules.recipe`;
the layers are merged by :mod:`lightning_modules.config.loader` (shared with SynthX): schema
defaults -> ``recipes/_base.yaml`` -> the backbone's recipe -> the recipe's profile
(``profiles.<name>``, e.g. ``cpu``) -> command-line ``key=value`` overrides. The top level of a
recipe is the full-size setting (``docs/explanation/training.md "Touchstone hyper-parameters"``, BenchX tables 7
and 8); ``profiles.cpu`` shrinks it for this machine and the tests.

Example::

    recipe = load_recipe("recipes/unet.yaml", ["profile=cpu", "trainer.max_steps=50"])  # lightning_modules.recipe
    datamodule = CohortDataModule(recipe.data, seed=recipe.seed)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_modules.config.loader import RecipeError
from lightning_modules.config.memory import available_memory_bytes

__all__ = [
    "CacheMode", "DataConfig", "DetectionConfig", "DetectionScore", "LossConfig", "MixingMode", "ModelConfig",
    "Normalization", "OptimConfig", "OptimizerName", "Recipe", "RecipeError", "Schedule", "SynthXMixConfig",
    "ThresholdRule", "TrackingConfig", "TrainerConfig", "check_values",
]


# The choices of the schema. Member names equal their values, so a recipe spells them as before
# (``cache: disk``) and a resolved recipe is written the same; each compares equal to its text.
Normalization = StrEnum("Normalization", ["window", "ct"], module=__name__)
CacheMode = StrEnum("CacheMode", ["memory", "disk", "none"], module=__name__)
OptimizerName = StrEnum("OptimizerName", ["sgd", "adamw"], module=__name__)
Schedule = StrEnum("Schedule", ["poly", "cosine", "constant"], module=__name__)
ThresholdRule = StrEnum("ThresholdRule", ["fixed", "f1", "youden"], module=__name__)
DetectionScore = StrEnum("DetectionScore", ["volume", "max_prob"], module=__name__)
MixingMode = StrEnum("MixingMode", ["add", "displace"], module=__name__)


@dataclass
class CTIntensityConfig:
    # nnU-Net's CT normalisation statistics of the training foreground, in HU
    # (lightning_modules/data/intensity.py); measured when training starts.
    mean: float = 0.0
    std: float = 1.0
    percentile_00_5: float = 0.0
    percentile_99_5: float = 0.0


@dataclass
class DataConfig:
    root: str = "data/phantom"
    split: str = "splits/phantom.csv"
    # Classes trained on, in label order after background (docs/explanation/data.md "Cohorts on disk").
    classes: list[str] = field(default_factory=lambda: ["pancreas", "pancreatic_lesion"])
    tumor_class: str = "pancreatic_lesion"
    spacing: list[float] = field(default_factory=lambda: [1.5, 1.5, 1.5])
    hu_window: list[float] = field(default_factory=lambda: [-175.0, 250.0])
    # window: hu_window -> [0, 1] (Touchstone); ct: nnU-Net's CT normalisation (clip to the training
    # foreground's 0.5/99.5 percentiles, z-score), its statistics in ct_intensity (measured if null).
    normalization: Normalization = Normalization.window
    ct_intensity: Optional[CTIntensityConfig] = None
    patch_size: list[int] = field(default_factory=lambda: [96, 96, 96])
    batch_size: int = 2
    samples_per_volume: int = 2
    # Patch centres (RandCropByLabelClassesd ratios): background `neg`, each organ class `pos`,
    # each lesion class `pos * lesion_ratio`, so lesions are sampled often though they are small.
    pos: float = 1.0
    neg: float = 1.0
    lesion_ratio: float = 2.0
    augment: bool = True
    # memory (CacheDataset) | disk (PersistentDataset in cache_dir, shared by ranks) | none.
    cache: CacheMode = CacheMode.memory
    # Folder of the disk cache; empty = <tracking.output_dir>/data-cache.
    cache_dir: str = ""
    num_workers: int = 0
    # The checks of `validate` run before training; a broken cohort is refused.
    validate: bool = True
    allow_leakage: bool = False


@dataclass
class ModelConfig:
    backbone: str = "unet"
    # Keyword arguments of the backbone's builder, checked against its signature at recipe load.
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.sgd
    lr: float = 1e-2
    weight_decay: float = 3e-5
    momentum: float = 0.99
    nesterov: bool = True
    schedule: Schedule = Schedule.poly
    warmup_steps: int = 0
    poly_power: float = 0.9


@dataclass
class LossConfig:
    dice_weight: float = 1.0
    ce_weight: float = 1.0
    # Dice over the whole batch rather than per patch (nnU-Net's batch Dice).
    batch_dice: bool = True
    # nnU-Net: weights 1/2^i for deep-supervision scale i, the lowest scale dropped, normalized.
    deep_supervision_decay: float = 0.5


@dataclass
class TrainerConfig:
    max_steps: int = 250_000
    val_every_n_steps: int = 2_000
    accelerator: str = "auto"
    devices: Any = 1
    # ddp for several processes (Lightning's launcher, torchrun, srun); devices x num_nodes = processes.
    strategy: str = "auto"
    num_nodes: int = 1
    precision: str = "32-true"
    log_every_n_steps: int = 50
    gradient_clip_val: Optional[float] = None
    sw_batch_size: int = 4
    sw_overlap: float = 0.5
    # Sliding-window size for whole-volume inference; empty = data.patch_size. Fully convolutional
    # backbones (U-Net, nnU-Net) may use larger windows than they train on: fewer, cheaper windows.
    sw_roi_size: list[int] = field(default_factory=list)
    deterministic: bool = False
    # last.ckpt is also written every this many steps, so a killed run loses at most that much.
    checkpoint_every_n_steps: int = 1000
    progress_bar: bool = True


@dataclass
class DetectionConfig:
    # docs/explanation/detection-and-statistics.md "Scan-level detection": a scan is positive when its predicted tumor volume exceeds m (mm^3).
    threshold_mm3: float = 50.0
    # fixed | f1 | youden: 'f1'/'youden' choose m on the validation split, then apply it to test.
    threshold_rule: ThresholdRule = ThresholdRule.fixed
    # Patient resamples of the validation records whose choices are averaged (a bagged cut-point,
    # evaluation/thresholds.py); 0 applies the rule once. Also used for the study's validation point.
    threshold_bootstrap: int = 2000
    score: DetectionScore = DetectionScore.volume
    # nnU-Net-style post-processing: predicted tumor components smaller than this (mm^3) are removed
    # before the scan-level score (lightning_modules/models/tumor_outputs.py).
    min_component_mm3: float = 0.0
    small_tumor_mm: float = 20.0
    bootstrap_resamples: int = 2000
    confidence: float = 0.95


@dataclass
class TrackingConfig:
    # None: MLFLOW_TRACKING_URI if set (as `mlflow run` does), else sqlite:///mlflow.db.
    uri: Optional[str] = None
    experiment: str = "benchx"
    run_name: Optional[str] = None
    output_dir: str = "outputs"
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class SynthXMixConfig:
    # add: synthetic draws on top of every real case per epoch (r = synthetic / real exposures);
    # displace: each draw synthetic with probability r (lightning_modules/data/mixing.py).
    ratio: float = 0.0
    mode: MixingMode = MixingMode.add
    cohort: Optional[str] = None
    generator_run: Optional[str] = None
    # Exposure-matched schedule (lightning_modules/data/exposure.py): the first real_steps x batch
    # draws are the real stream every arm shares; trainer.max_steps = real_steps x (1 + ratio).
    real_steps: Optional[int] = None
    # Sham arm: each synthetic slot is filled by a real training positive of the synthetic case's cell.
    sham: bool = False


@dataclass
class Recipe:
    name: str = "unet"
    seed: int = 0
    profile: str = "full"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    synthx: SynthXMixConfig = field(default_factory=SynthXMixConfig)
    # Named sets of overrides (e.g. 'cpu'); applied when `profile` names one.
    profiles: dict[str, Any] = field(default_factory=dict)


MIN_SPACING_MM, MAX_SPACING_MM = 0.1, 100.0
# What Lightning's Trainer(precision=...) accepts.
PRECISIONS = ("64-true", "64", "32-true", "32", "16-mixed", "16", "bf16-mixed", "bf16", "16-true", "bf16-true",
              "transformer-engine", "transformer-engine-float16")
# One batch of float32 input patches must fit in half the available memory (the network's
# activations take many times more; this bound only refuses what can never be allocated).
PATCH_BYTES_PER_VOXEL = 4


# The numeric settings with an obvious valid range: (dotted key, test, what it must be). Each test
# is written so that NaN fails it (every comparison with NaN is false).
RANGES: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("seed", lambda v: v >= 0, ">= 0"),
    # Resampled to a finer grid than 0.1 mm an abdominal CT has trillions of voxels.
    ("data.spacing", lambda v: MIN_SPACING_MM <= v <= MAX_SPACING_MM, f"> 0 mm, within [{MIN_SPACING_MM}, {MAX_SPACING_MM}] mm"),
    ("data.patch_size", lambda v: v >= 1, ">= 1 voxel"),
    ("data.batch_size", lambda v: v >= 1, ">= 1"),
    ("data.samples_per_volume", lambda v: v >= 1, ">= 1"),
    ("data.pos", lambda v: 0 <= v < math.inf, ">= 0"),
    ("data.neg", lambda v: 0 <= v < math.inf, ">= 0"),
    ("data.lesion_ratio", lambda v: 0 <= v < math.inf, ">= 0"),
    ("data.num_workers", lambda v: v >= 0, ">= 0"),
    ("optim.lr", lambda v: 0 < v < math.inf, "a finite number > 0"),
    ("optim.weight_decay", lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    ("optim.momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("optim.poly_power", lambda v: 0 < v < math.inf, "a finite number > 0"),
    ("loss.dice_weight", lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    ("loss.ce_weight", lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    ("loss.deep_supervision_decay", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("trainer.max_steps", lambda v: v >= 1, ">= 1"),
    ("trainer.val_every_n_steps", lambda v: v >= 0, ">= 0 (0: no validation)"),
    ("trainer.num_nodes", lambda v: v >= 1, ">= 1"),
    ("trainer.log_every_n_steps", lambda v: v >= 1, ">= 1"),
    ("trainer.gradient_clip_val", lambda v: 0 < v < math.inf, "a finite number > 0 (or null: no clipping)"),
    ("trainer.sw_batch_size", lambda v: v >= 1, ">= 1"),
    ("trainer.sw_overlap", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("trainer.sw_roi_size", lambda v: v >= 1, ">= 1 voxel"),
    ("trainer.checkpoint_every_n_steps", lambda v: v >= 0, ">= 0 (0: only at validation)"),
    ("detection.threshold_mm3", lambda v: math.isfinite(v), "a finite number"),
    ("detection.threshold_bootstrap", lambda v: v >= 0, "0 (no bagging) or a number of resamples"),
    ("detection.min_component_mm3", lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    ("detection.small_tumor_mm", lambda v: 0 < v < math.inf, "a finite number > 0"),
    ("detection.bootstrap_resamples", lambda v: v >= 0, ">= 0"),
    ("detection.confidence", lambda v: 0 < v < 1, "in (0, 1)"),
)


def check_ranges(config: DictConfig, source: str = "recipe") -> None:
    """Every numeric setting of :data:`RANGES` in its range (each value of a list), and the HU window
    increasing; the first one out of range is named with what it must be."""
    for key, valid, expected in RANGES:
        value = OmegaConf.select(config, key)
        if value is None:
            continue
        values = list(value) if OmegaConf.is_list(value) else [value]
        for item in values:
            if isinstance(item, bool) or not isinstance(item, (int, float)) or not valid(item):
                shown = list(value) if len(values) > 1 or OmegaConf.is_list(value) else value
                raise RecipeError(f"{source}: {key} must be {expected}, got {shown}")
    window = list(config.data.hu_window)
    if len(window) != 2 or not all(math.isfinite(v) for v in window) or not window[0] < window[1]:
        raise RecipeError(f"{source}: data.hu_window must be two finite HU values, low < high, got {window}")
    if config.data.pos + config.data.neg <= 0:
        raise RecipeError(f"{source}: data.pos and data.neg cannot both be 0 (no patch centre could be drawn)")
    if config.loss.dice_weight + config.loss.ce_weight <= 0:
        raise RecipeError(f"{source}: loss.dice_weight and loss.ce_weight cannot both be 0 (nothing to train on)")


def check_values(config: DictConfig, source: str = "recipe") -> None:
    """The checks of the recipe's values that need no other layer: shapes, ranges, and the settings
    that must agree with each other. The backbone's options are checked by the model layer and the
    exposure schedule by the data layer (:func:`lightning_modules.recipe.check_recipe` runs all)."""
    data = config.data
    if len(data.patch_size) != 3 or len(data.spacing) != 3:
        raise RecipeError(f"{source}: data.patch_size and data.spacing need 3 values")
    check_ranges(config, source)
    if data.tumor_class not in data.classes:
        raise RecipeError(f"{source}: data.tumor_class {data.tumor_class!r} is not one of data.classes {list(data.classes)}")
    if not 0.0 <= config.synthx.ratio <= (1.0 if config.synthx.mode == MixingMode.displace else 10.0):
        raise RecipeError(f"{source}: synthx.ratio must be in [0, 1] (displace) or [0, 10] (add), got {config.synthx.ratio}")
    stats = config.data.ct_intensity
    if stats is not None and not (0 < stats.std < math.inf and stats.percentile_00_5 < stats.percentile_99_5):
        raise RecipeError(f"{source}: data.ct_intensity needs std > 0 and percentile_00_5 < percentile_99_5, "
                          f"got {OmegaConf.to_container(stats)}")
    if config.synthx.sham and (config.synthx.real_steps is None or config.synthx.ratio == 0):
        raise RecipeError(f"{source}: synthx.sham needs an exposure-matched schedule with synthetic slots "
                          "(synthx.real_steps and synthx.ratio > 0)")
    if len(config.trainer.sw_roi_size) not in (0, 3):
        raise RecipeError(f"{source}: trainer.sw_roi_size needs 3 values (or none: data.patch_size)")
    check_trainer_choices(config.trainer, source)
    check_patch_memory(config, source)


def check_trainer_choices(trainer: DictConfig, source: str = "recipe") -> None:
    """``trainer.precision`` one of Lightning's; ``trainer.devices`` a count, -1, "auto" or device indices."""
    precision = str(trainer.precision)
    if precision not in PRECISIONS:
        raise RecipeError(f"{source}: trainer.precision must be one of {', '.join(PRECISIONS)}, got {trainer.precision!r}")
    devices = trainer.devices
    if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        items = list(devices)
        valid = bool(items) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items)
    elif isinstance(devices, bool):
        valid = False
    elif isinstance(devices, int):
        valid = devices >= 1 or devices == -1
    else:
        text = str(devices).strip()
        parts = [p.strip() for p in text.split(",") if p.strip()]
        valid = text == "auto" or text == "-1" or (bool(parts) and all(p.isdigit() for p in parts)
                                                   and (len(parts) > 1 or text.endswith(",") or int(parts[0]) >= 1))
    if not valid:
        raise RecipeError(f"{source}: trainer.devices must be a number of devices >= 1, -1 (all), 'auto', "
                          f"or a list of device indices such as [0, 1], got {devices!r}")


def check_patch_memory(config: DictConfig, source: str = "recipe", available: int | None = None) -> None:
    """One batch of input patches (and one sliding window batch) within half the available memory.

    Args:
        available: the available memory in bytes (default: what the system reports; unknown: not checked).
    """
    available = available_memory_bytes() if available is None else int(available)
    if available is None:
        return
    limit = available // 2
    data, trainer = config.data, config.trainer
    batches = [("data.patch_size", list(data.patch_size), int(data.batch_size) * int(data.samples_per_volume))]
    if len(trainer.sw_roi_size):
        batches.append(("trainer.sw_roi_size", list(trainer.sw_roi_size), int(trainer.sw_batch_size)))
    for key, size, count in batches:
        needed = math.prod(int(n) for n in size) * count * PATCH_BYTES_PER_VOXEL
        if needed > limit:
            raise RecipeError(
                f"{source}: {key} {size} x {count} patches per batch is {needed / 1e9:,.1f} GB of float32 input alone, "
                f"more than half the available memory ({limit / 1e9:,.1f} GB): use a smaller {key} "
                f"(each dimension at most about {int((limit / (count * PATCH_BYTES_PER_VOXEL)) ** (1 / 3))} voxels)"
            )
