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

    dm = CohortDataModule(recipe.data, seed=recipe.seed)  # recipe from lightning_modules.recipe.load_recipe
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
"""

from __future__ import annotations

import hashlib
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
    EnsureTyped,
    LoadImaged,
    MapTransform,
    Orientationd,
    SelectItemsd,
    Spacingd,
    SpatialPadd,
)
from monai.data import DataLoader
from monai.utils import convert_to_tensor

from lightning_modules.config.recipe import CacheMode, DataConfig
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
from lightning_modules.data.splits import load_split

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
    The label map gets the image's affine (masks live on the CT grid, docs/explanation/data.md "Cohorts on disk").
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


def preprocessing(data: DataConfig, with_label: bool = True) -> list:
    """Deterministic transforms shared by training, validation, test and inference (``with_label=False``).

    ``data``: the recipe's data section. Each transform is invertible (MONAI records them on the
    MetaTensor), so a prediction can be mapped back onto the scan's own grid and affine.
    """
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


def training_transforms(data: DataConfig) -> list:
    """Random patch sampling weighted toward lesions, then light intensity augmentation (``data``: the data section)."""
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


def default_cache_dir(output_dir: str | Path) -> Path:
    """Where ``data.cache: disk`` keeps its files when ``data.cache_dir`` is empty: ``<output_dir>/data-cache``."""
    return Path(output_dir) / "data-cache"


def disk_cache_folder(data: DataConfig, cache_dir: str | Path | None = None) -> Path:
    """``data.cache_dir`` (else ``cache_dir``, the run's default), one sub-folder per cohort root."""
    root = data.cache_dir or cache_dir
    if not root:
        raise ValueError("data.cache=disk needs data.cache_dir (or the run's default cache folder)")
    cohort = hashlib.sha256(str(Path(data.root).resolve()).encode()).hexdigest()[:12]
    return Path(root) / f"{Path(data.root).name}-{cohort}"


def cached_dataset(
    items: list[dict], compose: Compose, data: DataConfig, seed: int, cache: bool = True, cache_dir: str | Path | None = None,
) -> Dataset:
    """A dataset over ``items`` that caches the deterministic part of ``compose`` as ``data.cache`` says.

    Args:
        items: one dict per case (``case_items``).
        compose: the transforms (deterministic preprocessing first, random ones after).
        data: the recipe's data section (``cache``, ``cache_dir``).
        seed: the recipe's seed (the random transforms are re-seeded with it).
        cache: False forces no caching (e.g. the test split, read once).
        cache_dir: the disk cache's folder when ``data.cache_dir`` is empty (:func:`default_cache_dir`).

    The disk cache's file names hash each item and the deterministic transforms with their
    settings (MONAI's ``hash_transform``), so a changed spacing or window never reuses old files.
    """
    mode = CacheMode(data.cache)
    if not cache or mode == CacheMode.none:
        return Dataset(items, compose)
    if mode == CacheMode.memory:
        return CacheDataset(items, compose, cache_rate=1.0, num_workers=None, progress=False, copy_cache=False)
    folder = disk_cache_folder(data, cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    dataset = SharedPersistentDataset(
        items, compose, cache_dir=folder, hash_transform=pickle_hashing, track_meta=True, weights_only=False
    )
    # Hashing the transforms builds a flattened Compose, and a new Compose re-seeds the transforms
    # it holds: seed them again, so the patches are the recipe seed's, as with the other modes.
    compose.set_random_state(seed=int(seed))
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
    """Train / val / test loaders for one cohort + split, as the recipe's data section says.

    Args:
        data: the recipe's data section (``recipe.data`` of ``lightning_modules.recipe.load_recipe``).
        seed: the recipe's seed (patch sampling and augmentation draw from it).
        cohort: an already-loaded cohort (default: ``data.root``).
        split: an already-loaded split table (default: ``data.split``).
        train_dataset_factory: ``f(datamodule, transforms) -> Dataset`` building the training set
            (used for SynthX ratio mixing); a dataset with a ``sampler`` attribute gets that sampler
            instead of shuffling. Default: the split's real training cases.
        cache_dir: the disk cache's folder when ``data.cache_dir`` is empty (:func:`default_cache_dir`).
    """

    def __init__(
        self,
        data: DataConfig,
        seed: int = 0,
        cohort: Cohort | None = None,
        split: pd.DataFrame | None = None,
        train_dataset_factory=None,
        cache_dir: str | Path | None = None,
    ):
        super().__init__()
        self.data = data
        self.seed = int(seed)
        self.cohort = cohort
        self.split = split
        self.train_dataset_factory = train_dataset_factory
        self.cache_dir = cache_dir
        self.datasets: dict[str, Dataset] = {}

    def load(self) -> None:
        """Read the cohort and the split table (once); checks of the split happen here."""
        if self.cohort is None:
            self.cohort = load_cohort(self.data.root)
        if self.split is None:
            self.split = load_split(self.data.split, self.cohort)

    def case_ids(self, stage: str) -> list[str]:
        self.load()
        return list(self.split.loc[self.split["split"] == stage, "case_id"])

    def cached(self, items: list[dict], transforms: list, cache: bool = True) -> Dataset:
        """``items`` through ``transforms`` seeded with the recipe's seed, cached as ``data.cache`` says."""
        return cached_dataset(items, seeded_compose(transforms, self.seed), self.data, self.seed, cache, self.cache_dir)

    def _dataset(self, stage: str, transforms: list, cache: bool) -> Dataset:
        items = case_items(self.cohort, self.case_ids(stage), list(self.data.classes))
        if not items:
            raise ValueError(f"split {self.data.split} has no {stage} cases")
        return self.cached(items, transforms, cache)

    def setup(self, stage: str | None = None) -> None:
        self.load()
        data = self.data
        if stage in ("fit", None) and "train" not in self.datasets:
            train_transforms = preprocessing(data) + training_transforms(data)
            if self.train_dataset_factory is not None:
                self.datasets["train"] = self.train_dataset_factory(self, train_transforms)
            else:
                self.datasets["train"] = self._dataset("train", train_transforms, cache=True)
        if stage in ("fit", "validate", None) and "val" not in self.datasets:
            self.datasets["val"] = self._dataset("val", preprocessing(data), cache=True)
        if stage in ("test", None) and "test" not in self.datasets:
            self.datasets["test"] = self._dataset("test", preprocessing(data), cache=False)

    def train_dataloader(self) -> DataLoader:
        dataset = self.datasets["train"]
        sampler = getattr(dataset, "sampler", None)
        return DataLoader(
            dataset,
            batch_size=int(self.data.batch_size),
            shuffle=sampler is None,
            sampler=sampler,
            num_workers=int(self.data.num_workers),
            collate_fn=list_data_collate,
            persistent_workers=int(self.data.num_workers) > 0,
            # Full batches only, unless the training set is smaller than one batch (then every
            # epoch would be empty and training would silently do nothing).
            drop_last=len(dataset) > int(self.data.batch_size),
        )

    def _eval_loader(self, name: str) -> DataLoader:
        return DataLoader(self.datasets[name], batch_size=1, shuffle=False, num_workers=0, collate_fn=_collate_eval)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
