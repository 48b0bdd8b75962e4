"""The random tail's plain-tensor paths are MONAI's transforms, draw for draw and tensor for tensor.

Each class in ``lightning_modules.data.augmentation`` is compared with the MONAI class it derives
from, built with the same settings and seed: the same outputs (bit for bit) and the same random
state afterwards, with metadata tracking off (the fast path) and on (MONAI's own path). The whole
training chain, as ``seeded_compose`` runs it, gives the crops of MONAI's classes in a plain
``Compose`` with the same seed, so a recipe trains the same model as with MONAI's classes.

Run: ``python -m pytest -q tests/data/test_augmentation.py``
"""

from __future__ import annotations

import copy

import numpy as np

import pytest
import torch
from monai.data import MetaTensor, get_track_meta, set_track_meta
from monai.transforms import Compose, RandCropByLabelClassesd, RandGaussianNoised, RandScaleIntensityd, RandShiftIntensityd

from conftest import RECIPES, tiny_overrides
from lightning_modules.recipe import load_recipe
from lightning_modules.data import augmentation as aug
from lightning_modules.data import datamodule as dm


def _recipe(tiny_phantom, tmp_path, *extra):
    root, split = tiny_phantom
    return load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, split, tmp_path) + list(extra))


def _monai_class(cls) -> type:
    """The first MONAI class a project transform class derives from."""
    return next(base for base in cls.__mro__ if base.__module__.startswith("monai."))


def _as_monai(transform):
    """The MONAI class a project transform derives from, with the same settings (no state is added)."""
    reference = copy.deepcopy(transform)
    if type(transform).__module__ == aug.__name__:
        reference.__class__ = _monai_class(type(transform))
    return reference


def _next_draws(transform) -> list[float]:
    """The next values of every RandomState a transform holds (its own and its inner transform's)."""
    states = [transform.R] + [getattr(transform, name).R for name in ("scaler", "shifter", "rand_gaussian_noise", "cropper") if hasattr(transform, name)]
    return [float(state.rand()) for state in states]


@pytest.mark.parametrize(
    "ours, monais",
    [
        (lambda: aug.RandScaleIntensityPlaind(keys=["image"], factors=0.1, prob=0.5), RandScaleIntensityd),
        (lambda: aug.RandShiftIntensityPlaind(keys=["image"], offsets=0.05, prob=0.5), RandShiftIntensityd),
        (lambda: aug.RandGaussianNoisePlaind(keys=["image"], std=0.01, prob=0.5), RandGaussianNoised),
    ],
    ids=["scale", "shift", "noise"],
)
def test_intensity_transforms_equal_monais_draw_for_draw(ours, monais):
    project = ours()
    assert _monai_class(type(project)) is monais
    reference = _as_monai(project)
    project.set_random_state(seed=3)
    reference.set_random_state(seed=3)
    generator = torch.Generator().manual_seed(0)
    for tracking in (False, True):
        applied = 0
        set_track_meta(tracking)
        try:
            for _ in range(40):
                image = torch.rand((1, 8, 9, 10), generator=generator)
                item = {"image": MetaTensor(image) if tracking else image, "case_id": "c1"}
                expected, got = reference(dict(item)), project(dict(item))
                assert type(got["image"]) is type(expected["image"]), tracking
                assert got["image"].dtype == expected["image"].dtype == torch.float32
                assert torch.equal(torch.as_tensor(got["image"]), torch.as_tensor(expected["image"])), tracking
                assert got["case_id"] == "c1"
                applied += not torch.equal(torch.as_tensor(got["image"]), image)
        finally:
            set_track_meta(True)
        assert 5 < applied < 35, f"both branches occur at prob 0.5 (applied {applied} of 40)"
    assert _next_draws(project) == _next_draws(reference), "the same random state afterwards"


