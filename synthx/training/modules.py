"""The SynthX LightningModules: the conditional denoiser's training and the latent-mode autoencoder's.

:class:`SynthXTrainingModule`: DDPM noise on the patch; the denoiser sees the noisy patch, the patch
with the inpainting region blanked and the region mask; squared error weighted
``loss.tumor_weight`` inside the region; each condition is dropped to the null token with
``condition_dropout.each`` and all of them with ``condition_dropout.all`` (what classifier-free
guidance needs at sampling); EMA weights (diffusers ``EMAModel``); :meth:`SynthXTrainingModule.pipeline`
builds the sampling pipeline with the EMA weights.

:class:`SynthXAutoencoderModule`: tumor-weighted L1 reconstruction plus a small KL term.

Example::

    module = SynthXTrainingModule.from_recipe(recipe)
    pipeline = module.pipeline("ddim")
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from diffusers.training_utils import EMAModel
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from synthx.config import SynthXDataConfig, SynthXModelConfig
from synthx.generator.model import CONDITION_NAMES, SynthXAutoencoder, SynthXDenoiser
from synthx.generator.pipeline import SynthXPipeline, cpu_layout
from synthx.generator.schedulers import build_noise_scheduler, sampling_scheduler


def build_denoiser(model: SynthXModelConfig, data: SynthXDataConfig, in_channels: int = 1) -> SynthXDenoiser:
    """The denoiser of the ``model`` section, with the data contract of the ``data`` section (HU
    window, spacing, margin) in its config."""
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


def load_autoencoder(model: SynthXModelConfig, data: SynthXDataConfig) -> SynthXAutoencoder | None:
    """The frozen autoencoder of latent mode (``model.latent``), or None in pixel space."""
    if not model.latent:
        return None
    path = Path(model.vae_path)
    if not path.is_dir():
        raise ValueError(f"model.vae_path {path} is not a saved SynthXAutoencoder folder")
    vae = SynthXAutoencoder.from_pretrained(str(path))
    factor = vae.downsampling_factor * 2 ** (len(model.channels) - 1)
    if any(int(p) % factor for p in data.patch_size):
        raise ValueError(f"latent mode: every data.patch_size value must be divisible by {factor}; got {list(data.patch_size)}")
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
    def from_recipe(cls, recipe: DictConfig, vae: SynthXAutoencoder | None = None) -> "SynthXTrainingModule":
        """The recipe's module; latent mode loads ``model.vae_path`` unless ``vae`` is given (the dry
        run passes an untrained one built from the ``autoencoder`` section)."""
        vae = vae if vae is not None else load_autoencoder(recipe.model, recipe.data)
        in_channels = vae.config.latent_channels if vae is not None else 1
        return cls(
            build_denoiser(recipe.model, recipe.data, in_channels=in_channels),
            build_noise_scheduler(recipe.scheduler),
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
        clean, masked, region = (cpu_layout(t) for t in self.prepare(batch))
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
        if self.device.type == "cpu":
            self.denoiser.to(memory_format=torch.channels_last_3d)
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
        denoiser = copy.deepcopy(self.denoiser).cpu().to(memory_format=torch.contiguous_format)
        if self.ema is not None:
            self.ema.copy_to(denoiser.parameters())
        return denoiser.eval()

    def pipeline(self, sampling: str = "ddim") -> SynthXPipeline:
        """The sampling pipeline with the EMA weights and a sampling scheduler built from the training one."""
        vae = copy.deepcopy(self.vae).cpu() if self.vae is not None else None
        return SynthXPipeline(
            unet=self.ema_denoiser(), scheduler=sampling_scheduler(sampling, self.noise_scheduler), vae=vae
        )


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

    @classmethod
    def from_recipe(cls, recipe: DictConfig) -> "SynthXAutoencoderModule":
        """The recipe's autoencoder (section ``autoencoder``), its patch size checked against the downsampling."""
        settings = recipe.autoencoder
        autoencoder = SynthXAutoencoder(
            channels=list(settings.channels),
            latent_channels=int(settings.latent_channels),
            num_res_blocks=int(settings.num_res_blocks),
            norm_num_groups=int(settings.norm_num_groups),
        )
        factor = autoencoder.downsampling_factor
        if any(int(p) % factor for p in recipe.data.patch_size):
            raise ValueError(f"autoencoder: every data.patch_size value must be divisible by {factor}; got {list(recipe.data.patch_size)}")
        return cls(autoencoder, lr=settings.lr, kl_weight=settings.kl_weight, tumor_weight=recipe.loss.tumor_weight)

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
