"""The SynthX training data: tumor-centred patches of real training cases, each rank holding its share.

Data: every real case of the split's ``train`` part that has a tumor of ``data.tumor_class``
(validation, test and synthetic cases are refused: they must never shape the generator). Each case
is read with MONAI (orientation RAS, resampling to ``data.spacing``), a region around its lesions is
kept, and every item is a patch around one lesion (moved by a random jitter that keeps the lesion
inside when it fits, randomly flipped). Conditions come from the case's metadata: sex, age band,
phase, and the organ of the lesion class. With ``data.balance_phases`` (the default) lesions are
drawn with replacement so that every contrast phase is drawn equally often: arterial tumors are about
an eighth of the phantom's training tumors, and a generator that rarely sees them paints venous-looking
tumors when asked for arterial ones.

Under DDP every rank loads only its share of the cases (:class:`TumorPatchDataModule`), and all
ranks draw the same number of patches per epoch so their steps stay in lockstep.

Example::

    cases = recipe_training_cases(recipe.data, cohort, split)
    datamodule = TumorPatchDataModule(recipe.data, recipe.seed, cases)  # each rank loads cases[rank::world_size] in setup
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch
from scipy import ndimage
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_modules.data.cohort import Cohort, load_cohort
from synthx.config import SynthXDataConfig
from synthx.generator.model import CONDITION_NAMES, ORGAN_OF_LESION, encode_age_band, encode_organ, encode_phase, encode_sex
from synthx.generator.pipeline import inpainting_region, normalize_hu

TRAIN_SPLIT = "train"
# Air: what lies beyond the scan when a patch reaches past the volume's edge.
PAD_HU = -1024.0


def training_tumor_cases(
    cohort: Cohort,
    split: pd.DataFrame,
    tumor_class: str,
    case_ids: Sequence[str] | None = None,
) -> list[str]:
    """The real training-split cases the generator may learn from.

    Args:
        cohort: the cohort.
        split: its split table (``case_id, split``).
        tumor_class: the lesion class; without ``case_ids``, cases whose lesion mask is missing or
            empty are left out (they have nothing to learn from).
        case_ids: an explicit selection; every one must be a real case of the ``train`` split with
            a non-empty lesion mask.

    Raises:
        ValueError: naming each case that is not in the training split (and its split), synthetic,
            not in the cohort, or without a tumor.
    """
    split_of = dict(zip(split["case_id"].astype(str), split["split"].astype(str)))
    synthetic = dict(zip(cohort.metadata["case_id"], cohort.metadata["synthetic"].astype(int)))
    explicit = case_ids is not None and len(case_ids) > 0
    candidates = list(case_ids) if explicit else [c for c, s in split_of.items() if s == TRAIN_SPLIT]
    problems, selected = [], []
    for case_id in candidates:
        problem = _refusal(cohort, case_id, split_of.get(case_id), synthetic.get(case_id, 0))
        if problem:
            problems.append(problem)
            continue
        path = cohort.case(case_id).mask_path(tumor_class)
        if path.exists() and _mask_has_voxels(path):
            selected.append(case_id)
        elif explicit:
            problems.append(f"{case_id}: {path} is missing or empty; no {tumor_class} to learn from")
    if problems:
        raise ValueError("SynthX training refused:\n" + "\n".join(f"  - {p}" for p in problems))
    if not selected:
        raise ValueError(f"SynthX training: no training case of {cohort.root} has a non-empty {tumor_class} mask")
    return selected


def _refusal(cohort: Cohort, case_id: str, where: str | None, synthetic: int) -> str:
    """Why ``case_id`` may not train the generator, or ``""``."""
    if case_id not in cohort:
        return f"{case_id}: not in cohort {cohort.root} (metadata.csv)"
    if synthetic == 1:
        return f"{case_id}: synthetic case; the generator learns from real cases only"
    if where != TRAIN_SPLIT:
        if where:
            return f"{case_id}: in the '{where}' split, not '{TRAIN_SPLIT}'; the generator may only learn from training cases"
        return f"{case_id}: not in the split file, so not a training case"
    return ""


def _mask_has_voxels(path: Path) -> bool:
    import nibabel as nib

    return bool(np.asarray(nib.load(path).dataobj).any())


@dataclass
class LesionRegion:
    """A case's lesions with enough surroundings for any jittered patch: HU, lesion components, conditions."""

    case_id: str
    hu: np.ndarray  # int16 HU, rounded after resampling (half the memory of float32; CT is integer HU anyway)
    components: np.ndarray  # int32 labels of connected lesion components, 0 = none
    boxes: list[tuple[np.ndarray, np.ndarray]]  # per component: (lower, upper) voxel corners
    conditions: dict[str, int]


