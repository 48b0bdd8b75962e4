"""Tests for lightning_modules.data.intensity: the HU window and nnU-Net's CT normalisation (against
nnunetv2's own CTNormalization), the foreground statistics, and training measuring them once."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from conftest import RECIPES, tiny_overrides
from lightning_modules.recipe import RecipeError, load_recipe
from lightning_modules.data.cohort import load_cohort
from lightning_modules.data.intensity import ct_intensity_properties, intensity_transforms

STATS = {"mean": 60.0, "std": 40.0, "percentile_00_5": -40.0, "percentile_99_5": 180.0}


def _data(normalization: str, stats=None):
    return OmegaConf.create({"normalization": normalization, "hu_window": [-175.0, 250.0], "ct_intensity": stats})


def _apply(data, hu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    transforms, foreground = intensity_transforms(data)
    item = {"image": torch.from_numpy(hu.astype(np.float32))[None]}
    for transform in transforms:
        item = transform(item)
    image = item["image"]
    return np.asarray(image[0]), np.asarray(foreground(image)[0])


def test_ct_normalisation_equals_nnunet_s_ct_normalization():
    from nnunetv2.preprocessing.normalization.default_normalization_schemes import CTNormalization

    hu = np.random.default_rng(0).normal(40, 300, size=(20, 18, 16))
    ours, foreground = _apply(_data("ct", STATS), hu)
    theirs = CTNormalization(use_mask_for_norm=False, intensityproperties=STATS).run(hu.copy(), None)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    # The crop keeps what is above the clipped minimum: everything not clipped at the low end.
    np.testing.assert_array_equal(foreground, hu > STATS["percentile_00_5"])


def test_the_window_maps_hu_to_0_1_and_the_crop_keeps_what_is_above_the_window():
    hu = np.array([[[-1000.0, -175.0, 37.5, 250.0, 900.0]]])
    image, foreground = _apply(_data("window"), hu)
    np.testing.assert_allclose(image, [[[0.0, 0.0, 0.5, 1.0, 1.0]]], atol=1e-6)
    np.testing.assert_array_equal(foreground, [[[False, False, True, True, True]]])


def test_ct_normalisation_without_statistics_is_refused():
    with pytest.raises(ValueError, match="data.normalization=ct needs data.ct_intensity"):
        intensity_transforms(_data("ct"))
    with pytest.raises(RecipeError, match="data.normalization must be window or ct, got 'zscore'"):
        load_recipe(RECIPES / "nnunet.yaml", ["data.normalization=zscore"])
    with pytest.raises(RecipeError, match="data.ct_intensity needs std > 0"):
        load_recipe(RECIPES / "nnunet.yaml", ["data.normalization=ct", "data.ct_intensity.std=0"])


def test_foreground_statistics_are_those_of_the_labelled_voxels(tiny_phantom):
    root, split = tiny_phantom
    cohort = load_cohort(root)
    train = list(pd.read_csv(split).query("split == 'train'")["case_id"])[:4]
    classes = ["pancreas", "pancreatic_lesion"]
    values = []
    for case_id in train:
        case = cohort.case(case_id)
        ct = np.asanyarray(nib.load(case.ct_path).dataobj).astype(np.float64)
        mask = np.zeros(ct.shape, dtype=bool)
        for name in classes:
            if case.mask_path(name).exists():
                mask |= np.asanyarray(nib.load(case.mask_path(name)).dataobj) > 0
        values.append(ct[mask])
    pooled = np.concatenate(values)  # a tiny cohort: every voxel is taken, no sampling
    stats = ct_intensity_properties(cohort, train, classes)
    assert stats["mean"] == pytest.approx(pooled.mean()) and stats["std"] == pytest.approx(pooled.std())
    assert [stats["percentile_00_5"], stats["percentile_99_5"]] == pytest.approx(list(np.percentile(pooled, [0.5, 99.5])))


def test_training_measures_the_statistics_once_into_the_recipe_it_logs(tiny_phantom, tmp_path):
    from lightning_modules.workflows.train import prepare_data

    root, split = tiny_phantom
    recipe = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path), "data.normalization=ct"])
    assert recipe.data.ct_intensity is None
    prepared, _, datamodule = prepare_data(recipe)
    table = pd.read_csv(split)
    expected = ct_intensity_properties(load_cohort(root), list(table.loc[table["split"] == "train", "case_id"]),
                                       list(recipe.data.classes))
    assert OmegaConf.to_container(prepared.data.ct_intensity) == pytest.approx(expected)
    assert datamodule.data.ct_intensity == prepared.data.ct_intensity
    # A recipe that carries them (the resolved recipe a run logs) is not measured again.
    assert prepare_data(prepared)[0].data.ct_intensity == prepared.data.ct_intensity
