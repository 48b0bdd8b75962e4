"""Rule-based tumor masks for SynthX: where a synthetic tumor goes and what shape it has.

Following DiffTumor (Chen et al., CVPR 2024), a synthetic tumor starts as a mask drawn inside an
organ of a healthy scan; the diffusion model then paints its texture. A mask is an ellipsoid with
random axes within a size class, randomly rotated, elastically deformed (a smooth random
displacement field: Gaussian-filtered noise), clipped to the organ eroded by ``erosion_mm``, and
centred at a random organ location where it fits.

Size classes are ranges of the largest 3D extent in mm, and the extent is measured by
:func:`lightning_modules.data.lesions.largest_extent_mm`, the one size rule of the project (see
``docs/explanation/data.md "Lesion size and location"``); every returned mask has it inside its class. How
often each class is drawn is the recipe's ``mask_prior.size_class_weights``; by default
(:func:`size_class_weights`) the classes come in proportion to the real training tumors, so the
synthetic tumors are as large as the ones they stand beside.

Example::

    rng = np.random.default_rng(0)
    classes = sample_size_classes({"small": 2, "medium": 1}, rng)
    mask = sample_tumor_mask(pancreas_mask, classes[0], rng, spacing=(1.5, 1.5, 1.5))
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
from scipy import ndimage
from scipy.spatial.transform import Rotation

from lightning_modules.data.lesions import SIZE_CLASS_NAMES, SIZE_CLASSES, largest_extent_mm, size_class

# Shortest semi-axis as a fraction of the longest: real lesions are roundish, rarely needle-like.
_MIN_AXIS_RATIO = 0.6
# Displacement amplitude as a fraction of the longest semi-axis, and the smoothness (Gaussian sigma)
# of the displacement field as a fraction of the diameter: lobulated, not jagged, outlines.
_DEFORMATION_AMPLITUDE = 0.15
_DEFORMATION_SMOOTHNESS = 0.25


class TumorDoesNotFitError(ValueError):
    """The organ (after erosion) is too small or too thin for a tumor of the requested size class."""


def sample_size_classes(counts: Mapping[str, int], rng: np.random.Generator | int | None = None) -> list[str]:
    """Expand per-class counts into a shuffled list of size-class names.

    Args:
        counts: how many tumors of each class, e.g. ``{"tiny": 1, "small": 3, "medium": 2}``.
        rng: a numpy Generator or seed; the order is deterministic for a seed.
    """
    rng = np.random.default_rng(rng)
    names: list[str] = []
    for name, count in counts.items():
        if name not in SIZE_CLASSES:
            raise ValueError(f"unknown tumor size class {name!r}; expected one of {', '.join(SIZE_CLASS_NAMES)}")
        if int(count) != count or count < 0:
            raise ValueError(f"count for size class {name!r} must be a non-negative integer, got {count!r}")
        names += [name] * int(count)
    order = rng.permutation(len(names))
    return [names[i] for i in order]


def size_class_weights(diameters_mm: Iterable[float]) -> dict[str, float]:
    """How many of the given lesions fall in each size class: mask-prior weights that reproduce their sizes.

    A diameter beyond the classes counts in the nearest one (above 60 mm as ``large``, 2 mm or less as
    ``tiny``): a drawn tumor cannot be larger than the largest class anyway.

    Args:
        diameters_mm: lesion sizes by the project's one rule (largest 3D extent, mm).

    Raises:
        ValueError: a diameter is not a positive finite number, or none is given.
    """
    lowest, highest = SIZE_CLASSES[SIZE_CLASS_NAMES[0]][0], SIZE_CLASSES[SIZE_CLASS_NAMES[-1]][1]
    weights = {name: 0.0 for name in SIZE_CLASS_NAMES}
    for diameter in diameters_mm:
        diameter = float(diameter)
        if not np.isfinite(diameter) or diameter <= 0:
            raise ValueError(f"lesion diameter {diameter} mm is not a positive finite number")
        weights[size_class(min(max(diameter, np.nextafter(lowest, np.inf)), highest))] += 1.0
    if not sum(weights.values()):
        raise ValueError("no lesion diameters to take size class weights from")
    return weights


def eroded_organ(organ_mask: np.ndarray, spacing: Sequence[float], erosion_mm: float) -> np.ndarray:
    """Organ voxels farther than ``erosion_mm`` from the organ's outside (a spacing-aware erosion)."""
    organ = np.asarray(organ_mask, dtype=bool)
    if erosion_mm <= 0:
        return organ.copy()
    distance = ndimage.distance_transform_edt(organ, sampling=tuple(float(s) for s in spacing))
    return distance > erosion_mm


