"""The SynthX recipe schema: OmegaConf YAML merged onto a structured schema in struct mode.

Same approach as :mod:`lightning_modules.config.recipe` (whose merge helpers are reused): schema defaults
-> ``recipes/generator/synthx.yaml`` -> the selected profile (``profiles.<name>``) -> command-line
``key=value`` overrides, so a mistyped key is an error naming the file and the key. The top level of
``recipes/generator/synthx.yaml`` is the full-size (GPU) setting; ``profile=cpu`` shrinks it for a 2-core CPU
and the tests. Unlike the backbone recipes there is no ``_base.yaml`` layer: the generator shares no
keys with the segmentation recipes except ``tracking`` (the same :class:`TrackingConfig`).

Example::

    recipe = load_synthx_recipe("recipes/generator/synthx.yaml", ["profile=cpu", "trainer.max_steps=50"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from lightning_modules.config.recipe import RecipeError, TrackingConfig
from lightning_modules.recipe import load_recipe, recipe_to_yaml
from lightning_modules.data.lesions import SIZE_CLASSES
from synthx.conditions import ORGAN_OF_LESION, SAMPLING_SCHEDULERS

__all__ = ["SynthXRecipe", "load_synthx_recipe", "check_synthx_recipe", "recipe_to_yaml", "RecipeError"]


# The schema's choices (names equal values, so recipes spell them as before); the sampling
# schedulers are one member per scheduler class of synthx.generator.schedulers, so the two cannot disagree.
PredictionType = StrEnum("PredictionType", ["epsilon", "sample", "v_prediction"], module=__name__)
SamplingScheduler = StrEnum("SamplingScheduler", list(SAMPLING_SCHEDULERS), module=__name__)
SizeSource = StrEnum("SizeSource", ["training", "weights"], module=__name__)


@dataclass
class SynthXDataConfig:
    root: str = "data/phantom"
    split: str = "splits/phantom.csv"
    # The lesion class whose tumors are learned; its organ (pancreas for pancreatic_lesion) is the organ condition.
    tumor_class: str = "pancreatic_lesion"
    spacing: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    hu_window: list[float] = field(default_factory=lambda: [-175.0, 250.0])
    patch_size: list[int] = field(default_factory=lambda: [96, 96, 96])
    batch_size: int = 4
    # The inpainted region is the lesion dilated by this much, so the model learns the tumor border.
    inpaint_margin_mm: float = 3.0
    # Patch centres move up to this fraction of the free space around the lesion, so tumors are not always centred.
    centre_jitter: float = 0.5
    augment: bool = True
    # Draw lesions so that each contrast phase is seen equally often (with replacement): a rare phase's
    # tumors, the ones SynthX is asked for, are not drowned by the venous majority.
    balance_phases: bool = True
    num_workers: int = 4
    # Restrict training to these (training-split) cases; empty means every training case with a tumor.
    case_ids: list[str] = field(default_factory=list)


@dataclass
class SynthXModelConfig:
    channels: list[int] = field(default_factory=lambda: [64, 128, 256, 256])
    attention_levels: list[bool] = field(default_factory=lambda: [False, False, False, True])
    num_res_blocks: int = 2
    norm_num_groups: int = 32
    num_head_channels: int = 32
    blend_sigma_mm: float = 1.0
    # Latent mode: diffuse the latents of a trained SynthXAutoencoder saved at vae_path.
    latent: bool = False
    vae_path: Optional[str] = None


@dataclass
class AutoencoderConfig:
    """The SynthXAutoencoder of latent mode, trained with ``benchx synthx-train --stage autoencoder``."""

    channels: list[int] = field(default_factory=lambda: [32, 64, 64])
    latent_channels: int = 4
    num_res_blocks: int = 1
    norm_num_groups: int = 16
    max_steps: int = 20_000
    lr: float = 1.0e-4
    # L1 reconstruction (weighted like the diffusion loss toward the tumor) + kl_weight * KL.
    kl_weight: float = 1.0e-6


@dataclass
class NoiseSchedulerConfig:
    num_train_timesteps: int = 1000
    beta_schedule: str = "linear"
    beta_start: float = 1.0e-4
    beta_end: float = 2.0e-2
    prediction_type: PredictionType = PredictionType.epsilon
    clip_sample: bool = True


@dataclass
class ConditionDropoutConfig:
    # Each factor alone is replaced by the null token with `each`, all four together with `all`,
    # so the model learns the unconditional and partly conditional tasks that guidance needs.
    each: float = 0.1
    all: float = 0.1


@dataclass
class SynthXLossConfig:
    # Squared error weighted `tumor_weight` inside the inpainting region, 1 elsewhere.
    tumor_weight: float = 10.0


@dataclass
class SynthXOptimConfig:
    lr: float = 1.0e-4
    weight_decay: float = 0.0
    warmup_steps: int = 500


@dataclass
class EMAConfig:
    enabled: bool = True
    decay: float = 0.9999
    # diffusers EMAModel warm-up: decay = 1 - (1 + step)^-power, capped at `decay`.
    power: float = 0.6667


@dataclass
class SynthXTrainerConfig:
    max_steps: int = 100_000
    accelerator: str = "auto"
    devices: Any = 1
    # Lightning strategy: "auto" on one device, "ddp" for several (Lightning's launcher, torchrun or Slurm).
    strategy: str = "auto"
    num_nodes: int = 1
    # last.ckpt every this many steps (and at the end), so an interrupted run resumes close to where it stopped.
    checkpoint_every_n_steps: int = 1000
    precision: str = "32-true"
    log_every_n_steps: int = 50
    gradient_clip_val: Optional[float] = 1.0
    deterministic: bool = False


@dataclass
class SamplingConfig:
    # The scheduler saved with the pipeline and swapped in at generation (built from the training
    # scheduler's config); generation reads all three (benchx synthesize --recipe ... key=value).
    scheduler: SamplingScheduler = SamplingScheduler.ddim
    num_inference_steps: int = 50
    # Classifier-free guidance; > 1 needs a generator trained with condition_dropout.all > 0.
    guidance_scale: float = 2.0


# DiffTumor-like: mostly small tumors (mask_prior.size_source "weights").
DIFFTUMOR_SIZE_WEIGHTS = {"tiny": 1.0, "small": 2.0, "medium": 1.0, "large": 0.0}


@dataclass
class MaskPriorConfig:
    # Drawn tumors keep this distance from the organ's border.
    erosion_mm: float = 1.5
    # The gland grown around each painted or pasted mass: within rim_mm of the tumor, voxels outside
    # the pancreas and darker than its parenchyma take the parenchyma's HU (0: no rim;
    # synthx.generation.painting.grow_rim).
    rim_mm: float = 0.0
    # Clip each drawn tumor to the eroded organ (true) or keep it whole, centred in the organ with at
    # least half of it inside and the rest bulging out as a real mass does (false; with rim_mm > 0
    # the gland grows around the bulge).
    clip_to_organ: bool = True
    # Where the drawn tumors' size classes come from: "training" (in proportion to the real training
    # tumors, synthx.generation.canvases.training_tumor_diameters) or "weights" (size_class_weights).
    size_source: SizeSource = SizeSource.training
    # Relative frequency of each size class among the drawn tumors (synthx.generator.mask_prior.SIZE_CLASSES),
    # read with size_source "weights" only (a changed value with "training" is refused).
    size_class_weights: dict[str, float] = field(default_factory=lambda: dict(DIFFTUMOR_SIZE_WEIGHTS))


@dataclass
class QualityFilterConfig:
    """Read by ``benchx synthx-quality --recipe``: drop the synthetic cases a real-vs-synthetic discriminator spots."""

    enabled: bool = False
    # A synthetic tumor is dropped when its cross-fitted discriminator score exceeds this quantile of
    # the real training tumors' scores (synthx.analysis.realism.quality_filter).
    real_quantile: float = 0.95
    # Cross-fitting folds: every tumor is scored by a discriminator trained on the other folds.
    folds: int = 5


@dataclass
class SynthXRecipe:
    name: str = "synthx"
    seed: int = 0
    profile: str = "full"
    data: SynthXDataConfig = field(default_factory=SynthXDataConfig)
    model: SynthXModelConfig = field(default_factory=SynthXModelConfig)
    autoencoder: AutoencoderConfig = field(default_factory=AutoencoderConfig)
    scheduler: NoiseSchedulerConfig = field(default_factory=NoiseSchedulerConfig)
    condition_dropout: ConditionDropoutConfig = field(default_factory=ConditionDropoutConfig)
    loss: SynthXLossConfig = field(default_factory=SynthXLossConfig)
    optim: SynthXOptimConfig = field(default_factory=SynthXOptimConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    trainer: SynthXTrainerConfig = field(default_factory=SynthXTrainerConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    mask_prior: MaskPriorConfig = field(default_factory=MaskPriorConfig)
    quality_filter: QualityFilterConfig = field(default_factory=QualityFilterConfig)
    tracking: TrackingConfig = field(default_factory=lambda: TrackingConfig(experiment="synthx"))
    profiles: dict[str, Any] = field(default_factory=dict)


def load_synthx_recipe(path: str | Path, overrides: list[str] | None = None) -> DictConfig:
    """Load a SynthX recipe: schema <- recipe <- profile <- overrides, in struct mode, then check it.

    Args:
        path: the recipe YAML (e.g. ``recipes/generator/synthx.yaml``).
        overrides: ``key=value`` strings (dotted keys), applied last.

    Raises:
        RecipeError: naming the file and the key or value that is wrong.
    """
    return load_recipe(path, overrides, schema=SynthXRecipe, checker=check_synthx_recipe, base=False)


def check_synthx_recipe(config: DictConfig, source: str = "recipe") -> None:
    """Check values the schema's types cannot: shapes, ranges, names, divisibility."""
    data, model = config.data, config.model
    if len(data.patch_size) != 3 or len(data.spacing) != 3 or len(data.hu_window) != 2:
        raise RecipeError(f"{source}: data.patch_size and data.spacing need 3 values, data.hu_window 2")
    if not data.hu_window[1] > data.hu_window[0]:
        raise RecipeError(f"{source}: data.hu_window must be increasing, got {list(data.hu_window)}")
    if data.tumor_class not in ORGAN_OF_LESION:
        raise RecipeError(
            f"{source}: data.tumor_class {data.tumor_class!r} has no organ condition; expected one of {', '.join(ORGAN_OF_LESION)}"
        )
    if len(model.channels) != len(model.attention_levels):
        raise RecipeError(f"{source}: model.channels and model.attention_levels need the same length")
    bad_groups = [c for c in model.channels if c % model.norm_num_groups]
    if bad_groups:
        raise RecipeError(f"{source}: model.channels {list(model.channels)} must be multiples of model.norm_num_groups={model.norm_num_groups}")
    divisor = 2 ** (len(model.channels) - 1)
    if any(p % divisor for p in data.patch_size):
        raise RecipeError(f"{source}: every data.patch_size value must be divisible by {divisor} (2^(levels-1)); got {list(data.patch_size)}")
    autoencoder = config.autoencoder
    if any(c % autoencoder.norm_num_groups for c in autoencoder.channels):
        raise RecipeError(f"{source}: autoencoder.channels {list(autoencoder.channels)} must be multiples of autoencoder.norm_num_groups={autoencoder.norm_num_groups}")
    if model.latent and not model.vae_path:
        raise RecipeError(f"{source}: model.latent=true needs model.vae_path (a saved SynthXAutoencoder)")
    for name in ("each", "all"):
        value = config.condition_dropout[name]
        if not 0.0 <= value < 1.0:
            raise RecipeError(f"{source}: condition_dropout.{name} must be in [0, 1), got {value}")
    if config.loss.tumor_weight < 1.0:
        raise RecipeError(f"{source}: loss.tumor_weight must be >= 1, got {config.loss.tumor_weight}")
    prior = config.mask_prior
    weights = prior.size_class_weights
    if prior.size_source == "training" and dict(weights) != DIFFTUMOR_SIZE_WEIGHTS:
        raise RecipeError(
            f"{source}: mask_prior.size_class_weights {dict(weights)} would be ignored: tumor sizes follow the "
            "training tumors (mask_prior.size_source=training); set mask_prior.size_source=weights to use them"
        )
    unknown = [k for k in weights if k not in SIZE_CLASSES]
    if unknown:
        raise RecipeError(f"{source}: mask_prior.size_class_weights has unknown classes {unknown}; expected {', '.join(SIZE_CLASSES)}")
    if any(v < 0 for v in weights.values()) or sum(weights.values()) <= 0:
        raise RecipeError(f"{source}: mask_prior.size_class_weights must be non-negative with a positive sum, got {dict(weights)}")
    if prior.rim_mm < 0:
        raise RecipeError(f"{source}: mask_prior.rim_mm must be >= 0 (0: no rim), got {prior.rim_mm}")
    quality = config.quality_filter
    if not 0.0 < quality.real_quantile <= 1.0 or quality.folds < 2:
        raise RecipeError(f"{source}: quality_filter.real_quantile must be in (0, 1] and quality_filter.folds >= 2, "
                          f"got {quality.real_quantile} and {quality.folds}")
    if config.sampling.guidance_scale < 1.0 or config.sampling.num_inference_steps < 1:
        raise RecipeError(f"{source}: sampling.guidance_scale must be >= 1 and sampling.num_inference_steps >= 1")
