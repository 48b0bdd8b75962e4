"""Rendering one planned phantom scan: label map, lesions, intensities, blur and noise.

Each scan draws from random streams keyed by (seed, patient index, stream, scan number), so the
same plan and seed always give the same volume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import ndimage

from lightning_modules.data.cohort import ORGAN_CLASSES
from lightning_modules.cohorts.phantom.anatomy import _build_labels, _draw_anatomy, _Grid
from lightning_modules.cohorts.phantom.intensities import _attenuation_table, _smooth_noise
from lightning_modules.cohorts.phantom.lesions import _place_lesions
from lightning_modules.cohorts.phantom.plan import (
    _ACQUISITION_STREAM,
    _ANATOMY_STREAM,
    ScanPlan,
    _check_shape_and_spacing,
    _stream,
)
from lightning_modules.cohorts.phantom.tissues import MASK_TISSUES, _allowed

@dataclass
class PhantomScan:
    """A rendered scan: CT (int16 HU), masks (uint8) keyed by class, and the shared affine."""

    ct: np.ndarray
    masks: dict[str, np.ndarray]
    affine: np.ndarray


def render_scan(plan: ScanPlan, shape: Sequence[int], spacing: Sequence[float], seed: int) -> PhantomScan:
    """Render one planned scan.

    Args:
        plan: the scan (see :func:`plan_phantom_cohort`).
        shape: volume shape in voxels (each at least 16).
        spacing: voxel spacing in mm.
        seed: the cohort seed; with the plan's patient index and scan number it keys the random streams.
    """
    _check_shape_and_spacing(shape, spacing)
    anatomy = _draw_anatomy(_stream(seed, plan.patient_index, _ANATOMY_STREAM))
    grid = _Grid(shape, spacing, anatomy.placement_mm)
    layout = _build_labels(plan, grid, anatomy)
    _place_lesions(plan, grid, anatomy, layout)
    labels = layout.labels

    acquisition = _stream(seed, plan.patient_index, _ACQUISITION_STREAM, plan.scan_number)
    hu, amplitude = _attenuation_table(plan, acquisition)
    texture = _smooth_noise(acquisition, grid.shape, grid.spacing, correlation_mm=12.0)
    image = hu[labels] + amplitude[labels] * texture
    blur_sigma = plan.site.blur_mm / grid.spacing
    image = ndimage.gaussian_filter(image, sigma=blur_sigma, mode="nearest")
    noise_sigma = plan.site.noise_sigma_hu * acquisition.uniform(0.92, 1.08)
    image += acquisition.standard_normal(grid.shape, dtype=np.float32) * np.float32(noise_sigma)
    ct = np.clip(np.rint(image), -1024, 3071).astype(np.int16)

    masks = {}
    for name in ORGAN_CLASSES + plan.lesion_classes():
        masks[name] = _allowed(*MASK_TISSUES[name])[labels].view(np.uint8)
    return PhantomScan(ct=ct, masks=masks, affine=grid.affine)

