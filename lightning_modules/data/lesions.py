"""Lesion size and location from masks: the one tumor-size rule and the one pancreas-location rule.

Every part of the project that needs a tumor's size or where it sits in the pancreas calls these
functions: the per-case evaluation records, the ``tumor_size`` subgroup of the detection metrics,
and SynthX's mask prior and generation. See ``docs/explanation/data.md "Lesion size and location"``.

Size. A lesion's size is its largest 3D extent: the largest distance between the centres of two of
its voxels, in mm (:func:`largest_extent_mm`; the farthest pair lies on the convex hull, so only
hull vertices are compared). This is orientation-free: an oblique lesion measures its true major
axis, where a bounding box along one array axis would not. A one-voxel lesion measures the voxel's
largest spacing (it is at least that large, and a positive scan never reads 0 mm). A scan with
several lesions takes its largest lesion (:func:`largest_lesion_extent_mm`: connected components,
26-connectivity), so two small lesions far apart are not one large one.

Size classes (lower bound exclusive, upper bound inclusive, like the age bands)::

    tiny (2, 10]   small (10, 20]   medium (20, 40]   large (40, 60]

BenchX's evaluation subgroup splits at 20 mm (BenchX paper, subgroup analysis by tumor size):
``small`` (<= 20 mm) is ``tiny`` + ``small`` above, ``large`` (> 20 mm) is ``medium`` + ``large``
(:func:`tumor_size_group`).

Location. :func:`pancreas_location` projects the pancreas (with the lesion, which AbdomenAtlas
pancreas masks include) on its principal axis in world (RAS) millimetres, orients that axis so
its head end is the patient's right (the head lies in the duodenal C-loop, right of the superior
mesenteric vessels), and cuts the projected extent into thirds: head, body, tail. The lesion's
centre (of its largest component) decides. This is a geometric stand-in for the anatomical
landmarks (the neck over the superior mesenteric vein), which the masks do not carry.

Example::

    diameter = largest_lesion_extent_mm(lesion_mask, spacing=(0.8, 0.8, 2.5))
    tumor_size_group(diameter, tumor=1)                 # "small" or "large"
    pancreas_location(pancreas_mask, lesion_mask, affine)   # "head", "body" or "tail"
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy import ndimage
from scipy.spatial import ConvexHull, QhullError
from scipy.spatial.distance import pdist

from lightning_modules.data.metadata import UNKNOWN

# name -> (lower bound exclusive, upper bound inclusive) of the largest extent in mm.
SIZE_CLASSES: dict[str, tuple[float, float]] = {
    "tiny": (2.0, 10.0),
    "small": (10.0, 20.0),
    "medium": (20.0, 40.0),
    "large": (40.0, 60.0),
}
SIZE_CLASS_NAMES = tuple(SIZE_CLASSES)
# BenchX's small/large boundary (the recipe's detection.small_tumor_mm).
SMALL_TUMOR_MM = 20.0
TUMOR_SIZE_GROUPS = ("small", "large")
PANCREAS_LOCATIONS = ("head", "body", "tail")


def largest_extent_mm(mask: np.ndarray, spacing: Sequence[float]) -> float:
    """The largest distance between the centres of two voxels of ``mask``, in mm.

    An empty mask gives NaN (no lesion, no size); a single voxel gives its largest spacing.

    Args:
        mask: a 3D mask (non-zero = lesion).
        spacing: voxel size in mm along each array axis.
    """
    spacing = np.asarray(spacing, dtype=np.float64)
    points = np.argwhere(np.asarray(mask) != 0).astype(np.float64) * spacing
    if len(points) == 0:
        return math.nan
    if len(points) == 1:
        return float(spacing.max())
    if len(points) > 4:
        try:
            points = points[ConvexHull(points).vertices]
        except QhullError:
            # Flat or collinear sets have no 3D hull; they are small enough to compare directly.
            pass
    return float(pdist(points).max())


def _components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    return ndimage.label(np.asarray(mask) != 0, structure=np.ones((3, 3, 3), dtype=bool))


def largest_lesion_extent_mm(mask: np.ndarray, spacing: Sequence[float]) -> float:
    """The largest :func:`largest_extent_mm` over the connected lesions of ``mask`` (NaN when empty)."""
    labels, count = _components(mask)
    if count <= 1:
        return largest_extent_mm(labels, spacing)
    boxes = ndimage.find_objects(labels)
    return max(largest_extent_mm(labels[box] == index, spacing) for index, box in enumerate(boxes, start=1))


def size_class(diameter_mm: float) -> str:
    """The size class (``tiny``/``small``/``medium``/``large``) whose range holds ``diameter_mm``.

    Raises:
        ValueError: the diameter is outside every class (NaN included).
    """
    for name, (low, high) in SIZE_CLASSES.items():
        if low < diameter_mm <= high:
            return name
    raise ValueError(
        f"diameter {diameter_mm:.1f} mm is outside every size class "
        f"({', '.join(f'{n} {lo:g}-{hi:g}' for n, (lo, hi) in SIZE_CLASSES.items())})"
    )


def tumor_size_group(diameter_mm: float, tumor: int, small_tumor_mm: float = SMALL_TUMOR_MM) -> str:
    """BenchX's ``tumor_size`` subgroup of one scan.

    Returns ``small`` (largest extent <= ``small_tumor_mm``), ``large``, ``Unknown`` for a positive
    scan without a measurable diameter, and ``""`` for a negative scan (it has no tumor size).

    Args:
        diameter_mm: the scan's largest lesion extent (NaN when unknown).
        tumor: the scan-level label (1 = tumor).
        small_tumor_mm: the boundary (the recipe's ``detection.small_tumor_mm``; BenchX: 20 mm).
    """
    if int(tumor) != 1:
        return ""
    if diameter_mm is None or math.isnan(float(diameter_mm)):
        return UNKNOWN
    return "small" if float(diameter_mm) <= small_tumor_mm else "large"


def _world_points(voxels: np.ndarray, affine_or_spacing) -> np.ndarray:
    transform = np.asarray(affine_or_spacing, dtype=np.float64)
    if transform.shape == (4, 4):
        return voxels @ transform[:3, :3].T + transform[:3, 3]
    if transform.shape == (3,):
        return voxels * transform
    raise ValueError(f"expected a 4x4 affine or 3 spacings, got shape {transform.shape}")


def pancreas_location(pancreas_mask: np.ndarray, lesion_mask: np.ndarray, affine_or_spacing) -> str:
    """``head``, ``body`` or ``tail``: where the lesion's centre lies along the pancreas (module docstring).

    Args:
        pancreas_mask: the pancreas mask (the lesion is added to it, as AbdomenAtlas masks include it).
        lesion_mask: the lesion mask on the same grid; with several lesions the largest decides.
        affine_or_spacing: the grid's 4x4 voxel-to-world affine in RAS+ (world x grows toward the
            patient's right), or its 3 spacings in mm for an array already in RAS orientation
            (array axis 0 growing toward the patient's right, as after MONAI's ``Orientation("RAS")``).

    Raises:
        ValueError: the lesion mask is empty, or the masks are on different grids.
    """
    pancreas_mask, lesion_mask = np.asarray(pancreas_mask) != 0, np.asarray(lesion_mask) != 0
    if pancreas_mask.shape != lesion_mask.shape:
        raise ValueError(f"pancreas mask {pancreas_mask.shape} and lesion mask {lesion_mask.shape} differ in shape")
    labels, count = _components(lesion_mask)
    if count == 0:
        raise ValueError("the lesion mask is empty: a location needs a lesion")
    largest = 1 + int(np.argmax(ndimage.sum_labels(lesion_mask, labels, index=np.arange(1, count + 1))))
    organ = _world_points(np.argwhere(pancreas_mask | lesion_mask).astype(np.float64), affine_or_spacing)
    centre = _world_points(np.argwhere(labels == largest).mean(axis=0, keepdims=True), affine_or_spacing)[0]
    mean = organ.mean(axis=0)
    # Principal axis: the right singular vector of the largest singular value of the centred points.
    axis = np.linalg.svd(organ - mean, full_matrices=False)[2][0]
    if axis[0] < 0:
        axis = -axis  # point toward the patient's right (RAS+ x), where the head is
    projected = (organ - mean) @ axis
    low, high = float(projected.min()), float(projected.max())
    if high <= low:
        return "body"
    from_head = (high - float((centre - mean) @ axis)) / (high - low)
    return "head" if from_head < 1 / 3 else ("body" if from_head < 2 / 3 else "tail")