class TumorPatchDataset(Dataset):
    """Tumor-centred training patches (see the module docstring); one item per lesion.

    Args:
        cohort: the cohort.
        case_ids: real training cases with tumors (:func:`training_tumor_cases`).
        tumor_class: the lesion class.
        spacing: voxel size in mm after resampling.
        patch_size: patch size in voxels.
        hu_window: HU window mapped to [-1, 1].
        inpaint_margin_mm: the inpainting region is the lesion dilated by this.
        centre_jitter: share of the free space around a lesion its patch centre may move.
        augment: random flips along each axis.
    """

    def __init__(
        self,
        cohort: Cohort,
        case_ids: Sequence[str],
        tumor_class: str,
        spacing: Sequence[float],
        patch_size: Sequence[int],
        hu_window: Sequence[float],
        inpaint_margin_mm: float,
        centre_jitter: float = 0.5,
        augment: bool = True,
    ):
        self.tumor_class = tumor_class
        self.spacing = tuple(float(s) for s in spacing)
        self.patch_size = np.asarray([int(p) for p in patch_size])
        self.hu_window = tuple(float(h) for h in hu_window)
        self.inpaint_margin_mm = float(inpaint_margin_mm)
        self.centre_jitter = float(centre_jitter)
        self.augment = bool(augment)
        organ_index = encode_organ(ORGAN_OF_LESION[tumor_class])
        loader = self._loader()
        self.regions: list[LesionRegion] = []
        for case_id in case_ids:
            row = cohort.case(case_id).metadata
            conditions = {
                "sex": encode_sex(row.get("sex")),
                "age_band": encode_age_band(row.get("age_band", row.get("age"))),
                "phase": encode_phase(row.get("phase")),
                "organ": organ_index,
            }
            self.regions.append(self._lesion_region(loader, cohort.case(case_id), conditions))
        # One item per lesion: a case with two lesions is seen twice per epoch.
        self.items = [(r, c) for r, region in enumerate(self.regions) for c in range(len(region.boxes))]

    def phase_weights(self) -> torch.Tensor:
        """A drawing weight per item: 1 / (items of its contrast phase), so every phase is drawn equally often."""
        phases = [self.regions[r].conditions["phase"] for r, _ in self.items]
        counts = Counter(phases)
        return torch.tensor([1.0 / counts[p] for p in phases], dtype=torch.double)

    def _loader(self):
        from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, Orientationd, Spacingd

        return Compose(
            [
                LoadImaged(keys=["ct", "lesion"], image_only=True),
                EnsureChannelFirstd(keys=["ct", "lesion"]),
                Orientationd(keys=["ct", "lesion"], axcodes="RAS", labels=None),
                Spacingd(keys=["ct", "lesion"], pixdim=self.spacing, mode=("bilinear", "nearest")),
            ]
        )

    def _read(self, loader, case) -> tuple[np.ndarray, np.ndarray]:
        """The case's CT (float HU) and lesion mask, resampled; errors name the case and the files."""
        ct_path, lesion_path = case.ct_path, case.mask_path(self.tumor_class)
        for path in (ct_path, lesion_path):
            if not path.exists():
                raise ValueError(f"{case.case_id}: {path} is missing")
        try:
            loaded = loader({"ct": str(ct_path), "lesion": str(lesion_path)})
        except Exception as error:  # MONAI wraps reader errors; name the case and files.
            raise ValueError(f"{case.case_id}: cannot read {ct_path} / {lesion_path}: {error}") from error
        hu = np.asarray(loaded["ct"][0], dtype=np.float32)
        lesion = np.asarray(loaded["lesion"][0]) > 0.5
        if hu.shape != lesion.shape:
            raise ValueError(f"{case.case_id}: {lesion_path} has shape {lesion.shape}, the CT {hu.shape}")
        if not lesion.any():
            raise ValueError(f"{case.case_id}: {lesion_path} is empty after resampling to {self.spacing} mm")
        return hu, lesion

    def _lesion_region(self, loader, case, conditions: dict[str, int]) -> LesionRegion:
        hu, lesion = self._read(loader, case)
        # Keep the lesions' bounding box plus room for a full patch around any of them.
        coords = np.argwhere(lesion)
        lower = coords.min(0) - self.patch_size
        upper = coords.max(0) + 1 + self.patch_size
        pad_before = np.maximum(-lower, 0)
        pad_after = np.maximum(upper - np.asarray(hu.shape), 0)
        box = tuple(slice(int(max(a, 0)), int(min(b, s))) for a, b, s in zip(lower, upper, hu.shape))
        padding = list(zip(pad_before.tolist(), pad_after.tolist()))
        hu = np.pad(hu[box], padding, constant_values=PAD_HU)
        lesion = np.pad(lesion[box], padding, constant_values=False)
        components, _ = ndimage.label(lesion)
        boxes = [(np.asarray([s.start for s in found]), np.asarray([s.stop for s in found])) for found in ndimage.find_objects(components)]
        return LesionRegion(case.case_id, np.round(hu).astype(np.int16), components.astype(np.int32), boxes, conditions)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        region_index, component = self.items[index]
        region = self.regions[region_index]
        lower, upper = region.boxes[component]
        extent = upper - lower
        centre = (lower + upper) / 2.0
        # Move the patch by up to `centre_jitter` of the room the lesion leaves in it, so the lesion
        # stays inside when it fits yet is not always in the middle.
        room = np.maximum(self.patch_size - extent, 0) / 2.0
        shift = (torch.rand(3).numpy() * 2.0 - 1.0) * room * self.centre_jitter
        start = np.round(centre + shift - self.patch_size / 2.0).astype(int)
        start = np.clip(start, 0, np.asarray(region.hu.shape) - self.patch_size)
        crop = tuple(slice(int(s), int(s + p)) for s, p in zip(start, self.patch_size))
        hu = region.hu[crop].astype(np.float32)
        tumor = region.components[crop] > 0
        if self.augment:
            flips = [axis for axis in range(3) if torch.rand(()).item() < 0.5]
            if flips:
                hu, tumor = np.flip(hu, flips), np.flip(tumor, flips)
        inpaint = inpainting_region(tumor, self.spacing, self.inpaint_margin_mm)
        item = {
            "image": torch.from_numpy(np.ascontiguousarray(normalize_hu(hu, self.hu_window)))[None],
            "region": torch.from_numpy(np.ascontiguousarray(inpaint, dtype=np.float32))[None],
            "case_id": region.case_id,
        }
        item.update({name: torch.tensor(region.conditions[name], dtype=torch.long) for name in CONDITION_NAMES})
        return item


