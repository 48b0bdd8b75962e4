"""Train the SynthX generator: tumor-centred patches of real training cases -> conditional denoiser -> pipeline.

Data: every real case of the split's ``train`` part that has a tumor of ``data.tumor_class``
(validation, test and synthetic cases are refused: they must never shape the generator). Each case
is read with MONAI (orientation RAS, resampling to ``data.spacing``), a region around its lesions is
kept, and every item is a patch around one lesion (moved by a random jitter that keeps the lesion
inside when it fits, randomly flipped). Conditions come from the case's metadata: sex, age band,
phase, and the organ of the lesion class.

Training (:class:`SynthXTrainingModule`): DDPM noise on the patch, the denoiser sees the noisy patch,
the patch with the inpainting region blanked and the region mask; squared error weighted
``loss.tumor_weight`` inside the region; each condition is dropped to the null token with
``condition_dropout.each`` and all of them with ``condition_dropout.all`` (for classifier-free
guidance); EMA weights (diffusers ``EMAModel``). The run is its own MLflow run (Lightning's
``MLFlowLogger``, the recipe's ``tracking.uri``) with the resolved recipe, the training case list
and the saved pipeline (EMA weights, the recipe's sampling scheduler) under artifact path ``pipeline``.

Run::

    benchx synthx-train --recipe recipes/generator/synthx.yaml profile=cpu
    benchx synthx-train --recipe recipes/generator/synthx.yaml --root data/phantom --split splits/phantom.csv trainer.max_steps=300

Latent mode (full-size runs): train the autoencoder first, then the generator on its latents::

    benchx synthx-train --recipe recipes/generator/synthx.yaml --stage autoencoder --out outputs/synthx-ae
    benchx synthx-train --recipe recipes/generator/synthx.yaml model.latent=true model.vae_path=outputs/synthx-ae/autoencoder
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, SchedulerMixin
from diffusers.training_utils import EMAModel
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig, OmegaConf
from scipy import ndimage
from torch.utils.data import DataLoader, Dataset

from lightning_modules.data.cohort import Cohort, file_sha256, load_cohort
from lightning_modules.data.splits import load_split
from lightning_modules.monitoring import system_callbacks
from lightning_modules.tracking import experiment_id, flatten, git_commit, tracking_uri
from synthx.config import load_synthx_recipe, recipe_to_yaml
from synthx.model import (
    CONDITION_NAMES,
    ORGAN_OF_LESION,
    SynthXAutoencoder,
    SynthXDenoiser,
    encode_age_band,
    encode_organ,
    encode_phase,
    encode_sex,
)
from synthx.pipeline import SynthXPipeline, inpainting_region, normalize_hu

TRAIN_SPLIT = "train"
# Air: what lies beyond the scan when a patch reaches past the volume's edge.
PAD_HU = -1024.0


# ----------------------------------------------------------------------------------------------
# Cases and data


def training_tumor_cases(
    cohort: Cohort,
    split: pd.DataFrame,
    tumor_class: str,
    case_ids: Sequence[str] | None = None,
) -> list[str]:
    """The real training-split cases the generator may learn from.

    Args:
        cohort: the cohort.
        split: its split table (``case_id, split``).
        tumor_class: the lesion class; without ``case_ids``, cases whose lesion mask is missing or
            empty are left out (they have nothing to learn from).
        case_ids: an explicit selection; every one must be a real case of the ``train`` split with
            a non-empty lesion mask.

    Raises:
        ValueError: naming each case that is not in the training split (and its split), synthetic,
            not in the cohort, or without a tumor.
    """
    split_of = dict(zip(split["case_id"].astype(str), split["split"].astype(str)))
    synthetic = dict(zip(cohort.metadata["case_id"], cohort.metadata["synthetic"].astype(int)))
    explicit = case_ids is not None and len(case_ids) > 0
    candidates = list(case_ids) if explicit else [c for c, s in split_of.items() if s == TRAIN_SPLIT]
    problems, selected = [], []
    for case_id in candidates:
        if case_id not in cohort:
            problems.append(f"{case_id}: not in cohort {cohort.root} (metadata.csv)")
        elif synthetic.get(case_id, 0) == 1:
            problems.append(f"{case_id}: synthetic case; the generator learns from real cases only")
        elif split_of.get(case_id) != TRAIN_SPLIT:
            where = split_of.get(case_id)
            problems.append(
                f"{case_id}: in the '{where}' split, not '{TRAIN_SPLIT}'; the generator may only learn from training cases"
                if where
                else f"{case_id}: not in the split file, so not a training case"
            )
        else:
            path = cohort.case(case_id).mask_path(tumor_class)
            if path.exists() and _mask_has_voxels(path):
                selected.append(case_id)
            elif explicit:
                problems.append(f"{case_id}: {path} is missing or empty; no {tumor_class} to learn from")
    if problems:
        raise ValueError("SynthX training refused:\n" + "\n".join(f"  - {p}" for p in problems))
    if not selected:
        raise ValueError(
            f"SynthX training: no training case of {cohort.root} has a non-empty {tumor_class} mask"
        )
    return selected


def _mask_has_voxels(path: Path) -> bool:
    import nibabel as nib

    return bool(np.asarray(nib.load(path).dataobj).any())


@dataclass
class LesionRegion:
    """A case's lesions with enough surroundings for any jittered patch: HU, lesion components, conditions."""

    case_id: str
    hu: np.ndarray  # int16 HU, rounded after resampling (half the memory of float32; CT is integer HU anyway)
    components: np.ndarray  # int32 labels of connected lesion components, 0 = none
    boxes: list[tuple[np.ndarray, np.ndarray]]  # per component: (lower, upper) voxel corners
    conditions: dict[str, int]


