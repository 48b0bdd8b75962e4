"""The copy-paste painter: a real training tumor cut out with its mask and pasted at SynthX's site.

SynthX's arm differs from the sham arm in two ways at once: its tumors sit in healthy canvases at
drawn sites (the placement), and their voxels are generated (the content). The copy-paste painter
keeps the first and removes the second. For each synthetic slot it repeats what the diffusion
painter does up to the content (:func:`synthx.generation.painting.generate_case`): the same canvas
(:func:`~synthx.generation.canvases.choose_canvas` on the request's stream, done by the run), the
same tumor site drawn with the same mask prior and the same random stream
(:func:`~synthx.generation.painting.draw_tumor`), so the same center and size. Then, instead of
running the generator, it takes a REAL tumor of a training case and pastes it there:

1. Source: a real training tumor case (split ``train``, ``tumor`` 1, not synthetic), drawn with the
   request's stream from the first non-empty pool of, in this order, the slot's cell (sex, age band,
   phase), its phase, any training tumor: the sham arm's order
   (:func:`lightning_modules.data.exposure.sham_substitutes`), so the copy-paste arm pastes the very
   tumors the sham arm trains on. The match is recorded (``copy_paste_match``); the split is checked
   again for the chosen case, and a case outside ``train`` is refused.
2. Cut: its largest connected lesion with its mask, in RAS, with a margin of context voxels.
3. Scale (``scale_to_site``, the default): zoom the cut isotropically so its largest extent is the
   site's (linear for HU, the mask at half), and resample to the canvas' voxel size. With
   ``scale_to_site=False`` only the voxel sizes are matched; on the same voxel grid nothing is
   resampled and the tumor's HU are copied exactly.
4. Paste: the cut's mask center (of its bounding box) on the site's center; inside the pasted mask
   the voxels are the source's (rounded to integer HU), outside it they are the canvas' own. With
   ``feather_mm`` > 0 the source's weight rises linearly from the mask's edge to 1 at
   ``feather_mm`` inside it (blended with the canvas in between); the core keeps the source's HU.
5. With the mask prior's ``rim_mm`` > 0, the gland grows around the pasted mass as around a painted
   one (:func:`synthx.generation.painting.grow_rim`).
6. The masks (the lesion is the pasted mask, the pancreas grown to include it and its rim) and the metadata row
   of the canvas (as the other painters), plus ``tumor_source_case_id``,
   ``tumor_source_patient_id``, ``copy_paste_match`` and ``copy_paste_scale``.

The synthetic cohort's provenance lists every training tumor the painter may copy, so mixing, the
audit and evaluation refuse the cohort under a split where one of them is not a training case
(:mod:`lightning_modules.data.synthetic_provenance`).

Example::

    painter = CopyPastePainter(cohort, split, PaintSettings(seed=0, size_classes={"small": 1.0}))
    case = painter.paint(canvas_row, request, rng, seed)   # rng: the stream choose_canvas drew from
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import nibabel as nib
import numpy as np
import pandas as pd
from scipy import ndimage

from lightning_modules.data.cohort import Cohort
from lightning_modules.data.lesions import largest_extent_mm, pancreas_location
from lightning_modules.data.metadata import UNKNOWN
from synthx.generation.canvases import LESION_CLASS, ORGAN_CLASS, GenerationError, SynthesisRequest
from synthx.generation.painting import (GeneratedCase, PaintSettings, _reorient, draw_tumor, grow_rim, read_canvas,
                                        synthetic_row)
from synthx.painters import COPY_PASTE_PAINTER
from synthx.generation.cells import labelled_cases

# The pools a source tumor is drawn from, first non-empty wins (the sham arm's order).
SOURCE_MATCHES = ("cell", "phase", "any")
CONTEXT_VOXELS = 2


@dataclass
class SourceTumor:
    """A real tumor cut from its training scan, in RAS: the crop's HU, its lesion mask and voxel size."""

    case_id: str
    patient_id: str
    ct: np.ndarray
    mask: np.ndarray
    spacing: np.ndarray
    diameter_mm: float


def source_tumors(cohort: Cohort, split: pd.DataFrame) -> pd.DataFrame:
    """The tumors the painter may copy: real tumor cases of the TRAINING split (``case_id, patient_id, sex, age_band, phase``).

    Raises:
        GenerationError: the training split has no real tumor case.
    """
    cases = labelled_cases(cohort, split, LESION_CLASS)
    real = cases["synthetic"].astype(int) == 0 if "synthetic" in cases else True
    chosen = cases[(cases["split"] == "train") & (cases["tumor"].astype(int) == 1) & real].copy()
    if chosen.empty:
        raise GenerationError(f"{cohort.root}: the copy-paste painter needs real training tumors, and the training split has none")
    columns = ["case_id", "patient_id", "sex", "age_band", "phase"]
    return chosen[columns].astype(str).sort_values("case_id").reset_index(drop=True)


