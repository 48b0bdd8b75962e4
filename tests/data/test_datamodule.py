"""The data cache: ``data.cache`` = memory | disk | none give the same items; the disk cache is safe
when several processes (DDP ranks) fill one folder at once; class indices are capped per class.

Run: ``python -m pytest -q tests/data/test_datamodule.py``
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch
from monai.data import MetaTensor

from conftest import RECIPES, tiny_overrides
from lightning_modules.recipe import load_recipe
from lightning_modules.data import datamodule as dm


def _recipe(tiny_phantom, tmp_path, *extra):
    root, split = tiny_phantom
    return load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, split, tmp_path) + list(extra))


N_CASES = 4  # cases per stage read in the cache tests (the tiny phantom's first training/validation cases)


def _datasets(recipe) -> dict:
    """The training (patch sampling) and validation (whole volume) datasets over N_CASES cases each."""
    module = dm.CohortDataModule(recipe.data, recipe.seed)
    module.load()
    chains = {"train": dm.preprocessing(recipe.data) + dm.training_transforms(recipe.data), "val": dm.preprocessing(recipe.data)}
    return {
        stage: dm.cached_dataset(
            dm.case_items(module.cohort, module.case_ids(stage)[:N_CASES], list(recipe.data.classes)),
            dm.seeded_compose(chain, int(recipe.seed)),
            recipe.data,
            recipe.seed,
            cache_dir=dm.default_cache_dir(recipe.tracking.output_dir),
        )
        for stage, chain in chains.items()
    }


def _items(recipe) -> dict:
    return {stage: [dataset[i] for i in range(len(dataset))] for stage, dataset in _datasets(recipe).items()}


def _fill_disk_cache(overrides: list[str], start) -> None:
    """One 'rank': wait for the start signal, then read every item (filling the disk cache)."""
    recipe = load_recipe(RECIPES / "unet.yaml", overrides)
    datasets = _datasets(recipe)
    start.wait(120)
    for dataset in datasets.values():
        for i in range(len(dataset)):
            dataset[i]


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (torch.Tensor, np.ndarray)):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), where
        if ".val[" in where and where.endswith((".image", ".label")):
            # whole volumes keep the metadata that inverts a prediction onto the scan
            assert isinstance(a, MetaTensor) and isinstance(b, MetaTensor), where
            assert torch.equal(a.affine, b.affine) and a.meta["filename_or_obj"] == b.meta["filename_or_obj"], where
        elif where.endswith((".image", ".label")):  # training crops are plain tensors (RandomPartWithoutMetadata)
            assert type(a) is torch.Tensor and type(b) is torch.Tensor, where
    else:
        assert a == b, where


def test_disk_cache_filled_by_two_processes_equals_memory_cache(tiny_phantom, tmp_path):
    cache_dir = tmp_path / "cache"
    root, split = tiny_phantom
    overrides = tiny_overrides(root, split, tmp_path) + ["data.cache=disk", f"data.cache_dir={cache_dir}"]
    # spawn, as DDP ranks are separate processes (a fork after earlier tests ran torch threads can hang)
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    ranks = [context.Process(target=_fill_disk_cache, args=(overrides, start)) for _ in range(2)]
    for rank in ranks:
        rank.start()
    start.set()
    for rank in ranks:
        rank.join(600)
        assert rank.exitcode == 0, "a process filling the disk cache failed"

    files = list(cache_dir.rglob("*.pt"))
    assert len(files) == 2 * N_CASES, "one cache file per case and transform chain"
    assert not list(cache_dir.rglob(".*.partial")), "no partial file is left behind"

    memory = _items(_recipe(tiny_phantom, tmp_path, "data.cache=memory"))
    _assert_same(_items(load_recipe(RECIPES / "unet.yaml", overrides)), memory, "disk")
    assert len(list(cache_dir.rglob("*.pt"))) == len(files), "a later run reads the cache and writes nothing"
    _assert_same(_items(_recipe(tiny_phantom, tmp_path, "data.cache=none")), memory, "none")


def test_disk_cache_keys_change_with_preprocessing(tiny_phantom, tmp_path):
    """A different spacing must not reuse files cached for another one."""
    cache_dir = tmp_path / "cache"
    for spacing in ("[2.5,2.5,3.0]", "[3.0,3.0,3.0]", "[2.5,2.5,3.0]"):
        recipe = _recipe(tiny_phantom, tmp_path, "data.cache=disk", f"data.cache_dir={cache_dir}", f"data.spacing={spacing}")
        _datasets(recipe)["val"][0]
    assert len(list(cache_dir.rglob("*.pt"))) == 2


def test_class_indices_are_capped_per_class_and_labels_stay_uint8(tiny_phantom, tmp_path, monkeypatch):
    monkeypatch.setattr(dm, "CLASS_INDICES_PER_CLASS", 100)
    recipe = _recipe(tiny_phantom, tmp_path)
    transforms = dm.preprocessing(recipe.data) + dm.training_transforms(recipe.data)[:1]
    cohort = dm.load_cohort(recipe.data.root)
    case_id = cohort.case_ids[0]
    item = dm.seeded_compose(transforms, 0)(dm.case_items(cohort, [case_id], list(recipe.data.classes))[0])
    sizes = [len(indices) for indices in item["label_cls_indices"]]
    assert max(sizes) == 100, sizes
    background = int((item["label"] == 0).sum())
    assert background > 100, "the background is larger than the cap"
    assert item["label"].dtype == torch.uint8, "a cached label costs 1 byte per voxel"


def test_unknown_cache_mode_is_refused(tiny_phantom, tmp_path):
    with pytest.raises(ValueError, match="data.cache must be memory, disk or none"):
        _datasets(_recipe(tiny_phantom, tmp_path, "data.cache=True"))


def test_training_crops_drop_metadata_but_not_the_crops_and_restore_the_switch(tiny_phantom, tmp_path):
    """The random tail runs without metadata tracking: the same crops as with it, plain tensors, switch restored."""
    from monai.data import get_track_meta
    from monai.transforms import Compose, Lambdad

    recipe = _recipe(tiny_phantom, tmp_path)
    chain = dm.preprocessing(recipe.data) + dm.training_transforms(recipe.data)
    cohort = dm.load_cohort(recipe.data.root)
    items = dm.case_items(cohort, cohort.case_ids[:2], list(recipe.data.classes))
    with_metadata = Compose(dm.preprocessing(recipe.data) + dm.training_transforms(recipe.data))  # own transform objects
    with_metadata.set_random_state(seed=7)
    without = dm.seeded_compose(chain, 7)
    for item in items:
        expected, crops = with_metadata(dict(item)), without(dict(item))
        assert get_track_meta(), "the process-wide switch is back on after the random tail"
        assert len(expected) == len(crops) == int(recipe.data.samples_per_volume)
        for e, c in zip(expected, crops):
            assert isinstance(e["image"], MetaTensor) and type(c["image"]) is torch.Tensor
            assert torch.equal(e["image"].as_tensor(), c["image"]) and torch.equal(e["label"].as_tensor(), c["label"])

    # whole volumes (no random transform) keep their affine
    volume = dm.seeded_compose(dm.preprocessing(recipe.data), 0)(dict(items[0]))
    assert isinstance(volume["image"], MetaTensor) and volume["image"].affine.shape == (4, 4)
    assert isinstance(volume["label"], MetaTensor) and torch.equal(volume["label"].affine, volume["image"].affine)

    def fail(_):
        raise RuntimeError("broken augmentation")

    broken = dm.seeded_compose(chain + [Lambdad(keys="image", func=fail)], 0)
    with pytest.raises(RuntimeError):
        broken(dict(items[0]))
    assert get_track_meta(), "the switch is restored when a random transform fails"


def test_the_disk_cache_folder_is_data_cache_dir_else_the_runs_default_and_never_guessed(tmp_path):
    recipe = load_recipe(RECIPES / "unet.yaml", ["profile=cpu", "data.cache=disk", f"data.root={tmp_path / 'cohort'}"])
    with pytest.raises(ValueError, match="data.cache=disk needs data.cache_dir"):
        dm.disk_cache_folder(recipe.data)
    default = dm.disk_cache_folder(recipe.data, dm.default_cache_dir(tmp_path / "outputs"))
    assert default.parent == tmp_path / "outputs" / "data-cache" and default.name.startswith("cohort-")
    chosen = load_recipe(RECIPES / "unet.yaml", ["profile=cpu", "data.cache=disk", f"data.root={tmp_path / 'cohort'}",
                                                 f"data.cache_dir={tmp_path / 'shared'}"])
    assert dm.disk_cache_folder(chosen.data, tmp_path / "outputs").parent == tmp_path / "shared", "data.cache_dir wins"
