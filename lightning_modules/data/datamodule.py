"""The data layer for segmentation training: a cohort + split -> MONAI pipelines -> a LightningDataModule.

Touchstone-style preprocessing (shared by training, validation and inference): orientation RAS,
resampling to the recipe's spacing, HU clipped to the recipe's window and scaled to [0, 1],
foreground (body) crop. Training adds patch sampling weighted toward lesions
(``RandCropByLabelClassesd``: background, organ and lesion centres in the recipe's ratios) and light
intensity augmentation. The deterministic part is cached as ``data.cache`` says, so NIfTI files
are decoded once, not every epoch: ``memory`` (``CacheDataset``, each process holds its cases),
``disk`` (``PersistentDataset`` files in ``data.cache_dir``, filled safely by several ranks at once
and reused by later runs) or ``none``. The class indices for lesion-weighted patch sampling are
capped per class (``CLASS_INDICES_PER_CLASS``), so a cached case costs about its image (float32)
and label (uint8), not 8 more bytes for every voxel.

Per-case metadata (case id, patient id, subgroup attributes) travels with each validation/test
item, so the evaluation callback can build one record per case.

Example::

    dm = CohortDataModule(recipe)     # recipe from lightning_modules.config.recipe.load_recipe
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
from pathlib import Path
from typing import Sequence

import lightning.pytorch as pl
import nibabel as nib
import numpy as np
import pandas as pd
import torch
from monai.data import CacheDataset, Dataset, MetaTensor, PersistentDataset, list_data_collate
from monai.data.utils import pickle_hashing
from monai.transforms import (
    CastToTyped,
    ClassesToIndicesd,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    MapTransform,
    Orientationd,
    SelectItemsd,
    Spacingd,
    SpatialPadd,
)
from omegaconf import DictConfig
from monai.data import DataLoader
from monai.utils import convert_to_tensor

from lightning_modules.data.augmentation import (
    RandCropByLabelClassesPlaind,
    RandGaussianNoisePlaind,
    RandomPartWithoutMetadata,
    RandScaleIntensityPlaind,
    RandShiftIntensityPlaind,
)
from lightning_modules.data.cohort import Cohort, is_lesion_class, load_cohort
from lightning_modules.data.intensity import intensity_transforms
from lightning_modules.data.metadata import RECORD_COLUMNS

CACHE_MODES = ("memory", "disk", "none")
# Patch-centre candidates kept per class (evenly spaced in raster order, MONAI's
# ``max_samples_per_class``): a lesion smaller than this keeps every voxel, the background and
# large organs keep an even spread. Storing every voxel's index as int64 would cost 8 bytes per
# voxel (about 100 MB per case at 1.5 mm).
CLASS_INDICES_PER_CLASS = 20_000


class LoadLabelMapd(MapTransform):
    """Build one integer label map from the per-class mask files of a case.

    Label k is the k-th recipe class; classes later in the list override earlier ones, and lesion
    classes are applied after organs, so a lesion inside its organ keeps its lesion label. A
    missing lesion file means "no lesion"; a missing organ file is an error naming the case and file.
    The label map gets the image's affine (masks live on the CT grid, docs/design.md "Cohorts on disk").
    """

    def __init__(self, classes: Sequence[str], image_key: str = "image", label_key: str = "label"):
        super().__init__(keys=[label_key])
        self.classes = list(classes)
        order = [c for c in self.classes if not is_lesion_class(c)] + [c for c in self.classes if is_lesion_class(c)]
        self.order = [(self.classes.index(name) + 1, name) for name in order]
        self.image_key = image_key
        self.label_key = label_key

    def __call__(self, data):
        item = dict(data)
        image = item[self.image_key]
        shape = tuple(image.shape[-3:])
        label = np.zeros(shape, dtype=np.uint8)
        for value, name in self.order:
            path = Path(item["mask_paths"][name])
            if not path.exists():
                if is_lesion_class(name):
                    continue
                raise FileNotFoundError(f"{item['case_id']}: required mask {path} is missing")
            mask = np.asanyarray(nib.load(path).dataobj)
            if mask.shape != shape:
                raise ValueError(f"{item['case_id']}: mask {path} has shape {mask.shape}, CT has {shape}")
            label[mask > 0] = value
        # The image's metadata, its affine included (the default affine for a plain array).
        meta = dict(image.meta) if isinstance(image, MetaTensor) else {}
        item[self.label_key] = MetaTensor(torch.from_numpy(label[None]), meta=meta)
        return item


def preprocessing(recipe: DictConfig, with_label: bool = True) -> list:
    """Deterministic transforms shared by training, validation, test and inference (``with_label=False``).

    Each is invertible (MONAI records them on the MetaTensor), so a prediction can be mapped back
    onto the scan's own grid and affine.
    """
    data = recipe.data
    intensity, foreground = intensity_transforms(data)
    keys = ["image", "label"] if with_label else ["image"]
    load = [LoadImaged(keys=["image"], ensure_channel_first=True, image_only=True)]
    if with_label:
        load.append(LoadLabelMapd(classes=list(data.classes)))
    transforms = load + [
        EnsureTyped(keys=keys, dtype=(torch.float32, torch.uint8)[: len(keys)], track_meta=True),
        Orientationd(keys=keys, axcodes="RAS", labels=None),
        Spacingd(keys=keys, pixdim=tuple(float(s) for s in data.spacing), mode=("bilinear", "nearest")[: len(keys)]),
        *intensity,
        CropForegroundd(keys=keys, source_key="image", select_fn=foreground, allow_smaller=True),
        SpatialPadd(keys=keys, spatial_size=tuple(int(p) for p in data.patch_size)),
    ]
    if with_label:
        # Resampling returns float32 labels; back to uint8 (nearest neighbour keeps them exact), so a
        # cached case costs 1 byte per voxel for its label, not 4.
        transforms.append(CastToTyped(keys="label", dtype=torch.uint8))
    return transforms


def training_transforms(recipe: DictConfig) -> list:
    """Random patch sampling weighted toward lesions, then light intensity augmentation."""
    data = recipe.data
    # Ratios per label value: background, then each class (lesions get `lesion_ratio`).
    ratios = [float(data.neg)] + [
        float(data.pos) * (float(data.lesion_ratio) if is_lesion_class(name) else 1.0) for name in data.classes
    ]
    transforms = [
        # Deterministic, so the cache keeps it: the voxel indices of each class are computed once
        # per volume instead of on every random crop, capped per class.
        ClassesToIndicesd(
            keys="label", num_classes=len(data.classes) + 1, indices_postfix="_cls_indices",
            max_samples_per_class=CLASS_INDICES_PER_CLASS,
        ),
        # Training reads only the image and label of a crop; the case's metadata (ids, subgroup
        # fields, mask paths) would be copied into every crop, through every augmentation, and
        # collated into every batch for nothing. Deterministic, so the cache keeps the slim item.
        SelectItemsd(keys=["image", "label", "label_cls_indices"]),
        # The crop removes the class indices from its output (MONAI's class does too).
        RandCropByLabelClassesPlaind(
            keys=["image", "label"],
            label_key="label",
            spatial_size=tuple(int(p) for p in data.patch_size),
            ratios=ratios,
            num_classes=len(data.classes) + 1,
            num_samples=int(data.samples_per_volume),
            indices_key="label_cls_indices",
            warn=False,
        ),
    ]
    if data.augment:
        transforms += [
            RandScaleIntensityPlaind(keys=["image"], factors=0.1, prob=0.5),
            RandShiftIntensityPlaind(keys=["image"], offsets=0.05, prob=0.5),
            RandGaussianNoisePlaind(keys=["image"], std=0.01, prob=0.15),
        ]
    return transforms


def seeded_compose(transforms: list, seed: int) -> Compose:
    """A Compose whose random transforms draw from the recipe's seed (random tail without metadata).

    MONAI's random transforms keep their own RandomState, which ``seed_everything`` does not
    touch; without this, two runs of one recipe crop different patches. Worker processes are
    re-seeded by MONAI's DataLoader from torch's (seeded) base seed. The random tail runs without
    metadata tracking (:class:`RandomPartWithoutMetadata`).
    """
    compose = RandomPartWithoutMetadata(transforms)
    compose.set_random_state(seed=seed)
    return compose


class SharedPersistentDataset(PersistentDataset):
    """A ``PersistentDataset`` whose cache files appear atomically, so several ranks may fill one folder.

    MONAI writes each file in the system temporary folder and moves it into the cache; when the
    two are on different file systems (a node's /tmp, a shared cache) the move is a copy, and
    another rank can read a half-copied file. Here the file is written next to its final name
    (unique per host and process) and renamed with ``os.replace``, atomic on one file system.
    """

    def _cachecheck(self, item_transformed):
        hashfile = self.cache_dir / f"{self.hash_func(item_transformed).decode('utf-8')}{self.transform_hash}.pt"
        if hashfile.is_file():
            return torch.load(hashfile, weights_only=self.weights_only)
        item = self._pre_transform(dict(item_transformed))
        partial = hashfile.with_name(f".{hashfile.name}.{socket.gethostname()}.{os.getpid()}.partial")
        torch.save(convert_to_tensor(item, convert_numeric=False, track_meta=self.track_meta), partial)
        os.replace(partial, hashfile)
        return item


def cache_mode(recipe: DictConfig) -> str:
    """``data.cache``, checked: memory, disk or none."""
    mode = str(recipe.data.cache)
    if mode not in CACHE_MODES:
        raise ValueError(f"data.cache must be one of {', '.join(CACHE_MODES)} (got {mode!r})")
    return mode


def disk_cache_folder(recipe: DictConfig) -> Path:
    """``data.cache_dir`` (default ``<tracking.output_dir>/data-cache``), one sub-folder per cohort root."""
    root = Path(recipe.data.cache_dir or Path(recipe.tracking.output_dir) / "data-cache")
    cohort = hashlib.sha256(str(Path(recipe.data.root).resolve()).encode()).hexdigest()[:12]
    return root / f"{Path(recipe.data.root).name}-{cohort}"


def cached_dataset(items: list[dict], compose: Compose, recipe: DictConfig, cache: bool = True) -> Dataset:
    """A dataset over ``items`` that caches the deterministic part of ``compose`` as ``data.cache`` says.

    Args:
        items: one dict per case (``case_items``).
        compose: the transforms (deterministic preprocessing first, random ones after).
        recipe: the loaded recipe (``data.cache``, ``data.cache_dir``).
        cache: False forces no caching (e.g. the test split, read once).

    The disk cache's file names hash each item and the deterministic transforms with their
    settings (MONAI's ``hash_transform``), so a changed spacing or window never reuses old files.
    """
    mode = cache_mode(recipe)
    if not cache or mode == "none":
        return Dataset(items, compose)
    if mode == "memory":
        return CacheDataset(items, compose, cache_rate=1.0, num_workers=None, progress=False, copy_cache=False)
    folder = disk_cache_folder(recipe)
    folder.mkdir(parents=True, exist_ok=True)
    dataset = SharedPersistentDataset(
        items, compose, cache_dir=folder, hash_transform=pickle_hashing, track_meta=True, weights_only=False
    )
    # Hashing the transforms builds a flattened Compose, and a new Compose re-seeds the transforms
    # it holds: seed them again, so the patches are the recipe seed's, as with the other modes.
    compose.set_random_state(seed=int(recipe.seed))
    return dataset


def case_items(cohort: Cohort, case_ids: Sequence[str], classes: Sequence[str]) -> list[dict]:
    """One dict per case for MONAI datasets: file paths plus the metadata fields of RECORD_COLUMNS."""
    items = []
    for case_id in case_ids:
        case = cohort.case(case_id)
        row = case.metadata
        item = {
            "image": str(case.ct_path),
            "mask_paths": {name: str(case.mask_path(name)) for name in classes},
            "tumor": int(row.get("tumor", -1)),
        }
        for column in RECORD_COLUMNS:
            value = row.get(column, "")
            if isinstance(value, float) and math.isnan(value):
                value = ""
            item[column] = value if isinstance(value, (int, float)) else str(value)
        items.append(item)
    return items


def _collate_eval(batch: list[dict]) -> dict:
    """Collate whole volumes (batch size 1 in practice); keep metadata as lists."""
    out = list_data_collate([{k: v for k, v in item.items() if k != "mask_paths"} for item in batch])
    return out


class CohortDataModule(pl.LightningDataModule):
    """Train / val / test loaders for one cohort + split, as the recipe says.

    Args:
        recipe: a loaded recipe (``lightning_modules.config.recipe.load_recipe``).
        cohort: an already-loaded cohort (default: ``recipe.data.root``).
        split: an already-loaded split table (default: ``recipe.data.split``).
        train_dataset_factory: ``f(datamodule, transforms) -> Dataset`` building the training set
            (used for SynthX ratio mixing); a dataset with a ``sampler`` attribute gets that sampler
            instead of shuffling. Default: the split's real training cases.
    """

    def __init__(
        self,
        recipe: DictConfig,
        cohort: Cohort | None = None,
        split: pd.DataFrame | None = None,
        train_dataset_factory=None,
    ):
        super().__init__()
        self.recipe = recipe
        self.cohort = cohort
        self.split = split
        self.train_dataset_factory = train_dataset_factory
        self.datasets: dict[str, Dataset] = {}

    def _load(self) -> None:
        from lightning_modules.data.splits import load_split

        if self.cohort is None:
            self.cohort = load_cohort(self.recipe.data.root)
        if self.split is None:
            self.split = load_split(self.recipe.data.split, self.cohort)

    def case_ids(self, stage: str) -> list[str]:
        self._load()
        return list(self.split.loc[self.split["split"] == stage, "case_id"])

    def _dataset(self, stage: str, transforms: list, cache: bool) -> Dataset:
        items = case_items(self.cohort, self.case_ids(stage), list(self.recipe.data.classes))
        if not items:
            raise ValueError(f"split {self.recipe.data.split} has no {stage} cases")
        return cached_dataset(items, seeded_compose(transforms, int(self.recipe.seed)), self.recipe, cache)

    def setup(self, stage: str | None = None) -> None:
        self._load()
        recipe = self.recipe
        if stage in ("fit", None) and "train" not in self.datasets:
            train_transforms = preprocessing(recipe) + training_transforms(recipe)
            if self.train_dataset_factory is not None:
                self.datasets["train"] = self.train_dataset_factory(self, train_transforms)
            else:
                self.datasets["train"] = self._dataset("train", train_transforms, cache=True)
        if stage in ("fit", "validate", None) and "val" not in self.datasets:
            self.datasets["val"] = self._dataset("val", preprocessing(recipe), cache=True)
        if stage in ("test", None) and "test" not in self.datasets:
            self.datasets["test"] = self._dataset("test", preprocessing(recipe), cache=False)

    def train_dataloader(self) -> DataLoader:
        dataset = self.datasets["train"]
        sampler = getattr(dataset, "sampler", None)
        return DataLoader(
            dataset,
            batch_size=int(self.recipe.data.batch_size),
            shuffle=sampler is None,
            sampler=sampler,
            num_workers=int(self.recipe.data.num_workers),
            collate_fn=list_data_collate,
            persistent_workers=int(self.recipe.data.num_workers) > 0,
            # Full batches only, unless the training set is smaller than one batch (then every
            # epoch would be empty and training would silently do nothing).
            drop_last=len(dataset) > int(self.recipe.data.batch_size),
        )

    def _eval_loader(self, name: str) -> DataLoader:
        return DataLoader(self.datasets[name], batch_size=1, shuffle=False, num_workers=0, collate_fn=_collate_eval)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
