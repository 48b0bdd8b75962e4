"""Tests of lightning_modules/models/tumor_outputs.py: one rule for tumor voxels, the removal of
small predicted components and the scan-level tumor score, read from the recipe.

Run: .venv/bin/pytest tests/models/test_tumor_outputs.py -x -q
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from monai.data import MetaTensor

from lightning_modules.recipe import load_recipe
from lightning_modules.models.checkpoints import build_module
from lightning_modules.models.tumor_outputs import (
    predicted_labels,
    remove_small_components,
    tumor_scan_scores,
    tumor_voxels,
)


def _mask_with_blobs() -> torch.Tensor:
    """A 3-D mask with a 27-voxel cube, a 2-voxel speck and a diagonal pair (26-connected, 2 voxels)."""
    mask = torch.zeros(20, 20, 20, dtype=torch.bool)
    mask[2:5, 2:5, 2:5] = True  # 27 voxels
    mask[10, 10, 10:12] = True  # 2 voxels
    mask[15, 15, 15] = mask[16, 16, 16] = True  # touching by a corner: one component of 2
    return mask


def test_small_components_are_removed_and_large_ones_kept_exactly():
    mask = _mask_with_blobs()
    kept = remove_small_components(mask, min_voxels=3)
    assert kept.dtype == torch.bool and kept.shape == mask.shape
    assert int(kept.sum()) == 27 and bool(kept[2:5, 2:5, 2:5].all())
    assert torch.equal(remove_small_components(mask, min_voxels=0), mask)
    assert int(remove_small_components(mask, min_voxels=28).sum()) == 0


def test_scan_scores_count_only_components_above_the_size_in_mm3():
    mask = _mask_with_blobs()
    voxel = 2.5 * 2.5 * 3.0  # 18.75 mm^3
    raw = tumor_scan_scores(mask, voxel)
    assert raw == {"raw_volume_mm3": 31 * voxel, "volume_mm3": 31 * voxel, "largest_component_mm3": 27 * voxel,
                   "components": 3}
    # 2 voxels = 37.5 mm^3 < 50 mm^3: both specks go, the cube (506 mm^3) stays; the raw volume keeps them.
    cleaned = tumor_scan_scores(mask, voxel, min_component_mm3=50.0)
    assert cleaned == {"raw_volume_mm3": 31 * voxel, "volume_mm3": 27 * voxel, "largest_component_mm3": 27 * voxel,
                       "components": 1}
    assert tumor_scan_scores(mask, voxel, min_component_mm3=1000.0)["volume_mm3"] == 0.0
    assert tumor_scan_scores(torch.zeros(4, 4, 4, dtype=torch.bool), voxel, 50.0)["components"] == 0
    with pytest.raises(ValueError, match="min_component_mm3"):
        tumor_scan_scores(mask, voxel, min_component_mm3=-1.0)
    with pytest.raises(ValueError, match="3-D"):
        remove_small_components(torch.ones(2, 4, 4, 4, dtype=torch.bool), 2)


def test_softmax_and_sigmoid_tumor_voxels_follow_one_rule():
    logits = torch.full((1, 3, 4, 4, 4), -5.0)
    logits[:, 0] = 5.0  # background everywhere ...
    logits[0, 2, 1, 1, 1] = 10.0  # ... but one tumor voxel (label 2)
    assert int(tumor_voxels(logits, "softmax", 2).sum()) == 1
    sigmoid = logits[:, 1:]  # no background channel
    assert int(tumor_voxels(sigmoid, "sigmoid", 2).sum()) == 1
    assert int(predicted_labels(sigmoid, "sigmoid").max()) == 2


def test_softmax_label_map_is_the_argmax_with_its_tie_rule():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 6, 7, 5)
    logits[0, :, 0] = 1.0  # a plane where all three channels tie: argmax takes the first (background)
    logits[1, 1:, 1] = 4.0  # channels 1 and 2 tie above channel 0: the first of them (1)
    labels = predicted_labels(logits, "softmax")
    assert torch.equal(labels, torch.argmax(logits, dim=1))
    assert bool((labels[0, 0] == 0).all()) and bool((labels[1, 1] == 1).all())


def test_the_fixed_m_rule_counts_raw_voxels_that_component_removal_would_drop():
    from lightning_modules.evaluation.detection import decisions
    from lightning_modules.evaluation.records import fixed_rule_score

    # Four scattered voxels of 20 mm^3 each: 80 mm^3 of raw tumor voxels, no component of 150 mm^3.
    mask = torch.zeros(20, 20, 20, dtype=torch.bool)
    for corner in (0, 5, 10, 15):
        mask[corner, corner, corner] = True
    scores = tumor_scan_scores(mask, 20.0, min_component_mm3=150.0)
    assert scores["raw_volume_mm3"] == 80.0 and scores["volume_mm3"] == 0.0
    records = pd.DataFrame([{**scores, "case_id": "C1", "label": 1}])
    fixed = fixed_rule_score("volume", records)
    assert fixed == "raw_volume"
    # BenchX's fixed m = 50 mm^3 calls the scan positive on its raw voxels; the cleaned score would not.
    assert decisions(records, 50.0, fixed).tolist() == [True]
    assert decisions(records, 50.0, "volume").tolist() == [False]
    assert fixed_rule_score("volume", records.drop(columns="raw_volume_mm3")) == "volume"
    assert fixed_rule_score("max_prob") == "max_prob"


def test_a_component_away_from_the_lesion_does_not_find_the_tumor():
    lesion = torch.zeros(20, 20, 20, dtype=torch.bool)
    lesion[2:5, 2:5, 2:5] = True
    elsewhere = torch.zeros(20, 20, 20, dtype=torch.bool)
    elsewhere[12:16, 12:16, 12:16] = True  # 64 voxels, far from the lesion
    missed = tumor_scan_scores(elsewhere, 1.0, min_component_mm3=10.0, lesion_mask=lesion)
    assert missed["volume_mm3"] == 64.0, "the volume score credits the blob"
    assert missed["localized_volume_mm3"] == 0.0 and (missed["lesions"], missed["lesions_found"]) == (1, 0)
    touching = elsewhere.clone()
    touching[4:6, 4:6, 4:6] = True  # an 8-voxel component overlapping the lesion's corner
    found = tumor_scan_scores(touching, 1.0, min_component_mm3=5.0, lesion_mask=lesion)
    assert found["localized_volume_mm3"] == 8.0 and found["lesions_found"] == 1
    # A component that overlaps the lesion but is removed as too small does not count either.
    assert tumor_scan_scores(touching, 1.0, min_component_mm3=10.0, lesion_mask=lesion)["lesions_found"] == 0
    # Two lesions, one hit: lesion-level hits 1 of 2.
    two = lesion.clone()
    two[17:19, 1:3, 1:3] = True
    assert (tumor_scan_scores(touching, 1.0, lesion_mask=two)["lesions"], tumor_scan_scores(touching, 1.0, lesion_mask=two)["lesions_found"]) == (2, 1)
    # Without a lesion every component is a false positive: the localized score is the volume score.
    healthy = tumor_scan_scores(elsewhere, 1.0, lesion_mask=torch.zeros_like(lesion))
    assert healthy["localized_volume_mm3"] == healthy["volume_mm3"] == 64.0 and healthy["lesions"] == 0
    empty = tumor_scan_scores(torch.zeros_like(lesion), 1.0, lesion_mask=lesion)
    assert empty["localized_volume_mm3"] == 0.0 and (empty["lesions"], empty["lesions_found"]) == (1, 0)


def test_recipe_key_reaches_the_records(tmp_path):
    """detection.min_component_mm3 is read: a module built from the recipe scores with it."""
    recipe = load_recipe("recipes/unet.yaml", ["profile=cpu", "detection.min_component_mm3=50", "data.patch_size=[16,16,16]",
                                               "model.options.channels=[4,8,16,32]"])
    module = build_module(recipe)
    assert module.hparams.min_component_mm3 == 50.0
    logits = torch.full((1, 3, 16, 16, 16), -5.0)
    logits[:, 0] = 5.0
    logits[0, 2, 2:6, 2:6, 2:6] = 10.0  # 64 voxels of 1 mm^3 = 64 mm^3: kept
    logits[0, 2, 12, 12, 12] = 10.0  # 1 voxel: removed
    batch = {"image": MetaTensor(torch.zeros(1, 1, 16, 16, 16), affine=torch.eye(4)), "label": torch.zeros(1, 1, 16, 16, 16), "case_id": ["C1"]}
    record = module.case_records(batch, logits)[0]
    assert record["volume_mm3"] == 64.0 and record["components"] == 1
    assert record["raw_volume_mm3"] == 65.0 and record["lesions"] == 0 and record["localized_volume_mm3"] == 64.0
