"""The SynthX networks: a conditional volumetric denoiser and an optional autoencoder for latent mode.

:class:`SynthXDenoiser` wraps MONAI's ``DiffusionModelUNet(spatial_dims=3)``, a true volumetric
(Conv3d) diffusion U-Net; diffusers' ``UNet3DConditionModel`` is a video model (2D + time) and is not
used. Inpainting is by channel concatenation (as in latent-diffusion inpainting): the network sees
the noisy patch, the patch with the tumor region blanked, and the tumor-region mask.

Conditions are the patient's sex and age band, the contrast phase and the organ. Each has its own
learned ``nn.Embedding`` whose index 0 is the null (unconditional / Unknown) token; the four
embeddings are summed into the time embedding, so a rare combination (a young woman's non-contrast
scan) shares what it has in common with the frequent ones. The summed embedding goes through the
class-label path of ``DiffusionModelUNet`` (which adds ``class_embedding(class_labels)`` to the time
embedding): the U-Net's single ``class_embedding`` is replaced by :class:`SummedConditionEmbedding`
and the four indices travel together as a ``(B, 4)`` label tensor.

Both classes inherit ``ModelMixin, ConfigMixin`` with ``@register_to_config``, so they round-trip
through ``save_pretrained`` / ``from_pretrained``. ``ModelMixin`` is bound at module level on
purpose: diffusers finds a custom component's loader by looking that name up in the module that
``model_index.json`` records (``synthx.generator.model``).

Example::

    unet = SynthXDenoiser(channels=(16, 32, 32), attention_levels=(False, False, True))
    labels = encode_conditions(sex=["F"], age=[34], phase=["arterial"], organ=["pancreas"])
    out = unet(noisy, timestep, masked, region, **labels).sample
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.utils import BaseOutput
from monai.networks.nets import AutoencoderKL, DiffusionModelUNet
from torch import nn

from lightning_modules.data.metadata import (
    AGE_BAND_NAMES,
    PHASES,
    SEXES,
    UNKNOWN,
    age_band,
    normalize_age,
    normalize_phase,
    normalize_sex,
)
from lightning_modules.models.pinned_layers import use_pinned_layers
from synthx.conditions import ORGAN_CLASSES, ORGAN_OF_LESION

__all__ = [
    "AGE_BAND_VOCAB",
    "CONDITION_NAMES",
    "ModelMixin",
    "ORGAN_CLASSES",
    "ORGAN_OF_LESION",
    "ORGAN_VOCAB",
    "PHASE_VOCAB",
    "SEX_VOCAB",
    "SummedConditionEmbedding",
    "SynthXAutoencoder",
    "SynthXDenoiser",
    "SynthXDenoiserOutput",
    "encode_age_band",
    "encode_conditions",
    "encode_organ",
    "encode_phase",
    "encode_sex",
]

NULL_TOKEN = "<null>"
# Index 0 of every vocabulary is the null condition: used for Unknown values, for condition dropout
# in training and for the unconditional branch of classifier-free guidance.
SEX_VOCAB: tuple[str, ...] = (NULL_TOKEN, *SEXES)
AGE_BAND_VOCAB: tuple[str, ...] = (NULL_TOKEN, *AGE_BAND_NAMES)
PHASE_VOCAB: tuple[str, ...] = (NULL_TOKEN, *PHASES)
ORGAN_VOCAB: tuple[str, ...] = (NULL_TOKEN, "pancreas", "liver", "kidney")
CONDITION_NAMES = ("sex", "age_band", "phase", "organ")



def encode_sex(value) -> int:
    """Index of a recorded sex in :data:`SEX_VOCAB` (``female`` -> F); Unknown/empty -> 0 (null)."""
    sex = normalize_sex(value)
    return 0 if sex == UNKNOWN else SEX_VOCAB.index(sex)


def encode_age_band(value) -> int:
    """Index of an age in years (or an age-band name such as ``40-60``) in :data:`AGE_BAND_VOCAB`; Unknown -> 0."""
    if isinstance(value, str) and value.strip() in AGE_BAND_NAMES:
        return AGE_BAND_VOCAB.index(value.strip())
    if isinstance(value, str) and value.strip() == UNKNOWN:
        return 0
    band = age_band(normalize_age(value))
    return 0 if band == UNKNOWN else AGE_BAND_VOCAB.index(band)


def encode_phase(value) -> int:
    """Index of a contrast phase (``portal venous`` -> venous, ...) in :data:`PHASE_VOCAB`; Unknown -> 0."""
    phase = normalize_phase(value)
    return 0 if phase == UNKNOWN else PHASE_VOCAB.index(phase)


def encode_organ(value) -> int:
    """Index of an organ in :data:`ORGAN_VOCAB`; lesion and mask names map to their organ
    (``pancreatic_lesion`` -> pancreas, ``kidney_left`` -> kidney); None/Unknown -> 0."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return 0
    name = str(value).strip().lower()
    if name in ("", UNKNOWN.lower(), NULL_TOKEN):
        return 0
    name = ORGAN_OF_LESION.get(name, name)
    for organ, mask_classes in ORGAN_CLASSES.items():
        if name in mask_classes:
            name = organ
    if name not in ORGAN_VOCAB:
        raise ValueError(f"unknown organ {value!r}; expected one of {', '.join(ORGAN_VOCAB[1:])}")
    return ORGAN_VOCAB.index(name)


