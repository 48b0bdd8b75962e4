"""Lesion size and location: the largest 3D extent, the size classes, and head/body/tail of the pancreas.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/data/test_lesions.py -x -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.spatial.distance import pdist
from scipy.spatial.transform import Rotation

from lightning_modules.cohorts import phantom
from lightning_modules.data.lesions import (
    largest_extent_mm,
    largest_lesion_extent_mm,
    pancreas_location,
    size_class,
    tumor_size_group,
)


def oblique_ellipsoid(semi_axes_mm, spacing, shape, rotation: Rotation) -> np.ndarray:
    grid = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), axis=-1).astype(float)
    centre = (np.asarray(shape) - 1) / 2
    world = (grid - centre) * np.asarray(spacing)
    local = world @ rotation.as_matrix()  # rows: world -> ellipsoid frame
    return (((local / np.asarray(semi_axes_mm)) ** 2).sum(axis=-1) <= 1.0).astype(np.uint8)


def test_oblique_ellipsoid_measures_its_major_axis_within_a_voxel():
    spacing = (0.8, 0.9, 1.5)
    rotation = Rotation.from_euler("xyz", [35, -50, 25], degrees=True)
    mask = oblique_ellipsoid((20.0, 8.0, 6.0), spacing, (70, 70, 50), rotation)
    diameter = largest_extent_mm(mask, spacing)
    assert abs(diameter - 40.0) <= max(spacing)
    # The bounding box along one array axis (the old records rule) misses the oblique major axis.
    coords = np.argwhere(mask)
    bounding_box = ((coords.max(0) - coords.min(0) + 1) * np.asarray(spacing)).max()
    assert bounding_box < 40.0 - 2 * max(spacing)


def test_extent_agrees_with_brute_force_and_edge_cases():
    rng = np.random.default_rng(0)
    blob = rng.random((9, 8, 7)) > 0.6
    spacing = (0.8, 1.2, 2.5)
    assert largest_extent_mm(blob, spacing) == pytest.approx(pdist(np.argwhere(blob) * np.asarray(spacing)).max())
    single = np.zeros((3, 3, 3), dtype=np.uint8)
    single[1, 1, 1] = 1
    assert largest_extent_mm(single, spacing) == 2.5  # one voxel: its largest spacing
    assert math.isnan(largest_extent_mm(np.zeros((3, 3, 3)), spacing))


def test_a_scan_with_two_lesions_takes_the_larger_not_the_span_between_them():
    mask = np.zeros((40, 10, 10), dtype=np.uint8)
    mask[2:6, 4, 4] = 1  # 3 mm
    mask[20:31, 4, 4] = 1  # 10 mm
    assert largest_lesion_extent_mm(mask, (1.0, 1.0, 1.0)) == pytest.approx(10.0)
    assert largest_extent_mm(mask, (1.0, 1.0, 1.0)) == pytest.approx(28.0)


def test_size_classes_and_the_benchx_20_mm_split_agree():
    assert [size_class(d) for d in (5.0, 10.0, 10.5, 20.0, 20.1, 60.0)] == [
        "tiny", "tiny", "small", "small", "medium", "large"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="outside every size class"):
        size_class(1.0)
    assert tumor_size_group(20.0, 1) == "small"
    assert tumor_size_group(20.5, 1) == "large"
    assert tumor_size_group(math.nan, 1) == "Unknown"  # a positive without a diameter
    assert tumor_size_group(12.0, 0) == ""  # a negative has no tumor size
    for d in (3.0, 15.0, 20.0, 25.0, 45.0):
        assert tumor_size_group(d, 1) == ("small" if size_class(d) in ("tiny", "small") else "large")


def bar_pancreas(lesion_at: int) -> tuple[np.ndarray, np.ndarray]:
    """A bar along array axis 0 (90 voxels) with a lesion cube centred at index ``lesion_at``."""
    pancreas = np.zeros((90, 12, 10), dtype=np.uint8)
    pancreas[:, 3:9, 3:7] = 1
    lesion = np.zeros_like(pancreas)
    lesion[lesion_at - 2 : lesion_at + 3, 4:8, 4:6] = 1
    return pancreas, lesion


@pytest.mark.parametrize("index, expected", [(80, "head"), (45, "body"), (8, "tail")])
def test_location_on_a_bar_follows_the_patients_right(index, expected):
    pancreas, lesion = bar_pancreas(index)
    # RAS+: world x grows toward the patient's right, so the high-index end is the head.
    assert pancreas_location(pancreas, lesion, (1.0, 1.0, 1.0)) == expected
    ras = np.diag([1.5, 1.0, 2.0, 1.0])
    assert pancreas_location(pancreas, lesion, ras) == expected
    # The same array stored with x flipped (an LPS-like affine): head and tail swap.
    flipped = np.diag([-1.5, 1.0, 2.0, 1.0])
    assert pancreas_location(pancreas, lesion, flipped) == {"head": "tail", "tail": "head"}.get(expected, expected)


def test_location_needs_a_lesion_on_the_same_grid():
    pancreas, lesion = bar_pancreas(40)
    with pytest.raises(ValueError, match="empty"):
        pancreas_location(pancreas, np.zeros_like(lesion), (1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="differ in shape"):
        pancreas_location(pancreas, lesion[:-1], (1.0, 1.0, 1.0))


def test_location_and_size_derived_on_phantom_pancreases_match_the_plan():
    """The phantom draws each lesion in a planned third of its curved pancreas, with a planned diameter."""
    shape, spacing = (64, 64, 48), (3.75, 3.75, 4.0)
    plans = [plan for plan in phantom.plan_phantom_cohort(200, seed=0) if plan.tumor][:12]
    assert {plan.lesion("pancreatic_lesion").location for plan in plans} == {"head", "body", "tail"}
    for plan in plans:
        scan = phantom.render_scan(plan, shape, spacing, seed=0)
        lesion = scan.masks["pancreatic_lesion"]
        planned = plan.lesion("pancreatic_lesion")
        assert pancreas_location(scan.masks["pancreas"], lesion, scan.affine) == planned.location, plan.case_id
        assert abs(largest_lesion_extent_mm(lesion, spacing) - planned.diameter_mm) <= 2 * max(spacing), plan.case_id


def test_evaluation_records_use_the_one_size_rule_and_derive_the_location():
    """The per-case record builder measures an oblique lesion by its 3D extent and locates it."""
    import torch
    from monai.data import MetaTensor

    from lightning_modules.models.segmentation_module import SegmentationModule

    spacing = (1.0, 1.0, 1.0)
    pancreas, _ = bar_pancreas(45)
    lesion = oblique_ellipsoid((9.0, 2.5, 2.0), spacing, (19, 19, 19), Rotation.from_euler("z", 40, degrees=True))
    labels = pancreas.astype(np.int64)
    labels[70:89, :12, :10][lesion[:19, :12, :10] == 1] = 2  # lesion near the high-x (right) end
    module = SegmentationModule(
        torch.nn.Identity(), ["pancreas", "pancreatic_lesion"], "pancreatic_lesion", patch_size=(16, 16, 16)
    )
    affine = torch.as_tensor(np.diag([*spacing, 1.0]))
    image = MetaTensor(torch.zeros((2, 1, *labels.shape)), affine=affine)
    label = torch.as_tensor(np.stack([labels, pancreas.astype(np.int64)]))[:, None]
    logits = torch.zeros((2, 3, *labels.shape))
    batch = {
        "image": image,
        "label": label,
        "case_id": ["POS", "NEG"],
        "tumor": torch.tensor([-1, 0]),
        "tumor_diameter_mm": ["", ""],
        "tumor_location": ["", ""],
    }
    positive, negative = module.case_records(batch, logits)
    truth = labels == 2
    assert positive["tumor_diameter_mm"] == pytest.approx(largest_lesion_extent_mm(truth, spacing))
    coords = np.argwhere(truth)
    assert positive["tumor_diameter_mm"] > ((coords.max(0) - coords.min(0) + 1)).max()  # not the bounding box
    assert positive["tumor_size"] == "small" and positive["tumor_location"] == "head"
    assert negative["tumor_size"] == "" and negative["tumor_location"] == ""
    # A positive whose lesion is not in the masks: size and location Unknown (one rule for both).
    batch.update(label=torch.as_tensor(np.stack([pancreas, pancreas]).astype(np.int64))[:, None], tumor=torch.tensor([1, 0]))
    unknown, _ = module.case_records(batch, logits)
    assert unknown["tumor_size"] == "Unknown" and unknown["tumor_location"] == "Unknown"
