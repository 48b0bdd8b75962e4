"""SynthXPipeline: paint a conditioned synthetic tumor into a CT patch (a diffusers ``DiffusionPipeline``).

Given a patch of a healthy scan in Hounsfield units, its organ mask and the patient's sex, age and
contrast phase, the pipeline (1) draws a tumor mask with the rule-based prior when none is given,
(2) blanks the inpainting region (the tumor mask dilated by ``unet.config.inpaint_margin_mm``),
(3) denoises from noise with the conditional denoiser (optionally with classifier-free guidance
against the null condition), and (4) blends the result back with a soft border. Voxels outside the
inpainting region are returned exactly as given.

Patches are in HU (any float or integer dtype) on the grid the model was trained on: voxel size
``unet.config.spacing``, every size divisible by ``unet.downsampling_factor``. The HU <-> model
intensity mapping is :func:`normalize_hu` / :func:`denormalize_hu`, shared with training.

Any diffusers scheduler with the same ``prediction_type`` can be swapped in::

    pipe = SynthXPipeline.from_pretrained("outputs/synthx/pipeline")
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    out = pipe(ct_patch, pancreas_patch, sex="F", age=34, phase="arterial", num_inference_steps=50,
               generator=torch.Generator().manual_seed(0))
    out.images[0], out.tumor_masks[0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import DiffusionPipeline, SchedulerMixin
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor
from scipy import ndimage

from synthx.generator.mask_prior import sample_tumor_mask
from synthx.generator.model import SynthXAutoencoder, SynthXDenoiser, encode_conditions

__all__ = [
    "SynthXPipeline",
    "SynthXPipelineOutput",
    "blend_weights",
    "denormalize_hu",
    "inpainting_region",
    "normalize_hu",
]


def normalize_hu(hu, hu_window: Sequence[float]):
    """HU -> model intensity: clip to the window and map it linearly onto [-1, 1].

    Works on numpy arrays and torch tensors alike. This is the only place the mapping is defined:
    training and the pipeline both call it.
    """
    low, high = float(hu_window[0]), float(hu_window[1])
    if not high > low:
        raise ValueError(f"HU window must be increasing, got {list(hu_window)}")
    return (hu.clip(low, high) - low) / (high - low) * 2.0 - 1.0


def denormalize_hu(values, hu_window: Sequence[float]):
    """Model intensity in [-1, 1] -> HU (the inverse of :func:`normalize_hu` inside the window)."""
    low, high = float(hu_window[0]), float(hu_window[1])
    return (values.clip(-1.0, 1.0) + 1.0) / 2.0 * (high - low) + low


def inpainting_region(tumor_mask: np.ndarray, spacing: Sequence[float], margin_mm: float) -> np.ndarray:
    """The region the model repaints: the tumor mask dilated by ``margin_mm`` (spacing-aware).

    The margin lets the model draw the transition from tumor to organ rather than a hard edge.
    """
    tumor = np.asarray(tumor_mask, dtype=bool)
    if margin_mm <= 0 or not tumor.any():
        return tumor.copy()
    distance = ndimage.distance_transform_edt(~tumor, sampling=tuple(float(s) for s in spacing))
    return distance <= margin_mm


def blend_weights(tumor_mask: np.ndarray, region: np.ndarray, spacing: Sequence[float], sigma_mm: float) -> np.ndarray:
    """Soft blending weights: 1 inside the tumor, a Gaussian fall-off across the margin, exactly 0 outside ``region``."""
    tumor = np.asarray(tumor_mask, dtype=np.float64)
    if sigma_mm > 0:
        smooth = ndimage.gaussian_filter(tumor, sigma=[sigma_mm / float(s) for s in spacing], mode="nearest")
        weights = np.maximum(smooth, tumor)
    else:
        weights = tumor
    return np.where(np.asarray(region, dtype=bool), weights, 0.0)


@dataclass
class SynthXPipelineOutput(BaseOutput):
    """Output of :class:`SynthXPipeline`.

    Args:
        images: the patches with synthetic tumors, float32 HU, shape ``(B, D, H, W)``.
        tumor_masks: the tumor masks used, bool, shape ``(B, D, H, W)``.
    """

    images: np.ndarray
    tumor_masks: np.ndarray


def _as_batch(array, name: str, dtype) -> np.ndarray | None:
    """(D, H, W), (B, D, H, W) or (B, 1, D, H, W) array-like -> (B, D, H, W) numpy array."""
    if array is None:
        return None
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    array = np.asarray(array)
    if array.ndim == 3:
        array = array[None]
    elif array.ndim == 5 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 4:
        raise ValueError(f"{name} must be (D, H, W), (B, D, H, W) or (B, 1, D, H, W); got shape {array.shape}")
    return array.astype(dtype, copy=False)


class SynthXPipeline(DiffusionPipeline):
    """Conditional 3D tumor inpainting.

    Args:
        unet: the conditional denoiser.
        scheduler: any diffusers scheduler whose ``prediction_type`` matches the one used in training.
        vae: optional autoencoder; when registered the diffusion runs on its latents (latent mode).
    """

    model_cpu_offload_seq = "unet->vae"
    _optional_components = ["vae"]

    def __init__(self, unet: SynthXDenoiser, scheduler: SchedulerMixin, vae: SynthXAutoencoder | None = None):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler, vae=vae)

    @torch.no_grad()
    def __call__(
        self,
        image,
        organ_mask=None,
        tumor_mask=None,
        sex: str | Sequence[str] | None = None,
        age: float | str | Sequence | None = None,
        phase: str | Sequence[str] | None = None,
        organ: str | Sequence[str] = "pancreas",
        num_inference_steps: int = 50,
        guidance_scale: float = 1.0,
        generator: torch.Generator | None = None,
        size_class: str | Sequence[str] = "small",
        erosion_mm: float = 1.5,
        return_dict: bool = True,
    ) -> SynthXPipelineOutput | tuple[np.ndarray, np.ndarray]:
        """Synthesize one tumor per patch.

        Args:
            image: CT patch(es) in HU, ``(D, H, W)`` or ``(B, D, H, W)``, at ``unet.config.spacing``.
            organ_mask: the organ the tumor grows in, same shape; needed when ``tumor_mask`` is None.
            tumor_mask: the tumor mask(s) to fill; None draws one per patch with the mask prior.
            sex: F / M / Unknown (one value, or one per patch). Unknown or None is the null condition.
            age: years or an age-band name (e.g. ``40-60``), one value or one per patch.
            phase: non-contrast / arterial / venous / delayed (synonyms accepted), one or one per patch.
            organ: pancreas / liver / kidney, one or one per patch.
            num_inference_steps: denoising steps of the scheduler.
            guidance_scale: classifier-free guidance weight; 1 disables guidance (no null branch).
            generator: a torch Generator; fixes the noise and the drawn tumor masks.
            size_class: size class(es) for drawn masks (see :mod:`synthx.generator.mask_prior`).
            erosion_mm: drawn masks keep this distance from the organ's border.
            return_dict: return a :class:`SynthXPipelineOutput` rather than ``(images, tumor_masks)``.
        """
        config = self.unet.config
        spacing = tuple(float(s) for s in config.spacing)
        device = self._execution_device
        dtype = self.unet.dtype

        # 1. Check the inputs and bring them to (B, D, H, W).
        images, organs, tumors = self._check_inputs(image, organ_mask, tumor_mask)
        batch = images.shape[0]

        # 2. Draw the tumor masks that were not given (seeded from the torch generator for reproducibility).
        if tumors is None:
            tumors = _draw_tumor_masks(organs, size_class, erosion_mm, spacing, generator)
        empty = [b for b in range(batch) if not tumors[b].any()]
        if empty:
            raise ValueError(f"tumor_mask of patch(es) {empty} is empty")
        regions = np.stack([inpainting_region(tumors[b], spacing, config.inpaint_margin_mm) for b in range(batch)])

        # 3. Encode the conditions; the null condition (all 0) is the unconditional branch of guidance.
        use_guidance = guidance_scale > 1.0
        conditions = encode_conditions(sex=sex, age=age, phase=phase, organ=organ, batch_size=batch)
        conditions = {name: (torch.cat([torch.zeros_like(v), v]) if use_guidance else v).to(device) for name, v in conditions.items()}

        # 4. Normalize intensities and blank the inpainting region (in latent space when a vae is registered).
        masked, region = self._masked_input(images, regions, device, dtype)

        # 5. Start from pure noise over the whole patch (the known part reaches the model as `masked`).
        latents = randn_tensor(masked.shape, generator=generator, device=device, dtype=dtype)
        self.scheduler.set_timesteps(num_inference_steps, device=device)
        latents = latents * self.scheduler.init_noise_sigma
        model_masked = cpu_layout(torch.cat([masked] * 2) if use_guidance else masked)
        model_region = cpu_layout(torch.cat([region] * 2) if use_guidance else region)

        # 6. Denoising loop.
        for t in self.progress_bar(self.scheduler.timesteps):
            # 6.1 Duplicate the batch for the unconditional branch when guiding.
            model_input = torch.cat([latents] * 2) if use_guidance else latents
            model_input = cpu_layout(self.scheduler.scale_model_input(model_input, t))
            # 6.2 Predict (noise, clean patch or velocity, per the scheduler's prediction_type).
            prediction = self.unet(model_input, t, model_masked, model_region, **conditions).sample
            # 6.3 Classifier-free guidance: move away from the null-condition prediction.
            if use_guidance:
                unconditional, conditional = prediction.chunk(2)
                prediction = unconditional + guidance_scale * (conditional - unconditional)
            # 6.4 One scheduler step toward the clean patch.
            latents = self.scheduler.step(prediction, t, latents, generator=generator).prev_sample

        # 7. Back to voxel space and HU.
        generated = self.vae.decode(latents) if self.vae is not None else latents
        generated_hu = denormalize_hu(generated[:, 0].float().cpu().numpy(), config.hu_window)

        # 8. Blend: soft border inside the region, the input kept exactly outside it.
        results = _blend(images, generated_hu, tumors, regions, spacing, config.blend_sigma_mm)

        self.maybe_free_model_hooks()
        if not return_dict:
            return results, tumors
        return SynthXPipelineOutput(images=results, tumor_masks=tumors)

    def _masked_input(self, images: np.ndarray, regions: np.ndarray, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalized patches with the region blanked, and the region (both at the latent size with a vae)."""
        clean = torch.from_numpy(normalize_hu(images, self.unet.config.hu_window)).to(device=device, dtype=dtype)[:, None]
        region = torch.from_numpy(regions).to(device=device, dtype=dtype)[:, None]
        masked = clean * (1.0 - region)
        if self.vae is not None:
            masked = self.vae.encode(masked)
            region = F.max_pool3d(region, kernel_size=self.vae.downsampling_factor)
        return masked, region

    def _check_inputs(self, image, organ_mask, tumor_mask) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Images, organ masks and tumor masks as (B, D, H, W), same shapes, divisible by the downsampling, finite."""
        images = _as_batch(image, "image", np.float32)
        organs = _as_batch(organ_mask, "organ_mask", bool)
        tumors = _as_batch(tumor_mask, "tumor_mask", bool)
        batch, shape = images.shape[0], images.shape[1:]
        for name, array in (("organ_mask", organs), ("tumor_mask", tumors)):
            if array is not None and array.shape != images.shape:
                raise ValueError(f"{name} has shape {array.shape[1:]} per patch, image has {shape} (batch {batch})")
        factor = self.unet.downsampling_factor * (self.vae.downsampling_factor if self.vae is not None else 1)
        if any(s % factor for s in shape):
            raise ValueError(f"patch size {shape} must be divisible by {factor} (the model's downsampling)")
        if not np.isfinite(images).all():
            raise ValueError("image contains NaN or infinite values")
        if tumors is None and organs is None:
            raise ValueError("give either tumor_mask or organ_mask (to draw a tumor mask from)")
        return images, organs, tumors


def cpu_layout(tensor: torch.Tensor) -> torch.Tensor:
    """A 5D tensor in channels-last 3D layout on the CPU (unchanged elsewhere): oneDNN's 3D convolutions
    run faster in it and keep it for their outputs (measured on 2 cores: a CPU-profile training step
    0.68 -> 0.51 s, a 16-channel 32^3 convolution 19 -> 15 ms)."""
    return tensor.contiguous(memory_format=torch.channels_last_3d) if tensor.device.type == "cpu" and tensor.dim() == 5 else tensor


def _draw_tumor_masks(organs: np.ndarray, size_class, erosion_mm: float, spacing, generator: torch.Generator | None) -> np.ndarray:
    """One mask-prior tumor per organ mask, seeded from the torch generator."""
    batch = organs.shape[0]
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device).item()) if generator is not None else None
    rng = np.random.default_rng(seed)
    classes = list(size_class) if isinstance(size_class, (list, tuple)) else [size_class] * batch
    if len(classes) != batch:
        raise ValueError(f"size_class has {len(classes)} entries for a batch of {batch}")
    return np.stack(
        [sample_tumor_mask(organs[b], classes[b], rng, spacing=spacing, erosion_mm=erosion_mm, where=f"patch {b} organ mask") for b in range(batch)]
    )


def _blend(images: np.ndarray, generated_hu: np.ndarray, tumors: np.ndarray, regions: np.ndarray, spacing, sigma_mm: float) -> np.ndarray:
    """The generated HU inside each region with a soft border, the input exactly outside it."""
    results = images.copy()
    for b in range(images.shape[0]):
        weights = blend_weights(tumors[b], regions[b], spacing, sigma_mm)
        inside = regions[b]
        results[b][inside] = (images[b][inside] * (1.0 - weights[inside]) + generated_hu[b][inside] * weights[inside]).astype(np.float32)
    return results