_ENCODERS = {"sex": encode_sex, "age_band": encode_age_band, "phase": encode_phase, "organ": encode_organ}


def encode_conditions(
    sex: Sequence | None = None,
    age: Sequence | None = None,
    phase: Sequence | None = None,
    organ: Sequence | None = None,
    batch_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Encode per-sample conditions into the index tensors :meth:`SynthXDenoiser.forward` takes.

    Each argument is one value (used for the whole batch), a sequence with one value per sample,
    or None (null). ``age`` is in years or an age-band name.

    Returns:
        ``{"sex", "age_band", "phase", "organ"}`` -> LongTensor of shape ``(B,)``.
    """
    raw = {"sex": sex, "age_band": age, "phase": phase, "organ": organ}
    lengths = {len(v) for v in raw.values() if isinstance(v, (list, tuple))}
    if len(lengths) > 1 or (batch_size is not None and lengths and lengths != {batch_size}):
        raise ValueError(f"condition lists have different lengths {sorted(lengths)} (batch size {batch_size})")
    size = batch_size if batch_size is not None else (lengths.pop() if lengths else 1)
    encoded = {}
    for name, value in raw.items():
        values = list(value) if isinstance(value, (list, tuple)) else [value] * size
        try:
            encoded[name] = torch.tensor([_ENCODERS[name](v) for v in values], dtype=torch.long)
        except ValueError as error:
            raise ValueError(f"condition {name}: {error}") from error
    return encoded


class SummedConditionEmbedding(nn.Module):
    """One learned embedding per condition factor, summed: ``(B, 4)`` indices -> ``(B, dim)``.

    Args:
        vocab_sizes: the number of entries (null included) of each factor, in :data:`CONDITION_NAMES` order.
        dim: the time-embedding width of the U-Net.
    """

    def __init__(self, vocab_sizes: Sequence[int], dim: int):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(int(size), dim) for size in vocab_sizes)
        for embedding in self.embeddings:
            # Small start: conditions then nudge, rather than swamp, the time embedding early in training.
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        if labels.ndim != 2 or labels.shape[1] != len(self.embeddings):
            raise ValueError(f"condition labels must have shape (B, {len(self.embeddings)}), got {tuple(labels.shape)}")
        return sum(embedding(labels[:, i]) for i, embedding in enumerate(self.embeddings))


@dataclass
class SynthXDenoiserOutput(BaseOutput):
    """Output of :class:`SynthXDenoiser`: the prediction (noise, clean patch or velocity, per the
    scheduler's ``prediction_type``), shape ``(B, C, D, H, W)``."""

    sample: torch.Tensor


class SynthXDenoiser(ModelMixin, ConfigMixin):
    """Conditional 3D inpainting denoiser (MONAI ``DiffusionModelUNet`` + summed condition embeddings).

    Args:
        in_channels: channels of the diffused signal: 1 in pixel space, the autoencoder's latent
            channels in latent mode. The network input has ``2 * in_channels + 1`` channels.
        channels: feature channels per U-Net level (each a multiple of ``norm_num_groups``).
        attention_levels: self-attention per level (costly at full resolution in 3D).
        num_res_blocks: residual blocks per level.
        norm_num_groups: GroupNorm groups.
        num_head_channels: channels per attention head.
        hu_window: the HU window mapped to [-1, 1] (training and pipeline share it through this config).
        spacing: voxel size in mm of the training patches; generation patches must use it too.
        inpaint_margin_mm: the inpainted region is the tumor mask dilated by this much.
        blend_sigma_mm: Gaussian sigma of the soft blend at the tumor border.
        patch_size: the training patch size in voxels (informative; any size divisible by
            ``2 ** (len(channels) - 1)`` works).
    """

    _supports_gradient_checkpointing = False

    @register_to_config
    def __init__(
        self,
        in_channels: int = 1,
        channels: Sequence[int] = (32, 64, 64),
        attention_levels: Sequence[bool] = (False, False, True),
        num_res_blocks: int = 1,
        norm_num_groups: int = 16,
        num_head_channels: int = 32,
        hu_window: Sequence[float] = (-175.0, 250.0),
        spacing: Sequence[float] = (1.0, 1.0, 1.0),
        inpaint_margin_mm: float = 3.0,
        blend_sigma_mm: float = 1.0,
        patch_size: Sequence[int] = (32, 32, 32),
        num_sexes: int = len(SEX_VOCAB),
        num_age_bands: int = len(AGE_BAND_VOCAB),
        num_phases: int = len(PHASE_VOCAB),
        num_organs: int = len(ORGAN_VOCAB),
    ):
        super().__init__()
        if len(channels) != len(attention_levels):
            raise ValueError(
                f"channels {list(channels)} and attention_levels {list(attention_levels)} need the same length"
            )
        self.unet = DiffusionModelUNet(
            spatial_dims=3,
            in_channels=2 * in_channels + 1,
            out_channels=in_channels,
            num_res_blocks=num_res_blocks,
            channels=tuple(channels),
            attention_levels=tuple(attention_levels),
            norm_num_groups=norm_num_groups,
            num_head_channels=num_head_channels,
            # Enables the U-Net's class-label path; its single table is replaced just below.
            num_class_embeds=1,
        )
        self.unet.class_embedding = SummedConditionEmbedding(
            (num_sexes, num_age_bands, num_phases, num_organs), dim=4 * channels[0]
        )
        # CPU sums that follow neither the machine nor the thread count (lightning_modules.models.pinned_layers).
        use_pinned_layers(self.unet)

    @property
    def downsampling_factor(self) -> int:
        """Every spatial size must be divisible by this."""
        return 2 ** (len(self.config.channels) - 1)

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float | int,
        masked_image: torch.Tensor,
        tumor_mask: torch.Tensor,
        sex: torch.Tensor,
        age_band: torch.Tensor,
        phase: torch.Tensor,
        organ: torch.Tensor,
        return_dict: bool = True,
    ) -> SynthXDenoiserOutput | tuple[torch.Tensor]:
        """Predict from a noisy patch, its known surroundings and the conditions.

        Args:
            sample: the noisy patch, ``(B, C, D, H, W)``.
            timestep: the diffusion step, a scalar or ``(B,)``.
            masked_image: the clean patch with the inpainting region set to 0, ``(B, C, D, H, W)``.
            tumor_mask: the inpainting region, ``(B, 1, D, H, W)``, 1 inside.
            sex, age_band, phase, organ: vocabulary indices, ``(B,)`` (0 = null).
            return_dict: return a :class:`SynthXDenoiserOutput` rather than a tuple.
        """
        batch = sample.shape[0]
        if masked_image.shape != sample.shape:
            raise ValueError(f"masked_image has shape {tuple(masked_image.shape)}, sample {tuple(sample.shape)}")
        if tumor_mask.shape != (batch, 1, *sample.shape[2:]):
            raise ValueError(f"tumor_mask must have shape {(batch, 1, *sample.shape[2:])}, got {tuple(tumor_mask.shape)}")
        bad = [s for s in sample.shape[2:] if s % self.downsampling_factor]
        if bad:
            raise ValueError(
                f"every spatial size must be divisible by {self.downsampling_factor}; got {tuple(sample.shape[2:])}"
            )
        timesteps = torch.as_tensor(timestep, device=sample.device)
        if timesteps.ndim == 0:
            timesteps = timesteps.expand(batch)
        labels = torch.stack(
            [torch.as_tensor(v, device=sample.device, dtype=torch.long).reshape(-1).expand(batch) for v in (sex, age_band, phase, organ)],
            dim=1,
        )
        network_input = torch.cat([sample, masked_image, tumor_mask.to(sample.dtype)], dim=1)
        prediction = self.unet(network_input, timesteps, class_labels=labels)
        if not return_dict:
            return (prediction,)
        return SynthXDenoiserOutput(sample=prediction)


class SynthXAutoencoder(ModelMixin, ConfigMixin):
    """MONAI ``AutoencoderKL`` (3D) for latent-mode SynthX on full-size patches.

    Latent mode diffuses ``scaling_factor * z`` where ``z`` is the encoder mean; the pipeline
    encodes the masked patch and decodes the result, then blends in voxel space.

    Args:
        channels: encoder/decoder channels per level; the latent is ``2 ** (len(channels) - 1)`` times smaller.
        latent_channels: channels of the latent.
        num_res_blocks: residual blocks per level.
        norm_num_groups: GroupNorm groups.
        scaling_factor: multiplies latents so they have about unit variance (estimate it on training latents).
    """

    @register_to_config
    def __init__(
        self,
        channels: Sequence[int] = (32, 64, 64),
        latent_channels: int = 4,
        num_res_blocks: int = 1,
        norm_num_groups: int = 16,
        scaling_factor: float = 1.0,
    ):
        super().__init__()
        self.autoencoder = AutoencoderKL(
            spatial_dims=3,
            in_channels=1,
            out_channels=1,
            channels=tuple(channels),
            latent_channels=latent_channels,
            num_res_blocks=num_res_blocks,
            attention_levels=(False,) * len(channels),
            norm_num_groups=norm_num_groups,
            # Non-local attention over a whole 3D volume is quadratic in voxels; convolutions suffice here.
            with_encoder_nonlocal_attn=False,
            with_decoder_nonlocal_attn=False,
        )
        use_pinned_layers(self.autoencoder)

    @property
    def downsampling_factor(self) -> int:
        return 2 ** (len(self.config.channels) - 1)

    def encode(self, image: torch.Tensor) -> torch.Tensor:
        """Normalized image ``(B, 1, D, H, W)`` -> scaled latent (the posterior mean)."""
        z_mu, _ = self.autoencoder.encode(image)
        return z_mu * self.config.scaling_factor

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """Scaled latent -> normalized image."""
        return self.autoencoder.decode(latent / self.config.scaling_factor)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reconstruction, posterior mean and sigma (MONAI's convention), for autoencoder training."""
        return self.autoencoder(image)