def choose_source(sources: pd.DataFrame, cell: tuple[str, str, str], rng: np.random.Generator) -> tuple[dict, str]:
    """A source tumor for a slot of ``cell`` and the pool it came from (:data:`SOURCE_MATCHES`, in order)."""
    sex, band, phase = cell
    same_phase = sources["phase"] == phase
    same_cell = same_phase & (sources["sex"] == sex) & (sources["age_band"] == band)
    for match, pool in zip(SOURCE_MATCHES, (same_cell, same_phase, pd.Series(True, index=sources.index))):
        if pool.any():
            candidates = sources[pool]
            return candidates.iloc[int(rng.integers(len(candidates)))].to_dict(), match
    raise GenerationError("no real training tumor to copy")


def cut_tumor(cohort: Cohort, case_id: str, patient_id: str) -> SourceTumor:
    """The case's largest connected lesion with its mask and a margin of context, in RAS."""
    case = cohort.case(case_id)
    image = nib.load(case.ct_path)
    path = case.mask_path(LESION_CLASS)
    try:
        lesion = np.asarray(nib.load(path).dataobj) > 0
    except Exception as error:  # nibabel raises several types; name the case and the file
        raise GenerationError(f"source tumor {case_id}: {path} cannot be read: {error}") from error
    if lesion.shape != image.shape[:3]:
        raise GenerationError(f"source tumor {case_id}: {path} has shape {lesion.shape}, its CT has {image.shape[:3]}")
    labels, count = ndimage.label(lesion, structure=np.ones((3, 3, 3)))
    if count == 0:
        raise GenerationError(f"source tumor {case_id}: recorded as a tumor case, but {path} is empty")
    largest = 1 + int(np.argmax(ndimage.sum_labels(lesion, labels, index=np.arange(1, count + 1))))
    orientation = nib.orientations.io_orientation(image.affine)
    ct = _reorient(np.asarray(image.dataobj, dtype=np.float32), orientation)
    mask = _reorient(labels == largest, orientation)
    zooms = [float(s) for s in image.header.get_zooms()[:3]]
    spacing = np.empty(3)
    for axis, (target, _) in enumerate(orientation):
        spacing[int(target)] = zooms[axis]
    corners = np.argwhere(mask)
    low = np.maximum(corners.min(axis=0) - CONTEXT_VOXELS, 0)
    high = np.minimum(corners.max(axis=0) + CONTEXT_VOXELS + 1, mask.shape)
    box = tuple(slice(int(a), int(b)) for a, b in zip(low, high))
    mask = mask[box].copy()
    return SourceTumor(case_id, patient_id, ct[box].copy(), mask, spacing, largest_extent_mm(mask, spacing))