class TumorPatchDataset(Dataset):
    """Tumor-centred training patches (see the module docstring).

    Args:
        cohort: the cohort.
        case_ids: real training cases with tumors (:func:`training_tumor_cases`).
        tumor_class: the lesion class.
        spacing: voxel size in mm after resampling.
        patch_size: patch size in voxels.
        hu_window: HU window mapped to [-1, 1].
        inpaint_margin_mm: the inpainting region is the lesion dilated by this.
        centre_jitter: share of the free space around a lesion its patch centre may move.
        augment: random flips along each axis.
    """

    def __init__(
        self,
        cohort: Cohort,
        case_ids: Sequence[str],
        tumor_class: str,
        spacing: Sequence[float],
        patch_size: Sequence[int],
        hu_window: Sequence[float],
        inpaint_margin_mm: float,
        centre_jitter: float = 0.5,
        augment: bool = True,
    ):
        self.tumor_class = tumor_class
        self.spacing = tuple(float(s) for s in spacing)
        self.patch_size = np.asarray([int(p) for p in patch_size])
        self.hu_window = tuple(float(h) for h in hu_window)
        self.inpaint_margin_mm = float(inpaint_margin_mm)
        self.centre_jitter = float(centre_jitter)
        self.augment = bool(augment)
        organ_index = encode_organ(ORGAN_OF_LESION[tumor_class])
        self.regions: list[LesionRegion] = []
        loader = self._loader()
        for case_id in case_ids:
            case = cohort.case(case_id)
            row = case.metadata
            conditions = {
                "sex": encode_sex(row.get("sex")),
                "age_band": encode_age_band(row.get("age_band", row.get("age"))),
                "phase": encode_phase(row.get("phase")),
                "organ": organ_index,
            }
            self.regions.append(self._lesion_region(loader, case, conditions))
        # One item per lesion: a case with two lesions is seen twice per epoch.
        self.items = [(r, c) for r, region in enumerate(self.regions) for c in range(len(region.boxes))]

    def _loader(self):
        from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, Orientationd, Spacingd

        return Compose(
            [
                LoadImaged(keys=["ct", "lesion"], image_only=True),
                EnsureChannelFirstd(keys=["ct", "lesion"]),
                Orientationd(keys=["ct", "lesion"], axcodes="RAS", labels=None),
                Spacingd(keys=["ct", "lesion"], pixdim=self.spacing, mode=("bilinear", "nearest")),
            ]
        )

    def _lesion_region(self, loader, case, conditions: dict[str, int]) -> LesionRegion:
        ct_path, lesion_path = case.ct_path, case.mask_path(self.tumor_class)
        for path in (ct_path, lesion_path):
            if not path.exists():
                raise ValueError(f"{case.case_id}: {path} is missing")
        try:
            loaded = loader({"ct": str(ct_path), "lesion": str(lesion_path)})
        except Exception as error:  # MONAI wraps reader errors; name the case and files.
            raise ValueError(f"{case.case_id}: cannot read {ct_path} / {lesion_path}: {error}") from error
        hu = np.asarray(loaded["ct"][0], dtype=np.float32)
        lesion = np.asarray(loaded["lesion"][0]) > 0.5
        if hu.shape != lesion.shape:
            raise ValueError(f"{case.case_id}: {lesion_path} has shape {lesion.shape}, the CT {hu.shape}")
        if not lesion.any():
            raise ValueError(f"{case.case_id}: {lesion_path} is empty after resampling to {self.spacing} mm")
        # Keep the lesions' bounding box plus room for a full patch around any of them.
        coords = np.argwhere(lesion)
        reach = self.patch_size  # a patch centred anywhere in the lesion box fits in box +- patch
        lower = coords.min(0) - reach
        upper = coords.max(0) + 1 + reach
        pad_before = np.maximum(-lower, 0)
        pad_after = np.maximum(upper - np.asarray(hu.shape), 0)
        box = tuple(slice(int(max(a, 0)), int(min(b, s))) for a, b, s in zip(lower, upper, hu.shape))
        padding = list(zip(pad_before.tolist(), pad_after.tolist()))
        hu = np.pad(hu[box], padding, constant_values=PAD_HU)
        lesion = np.pad(lesion[box], padding, constant_values=False)
        components, count = ndimage.label(lesion)
        boxes = []
        for found in ndimage.find_objects(components):
            boxes.append(
                (np.asarray([s.start for s in found]), np.asarray([s.stop for s in found]))
            )
        return LesionRegion(
            case.case_id, np.round(hu).astype(np.int16), components.astype(np.int32), boxes, conditions
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        region_index, component = self.items[index]
        region = self.regions[region_index]
        lower, upper = region.boxes[component]
        extent = upper - lower
        centre = (lower + upper) / 2.0
        # Move the patch by up to `centre_jitter` of the room the lesion leaves in it, so the lesion
        # stays inside when it fits yet is not always in the middle.
        room = np.maximum(self.patch_size - extent, 0) / 2.0
        shift = (torch.rand(3).numpy() * 2.0 - 1.0) * room * self.centre_jitter
        start = np.round(centre + shift - self.patch_size / 2.0).astype(int)
        start = np.clip(start, 0, np.asarray(region.hu.shape) - self.patch_size)
        crop = tuple(slice(int(s), int(s + p)) for s, p in zip(start, self.patch_size))
        hu = region.hu[crop].astype(np.float32)
        tumor = region.components[crop] > 0
        if self.augment:
            flips = [axis for axis in range(3) if torch.rand(()).item() < 0.5]
            if flips:
                hu, tumor = np.flip(hu, flips), np.flip(tumor, flips)
        inpaint = inpainting_region(tumor, self.spacing, self.inpaint_margin_mm)
        item = {
            "image": torch.from_numpy(np.ascontiguousarray(normalize_hu(hu, self.hu_window)))[None],
            "region": torch.from_numpy(np.ascontiguousarray(inpaint, dtype=np.float32))[None],
            "case_id": region.case_id,
        }
        item.update({name: torch.tensor(region.conditions[name], dtype=torch.long) for name in CONDITION_NAMES})
        return item


# ----------------------------------------------------------------------------------------------
# Model building


def build_noise_scheduler(recipe: DictConfig) -> DDPMScheduler:
    """The DDPM training scheduler of the recipe."""
    config = recipe.scheduler
    return DDPMScheduler(
        num_train_timesteps=int(config.num_train_timesteps),
        beta_schedule=str(config.beta_schedule),
        beta_start=float(config.beta_start),
        beta_end=float(config.beta_end),
        prediction_type=str(config.prediction_type),
        clip_sample=bool(config.clip_sample),
    )


SAMPLING_SCHEDULER_CLASSES: dict[str, type[SchedulerMixin]] = {
    "ddpm": DDPMScheduler,
    "ddim": DDIMScheduler,
    "dpm_solver": DPMSolverMultistepScheduler,
}


def sampling_scheduler(name: str, training_scheduler: SchedulerMixin) -> SchedulerMixin:
    """A sampling scheduler built from the training scheduler's config (same betas, same prediction_type)."""
    if name not in SAMPLING_SCHEDULER_CLASSES:
        raise ValueError(f"unknown sampling scheduler {name!r}; expected one of {', '.join(SAMPLING_SCHEDULER_CLASSES)}")
    return SAMPLING_SCHEDULER_CLASSES[name].from_config(training_scheduler.config)


def build_denoiser(recipe: DictConfig, in_channels: int = 1) -> SynthXDenoiser:
    """The recipe's denoiser, with the data contract (HU window, spacing, margin) in its config."""
    model, data = recipe.model, recipe.data
    return SynthXDenoiser(
        in_channels=in_channels,
        channels=list(model.channels),
        attention_levels=list(model.attention_levels),
        num_res_blocks=int(model.num_res_blocks),
        norm_num_groups=int(model.norm_num_groups),
        num_head_channels=int(model.num_head_channels),
        hu_window=[float(v) for v in data.hu_window],
        spacing=[float(v) for v in data.spacing],
        inpaint_margin_mm=float(data.inpaint_margin_mm),
        blend_sigma_mm=float(model.blend_sigma_mm),
        patch_size=[int(v) for v in data.patch_size],
    )


def load_autoencoder(recipe: DictConfig) -> SynthXAutoencoder | None:
    """The frozen autoencoder of latent mode, or None in pixel space."""
    if not recipe.model.latent:
        return None
    path = Path(recipe.model.vae_path)
    if not path.is_dir():
        raise ValueError(f"model.vae_path {path} is not a saved SynthXAutoencoder folder")
    vae = SynthXAutoencoder.from_pretrained(str(path))
    factor = vae.downsampling_factor * 2 ** (len(recipe.model.channels) - 1)
    if any(int(p) % factor for p in recipe.data.patch_size):
        raise ValueError(f"latent mode: every data.patch_size value must be divisible by {factor}; got {list(recipe.data.patch_size)}")
    vae.requires_grad_(False)
    return vae.eval()


def drop_conditions(
    conditions: dict[str, torch.Tensor], each: float, all_: float, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """Replace conditions by the null index 0: each factor with probability ``each``, all with ``all_``."""
    batch = next(iter(conditions.values())).shape[0]
    device = next(iter(conditions.values())).device
    drop_all = torch.rand(batch, generator=generator).to(device) < all_
    dropped = {}
    for name, value in conditions.items():
        drop = drop_all | (torch.rand(batch, generator=generator).to(device) < each)
        dropped[name] = torch.where(drop, torch.zeros_like(value), value)
    return dropped


# ----------------------------------------------------------------------------------------------
# Lightning module


class SynthXTrainingModule(pl.LightningModule):
    """Denoising training of :class:`SynthXDenoiser` with a tumor-weighted loss, condition dropout and EMA.

    Args:
        denoiser: the network.
        noise_scheduler: the DDPM scheduler (its ``prediction_type`` sets the target).
        tumor_weight: loss weight inside the inpainting region (1 elsewhere).
        dropout_each: probability that one condition factor is nulled.
        dropout_all: probability that all condition factors are nulled.
        lr: AdamW learning rate (linear warm-up over ``warmup_steps``, then constant).
        weight_decay: AdamW weight decay.
        warmup_steps: warm-up length.
        ema_decay: the EMA decay cap; None disables EMA.
        ema_power: EMA warm-up power.
        vae: frozen autoencoder for latent mode.
    """

    def __init__(
        self,
        denoiser: SynthXDenoiser,
        noise_scheduler: DDPMScheduler,
        tumor_weight: float = 10.0,
        dropout_each: float = 0.1,
        dropout_all: float = 0.1,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        ema_decay: float | None = 0.9999,
        ema_power: float = 2 / 3,
        vae: SynthXAutoencoder | None = None,
    ):
        super().__init__()
        self.denoiser = denoiser
        self.noise_scheduler = noise_scheduler
        self.vae = vae
        self.tumor_weight = float(tumor_weight)
        self.dropout_each = float(dropout_each)
        self.dropout_all = float(dropout_all)
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.warmup_steps = int(warmup_steps)
        self.ema = (
            EMAModel(denoiser.parameters(), decay=float(ema_decay), use_ema_warmup=True, power=float(ema_power))
            if ema_decay is not None
            else None
        )
        self._step_started = 0.0
        self.step_seconds: list[float] = []

    @classmethod
    def from_recipe(cls, recipe: DictConfig) -> "SynthXTrainingModule":
        vae = load_autoencoder(recipe)
        in_channels = vae.config.latent_channels if vae is not None else 1
        return cls(
            build_denoiser(recipe, in_channels=in_channels),
            build_noise_scheduler(recipe),
            tumor_weight=recipe.loss.tumor_weight,
            dropout_each=recipe.condition_dropout.each,
            dropout_all=recipe.condition_dropout.all,
            lr=recipe.optim.lr,
            weight_decay=recipe.optim.weight_decay,
            warmup_steps=recipe.optim.warmup_steps,
            ema_decay=recipe.ema.decay if recipe.ema.enabled else None,
            ema_power=recipe.ema.power,
            vae=vae,
        )

    def prepare(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(clean, masked, region) in the diffused space (latents in latent mode)."""
        clean, region = batch["image"], batch["region"]
        masked = clean * (1.0 - region)
        if self.vae is not None:
            with torch.no_grad():
                clean, masked = self.vae.encode(clean), self.vae.encode(masked)
            region = F.max_pool3d(region, kernel_size=self.vae.downsampling_factor)
        return clean, masked, region

    def loss(
        self,
        batch: dict,
        timesteps: torch.Tensor,
        conditions: dict[str, torch.Tensor],
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """The tumor-weighted squared error at given timesteps and (possibly dropped) conditions.

        Args:
            batch: a batch of :class:`TumorPatchDataset` items.
            timesteps: one diffusion step per sample.
            conditions: the condition indices (after dropout).
            generator: fixes the noise (a CPU generator), e.g. to compare losses before and after steps.
        """
        clean, masked, region = self.prepare(batch)
        # A seeded generator lives on the CPU; unseeded noise is drawn directly on the device.
        noise_device = "cpu" if generator is not None else clean.device
        noise = torch.randn(clean.shape, generator=generator, device=noise_device, dtype=clean.dtype).to(clean.device)
        noisy = self.noise_scheduler.add_noise(clean, noise, timesteps)
        prediction = self.denoiser(noisy, timesteps, masked, region, **conditions).sample
        kind = self.noise_scheduler.config.prediction_type
        if kind == "epsilon":
            target = noise
        elif kind == "sample":
            target = clean
        elif kind == "v_prediction":
            target = self.noise_scheduler.get_velocity(clean, noise, timesteps)
        else:
            raise ValueError(f"unsupported prediction_type {kind!r}")
        weight = 1.0 + (self.tumor_weight - 1.0) * region
        weight = weight.expand_as(prediction)
        return (weight * (prediction.float() - target.float()) ** 2).sum() / weight.sum()

    def training_step(self, batch: dict, batch_index: int) -> torch.Tensor:
        clean = batch["image"]
        conditions = drop_conditions(
            {name: batch[name] for name in CONDITION_NAMES}, self.dropout_each, self.dropout_all
        )
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (clean.shape[0],), device=clean.device
        )
        loss = self.loss(batch, timesteps, conditions)
        self.log("train/loss", loss, prog_bar=True, batch_size=clean.shape[0])
        return loss

    def on_fit_start(self) -> None:
        self.noise_scheduler.alphas_cumprod = self.noise_scheduler.alphas_cumprod.to(self.device)
        if self.ema is not None:
            self.ema.to(self.device)

    def on_train_batch_start(self, batch, batch_index: int) -> None:
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_index: int) -> None:
        if self.ema is not None:
            self.ema.step(self.denoiser.parameters())
        seconds = time.perf_counter() - self._step_started
        self.step_seconds.append(seconds)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.denoiser.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        warmup = max(self.warmup_steps, 0)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.ema is not None:
            checkpoint["synthx_ema"] = self.ema.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.ema is not None and "synthx_ema" in checkpoint:
            self.ema.load_state_dict(checkpoint["synthx_ema"])

    def ema_denoiser(self) -> SynthXDenoiser:
        """A copy of the denoiser carrying the EMA weights (the trained weights when EMA is off)."""
        denoiser = copy.deepcopy(self.denoiser).cpu()
        if self.ema is not None:
            self.ema.copy_to(denoiser.parameters())
        return denoiser.eval()

    def pipeline(self, sampling: str = "ddim") -> SynthXPipeline:
        """The sampling pipeline with the EMA weights and a sampling scheduler built from the training one."""
        vae = copy.deepcopy(self.vae).cpu() if self.vae is not None else None
        return SynthXPipeline(
            unet=self.ema_denoiser(), scheduler=sampling_scheduler(sampling, self.noise_scheduler), vae=vae
        )


# ----------------------------------------------------------------------------------------------
# Running


@dataclass
class SynthXTrainResult:
    run_id: str
    output_dir: Path
    pipeline_dir: Path
    steps: int
    case_ids: list[str]
    mean_step_seconds: float


@dataclass
class AutoencoderTrainResult:
    run_id: str
    output_dir: Path
    autoencoder_dir: Path
    steps: int
    scaling_factor: float


def build_dataset(recipe: DictConfig, cohort: Cohort, split: pd.DataFrame) -> TumorPatchDataset:
    data = recipe.data
    case_ids = training_tumor_cases(cohort, split, data.tumor_class, list(data.case_ids) or None)
    return TumorPatchDataset(
        cohort,
        case_ids,
        tumor_class=data.tumor_class,
        spacing=data.spacing,
        patch_size=data.patch_size,
        hu_window=data.hu_window,
        inpaint_margin_mm=data.inpaint_margin_mm,
        centre_jitter=data.centre_jitter,
        augment=data.augment,
    )


def _training_data(recipe: DictConfig) -> tuple[TumorPatchDataset, DataLoader]:
    cohort = load_cohort(recipe.data.root)
    split = load_split(recipe.data.split, cohort)
    dataset = build_dataset(recipe, cohort, split)
    loader = DataLoader(
        dataset,
        batch_size=int(recipe.data.batch_size),
        shuffle=True,
        num_workers=int(recipe.data.num_workers),
        drop_last=len(dataset) >= int(recipe.data.batch_size),
        persistent_workers=int(recipe.data.num_workers) > 0,
    )
    return dataset, loader


def _start_run(
    recipe: DictConfig, variant: str, run_name: str, dataset: TumorPatchDataset, output_dir: str | Path | None
) -> tuple[MLFlowLogger, Path]:
    """Open the MLflow run (tags, params, resolved recipe, training case list) and the run folder."""
    uri = tracking_uri(recipe.tracking.uri)
    experiment = str(recipe.tracking.experiment)
    experiment_id(experiment, uri)
    tags = {
        "recipe": str(recipe.name),
        "profile": str(recipe.profile),
        "variant": variant,
        "split_sha256": file_sha256(recipe.data.split),
        "git_commit": git_commit(),
        **{str(k): str(v) for k, v in dict(recipe.tracking.tags).items()},
    }
    logger = MLFlowLogger(
        experiment_name=experiment,
        tracking_uri=uri,
        run_name=recipe.tracking.run_name or run_name,
        tags=tags,
        log_model=False,
    )
    run_id, client = logger.run_id, logger.experiment
    output_dir = Path(output_dir) if output_dir else Path(recipe.tracking.output_dir) / f"{variant}-{run_id[:8]}"
    output_dir.mkdir(parents=True, exist_ok=True)
    logger.log_hyperparams(flatten(OmegaConf.to_container(recipe, resolve=True)))
    client.log_text(run_id, recipe_to_yaml(recipe), "recipe.yaml")
    client.log_text(run_id, "case_id\n" + "\n".join(r.case_id for r in dataset.regions) + "\n", "training_cases.csv")
    client.log_param(run_id, "n_training_cases", len(dataset.regions))
    client.log_param(run_id, "n_training_lesions", len(dataset))
    return logger, output_dir


def _trainer(
    recipe: DictConfig, max_steps: int, output_dir: Path, logger: MLFlowLogger, enable_progress_bar: bool | None
) -> pl.Trainer:
    # last.ckpt every few thousand steps, so a long GPU run that stops can resume (--resume).
    checkpoints = ModelCheckpoint(
        dirpath=output_dir / "checkpoints",
        save_top_k=0,
        save_last=True,
        every_n_train_steps=max(1, min(max_steps, 5000)),
        enable_version_counter=False,
    )
    return pl.Trainer(
        max_steps=max_steps,
        accelerator=recipe.trainer.accelerator,
        devices=recipe.trainer.devices,
        precision=recipe.trainer.precision,
        log_every_n_steps=int(recipe.trainer.log_every_n_steps),
        gradient_clip_val=recipe.trainer.gradient_clip_val,
        deterministic=bool(recipe.trainer.deterministic),
        default_root_dir=str(output_dir),
        logger=logger,
        callbacks=[checkpoints, *system_callbacks(recipe.trainer.accelerator, 10 * int(recipe.trainer.log_every_n_steps))],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_model_summary=False,
        enable_progress_bar=sys.stderr.isatty() if enable_progress_bar is None else enable_progress_bar,
    )


def train_synthx(
    recipe: DictConfig,
    output_dir: str | Path | None = None,
    resume: bool = False,
    enable_progress_bar: bool | None = None,
) -> SynthXTrainResult:
    """Train the generator of a loaded recipe and log it (with its pipeline) as one MLflow run.

    Args:
        recipe: from :func:`synthx.config.load_synthx_recipe`.
        output_dir: run folder (default ``<tracking.output_dir>/generator-<run id prefix>``).
        resume: continue from ``<output_dir>/checkpoints/last.ckpt`` (into a new MLflow run).
        enable_progress_bar: Lightning's progress bar (default: when stderr is a terminal).
    """
    pl.seed_everything(int(recipe.seed), workers=True)
    dataset, loader = _training_data(recipe)
    module = SynthXTrainingModule.from_recipe(recipe)
    logger, output_dir = _start_run(recipe, "generator", f"synthx-train-{recipe.name}", dataset, output_dir)
    run_id, client = logger.run_id, logger.experiment
    client.log_param(run_id, "denoiser_parameters", sum(p.numel() for p in module.denoiser.parameters()))
    trainer = _trainer(recipe, int(recipe.trainer.max_steps), output_dir, logger, enable_progress_bar)
    last = output_dir / "checkpoints" / "last.ckpt"
    trainer.fit(module, train_dataloaders=loader, ckpt_path=str(last) if resume and last.exists() else None)

    pipeline_dir = output_dir / "pipeline"
    if trainer.is_global_zero:
        pipeline = module.pipeline(str(recipe.sampling.scheduler))
        pipeline.save_pretrained(str(pipeline_dir))
        client.log_artifacts(run_id, str(pipeline_dir), artifact_path="pipeline")
        from synthx.pyfunc import log_generator_model

        log_generator_model(run_id, tracking_uri(recipe.tracking.uri), pipeline_dir)
    # The first steps include one-off setup; the steady-state time is what a user plans with.
    steady = module.step_seconds[min(5, len(module.step_seconds) - 1) :] if module.step_seconds else [math.nan]
    mean_step = float(np.mean(steady))
    client.log_metric(run_id, "perf/mean_step_seconds", mean_step)
    logger.finalize("success")
    return SynthXTrainResult(run_id, output_dir, pipeline_dir, trainer.global_step, [r.case_id for r in dataset.regions], mean_step)


class SynthXAutoencoderModule(pl.LightningModule):
    """Trains the latent-mode :class:`SynthXAutoencoder`: tumor-weighted L1 reconstruction + ``kl_weight`` * KL.

    Args:
        autoencoder: the network.
        lr: Adam learning rate.
        kl_weight: weight of the KL term (small: a near-deterministic latent).
        tumor_weight: L1 weight inside the inpainting region (1 elsewhere), so tumor texture survives encoding.
    """

    def __init__(self, autoencoder: SynthXAutoencoder, lr: float = 1e-4, kl_weight: float = 1e-6, tumor_weight: float = 10.0):
        super().__init__()
        self.autoencoder = autoencoder
        self.lr = float(lr)
        self.kl_weight = float(kl_weight)
        self.tumor_weight = float(tumor_weight)

    def loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(total, weighted L1, KL per sample)."""
        image, region = batch["image"], batch["region"]
        reconstruction, z_mu, z_sigma = self.autoencoder(image)
        weight = 1.0 + (self.tumor_weight - 1.0) * region
        l1 = (weight * (reconstruction - image).abs()).sum() / weight.sum()
        kl = 0.5 * (z_mu.pow(2) + z_sigma.pow(2) - torch.log(z_sigma.pow(2) + 1e-12) - 1.0)
        kl = kl.flatten(1).sum(1).mean()
        return l1 + self.kl_weight * kl, l1, kl

    def training_step(self, batch: dict, batch_index: int) -> torch.Tensor:
        loss, l1, kl = self.loss(batch)
        size = batch["image"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/l1", l1, batch_size=size)
        self.log("train/kl", kl, batch_size=size)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.autoencoder.parameters(), lr=self.lr)

    @torch.no_grad()
    def latent_scaling_factor(self, loader: DataLoader, max_batches: int = 16) -> float:
        """1 / standard deviation of the latents of up to ``max_batches`` batches (latent diffusion's rule)."""
        self.autoencoder.eval()
        latents = []
        for index, batch in enumerate(loader):
            if index >= max_batches:
                break
            z_mu, _ = self.autoencoder.autoencoder.encode(batch["image"].to(self.device))
            latents.append(z_mu.flatten().cpu())
        spread = float(torch.cat(latents).std())
        if not math.isfinite(spread) or spread <= 0:
            raise ValueError(f"cannot scale latents: their standard deviation is {spread}")
        return 1.0 / spread


def train_autoencoder(
    recipe: DictConfig, output_dir: str | Path | None = None, resume: bool = False, enable_progress_bar: bool | None = None
) -> AutoencoderTrainResult:
    """Train the latent-mode autoencoder on the generator's patches and log it (artifact ``autoencoder``).

    Use the saved folder as ``model.vae_path`` with ``model.latent=true`` to train the generator in latent space.
    """
    pl.seed_everything(int(recipe.seed), workers=True)
    dataset, loader = _training_data(recipe)
    settings = recipe.autoencoder
    module = SynthXAutoencoderModule(
        SynthXAutoencoder(
            channels=list(settings.channels),
            latent_channels=int(settings.latent_channels),
            num_res_blocks=int(settings.num_res_blocks),
            norm_num_groups=int(settings.norm_num_groups),
        ),
        lr=settings.lr,
        kl_weight=settings.kl_weight,
        tumor_weight=recipe.loss.tumor_weight,
    )
    factor = module.autoencoder.downsampling_factor
    if any(int(p) % factor for p in recipe.data.patch_size):
        raise ValueError(f"autoencoder: every data.patch_size value must be divisible by {factor}; got {list(recipe.data.patch_size)}")
    logger, output_dir = _start_run(recipe, "autoencoder", f"synthx-autoencoder-{recipe.name}", dataset, output_dir)
    run_id, client = logger.run_id, logger.experiment
    trainer = _trainer(recipe, int(settings.max_steps), output_dir, logger, enable_progress_bar)
    last = output_dir / "checkpoints" / "last.ckpt"
    trainer.fit(module, train_dataloaders=loader, ckpt_path=str(last) if resume and last.exists() else None)

    scaling = module.latent_scaling_factor(loader)
    autoencoder = module.autoencoder.cpu().eval()
    autoencoder.register_to_config(scaling_factor=scaling)
    autoencoder_dir = output_dir / "autoencoder"
    if trainer.is_global_zero:
        autoencoder.save_pretrained(str(autoencoder_dir))
        client.log_artifacts(run_id, str(autoencoder_dir), artifact_path="autoencoder")
        client.log_metric(run_id, "latent_scaling_factor", scaling)
    logger.finalize("success")
    return AutoencoderTrainResult(run_id, output_dir, autoencoder_dir, trainer.global_step, scaling)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="benchx synthx-train",
        description="Train the SynthX tumor generator from a recipe. Trailing key=value pairs override the "
        "recipe (e.g. profile=cpu trainer.max_steps=300).",
    )
    parser.add_argument("--recipe", default="recipes/generator/synthx.yaml", help="SynthX recipe YAML")
    parser.add_argument("--root", default=None, help="cohort folder (overrides data.root)")
    parser.add_argument("--split", default=None, help="split CSV (overrides data.split)")
    parser.add_argument("--out", default=None, help="run folder (default: <tracking.output_dir>/synthx-<run id>)")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/checkpoints/last.ckpt")
    parser.add_argument(
        "--stage",
        choices=("generator", "autoencoder"),
        default="generator",
        help="generator (default), or the latent-mode autoencoder (then set model.latent=true model.vae_path=<its folder>)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    return parser.parse_known_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = parse_args(sys.argv[1:] if argv is None else argv)
    flags = [u for u in unknown if u.startswith("-")]
    if flags:
        print(f"benchx synthx-train: unknown option(s) {' '.join(flags)}", file=sys.stderr)
        return 2
    overrides = list(args.overrides) + list(unknown)
    if args.root:
        overrides.append(f"data.root={args.root}")
    if args.split:
        overrides.append(f"data.split={args.split}")
    recipe = load_synthx_recipe(args.recipe, overrides)
    if args.stage == "autoencoder":
        trained = train_autoencoder(recipe, output_dir=args.out, resume=args.resume)
        print(
            f"SynthX autoencoder trained for {trained.steps} steps (latent scaling {trained.scaling_factor:.3f}); "
            f"MLflow run {trained.run_id}; saved to {trained.autoencoder_dir}; train the generator on it with "
            f"model.latent=true model.vae_path={trained.autoencoder_dir}"
        )
        return 0
    result = train_synthx(recipe, output_dir=args.out, resume=args.resume)
    print(
        f"SynthX generator trained for {result.steps} steps on {len(result.case_ids)} training cases "
        f"({result.mean_step_seconds:.3f} s/step); MLflow run {result.run_id}; pipeline saved to {result.pipeline_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