def test_plain_label_crops_equal_monais_crops_tensor_for_tensor(tiny_phantom, tmp_path):
    """RandCropByLabelClassesPlaind gives, seed for seed, the crops of MONAI's RandCropByLabelClassesd
    with metadata off (the random tail's setting), the other keys copied per crop, and MONAI's own
    output (metadata included) with tracking on; the random states end equal."""
    recipe = _recipe(tiny_phantom, tmp_path)
    cohort = dm.load_cohort(recipe.data.root)
    head = dm.seeded_compose(dm.preprocessing(recipe.data) + dm.training_transforms(recipe.data)[:1], 0)
    items = [head(item) for item in dm.case_items(cohort, cohort.case_ids[:3], list(recipe.data.classes))]
    crop = next(t for t in dm.training_transforms(recipe.data) if isinstance(t, aug.RandCropByLabelClassesPlaind))
    settings = dict(keys=["image", "label"], label_key="label", spatial_size=crop.cropper.spatial_size,
                    ratios=crop.cropper.ratios, num_classes=crop.cropper.num_classes, num_samples=3,
                    indices_key="label_cls_indices", warn=False)
    for tracking in (False, True):
        ours, monai = aug.RandCropByLabelClassesPlaind(**settings), RandCropByLabelClassesd(**settings)
        ours.set_random_state(seed=11)
        monai.set_random_state(seed=11)
        centres = set()
        set_track_meta(tracking)
        try:
            for _ in range(20):  # 20 draws per case: lesion, organ and background centres all occur
                for item in items:
                    expected, got = monai(dict(item)), ours(dict(item))
                    assert len(expected) == len(got) == 3
                    assert ours.cropper.centers == monai.cropper.centers
                    centres.update(ours.cropper.centers)
                    for e, g in zip(expected, got):
                        assert list(e) == list(g), "same keys in the same order"
                        assert type(e["image"]) is type(g["image"]) is (MetaTensor if tracking else torch.Tensor)
                        assert torch.equal(e["image"], g["image"]) and torch.equal(e["label"], g["label"])
                        assert e["case_id"] == g["case_id"]
                        if tracking:
                            assert e["image"].meta["crop_center"] == g["image"].meta["crop_center"]
        finally:
            set_track_meta(True)
        assert len(centres) > 30, "the crops move around"
        assert _next_draws(ours) == _next_draws(monai), "the same random state afterwards"


def test_plain_crops_take_monais_path_where_the_fast_one_does_not_hold(tiny_phantom, tmp_path):
    """Without precomputed class indices (MONAI computes them from the label), and with a window
    larger than the volume (``allow_smaller``), the crops are still MONAI's."""
    recipe = _recipe(tiny_phantom, tmp_path)
    cohort = dm.load_cohort(recipe.data.root)
    head = dm.seeded_compose(dm.preprocessing(recipe.data), 0)
    items = [head(item) for item in dm.case_items(cohort, cohort.case_ids[:2], list(recipe.data.classes))]
    depth = int(items[0]["image"].shape[-1])
    for extra in ({}, {"spatial_size": (16, 16, depth + 8), "allow_smaller": True}):  # the second overhangs
        settings = dict(keys=["image", "label"], label_key="label", spatial_size=(16, 16, 16), ratios=[1, 1, 4],
                        num_classes=3, num_samples=2, warn=False) | extra
        ours, monai = aug.RandCropByLabelClassesPlaind(**settings), RandCropByLabelClassesd(**settings)
        ours.set_random_state(seed=5)
        monai.set_random_state(seed=5)
        set_track_meta(False)
        try:
            for _ in range(5):
                for item in items:
                    for e, g in zip(monai(dict(item)), ours(dict(item))):
                        assert e["image"].shape == g["image"].shape
                        assert torch.equal(e["image"], g["image"]) and torch.equal(e["label"], g["label"])
        finally:
            set_track_meta(True)


