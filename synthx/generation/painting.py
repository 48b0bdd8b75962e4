"""Painting one synthetic tumor into one canvas: draw the mask, crop, run the pipeline, paste back, describe.

Steps of :func:`generate_case`:

1. Read the canvas and turn it to RAS (the generator was trained on RAS patches, see
   :mod:`synthx.training.dataset`); the result is turned back to the canvas' own orientation.
2. Draw a tumor mask inside the canvas' pancreas with the mask prior (size class drawn from the
   weights; when a class does not fit the organ, the next smaller class is tried and the class
   used is recorded in ``synthx_size_class``).
3. Crop a patch around the tumor and resample it to the generator's voxel size when the canvas'
   differs.
4. Run :class:`synthx.generator.pipeline.SynthXPipeline` conditioned on the request's cell (which is the
   canvas' own cell), resample back and paste the repainted region into the canvas.
5. With ``rim_mm`` > 0, the gland grows around the mass (:func:`grow_rim`): within ``rim_mm`` of
   the tumor, voxels outside the pancreas take the parenchyma's local HU with the canvas' own noise.
6. The masks (``pancreatic_lesion`` added, the pancreas grown to include it and its rim:
   AbdomenAtlas convention) and the metadata row, which describes the canvas: its patient, sex, age,
   phase.

Example::

    case = generate_case(cohort, canvas, request, request.rng(seed), pipeline, PaintSettings(seed=0))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import nibabel as nib
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from scipy import ndimage

from lightning_modules.data.cohort import Cohort
from lightning_modules.data.metadata import UNKNOWN
from synthx.generation.canvases import LESION_CLASS, ORGAN_CLASS, GenerationError, SynthesisRequest
from lightning_modules.data.lesions import SIZE_CLASS_NAMES, largest_extent_mm, pancreas_location
from synthx.generator.mask_prior import TumorDoesNotFitError, sample_tumor_mask
from synthx.generator.pipeline import inpainting_region


@dataclass(frozen=True)
class PaintSettings:
    """How each tumor is painted (from the recipe's ``sampling`` and ``mask_prior`` sections)."""

    seed: int = 0
    num_inference_steps: int = 50
    guidance_scale: float = 2.0
    size_classes: Mapping[str, float] = field(default_factory=lambda: {"tiny": 1.0, "small": 2.0, "medium": 1.0})
    erosion_mm: float = 1.5
    rim_mm: float = 0.0
    clip_to_organ: bool = True


@dataclass
class GeneratedCase:
    case_id: str
    ct: np.ndarray
    affine: np.ndarray
    masks: dict[str, np.ndarray]
    row: dict


@dataclass
class Canvas:
    """A canvas in RAS: CT, masks, voxel size, and how to turn results back to its own orientation."""

    case_id: str
    image: nib.Nifti1Image
    ct: np.ndarray
    masks: dict[str, np.ndarray]
    spacing: np.ndarray
    back: np.ndarray


@dataclass
class Patch:
    """The crop around a tumor, at the canvas' voxel size and at the generator's."""

    start: np.ndarray
    crop_shape: np.ndarray
    crop_ct: np.ndarray
    crop_tumor: np.ndarray
    model_ct: np.ndarray
    model_organ: np.ndarray
    model_tumor: np.ndarray
    resampled: bool


def read_canvas(cohort: Cohort, canvas_id: str) -> Canvas:
    """Step 1: the canvas in RAS, its pancreas present and its lesion mask empty."""
    case = cohort.case(canvas_id)
    image = nib.load(case.ct_path)
    orientation = nib.orientations.io_orientation(image.affine)
    back = nib.orientations.ornt_transform(nib.orientations.axcodes2ornt(("R", "A", "S")), orientation)
    zooms = [float(s) for s in image.header.get_zooms()[:3]]
    spacing = np.empty(3)
    for axis, (target, _) in enumerate(orientation):
        spacing[int(target)] = zooms[axis]
    ct = _reorient(np.asarray(image.dataobj, dtype=np.float32), orientation)
    masks = {name: _reorient(mask, orientation) for name, mask in _read_masks(case, image.shape[:3]).items()}
    if ORGAN_CLASS not in masks or not masks[ORGAN_CLASS].any():
        raise GenerationError(f"canvas {canvas_id}: {case.mask_path(ORGAN_CLASS)} is missing or empty")
    if LESION_CLASS in masks and masks[LESION_CLASS].any():
        raise GenerationError(f"canvas {canvas_id}: {case.mask_path(LESION_CLASS)} has voxels but the case is recorded healthy")
    return Canvas(canvas_id, image, ct, masks, spacing, back)


def draw_tumor(canvas: Canvas, rng: np.random.Generator, settings: PaintSettings) -> tuple[np.ndarray, str]:
    """Step 2: a tumor mask in the canvas' pancreas and the size class it was drawn with."""
    names = [n for n in SIZE_CLASS_NAMES if settings.size_classes.get(n, 0) > 0]
    weights = np.array([settings.size_classes[n] for n in names], dtype=float)
    size_class = names[int(rng.choice(len(names), p=weights / weights.sum()))]
    errors = []
    # A class that does not fit this pancreas falls back to the next smaller one (recorded in the metadata).
    for fallback in reversed(SIZE_CLASS_NAMES[: SIZE_CLASS_NAMES.index(size_class) + 1]):
        try:
            mask = sample_tumor_mask(
                canvas.masks[ORGAN_CLASS], fallback, rng, spacing=canvas.spacing, erosion_mm=settings.erosion_mm,
                where=f"canvas {canvas.case_id} pancreas", clip=settings.clip_to_organ,
            )
            return mask, fallback
        except TumorDoesNotFitError as error:
            errors.append(str(error))
    raise GenerationError("; ".join(errors))


def crop_patch(canvas: Canvas, tumor: np.ndarray, pipeline, case_id: str) -> Patch:
    """Step 3: the crop around the tumor (tumor, inpainting margin, blending, at least the training patch)."""
    config = pipeline.unet.config
    model_spacing = np.array([float(s) for s in config.spacing])
    factor = pipeline.unet.downsampling_factor * (pipeline.vae.downsampling_factor if pipeline.vae is not None else 1)
    corners = np.argwhere(tumor)
    extent_mm = (corners.max(axis=0) - corners.min(axis=0) + 1) * canvas.spacing
    needed_mm = extent_mm + 2 * (float(config.inpaint_margin_mm) + 3 * float(config.blend_sigma_mm)) + 2 * model_spacing
    model_shape = np.maximum(np.array(config.patch_size), np.ceil(needed_mm / model_spacing)).astype(int)
    model_shape = (np.ceil(model_shape / factor) * factor).astype(int)
    crop_shape = np.maximum(np.round(model_shape * model_spacing / canvas.spacing).astype(int), 1)
    start = np.round((corners.min(axis=0) + corners.max(axis=0)) / 2).astype(int) - crop_shape // 2
    crop_ct = _crop(canvas.ct, start, crop_shape, mode="edge")
    crop_organ = _crop(canvas.masks[ORGAN_CLASS], start, crop_shape, mode="constant")
    crop_tumor = _crop(tumor, start, crop_shape, mode="constant")
    if np.allclose(canvas.spacing, model_spacing, rtol=1e-3, atol=1e-4):
        return Patch(start, crop_shape, crop_ct, crop_tumor, crop_ct, crop_organ, crop_tumor, False)
    model_ct = _resize(crop_ct, model_shape, "trilinear")
    model_organ = _resize(crop_organ.astype(np.float32), model_shape, "trilinear") > 0.5
    model_tumor = _resize(crop_tumor.astype(np.float32), model_shape, "trilinear") > 0.5
    if not model_tumor.any():
        model_tumor = _resize(crop_tumor.astype(np.float32), model_shape, "nearest") > 0.5
    if not model_tumor.any():
        raise GenerationError(
            f"{case_id}: the tumor drawn in canvas {canvas.case_id} vanishes at the generator's voxel size {model_spacing.tolist()} mm"
        )
    return Patch(start, crop_shape, crop_ct, crop_tumor, model_ct, model_organ, model_tumor, True)


def paint(canvas: Canvas, patch: Patch, request: SynthesisRequest, rng, pipeline, settings: PaintSettings, case_id: str) -> np.ndarray:
    """Step 4: the canvas CT (RAS) with the repainted region pasted in, rounded to int16 HU."""
    generator = torch.Generator(device="cpu").manual_seed(int(rng.integers(0, 2**31 - 1)))
    output = pipeline(
        image=patch.model_ct,
        organ_mask=patch.model_organ,
        tumor_mask=patch.model_tumor,
        sex=request.sex,
        age=request.age_band,  # the generator is conditioned on the band itself
        phase=request.phase,
        organ=ORGAN_CLASS,
        num_inference_steps=settings.num_inference_steps,
        guidance_scale=settings.guidance_scale,
        generator=generator,
    )
    painted = np.asarray(output.images[0], dtype=np.float32)
    if not np.isfinite(painted).all():
        raise GenerationError(f"{case_id}: the generator returned non-finite values (canvas {canvas.case_id})")
    new_crop = painted
    if patch.resampled:
        config = pipeline.unet.config
        model_spacing = np.array([float(s) for s in config.spacing])
        region = inpainting_region(patch.model_tumor, model_spacing, float(config.inpaint_margin_mm))
        back = _resize(painted, patch.crop_shape, "trilinear")
        # Nearest-neighbour region plus one canvas voxel, so the blended border is pasted whole;
        # outside it the pipeline left the patch as given and the canvas keeps its own voxels.
        region_back = _resize(region.astype(np.float32), patch.crop_shape, "nearest") > 0.5
        region_back = ndimage.binary_dilation(region_back | patch.crop_tumor, iterations=1)
        new_crop = np.where(region_back, back, patch.crop_ct)
    new_ct = canvas.ct.copy()
    _paste(new_ct, new_crop, patch.start)
    return np.clip(np.round(new_ct), np.iinfo(np.int16).min, np.iinfo(np.int16).max)


def grow_rim(ct: np.ndarray, canvas_ct: np.ndarray, organ: np.ndarray, tumor: np.ndarray, spacing,
             rim_mm: float) -> tuple[np.ndarray, np.ndarray]:
    """The gland grown around a painted mass: ``ct`` with a parenchymal rim, and the rim's mask.

    A pancreatic mass enlarges the gland's contour: it sits inside a rim of enhancing parenchyma
    where it meets fat or bowel, in real scans as in the embedded phantom (whose tumors carry a 5 mm
    rim). A tumor painted into a healthy gland has none where it reaches the gland's edge. The rim
    is every voxel within ``rim_mm`` of the tumor (voxel centers, in mm) outside both the canvas'
    pancreas and the tumor and darker than the parenchyma (fat, fluid, bowel: an enhancing vessel or
    bone beside the gland is kept). The parenchyma's HU is the median of the canvas' pancreas within
    ``2 * rim_mm`` of the tumor (the whole pancreas when none lies there); the rim takes it plus the
    canvas' own fine texture (the canvas minus its 3-voxel median, which keeps organ edges out of it),
    so the rim carries the scan's noise. The rim's outer edge is blended over about a voxel (a
    Gaussian-smoothed weight), not cut; changed voxels are rounded to integer HU, the others are
    ``ct``'s. ``rim_mm`` 0 returns ``ct`` unchanged and an empty rim.
    """
    rim = np.zeros(tumor.shape, dtype=bool)
    if rim_mm <= 0 or not tumor.any():
        return ct, rim
    spacing = np.asarray(spacing, dtype=float)
    corners = np.argwhere(tumor)
    reach = np.ceil(2 * rim_mm / spacing).astype(int) + 3
    box = tuple(slice(int(max(a - r, 0)), int(min(b + r + 1, n)))
                for a, b, r, n in zip(corners.min(axis=0), corners.max(axis=0), reach, tumor.shape))
    canvas_box, tumor_box = np.asarray(canvas_ct[box], dtype=np.float64), tumor[box]
    organ_box = np.asarray(organ[box], dtype=bool)
    distance = ndimage.distance_transform_edt(~tumor_box, sampling=spacing)
    near = organ_box & ~tumor_box & (distance <= 2 * rim_mm)
    parenchyma = float(np.median(canvas_box[near])) if near.any() else float(np.median(canvas_ct[organ & ~tumor]))
    rim_box = (distance <= rim_mm) & ~organ_box & ~tumor_box & (canvas_box < parenchyma)
    if not rim_box.any():
        return ct, rim
    texture = canvas_box - ndimage.median_filter(canvas_box, size=3)
    weight = ndimage.gaussian_filter(rim_box.astype(np.float64), 0.5)
    weight[rim_box] = 1.0
    weight[organ_box | tumor_box | (weight < 0.01)] = 0.0
    blend = weight > 0
    grown = np.array(ct, copy=True)
    region = grown[box]
    values = weight[blend] * (parenchyma + texture[blend]) + (1.0 - weight[blend]) * region[blend]
    region[blend] = np.clip(np.round(values), np.iinfo(np.int16).min, np.iinfo(np.int16).max)
    grown[box] = region
    rim[box] = rim_box
    return grown, rim


def describe(canvas: Canvas, canvas_row: Mapping, request: SynthesisRequest, case_id: str, tumor: np.ndarray, size_class: str, seed: int) -> dict:
    """Step 5: the metadata row; sex, age and phase are the canvas' own (they are the request's cell)."""
    return synthetic_row(canvas.case_id, canvas_row, request, case_id, tumor, canvas.spacing, size_class, seed)


def synthetic_row(canvas_id: str, canvas_row: Mapping, request: SynthesisRequest, case_id: str, tumor: np.ndarray,
                  spacing, size_class: str, seed: int) -> dict:
    """A synthetic case's metadata row: the canvas' patient, sex, age and phase, and the tumor painted into it.

    Args:
        spacing: voxel size of ``tumor``'s array axes (mm), for its largest extent.
    """
    age = canvas_row.get("age")
    return {
        "case_id": case_id,
        "patient_id": str(canvas_row["patient_id"]),
        "cohort": str(canvas_row.get("cohort", UNKNOWN)),
        "age": float(age) if age is not None and not pd.isna(age) else math.nan,
        "sex": str(canvas_row["sex"]),
        "race": str(canvas_row.get("race", UNKNOWN)),
        "phase": str(canvas_row["phase"]),
        "tumor": 1,
        "synthetic": 1,
        "source_case_id": canvas_id,
        "tumor_diameter_mm": round(largest_extent_mm(tumor, spacing), 2),
        "spacing": "x".join(f"{s:g}" for s in spacing),
        "synthx_request": request.key,
        "synthx_size_class": size_class,
        "synthx_seed": int(seed),
    }


def generate_case(
    cohort: Cohort, canvas_row: Mapping, request: SynthesisRequest, rng: np.random.Generator, pipeline, settings: PaintSettings
) -> GeneratedCase:
    """Paint one synthetic tumor into one canvas of the request's cell (steps 1-5 of the module docstring)."""
    case_id = request.case_id(settings.seed)
    canvas = read_canvas(cohort, str(canvas_row["case_id"]))
    tumor, size_class = draw_tumor(canvas, rng, settings)
    patch = crop_patch(canvas, tumor, pipeline, case_id)
    new_ct = paint(canvas, patch, request, rng, pipeline, settings, case_id)
    new_ct, rim = grow_rim(new_ct, canvas.ct, canvas.masks[ORGAN_CLASS], tumor, canvas.spacing, settings.rim_mm)
    row = describe(canvas, canvas_row, request, case_id, tumor, size_class, settings.seed)
    masks = dict(canvas.masks)
    masks[LESION_CLASS] = tumor
    # AbdomenAtlas convention: the organ mask includes its lesion (and the rim grown around it).
    masks[ORGAN_CLASS] = canvas.masks[ORGAN_CLASS] | tumor | rim
    masks = {name: _reorient(mask, canvas.back) for name, mask in masks.items()}
    row["tumor_location"] = pancreas_location(masks[ORGAN_CLASS], masks[LESION_CLASS], canvas.image.affine)
    return GeneratedCase(case_id, _reorient(new_ct, canvas.back), canvas.image.affine, masks, row)


# ----------------------------------------------------------------------------------------------


def _read_masks(case, shape) -> dict[str, np.ndarray]:
    masks = {}
    for name in case.available_classes():
        path = case.mask_path(name)
        mask = np.asarray(nib.load(path).dataobj)
        if mask.shape != tuple(shape):
            raise GenerationError(f"canvas {case.case_id}: mask {path} has shape {mask.shape}, its CT has {tuple(shape)}")
        masks[name] = mask > 0
    return masks


def _reorient(volume: np.ndarray, orientation: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(nib.orientations.apply_orientation(volume, orientation))


def _crop(volume: np.ndarray, start: np.ndarray, shape: np.ndarray, mode: str) -> np.ndarray:
    """``volume[start:start+shape]``, padded (edge values or zeros) where the box leaves the volume."""
    before = np.maximum(-start, 0)
    after = np.maximum(start + shape - np.array(volume.shape), 0)
    padded = np.pad(volume, list(zip(before, after)), mode=mode)
    offset = start + before
    return padded[tuple(slice(int(o), int(o + s)) for o, s in zip(offset, shape))].copy()


def _paste(volume: np.ndarray, patch: np.ndarray, start: np.ndarray) -> None:
    """Write ``patch`` into ``volume`` at ``start``, dropping what falls outside the volume."""
    lower = np.maximum(start, 0)
    upper = np.minimum(start + np.array(patch.shape), volume.shape)
    target = tuple(slice(int(a), int(b)) for a, b in zip(lower, upper))
    source = tuple(slice(int(a - s), int(b - s)) for a, b, s in zip(lower, upper, start))
    volume[target] = patch[source]


def _resize(volume: np.ndarray, shape, mode: str) -> np.ndarray:
    tensor = torch.from_numpy(np.ascontiguousarray(volume, dtype=np.float32))[None, None]
    kwargs = {"align_corners": False} if mode == "trilinear" else {}
    return F.interpolate(tensor, size=tuple(int(s) for s in shape), mode=mode, **kwargs)[0, 0].numpy()
