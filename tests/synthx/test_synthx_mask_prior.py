"""The rule-based tumor mask prior: inside the eroded organ, size classes in mm, determinism, clear errors.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/test_synthx_mask_prior.py -x -q
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial.distance import pdist

from lightning_modules.data.lesions import SIZE_CLASSES, largest_extent_mm
from lightning_modules.data.lesions import size_class as size_class_of
from synthx.generator.mask_prior import TumorDoesNotFitError, eroded_organ, sample_size_classes, sample_tumor_mask

SPACING = (1.5, 1.5, 2.0)


def ellipsoid_organ(semi_axes_mm, spacing=SPACING, shape=None) -> np.ndarray:
    """A solid ellipsoid with the given semi-axes in mm, centred in its array."""
    semi_axes_mm = np.asarray(semi_axes_mm, dtype=float)
    spacing = np.asarray(spacing, dtype=float)
    if shape is None:
        shape = tuple(int(np.ceil(2 * a / s)) + 6 for a, s in zip(semi_axes_mm, spacing))
    centre = (np.asarray(shape) - 1) / 2.0
    grid = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), axis=-1)
    return (((grid - centre) * spacing / semi_axes_mm) ** 2).sum(-1) <= 1.0


# A pancreas-like organ (elongated, about 20 mm thick) and a liver-sized one for the large class.
THIN_ORGAN = ellipsoid_organ((40.0, 12.0, 12.0))
LARGE_ORGAN = ellipsoid_organ((45.0, 40.0, 40.0), spacing=(2.0, 2.0, 2.0))


@pytest.mark.parametrize(
    "size_class, organ, spacing",
    [("tiny", THIN_ORGAN, SPACING), ("small", THIN_ORGAN, SPACING), ("medium", LARGE_ORGAN, (2.0, 2.0, 2.0)),
     ("large", LARGE_ORGAN, (2.0, 2.0, 2.0))],
)
def test_masks_lie_in_the_eroded_organ_and_respect_their_size_class(size_class, organ, spacing):
    low, high = SIZE_CLASSES[size_class]
    allowed = eroded_organ(organ, spacing, erosion_mm=1.5)
    for seed in range(3):
        mask = sample_tumor_mask(organ, size_class, seed, spacing=spacing, erosion_mm=1.5)
        assert mask.shape == organ.shape and mask.dtype == bool
        assert mask.any()
        assert not (mask & ~allowed).any(), "tumor voxels outside the eroded organ"
        diameter = largest_extent_mm(mask, spacing)
        assert low < diameter <= high, f"{size_class}: diameter {diameter:.1f} mm outside ({low}, {high}]"
        assert size_class_of(diameter) == size_class


def test_an_unclipped_tumor_bulges_out_of_a_thin_organ_with_at_least_half_inside():
    """clip=False keeps the drawn shape whole: its class holds, at least half of it lies in the
    eroded organ, and in a gland about 24 mm thick a small tumor's rest bulges out of it."""
    allowed = eroded_organ(THIN_ORGAN, SPACING, erosion_mm=1.5)
    bulging = 0
    for seed in range(6):
        clipped = sample_tumor_mask(THIN_ORGAN, "small", seed, spacing=SPACING)
        whole = sample_tumor_mask(THIN_ORGAN, "small", seed, spacing=SPACING, clip=False)
        assert size_class_of(largest_extent_mm(whole, SPACING)) == "small"
        assert (whole & allowed).sum() >= 0.5 * whole.sum()
        assert not (clipped & ~allowed).any()
        bulging += int((whole & ~allowed).any())
    assert bulging >= 3, "an unclipped tumor reaches out of the gland"


def test_same_seed_same_mask_and_different_seed_different_mask():
    first = sample_tumor_mask(THIN_ORGAN, "small", 7, spacing=SPACING)
    again = sample_tumor_mask(THIN_ORGAN, "small", np.random.default_rng(7), spacing=SPACING)
    other = sample_tumor_mask(THIN_ORGAN, "small", 8, spacing=SPACING)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_erosion_is_in_millimetres():
    # Erosion by 3 mm removes two voxels at 1.5 mm spacing in-plane but one at 3 mm through-plane.
    organ = np.zeros((20, 20, 10), dtype=bool)
    organ[2:18, 2:18, 2:8] = True
    allowed = eroded_organ(organ, (1.5, 1.5, 3.0), erosion_mm=3.0)
    assert allowed[:, 10, 5].nonzero()[0].tolist() == list(range(4, 16))
    assert allowed[10, 10, :].nonzero()[0].tolist() == list(range(3, 7))


def test_organ_too_small_for_the_class_is_a_clear_error():
    tiny_organ = ellipsoid_organ((6.0, 6.0, 6.0))
    with pytest.raises(TumorDoesNotFitError, match=r"case X pancreas.*too small for a large tumor \(40-60 mm\)"):
        sample_tumor_mask(tiny_organ, "large", 0, spacing=SPACING, where="case X pancreas")
    sliver = np.zeros((10, 10, 10), dtype=bool)
    sliver[5, 2:8, 5] = True  # one voxel thick: nothing survives a 1.5 mm erosion
    with pytest.raises(TumorDoesNotFitError, match="farther than 1.5 mm"):
        sample_tumor_mask(sliver, "tiny", 0, spacing=SPACING)
    with pytest.raises(TumorDoesNotFitError, match="medium tumor .* attempts"):
        # Long enough to pass the extent check, too thin for a 20-40 mm tumor to be half inside.
        sample_tumor_mask(THIN_ORGAN, "medium", 0, spacing=SPACING, min_inside_fraction=0.95, max_attempts=8)


def test_unknown_size_class_and_bad_spacing_are_rejected():
    with pytest.raises(ValueError, match="unknown tumor size class 'huge'"):
        sample_tumor_mask(THIN_ORGAN, "huge", 0, spacing=SPACING)
    with pytest.raises(ValueError, match="spacing must be 3 positive values"):
        sample_tumor_mask(THIN_ORGAN, "tiny", 0, spacing=(1.0, 0.0, 1.0))


def test_largest_diameter_agrees_with_brute_force_pairwise_distances():
    rng = np.random.default_rng(0)
    blob = rng.random((9, 8, 7)) > 0.6
    spacing = (0.8, 1.2, 2.5)
    points = np.argwhere(blob) * np.asarray(spacing)
    assert largest_extent_mm(blob, spacing) == pytest.approx(pdist(points).max())
    line = np.zeros((10, 3, 3), dtype=bool)
    line[2:7, 1, 1] = True
    assert largest_extent_mm(line, spacing) == pytest.approx(4 * 0.8)
    single = np.zeros((3, 3, 3), dtype=bool)
    single[1, 1, 1] = True
    assert largest_extent_mm(single, spacing) == max(spacing)  # one voxel: its largest spacing


def test_sample_size_classes_expands_counts_deterministically():
    counts = {"tiny": 2, "small": 3, "medium": 1, "large": 0}
    first = sample_size_classes(counts, 0)
    assert sorted(first) == sorted(["tiny"] * 2 + ["small"] * 3 + ["medium"])
    assert first == sample_size_classes(counts, np.random.default_rng(0))
    assert len({tuple(sample_size_classes(counts, seed)) for seed in range(10)}) > 1
    with pytest.raises(ValueError, match="unknown tumor size class 'giant'"):
        sample_size_classes({"giant": 1}, 0)
    with pytest.raises(ValueError, match="non-negative integer"):
        sample_size_classes({"tiny": -1}, 0)