def recipe_training_cases(data: SynthXDataConfig, cohort: Cohort, split: pd.DataFrame) -> list[str]:
    """The training cases of the ``data`` section: ``case_ids`` when given (each checked), else every training tumor case."""
    return training_tumor_cases(cohort, split, data.tumor_class, list(data.case_ids) or None)


def build_dataset(data: SynthXDataConfig, cohort: Cohort, split: pd.DataFrame) -> TumorPatchDataset:
    """The patch dataset of the ``data`` section over all its training cases (one process)."""
    return patch_dataset(data, cohort, recipe_training_cases(data, cohort, split))


def patch_dataset(data: SynthXDataConfig, cohort: Cohort, case_ids: Sequence[str]) -> TumorPatchDataset:
    """The patch dataset of the ``data`` section over ``case_ids``."""
    return TumorPatchDataset(
        cohort,
        case_ids,
        tumor_class=data.tumor_class,
        spacing=data.spacing,
        patch_size=data.patch_size,
        hu_window=data.hu_window,
        inpaint_margin_mm=data.inpaint_margin_mm,
        centre_jitter=data.centre_jitter,
        augment=data.augment,
    )


class _EpochDraws(Sampler[int]):
    """``length`` draws per epoch from a generator seeded with ``seed + epoch`` (``set_epoch``)."""

    def __init__(self, length: int, seed: int):
        self.length, self.seed, self.epoch = int(length), int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.length

    def _generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed + self.epoch)