def fit_to_site(source: SourceTumor, spacing: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The cut's HU and mask on a grid of ``spacing`` (mm) after an isotropic zoom by ``scale``.

    On the same grid and at scale 1 the cut is returned as it is (its HU exact); otherwise HU are
    interpolated linearly and the mask at half (one voxel, under the source's center, when that
    leaves it empty).
    """
    factors = source.spacing * scale / np.asarray(spacing, dtype=float)
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return source.ct.copy(), source.mask.copy()
    ct = ndimage.zoom(source.ct, factors, order=1, mode="nearest", grid_mode=True)
    mask = ndimage.zoom(source.mask.astype(np.float32), factors, order=1, mode="grid-constant", grid_mode=True) >= 0.5
    if not mask.any():
        # Smaller than a voxel (a site of one voxel): the voxel under the source mask's center.
        corners = np.argwhere(source.mask)
        center = ((corners.min(axis=0) + corners.max(axis=0)) / 2 + 0.5) * factors - 0.5
        mask[tuple(np.clip(np.round(center).astype(int), 0, np.array(mask.shape) - 1))] = True
    return ct, mask


def feather_weights(mask: np.ndarray, spacing: np.ndarray, feather_mm: float) -> np.ndarray:
    """The source's weight per voxel: 1 in the core, rising linearly over ``feather_mm`` from the mask's edge, 0 outside."""
    if feather_mm <= 0:
        return mask.astype(np.float32)
    # Distance of each mask voxel's center to the edge, taken half a voxel beyond the outermost centers.
    inside = ndimage.distance_transform_edt(np.pad(mask, 1), sampling=spacing)[1:-1, 1:-1, 1:-1]
    edge = inside - float(np.min(spacing)) / 2
    return np.where(mask, np.clip(edge / feather_mm, 0.0, 1.0), 0.0).astype(np.float32)


def paste(canvas_ct: np.ndarray, site: np.ndarray, ct: np.ndarray, mask: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``canvas_ct`` with ``ct`` blended in where ``mask`` lies, its mask's box center on the site's; and the pasted mask.

    Voxels outside the pasted mask keep the canvas' values; inside it they are
    ``round(w * source + (1 - w) * canvas)``. What falls outside the canvas is dropped.
    """
    site_corners, corners = np.argwhere(site), np.argwhere(mask)
    center = np.round((site_corners.min(axis=0) + site_corners.max(axis=0)) / 2).astype(int)
    start = center - np.round((corners.min(axis=0) + corners.max(axis=0)) / 2).astype(int)
    lower = np.maximum(start, 0)
    upper = np.minimum(start + np.array(mask.shape), canvas_ct.shape)
    if np.any(upper <= lower):
        raise GenerationError("the pasted tumor falls outside the canvas")
    target = tuple(slice(int(a), int(b)) for a, b in zip(lower, upper))
    source = tuple(slice(int(a - s), int(b - s)) for a, b, s in zip(lower, upper, start))
    pasted = np.zeros(canvas_ct.shape, dtype=bool)
    pasted[target] = mask[source]
    if not pasted.any():
        raise GenerationError("the pasted tumor falls outside the canvas")
    weight = np.zeros(canvas_ct.shape, dtype=np.float32)
    values = np.zeros(canvas_ct.shape, dtype=np.float32)
    weight[target], values[target] = weights[source], ct[source]
    new_ct = canvas_ct.copy()
    blended = weight[pasted] * values[pasted] + (1.0 - weight[pasted]) * canvas_ct[pasted]
    new_ct[pasted] = np.clip(np.round(blended), np.iinfo(np.int16).min, np.iinfo(np.int16).max)
    return new_ct, pasted


class CopyPastePainter:
    """Pastes real training tumors at the sites the diffusion painter would paint.

    Args:
        cohort: the real cohort (canvases and source tumors).
        split: its split table; sources are its ``train`` tumor cases only.
        settings: the mask prior of the SynthX run it stands beside (seed, size classes, erosion), so
            the sites are SynthX's; the sampling settings do not apply.
        scale_to_site: zoom each source so its largest extent is the site's (default), else paste it
            at its own size.
        feather_mm: width of the blended edge inside the mask (0: a hard paste).
    """

    def __init__(self, cohort: Cohort, split: pd.DataFrame, settings: PaintSettings, scale_to_site: bool = True,
                 feather_mm: float = 0.0):
        if feather_mm < 0:
            raise GenerationError(f"the copy-paste feather must be >= 0 mm, got {feather_mm}")
        self.cohort = cohort
        self.settings = settings
        self.scale_to_site = bool(scale_to_site)
        self.feather_mm = float(feather_mm)
        self.sources = source_tumors(cohort, split)
        self.split_of = dict(zip(split["case_id"].astype(str), split["split"].astype(str)))
        self._cuts: dict[str, SourceTumor] = {}

    @property
    def source_case_ids(self) -> list[str]:
        """Every case the painter may copy a tumor from (what the synthetic cohort's provenance lists)."""
        return list(self.sources["case_id"])

    def cut(self, case_id: str, patient_id: str) -> SourceTumor:
        """The source's cut (each case is read once)."""
        if self.split_of.get(case_id) != "train":
            raise GenerationError(f"source tumor {case_id} is in the '{self.split_of.get(case_id, '')}' split: "
                                  "only real TRAINING tumors may be copied")
        if case_id not in self._cuts:
            self._cuts[case_id] = cut_tumor(self.cohort, case_id, patient_id)
        return self._cuts[case_id]

    def paint(self, canvas_row: Mapping, request: SynthesisRequest, rng: np.random.Generator, seed: int) -> GeneratedCase:
        """The canvas with a real training tumor pasted at SynthX's site; its metadata describes the canvas."""
        case_id = request.case_id(seed)
        canvas = read_canvas(self.cohort, str(canvas_row["case_id"]))
        site, size_class = draw_tumor(canvas, rng, self.settings)
        chosen, match = choose_source(self.sources, request.cell, rng)
        source = self.cut(str(chosen["case_id"]), str(chosen["patient_id"]))
        scale = largest_extent_mm(site, canvas.spacing) / source.diameter_mm if self.scale_to_site else 1.0
        ct, mask = fit_to_site(source, canvas.spacing, scale)
        new_ct, pasted = paste(canvas.ct, site, ct, mask, feather_weights(mask, canvas.spacing, self.feather_mm))
        new_ct, rim = grow_rim(new_ct, canvas.ct, canvas.masks[ORGAN_CLASS], pasted, canvas.spacing, self.settings.rim_mm)
        row = synthetic_row(canvas.case_id, canvas_row, request, case_id, pasted, canvas.spacing, size_class, seed)
        masks = dict(canvas.masks)
        masks[LESION_CLASS] = pasted
        masks[ORGAN_CLASS] = canvas.masks[ORGAN_CLASS] | pasted | rim
        masks = {name: _reorient(m, canvas.back) for name, m in masks.items()}
        row["tumor_location"] = pancreas_location(masks[ORGAN_CLASS], masks[LESION_CLASS], canvas.image.affine)
        row.update(synthx_painter=COPY_PASTE_PAINTER, tumor_source_case_id=source.case_id,
                   tumor_source_patient_id=source.patient_id or UNKNOWN, copy_paste_match=match,
                   copy_paste_scale=round(float(scale), 4))
        return GeneratedCase(case_id, _reorient(new_ct, canvas.back), canvas.image.affine, masks, row)


__all__ = ["SOURCE_MATCHES", "CopyPastePainter", "SourceTumor", "choose_source", "cut_tumor", "feather_weights",
           "fit_to_site", "paste", "source_tumors"]