def sample_tumor_mask(
    organ_mask: np.ndarray,
    size_class: str,
    rng: np.random.Generator | int | None = None,
    spacing: Sequence[float] = (1.0, 1.0, 1.0),
    erosion_mm: float = 1.5,
    min_inside_fraction: float = 0.5,
    max_attempts: int = 64,
    where: str = "organ mask",
    clip: bool = True,
) -> np.ndarray:
    """Draw one tumor mask inside an organ.

    Each attempt draws a diameter uniformly in the class range, three semi-axes, a rotation and a
    displacement field, centres the shape on a random voxel of the eroded organ and clips it to the
    eroded organ (keeping the largest connected piece). An attempt is kept when its largest
    diameter is inside the class range and at least ``min_inside_fraction`` of the drawn shape lies
    inside the eroded organ (so thin organs such as the pancreas do not produce slivers).

    With ``clip=False`` the drawn shape is kept whole: centred in the eroded organ, at least
    ``min_inside_fraction`` of it inside, the rest bulging out of the organ as a real mass enlarges
    the gland (its diameter, not the clipped piece's, is checked against the class). The random
    draws are the same; only which attempt is kept may differ.

    Args:
        organ_mask: 3D boolean organ mask on the scan's grid.
        size_class: one of :data:`SIZE_CLASSES`.
        rng: a numpy Generator or seed; the mask is deterministic for a seed.
        spacing: voxel size in mm along each array axis.
        erosion_mm: the tumor keeps this distance from the organ's outside.
        min_inside_fraction: share of the drawn shape that must fall inside the eroded organ.
        max_attempts: attempts before giving up with :class:`TumorDoesNotFitError`.
        where: names the organ (e.g. ``"case PH0001 pancreas"``) in error messages.
        clip: clip the shape to the eroded organ (default) or keep it whole.

    Returns:
        A boolean array with the organ's shape.

    Raises:
        TumorDoesNotFitError: the eroded organ is empty, shorter than the class's smallest
            diameter, or no attempt fitted.
    """
    if size_class not in SIZE_CLASSES:
        raise ValueError(f"unknown tumor size class {size_class!r}; expected one of {', '.join(SIZE_CLASS_NAMES)}")
    organ = np.asarray(organ_mask, dtype=bool)
    if organ.ndim != 3:
        raise ValueError(f"{where}: organ mask must be 3D, got shape {organ.shape}")
    spacing = np.asarray([float(s) for s in spacing], dtype=np.float64)
    if spacing.shape != (3,) or (spacing <= 0).any():
        raise ValueError(f"{where}: spacing must be 3 positive values in mm, got {spacing.tolist()}")
    rng = np.random.default_rng(rng)
    low, high = SIZE_CLASSES[size_class]

    allowed = eroded_organ(organ, spacing, erosion_mm)
    candidates = np.argwhere(allowed)
    if len(candidates) == 0:
        raise TumorDoesNotFitError(
            f"{where}: no organ voxel is farther than {erosion_mm} mm from the organ's border "
            f"({int(organ.sum())} organ voxels); cannot place a {size_class} tumor"
        )
    organ_extent = largest_extent_mm(allowed, spacing)
    if organ_extent <= low:
        raise TumorDoesNotFitError(
            f"{where}: the organ eroded by {erosion_mm} mm spans {organ_extent:.1f} mm, too small for a "
            f"{size_class} tumor ({low:g}-{high:g} mm)"
        )

    best_fraction = 0.0
    for _ in range(max_attempts):
        centre = candidates[rng.integers(len(candidates))]
        shape, box = _deformed_ellipsoid(centre, organ.shape, spacing, low, high, rng)
        drawn_volume = int(shape.sum())
        if drawn_volume == 0:
            continue
        clipped = _largest_component(shape & allowed[box])
        inside_fraction = float(clipped.sum()) / drawn_volume
        best_fraction = max(best_fraction, inside_fraction)
        if inside_fraction < min_inside_fraction:
            continue
        kept = clipped if clip else _largest_component(shape)
        diameter = largest_extent_mm(kept, spacing)
        if low < diameter <= high:
            tumor = np.zeros(organ.shape, dtype=bool)
            tumor[box] = kept
            return tumor
    raise TumorDoesNotFitError(
        f"{where}: no {size_class} tumor ({low:g}-{high:g} mm) fitted in {max_attempts} attempts with at least "
        f"{min_inside_fraction:.0%} inside the organ eroded by {erosion_mm} mm (organ spans {organ_extent:.1f} mm; "
        f"at best {best_fraction:.0%} of a drawn tumor was inside); use a smaller size class or a smaller erosion"
    )


def _deformed_ellipsoid(
    centre: np.ndarray,
    volume_shape: tuple[int, ...],
    spacing: np.ndarray,
    low: float,
    high: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, tuple[slice, ...]]:
    """Rasterize one randomly rotated, elastically deformed ellipsoid in a box around ``centre``."""
    diameter = rng.uniform(low, high)
    semi_axes = 0.5 * diameter * np.concatenate([[1.0], rng.uniform(_MIN_AXIS_RATIO, 1.0, size=2)])
    rotation = Rotation.random(random_state=rng).as_matrix()
    amplitude = _DEFORMATION_AMPLITUDE * semi_axes[0]

    reach_mm = semi_axes[0] + 3.0 * amplitude
    half = np.ceil(reach_mm / spacing).astype(int) + 1
    lower = np.maximum(centre - half, 0)
    upper = np.minimum(centre + half + 1, volume_shape)
    box = tuple(slice(int(a), int(b)) for a, b in zip(lower, upper))
    box_shape = tuple(int(b - a) for a, b in zip(lower, upper))

    grid = np.stack(
        np.meshgrid(*[(np.arange(a, b) - c) * s for a, b, c, s in zip(lower, upper, centre, spacing)], indexing="ij"),
        axis=-1,
    )
    sigma_vox = [max(_DEFORMATION_SMOOTHNESS * diameter / s, 0.5) for s in spacing]
    displacement = np.empty(box_shape + (3,), dtype=np.float64)
    for axis in range(3):
        noise = ndimage.gaussian_filter(rng.standard_normal(box_shape), sigma_vox, mode="reflect")
        displacement[..., axis] = noise / (noise.std() + 1e-12) * amplitude
    # Evaluating the ellipsoid at displaced positions is the elastic warp of its indicator.
    local = (grid + displacement) @ rotation
    inside = ((local / semi_axes) ** 2).sum(axis=-1) <= 1.0
    return inside, box


def _largest_component(mask: np.ndarray) -> np.ndarray:
    labels, count = ndimage.label(mask)
    if count <= 1:
        return ndimage.binary_fill_holes(mask)
    sizes = ndimage.sum_labels(mask, labels, index=np.arange(1, count + 1))
    return ndimage.binary_fill_holes(labels == (int(np.argmax(sizes)) + 1))