class EqualLengthShuffle(_EpochDraws):
    """A fresh permutation of ``n_items`` per epoch, cycled to ``length`` draws: equal epochs on every rank.

    Args:
        n_items: items this rank holds.
        length: draws per epoch (the largest share over all ranks).
        seed: this rank's seed; epoch ``e`` (``set_epoch``) uses ``seed + e``.
    """

    def __init__(self, n_items: int, length: int, seed: int):
        super().__init__(length, seed)
        self.n_items = int(n_items)

    def __iter__(self) -> Iterator[int]:
        generator = self._generator()
        rounds = math.ceil(self.length / max(self.n_items, 1))
        order = torch.cat([torch.randperm(self.n_items, generator=generator) for _ in range(rounds)])
        return iter(order[: self.length].tolist())


class BalancedDraws(_EpochDraws):
    """``length`` draws with replacement, item ``i`` with probability proportional to ``weights[i]``.

    torch's ``WeightedRandomSampler`` draws the same way but from one running generator; here each
    epoch's draws come from ``seed + epoch``, as in :class:`EqualLengthShuffle`, so a training resumed
    from a checkpoint sees the draws the uninterrupted one would, and every rank its own.

    Args:
        weights: one non-negative weight per item (:meth:`TumorPatchDataset.phase_weights`).
        length: draws per epoch.
        seed: this rank's seed; epoch ``e`` (``set_epoch``) uses ``seed + e``.
    """

    def __init__(self, weights: torch.Tensor, length: int, seed: int):
        super().__init__(length, seed)
        self.weights = weights

    def __iter__(self) -> Iterator[int]:
        return iter(torch.multinomial(self.weights, self.length, replacement=True, generator=self._generator()).tolist())


class TumorPatchDataModule(pl.LightningDataModule):
    """The training patches of one rank: cases ``case_ids[rank::world_size]``, loaded in ``setup``.

    Args:
        data: the SynthX recipe's ``data`` section.
        seed: the recipe's seed (the draw order of each rank).
        case_ids: every training case (:func:`training_tumor_cases`), the same list on every rank.
    """

    def __init__(self, data: SynthXDataConfig, seed: int, case_ids: Sequence[str]):
        super().__init__()
        self.data = data
        self.seed = int(seed)
        self.case_ids = list(case_ids)
        self.dataset: TumorPatchDataset | None = None
        self.total_lesions = 0

    def setup(self, stage: str | None = None) -> None:
        if self.dataset is not None:
            return
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        share = self.case_ids[rank::world]
        if not share:
            raise ValueError(f"SynthX training: {len(self.case_ids)} training cases cannot feed {world} processes")
        self.dataset = patch_dataset(self.data, load_cohort(self.data.root), share)
        self.world, self.rank = world, rank
        self.longest_share = len(self.dataset)
        self.total_lesions = len(self.dataset)
        if world > 1:
            counts = self.trainer.strategy.all_gather(torch.tensor(len(self.dataset)))
            self.longest_share, self.total_lesions = int(counts.max()), int(counts.sum())

    def train_dataloader(self) -> DataLoader:
        data = self.data
        batch_size, workers = int(data.batch_size), int(data.num_workers)
        if data.balance_phases:
            # Every phase equally often; all ranks draw the same number of patches (lockstep).
            length = self.longest_share
            sampler = BalancedDraws(self.dataset.phase_weights(), length, self.seed + self.rank)
            shuffle, drop_last = None, length >= batch_size
        elif self.world == 1:
            # One process: every lesion once per epoch in a shuffled order.
            sampler, shuffle, drop_last = None, True, len(self.dataset) >= batch_size
        else:
            sampler = EqualLengthShuffle(len(self.dataset), self.longest_share, self.seed + self.rank)
            shuffle, drop_last = None, self.longest_share >= batch_size
        return DataLoader(
            self.dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, num_workers=workers,
            drop_last=drop_last, persistent_workers=workers > 0,
        )