def test_training_chain_equals_monais_classes_in_a_plain_compose(tiny_phantom, tmp_path):
    """``seeded_compose`` over the training chain (fast paths, direct dispatch, metadata off) gives the
    crops of MONAI's own classes in a plain Compose with the same seed, crop for crop, over many draws."""
    recipe = _recipe(tiny_phantom, tmp_path, "data.samples_per_volume=2")
    chain = dm.preprocessing(recipe.data) + dm.training_transforms(recipe.data)
    assert [type(t).__module__ for t in chain].count(aug.__name__) == 4, "crop, scale, shift and noise"
    reference = Compose([_as_monai(t) for t in dm.preprocessing(recipe.data) + dm.training_transforms(recipe.data)])
    reference.set_random_state(seed=7)
    ours = dm.seeded_compose(chain, 7)
    cohort = dm.load_cohort(recipe.data.root)
    items = dm.case_items(cohort, cohort.case_ids[:2], list(recipe.data.classes))
    cached = [ours(dict(item), end=ours._first_random()) for item in items]  # the deterministic head, once
    intensity = ours.transforms[-3:]
    applied = [0, 0, 0]
    for _ in range(30):
        for item, head in zip(items, cached):
            expected = reference(dict(item))
            got = ours(dict(head), start=ours._first_random())
            assert get_track_meta()
            assert len(expected) == len(got) == 2
            for e, g in zip(expected, got):
                assert isinstance(e["image"], MetaTensor) and type(g["image"]) is torch.Tensor
                assert torch.equal(e["image"].as_tensor(), g["image"]) and torch.equal(e["label"].as_tensor(), g["label"])
                assert sorted(e) == sorted(g) == ["image", "label"], "training crops carry what training reads"
            applied = [n + bool(t._do_transform) for n, t in zip(applied, intensity)]  # on the last crop
    assert all(n > 0 for n in applied), f"scale, shift and noise each applied on some crops: {applied}"


def test_direct_dispatch_names_the_failing_transform_and_restores_the_switch():
    from monai.transforms import Lambdad

    def fail(_):
        raise ValueError("broken augmentation")

    compose = aug.RandomPartWithoutMetadata([aug.RandScaleIntensityPlaind(keys=["image"], factors=0.1, prob=1.0),
                                             Lambdad(keys="image", func=fail)])
    with pytest.raises(RuntimeError, match="applying transform") as raised:
        compose({"image": torch.zeros((1, 4, 4, 4))})
    assert isinstance(raised.value.__cause__, ValueError)
    assert get_track_meta(), "the switch is restored when a random transform fails"


def test_legacy_choice_equals_numpys_choice_draw_for_draw():
    for seed in range(300):
        ratios = list(np.random.RandomState(10_000 + seed).rand(4) * 5)
        ratios[seed % 4] = 0.0 if seed % 3 else ratios[seed % 4]
        ours, numpys = np.random.RandomState(seed), np.random.RandomState(seed)
        n = 1 + seed % 5
        expected = numpys.choice(len(ratios), size=n, p=np.asarray(ratios) / np.sum(ratios))
        assert np.array_equal(aug._legacy_choice(ours, ratios, n), expected), seed
        assert ours.rand() == numpys.rand(), "the same random state afterwards"


def test_first_random_index_is_remembered_only_for_type_predicates():
    from monai.transforms import Lambdad, RandomizableTrait, Transform

    scale = aug.RandScaleIntensityPlaind(keys=["image"], factors=0.1, prob=1.0)
    compose = aug.RandomPartWithoutMetadata([Lambdad(keys="image", func=lambda x: x), scale])
    types = lambda t: isinstance(t, RandomizableTrait) or not isinstance(t, Transform)  # noqa: E731
    assert compose.get_index_of_first(types) == 1 == Compose.get_index_of_first(compose, types)
    assert compose.get_index_of_first(types) == 1, "asked again: the remembered answer"
    flagged = lambda t: getattr(t, "flag", False)  # noqa: E731  (reads state: asked every time)
    assert compose.get_index_of_first(flagged) is None
    scale.flag = True
    assert compose.get_index_of_first(flagged) == 1
    compose.transforms = compose.transforms[::-1]
    assert compose.get_index_of_first(types) == 0, "a new transform tuple is asked afresh"
