"""Tests for lightning_modules.models.segmentation_metrics: Dice and surface Dice on hand-made spheres, the
empty cases, and agreement with MONAI called directly.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/models/test_segmentation_metrics.py -x -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from monai.metrics import DiceMetric, compute_surface_dice
from monai.networks.utils import one_hot

from lightning_modules.models.segmentation_metrics import dice_per_class, surface_dice_per_class

# MONAI's own internal use of a deprecated argument, raised when the tests call MONAI directly.
pytestmark = pytest.mark.filterwarnings("ignore:.*always_return_as_numpy:FutureWarning")

CLASSES = ["pancreas", "pancreatic_lesion"]
SHAPE = (24, 24, 24)


def sphere(center, radius: float, shape=SHAPE) -> np.ndarray:
    grid = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"), axis=-1)
    return np.linalg.norm(grid - np.asarray(center, dtype=float), axis=-1) <= radius


def labels_from(pancreas: np.ndarray, lesion: np.ndarray) -> np.ndarray:
    volume = np.zeros(SHAPE, dtype=np.int64)
    volume[pancreas] = 1
    volume[lesion] = 2  # the lesion lies in the pancreas and overrides it, as in a label map
    return volume


def test_dice_of_spheres_equals_the_overlap_formula():
    truth_pancreas, truth_lesion = sphere((12, 12, 12), 8), sphere((12, 12, 12), 3)
    pred_pancreas, pred_lesion = sphere((13, 12, 12), 7), sphere((14, 12, 12), 3)
    truth, pred = labels_from(truth_pancreas, truth_lesion), labels_from(pred_pancreas, pred_lesion)
    dice = dice_per_class(pred, truth, CLASSES)
    for k, name in enumerate(CLASSES, start=1):
        a, b = pred == k, truth == k
        assert dice[name] == pytest.approx(2 * (a & b).sum() / (a.sum() + b.sum()), abs=1e-6)
    assert 0.3 < dice["pancreatic_lesion"] < 1.0


def test_identical_volumes_score_one():
    truth = labels_from(sphere((12, 12, 12), 8), sphere((10, 12, 12), 3))
    assert dice_per_class(truth, truth, CLASSES) == {"pancreas": 1.0, "pancreatic_lesion": 1.0}
    nsd = surface_dice_per_class(truth, truth, CLASSES, spacing=(1.0, 1.0, 1.0))
    assert nsd == {"pancreas": 1.0, "pancreatic_lesion": 1.0}


def test_empty_cases_are_decided_explicitly():
    pancreas = sphere((12, 12, 12), 8)
    no_lesion = labels_from(pancreas, np.zeros(SHAPE, bool))
    with_lesion = labels_from(pancreas, sphere((12, 12, 12), 3))
    # Both empty (a healthy scan predicted healthy): 1.0 for both metrics, where MONAI's NSD is NaN.
    assert dice_per_class(no_lesion, no_lesion, CLASSES)["pancreatic_lesion"] == 1.0
    assert surface_dice_per_class(no_lesion, no_lesion, CLASSES, (1, 1, 1))["pancreatic_lesion"] == 1.0
    # A false lesion on a healthy scan, and a missed lesion: 0.0.
    for pred, truth in ((with_lesion, no_lesion), (no_lesion, with_lesion)):
        assert dice_per_class(pred, truth, CLASSES)["pancreatic_lesion"] == 0.0
        assert surface_dice_per_class(pred, truth, CLASSES, (1, 1, 1))["pancreatic_lesion"] == 0.0
    # What MONAI itself returns for the empty-vs-empty class (the reason for deciding it here).
    hot = one_hot(torch.as_tensor(no_lesion)[None, None], num_classes=3, dim=1)
    assert torch.isnan(DiceMetric(include_background=False, reduction="none")(hot, hot)[0, 1])
    with pytest.warns(UserWarning):
        assert torch.isnan(compute_surface_dice(hot, hot, class_thresholds=[1.5, 1.5], spacing=1.0)[0, 1])


@pytest.mark.parametrize("seed", [0, 1])
def test_agreement_with_monai_called_directly(seed):
    rng = np.random.default_rng(seed)
    truth = labels_from(sphere((12, 12, 12), 7 + rng.random()), sphere((11, 13, 12), 2.5 + rng.random()))
    pred = labels_from(
        sphere(12 + rng.normal(0, 1, 3), 7 + rng.random()), sphere(12 + rng.normal(0, 1.5, 3), 2.5 + rng.random())
    )
    spacing = (0.8, 0.8, 2.5)
    pred_hot = one_hot(torch.as_tensor(pred)[None, None], num_classes=3, dim=1)
    truth_hot = one_hot(torch.as_tensor(truth)[None, None], num_classes=3, dim=1)
    monai_dice = DiceMetric(include_background=False, reduction="none")(pred_hot, truth_hot)[0]
    monai_nsd = compute_surface_dice(pred_hot, truth_hot, class_thresholds=[1.5, 1.5], spacing=spacing)[0]
    dice = dice_per_class(pred, truth, CLASSES)
    nsd = surface_dice_per_class(torch.as_tensor(pred), torch.as_tensor(truth), CLASSES, spacing=spacing)
    for k, name in enumerate(CLASSES):
        assert dice[name] == pytest.approx(float(monai_dice[k]), abs=1e-7)
        assert nsd[name] == pytest.approx(float(monai_nsd[k]), abs=1e-7)


def test_surface_dice_tolerance_is_in_millimetres():
    truth = labels_from(np.zeros(SHAPE, bool), sphere((12, 12, 12), 6))
    shifted = labels_from(np.zeros(SHAPE, bool), sphere((13, 12, 12), 6))  # one voxel along axis 0
    fine = surface_dice_per_class(shifted, truth, CLASSES, spacing=(1.0, 1.0, 1.0), tolerance_mm=1.5)
    coarse = surface_dice_per_class(shifted, truth, CLASSES, spacing=(2.0, 1.0, 1.0), tolerance_mm=1.5)
    # A 1 mm shift is within 1.5 mm everywhere; a 2 mm shift is not.
    assert fine["pancreatic_lesion"] == 1.0
    assert 0.0 < coarse["pancreatic_lesion"] < fine["pancreatic_lesion"]
    loose = surface_dice_per_class(shifted, truth, CLASSES, spacing=(2.0, 1.0, 1.0), tolerance_mm=2.0)
    assert loose["pancreatic_lesion"] == 1.0
    assert fine["pancreas"] == 1.0  # empty in both: decided, not NaN


def test_bad_inputs_are_refused():
    volume = np.zeros((8, 8, 8), dtype=np.int64)
    with pytest.raises(ValueError, match="differs from true_labels shape"):
        dice_per_class(volume, np.zeros((8, 8, 7), dtype=np.int64), CLASSES)
    with pytest.raises(ValueError, match=r"labels in \[0, 3\], expected 0..2"):
        dice_per_class(volume + 3 * (np.arange(8) == 0)[:, None, None], volume, CLASSES)
    with pytest.raises(ValueError, match="non-integer"):
        dice_per_class(volume + 0.5, volume, CLASSES)
    with pytest.raises(ValueError, match="3 positive voxel sizes"):
        surface_dice_per_class(volume, volume, CLASSES, spacing=(1.0, 1.0))
