"""Leakage audit of a cohort and its split: duplicates, patients, and source/header cues.

Three layers, after the contamination framework of the brain-MRI benchmark audit in
``references/leakage-audit-papers.txt`` (duplicate, patient and source-label leakage):

1. Duplicates. Exact: sha256 of the voxel array cast to little-endian float32 (plus its shape), so
   a copy re-saved under another name, header, dtype or affine still matches. Near: Pearson
   correlation (normalized cross-correlation, NCC) of volumes clipped to the soft-tissue HU window
   and resized to a fixed grid. Every volume is read once; all pairs are screened as chunked
   matrix products of 16^3 signatures (N x 4,096), and candidates are confirmed on 32^3 copies,
   allowing a shift of one cell (a copy re-exported with an offset). Reported across splits
   (train-val, train-test, val-test) and within train, with counts for thresholds 0.95-0.995
   (the paper's flagged count stays flat from 0.98 to 0.995 when the pairs are true duplicates).
2. Patients. A patient in two splits; a metadata table without ``patient_id`` (each case is then
   its own patient, so scans of one person cannot be traced: the audit says so); synthetic cases
   made from a validation/test canvas or from a case outside the split.
3. Source/header. Gradient-boosted trees trained on acquisition metadata alone (spacing, shape,
   dtype, file size, scanner, cohort, phase) predict the tumor label on train and are scored on
   test by balanced accuracy. Well above chance (default > 0.65, and p < 0.05 by a label-permutation
   test) is a warning naming the features that carry it (permutation importance): a model could
   learn the site or protocol instead of the tumor.

Findings of severity ``leak`` (cross-split duplicates, patient overlap, synthetic canvases outside
train) make ``benchx audit`` exit 1; training refuses to start on them unless
``data.allow_leakage=true`` (:func:`check_split_leakage`, the fast path without the classifier).

Run::

    benchx audit --root data/phantom --split splits/phantom.csv --out outputs/audit
    benchx audit --root data/phantom --split splits/phantom.csv --out outputs/audit \\
        --tracking-uri sqlite:///mlflow.db --experiment benchx-audit
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import nibabel as nib
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from scipy.ndimage import gaussian_filter

from lightning_modules.data.cohort import Cohort, CohortError, load_cohort
from lightning_modules.data.splits import SPLITS, SplitError, read_split_table, split_sha256
from lightning_modules.data.validation import READ_ERRORS, Problem, read_volume

THRESHOLDS = (0.95, 0.96, 0.97, 0.98, 0.99, 0.995)
DEFAULT_THRESHOLD = 0.98
# Pair categories reported by the duplicate layer; within val or within test is not leakage.
CROSS_SPLIT = ("train-val", "train-test", "val-test")
WITHIN_TRAIN = "train-train"
CATEGORIES = CROSS_SPLIT + (WITHIN_TRAIN,)
SIGNATURE_SIZE = 16  # 16^3 = 4,096 values per volume for the all-pairs screen
CONFIRM_SIZE = 32  # 32^3 copies confirm the screened candidates
# The confirming NCC allows a shift of up to MAX_SHIFT fine cells (a copy re-exported with an
# offset), so it can exceed the unshifted coarse NCC: the screen keeps pairs down to the lowest
# threshold minus this margin (the screen's one-cell blur closes most of that gap).
SCREEN_MARGIN = 0.05
MAX_SHIFT = 1
SCREEN_BLUR_CELLS = 1.0
# Above this many screened pairs only the highest (by coarse NCC) are confirmed, and the audit says so.
MAX_CANDIDATES = 200_000
CLIP_PERCENTILES = (0.5, 99.5)
# Touchstone's HU window (recipes/_base.yaml data.hu_window), the intensities training sees.
HU_WINDOW = (-175.0, 250.0)
HEADER_FEATURES_NUMERIC = ("spacing_x", "spacing_y", "spacing_z", "shape_x", "shape_y", "shape_z", "file_size")
HEADER_FEATURES_CATEGORICAL = ("dtype", "scanner", "cohort", "phase")


@dataclass(frozen=True)
class Finding:
    """One audit finding. ``severity``: ``leak`` (fails the audit), ``warning`` or ``info``."""

    layer: str
    kind: str
    severity: str
    case_id: str = ""
    other_case_id: str = ""
    split: str = ""
    other_split: str = ""
    patient_id: str = ""
    value: float = math.nan
    detail: str = ""

    def __str__(self) -> str:
        parts = [f"[{self.severity}] {self.layer}/{self.kind}"]
        if self.case_id:
            cases = self.case_id + (f" ({self.split})" if self.split else "")
            if self.other_case_id:
                cases += f" ~ {self.other_case_id}" + (f" ({self.other_split})" if self.other_split else "")
            parts.append(cases)
        parts.append(self.detail)
        return ": ".join(parts)


@dataclass
class HeaderLeakage:
    """Result of the source/header classifier (layer 3)."""

    balanced_accuracy: float = math.nan
    p_value: float = math.nan
    n_train: int = 0
    n_eval: int = 0
    evaluated_on: str = ""
    flagged: bool = False
    importances: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["feature", "importance", "std"]))
    carrying: list[str] = field(default_factory=list)
    skipped: str = ""


@dataclass
class AuditReport:
    """Everything the audit found, the metrics it logs and the files it wrote."""

    findings: list[Finding]
    metrics: dict[str, float]
    threshold_counts: pd.DataFrame
    best_matches: pd.DataFrame
    header: HeaderLeakage
    summary: str
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def leaks(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "leak"]

    @property
    def leakage_found(self) -> bool:
        return bool(self.leaks)


# ----------------------------------------------------------------------------------------------
# Reading: one pass over the CT files gives the hash, the signatures and the header features.


@dataclass
class _Volume:
    case_id: str
    sha256: str = ""
    coarse: np.ndarray | None = None
    fine: np.ndarray | None = None
    features: dict = field(default_factory=dict)
    tumor: int = -1
    error: str = ""


def canonical_sha256(data: np.ndarray) -> str:
    """sha256 of a voxel array independent of its file: little-endian float32 values plus the shape."""
    digest = hashlib.sha256(repr(tuple(int(s) for s in data.shape)).encode())
    # Adding +0.0 turns -0.0 into +0.0: the same value must hash the same whatever dtype held it.
    digest.update((np.ascontiguousarray(data, dtype="<f4") + np.float32(0.0)).tobytes())
    return digest.hexdigest()


def _zscore(vector: torch.Tensor) -> torch.Tensor:
    vector = vector - vector.mean()
    norm = vector.norm()
    # A constant volume has no correlation with anything: keep it as zeros (NCC 0).
    return vector / norm if norm > 1e-12 else torch.zeros_like(vector)


def volume_signatures(
    data: np.ndarray,
    coarse_size: int = SIGNATURE_SIZE,
    fine_size: int = CONFIRM_SIZE,
    window: tuple[float, float] | None = HU_WINDOW,
):
    """Zero-mean, unit-norm signatures of a volume: a ``coarse_size^3`` vector and a ``fine_size^3`` grid.

    The dot product of two coarse signatures is their Pearson correlation on that grid; the fine
    grids (float16, to hold thousands in memory) are compared by :func:`shifted_ncc`. Intensities are
    clipped to ``window`` first (HU; ``None``: the volume's 0.5-99.5 percentiles, for non-CT data).
    Without the soft-tissue window the 1,000 HU step between air and body dominates, and any two
    abdomens of similar girth correlate above 0.99; with it, organs and their layout decide. Area
    resizing to a fixed grid then makes volumes of any shape comparable.
    """
    volume = torch.as_tensor(np.asarray(data, dtype=np.float32))[None, None]
    if window is not None:
        volume = volume.clamp(float(window[0]), float(window[1]))
    fine = F.interpolate(volume, size=(fine_size,) * 3, mode="area")
    if window is None:
        low, high = np.percentile(fine.numpy(), CLIP_PERCENTILES)
        fine = fine.clamp(float(low), float(high))
    # Blurring by one fine cell before the screen's downsampling makes the screen about as tolerant
    # of small shifts as the confirming shifted_ncc, so shifted copies are not screened out.
    blurred = torch.as_tensor(gaussian_filter(fine[0, 0].numpy(), SCREEN_BLUR_CELLS, mode="nearest"))[None, None]
    coarse = F.interpolate(blurred, size=(coarse_size,) * 3, mode="area")
    fine = _zscore(fine.flatten()).reshape((fine_size,) * 3)
    return _zscore(coarse.flatten()).numpy(), fine.numpy().astype(np.float16)


def _read_case(cohort: Cohort, case_id: str, lesion_class: str, coarse_size: int, fine_size: int) -> _Volume:
    record = _Volume(case_id)
    case = cohort.case(case_id)
    metadata = case.metadata
    try:
        image, data = read_volume(case.ct_path)
        data = np.squeeze(data) if data.ndim > 3 else data
        if data.ndim != 3:
            raise ValueError(f"CT is not a 3D volume (shape {data.shape})")
        record.sha256 = canonical_sha256(data)
        record.coarse, record.fine = volume_signatures(data, coarse_size, fine_size)
        zooms = [float(z) for z in image.header.get_zooms()[:3]]
        record.features = {
            "spacing_x": zooms[0], "spacing_y": zooms[1], "spacing_z": zooms[2],
            "shape_x": data.shape[0], "shape_y": data.shape[1], "shape_z": data.shape[2],
            "file_size": case.ct_path.stat().st_size,
            "dtype": str(image.get_data_dtype()),
            "scanner": str(metadata.get("scanner", "Unknown") or "Unknown"),
            "cohort": str(metadata.get("cohort", "Unknown")),
            "phase": str(metadata.get("phase", "Unknown")),
        }  # fmt: skip
        tumor = int(metadata.get("tumor", -1))
        if tumor < 0:
            # Unrecorded label: derive it from the lesion mask, as training does.
            path = case.mask_path(lesion_class)
            tumor = int(path.exists() and bool(np.asarray(nib.load(str(path)).dataobj).any()))
        record.tumor = tumor
    except READ_ERRORS as error:
        record.error = f"unreadable NIfTI ({error})"
    return record


# ----------------------------------------------------------------------------------------------
# Building the audited case table from a cohort, its split and any synthetic cohorts.


def _as_cohort(cohort: Cohort | Path | str) -> Cohort:
    return cohort if isinstance(cohort, Cohort) else load_cohort(cohort)


def _as_split(split: pd.DataFrame | Path | str) -> tuple[pd.DataFrame, str]:
    if isinstance(split, pd.DataFrame):
        return split.astype(str), ""
    table = read_split_table(split)
    missing = [c for c in ("case_id", "split") if c not in table.columns]
    if missing:
        raise SplitError([Problem("<header>", str(split), f"required column(s) {missing} missing")], split)
    return table, split_sha256(split)


def _audited_cases(
    cohort: Cohort, split: pd.DataFrame, synthetic_cohorts: Sequence[Cohort]
) -> tuple[pd.DataFrame, list[Finding]]:
    """One row per audited case: where it is read from, its split, patient and synthetic origin."""
    findings: list[Finding] = []
    if "patient_id" not in split.columns:
        split = split.assign(patient_id="")
    rows = []
    for case_id, split_name, split_patient in zip(split["case_id"], split["split"], split["patient_id"]):
        if split_name not in SPLITS:
            findings.append(
                Finding(
                    "patients",
                    "bad_split_value",
                    "warning",
                    case_id,
                    detail=f"split {split_name!r} is not train/val/test: not audited",
                )
            )
            continue
        if case_id not in cohort:
            findings.append(
                Finding(
                    "patients",
                    "unknown_case",
                    "warning",
                    case_id,
                    split=split_name,
                    detail=f"not in cohort {cohort.root}: cannot be audited",
                )
            )
            continue
        row = cohort.row(case_id)
        patient = str(row["patient_id"])
        if split_patient and split_patient != patient:
            findings.append(
                Finding(
                    "patients",
                    "patient_id_mismatch",
                    "warning",
                    case_id,
                    split=split_name,
                    patient_id=patient,
                    detail=f"split CSV says patient {split_patient!r}, cohort metadata says {patient!r}; "
                    "the cohort's is used",
                )
            )
        rows.append(
            {
                "case_id": case_id,
                "split": split_name,
                "patient_id": patient,
                "synthetic": int(row["synthetic"]),
                "source_case_id": str(row["source_case_id"]),
                "cohort_index": 0,
            }
        )
    listed = {r["case_id"] for r in rows}
    for index, source in enumerate([cohort, *synthetic_cohorts]):
        for row in source.metadata.itertuples():
            if int(row.synthetic) != 1 or row.case_id in listed:
                continue
            # A synthetic case outside the split is training data (it is mixed into training only).
            rows.append(
                {
                    "case_id": row.case_id,
                    "split": "train",
                    "patient_id": str(row.patient_id),
                    "synthetic": 1,
                    "source_case_id": str(row.source_case_id),
                    "cohort_index": index,
                }
            )
            listed.add(row.case_id)
    return (
        pd.DataFrame(rows, columns=["case_id", "split", "patient_id", "synthetic", "source_case_id", "cohort_index"]),
        findings,
    )


# ----------------------------------------------------------------------------------------------
# Layer 2: patients.


def patient_findings(cohort: Cohort, cases: pd.DataFrame) -> list[Finding]:
    """Patient overlap across splits, missing patient ids, and synthetic canvases outside train."""
    findings: list[Finding] = []
    if cohort.patient_id_missing:
        findings.append(
            Finding(
                "patients",
                "patient_id_missing",
                "warning",
                detail="metadata.csv has no patient_id column: each case is treated as its own patient, "
                "so scans of one patient in different splits cannot be detected",
            )
        )
    real = cases[cases["synthetic"] == 0]
    order = {name: i for i, name in enumerate(SPLITS)}
    for patient, group in real.groupby("patient_id", sort=True):
        splits = sorted(set(group["split"]), key=order.get)
        if len(splits) < 2:
            continue
        first = group[group["split"] == splits[-1]].iloc[0]
        other = group[group["split"] == splits[0]].iloc[0]
        listing = ", ".join(f"{c} ({s})" for c, s in zip(group["case_id"], group["split"]))
        findings.append(
            Finding(
                "patients",
                "patient_overlap",
                "leak",
                first.case_id,
                other.case_id,
                first.split,
                other.split,
                patient_id=str(patient),
                detail=f"patient {patient} is in {'/'.join(splits)}: {listing}",
            )
        )

    split_of = dict(zip(real["case_id"], real["split"]))
    for row in cases[cases["synthetic"] == 1].itertuples():
        if row.split != "train":
            findings.append(
                Finding(
                    "patients",
                    "synthetic_in_eval",
                    "leak",
                    row.case_id,
                    split=row.split,
                    detail="synthetic case in a validation/test split: synthetic data is training-only",
                )
            )
        if not row.source_case_id:
            findings.append(
                Finding(
                    "patients",
                    "synthetic_without_source",
                    "warning",
                    row.case_id,
                    split=row.split,
                    detail="synthetic case without source_case_id: its canvas cannot be checked",
                )
            )
        elif row.source_case_id not in split_of:
            findings.append(
                Finding(
                    "patients",
                    "synthetic_source_outside_split",
                    "leak",
                    row.case_id,
                    row.source_case_id,
                    row.split,
                    detail="canvas is not in the split: only real training cases may serve as canvases",
                )
            )
        elif split_of[row.source_case_id] != "train":
            findings.append(
                Finding(
                    "patients",
                    "synthetic_source_in_eval",
                    "leak",
                    row.case_id,
                    row.source_case_id,
                    row.split,
                    split_of[row.source_case_id],
                    detail=f"canvas is a {split_of[row.source_case_id]} case: the evaluation scan leaks into training",
                )
            )
    return findings


# ----------------------------------------------------------------------------------------------
# Layer 1: duplicates.


def _category(split_a: str, split_b: str) -> str:
    order = {name: i for i, name in enumerate(SPLITS)}
    first, second = sorted((split_a, split_b), key=order.get)
    return f"{first}-{second}"


def duplicate_pairs(
    volumes: Sequence[_Volume],
    splits: Sequence[str],
    synthetic: Sequence[int],
    lowest_threshold: float,
    screen_margin: float = SCREEN_MARGIN,
    max_candidates: int = MAX_CANDIDATES,
    chunk_size: int = 1024,
) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """Pairs in :data:`CATEGORIES` with confirmed NCC >= ``lowest_threshold`` or identical voxels,
    and each val/test case's best training match.

    All pairs are screened at once as chunked products of the coarse signatures (N x 4,096);
    pairs at or above ``lowest_threshold - screen_margin`` are confirmed with :func:`shifted_ncc`
    on the fine grids. Within-train pairs involving a synthetic case are left out: a synthetic case
    is built on a training canvas, so it resembles that canvas by design.

    Returns:
        ``pairs`` (i, j, category, coarse_ncc, ncc, exact), ``best`` (i, best_j, coarse_ncc, ncc),
        and the number of screened pairs left unconfirmed beyond ``max_candidates``.
    """
    n = len(volumes)
    splits = np.asarray(splits)
    synthetic = np.asarray(synthetic, dtype=bool)
    split_code = np.array([SPLITS.index(s) for s in splits], dtype=int)
    coarse = np.stack([v.coarse for v in volumes]).astype(np.float32) if n else np.zeros((0, 1), np.float32)
    is_train = split_code == 0
    has_train = bool(is_train.any())
    screen = lowest_threshold - screen_margin
    rows_i, rows_j, rows_coarse = [], [], []
    best_j = np.full(n, -1)
    best_coarse = np.full(n, -np.inf, dtype=np.float32)
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        own = np.arange(start, stop)
        block = coarse[start:stop] @ coarse.T  # (chunk, n) Pearson correlations on the coarse grid
        if has_train:
            # Best training match of every val/test case (the paper's Fig. 3 distribution).
            against_train = np.where(is_train[None, :], block, -np.inf)
            arg = against_train.argmax(axis=1)
            evaluated = np.flatnonzero(~is_train[own])
            best_j[own[evaluated]] = arg[evaluated]
            best_coarse[own[evaluated]] = against_train[evaluated, arg[evaluated]]
        same_split = split_code[own][:, None] == split_code[None, :]
        either_synthetic = synthetic[own][:, None] | synthetic[None, :]
        reported = ~same_split | (is_train[own][:, None] & is_train[None, :] & ~either_synthetic)
        a, b = np.nonzero((np.arange(n)[None, :] > own[:, None]) & reported & (block >= screen))
        rows_i.append(a + start)
        rows_j.append(b)
        rows_coarse.append(block[a, b])
    i = np.concatenate(rows_i).astype(int) if rows_i else np.zeros(0, int)
    j = np.concatenate(rows_j).astype(int) if rows_j else np.zeros(0, int)
    coarse_ncc = np.concatenate(rows_coarse) if rows_coarse else np.zeros(0, np.float32)
    unconfirmed = max(len(i) - max_candidates, 0)
    if unconfirmed:
        keep = np.argsort(-coarse_ncc, kind="stable")[:max_candidates]
        i, j, coarse_ncc = i[keep], j[keep], coarse_ncc[keep]

    # Exact duplicates are found by hash, whatever the screen says.
    by_hash: dict[str, list[int]] = {}
    for index, volume in enumerate(volumes):
        by_hash.setdefault(volume.sha256, []).append(index)
    exact_pairs = {(a, b) for group in by_hash.values() for x, a in enumerate(group) for b in group[x + 1 :]}
    extra = [
        (a, b)
        for a, b in sorted(exact_pairs - set(zip(i.tolist(), j.tolist())))
        if split_code[a] != split_code[b] or (is_train[a] and not (synthetic[a] or synthetic[b]))
    ]
    if extra:
        i = np.concatenate([i, [a for a, _ in extra]]).astype(int)
        j = np.concatenate([j, [b for _, b in extra]]).astype(int)
        coarse_ncc = np.concatenate([coarse_ncc, [float(coarse[a] @ coarse[b]) for a, b in extra]])

    categories = np.array([_category(splits[a], splits[b]) for a, b in zip(i, j)], dtype=object)
    fine_ncc = _fine_ncc(volumes, i, j)
    exact = np.array([volumes[a].sha256 == volumes[b].sha256 for a, b in zip(i, j)], dtype=bool)
    pairs = pd.DataFrame(
        {"i": i, "j": j, "category": categories, "coarse_ncc": coarse_ncc, "ncc": fine_ncc, "exact": exact}
    )
    pairs = pairs[(pairs["ncc"] >= lowest_threshold) | pairs["exact"]].reset_index(drop=True)

    evaluated = np.flatnonzero(best_j >= 0)
    best_ncc = np.full(n, np.nan, dtype=np.float32)
    best_ncc[evaluated] = _fine_ncc(volumes, evaluated, best_j[evaluated])
    # A confirmed pair can beat the coarse best match on the fine grid.
    for row in pairs[pairs["category"].isin(("train-val", "train-test"))].itertuples():
        eval_index, train_index = (row.j, row.i) if is_train[row.i] else (row.i, row.j)
        if row.ncc > best_ncc[eval_index]:
            best_j[eval_index], best_coarse[eval_index], best_ncc[eval_index] = train_index, row.coarse_ncc, row.ncc
    best = pd.DataFrame(
        {"i": evaluated, "best_j": best_j[evaluated], "coarse_ncc": best_coarse[evaluated], "ncc": best_ncc[evaluated]}
    )
    return pairs, best, unconfirmed


def _box_sums(grids: torch.Tensor, max_shift: int, sign: int) -> torch.Tensor:
    """Sum of each grid over the region it keeps at every shift of a pair: (P, k, k, k), k = 2m + 1.

    ``sign`` +1 for the first grid of a pair (region ``[max(d, 0), n + min(d, 0))`` per axis),
    -1 for the second. Reduced one axis at a time, the contiguous last axis first (32-term float32
    sums), then in float64.
    """
    span = range(-max_shift, max_shift + 1)
    reduced = grids
    for axis in (3, 2, 1):
        n = grids.shape[axis]
        reduced = torch.stack([reduced.narrow(axis, max(sign * d, 0), n - abs(d)).sum(axis) for d in span], dim=axis)
        reduced = reduced.double()
    return reduced


def batched_shifted_ncc(first: torch.Tensor, second: torch.Tensor, max_shift: int = MAX_SHIFT) -> torch.Tensor:
    """The highest Pearson correlation of each pair of 3D grids over integer shifts up to ``max_shift``.

    Each shift compares only the overlapping region, re-centred and re-normalized, so a copy that
    was re-exported with an offset still correlates near 1. The cross terms of all shifts of all
    pairs are one grouped 3D convolution (the second grid as the kernel over the zero-padded first,
    in float32: absolute error about 3e-4); the overlap sums are reduced in float64.

    Args:
        first, second: (P, n, n, n) grids; pair k is (first[k], second[k]).
    """
    first, second = first.float(), second.float()
    pairs, size = first.shape[0], first.shape[1:]
    padded = F.pad(first, (max_shift,) * 6)[None]
    cross = F.conv3d(padded, second[:, None], groups=pairs)[0].double()  # (P, k, k, k)
    sum_a, squares_a = _box_sums(first, max_shift, 1), _box_sums(first * first, max_shift, 1)
    sum_b, squares_b = _box_sums(second, max_shift, -1), _box_sums(second * second, max_shift, -1)
    span = torch.arange(-max_shift, max_shift + 1)
    counts = (
        (size[0] - span.abs())[:, None, None]
        * (size[1] - span.abs())[None, :, None]
        * (size[2] - span.abs())[None, None, :]
    ).double()
    covariance = cross - sum_a * sum_b / counts
    variance = (squares_a - sum_a**2 / counts) * (squares_b - sum_b**2 / counts)
    correlation = torch.where(
        variance > 1e-20, covariance / variance.clamp_min(1e-20).sqrt(), torch.zeros_like(covariance)
    )
    return correlation.flatten(1).max(dim=1).values.clamp(-1.0, 1.0).float()


def shifted_ncc(first: np.ndarray, second: np.ndarray, max_shift: int = MAX_SHIFT) -> float:
    """:func:`batched_shifted_ncc` of one pair of grids."""
    pair = batched_shifted_ncc(
        torch.as_tensor(first.astype(np.float32))[None], torch.as_tensor(second.astype(np.float32))[None], max_shift
    )
    return float(pair[0])


def _fine_ncc(
    volumes: Sequence[_Volume], i: np.ndarray, j: np.ndarray, max_shift: int = MAX_SHIFT, batch: int = 256
) -> np.ndarray:
    """Shift-tolerant NCC of the pairs (i[k], j[k]) on the fine grid, in batches to bound memory."""
    values = np.zeros(len(i), np.float32)
    for start in range(0, len(i), batch):
        first = torch.as_tensor(np.stack([volumes[k].fine for k in i[start : start + batch]]).astype(np.float32))
        second = torch.as_tensor(np.stack([volumes[k].fine for k in j[start : start + batch]]).astype(np.float32))
        values[start : start + batch] = batched_shifted_ncc(first, second, max_shift).numpy()
    return values


def duplicate_findings(pairs: pd.DataFrame, cases: pd.DataFrame, threshold: float) -> list[Finding]:
    """One finding per pair at or above ``threshold`` (or with identical voxels).

    Across splits: ``leak``. Within train: ``warning`` (one scan counted twice in training), but
    only ``info`` for two scans of one patient that are not identical: repeat or multi-phase scans
    of a person can correlate above the threshold on the coarse grid, and that is not a copy.
    """
    findings = []
    for row in pairs.itertuples():
        if not (row.exact or row.ncc >= threshold):
            continue
        a, b = cases.iloc[row.i], cases.iloc[row.j]
        if SPLITS.index(a.split) > SPLITS.index(b.split):
            a, b = b, a  # name the evaluation-side case first, its training twin second
        same_patient = a.patient_id == b.patient_id
        what = "identical voxels" if row.exact else f"NCC {row.ncc:.4f} >= {threshold}"
        if row.category != WITHIN_TRAIN:
            severity, where = "leak", "across splits"
        elif same_patient and not row.exact:
            severity, where = "info", f"within train, both scans of patient {a.patient_id}"
        else:
            severity, where = "warning", "within train (one scan counted twice in training)"
        findings.append(
            Finding(
                "duplicates",
                "exact_duplicate" if row.exact else "near_duplicate",
                severity,
                b.case_id,
                a.case_id,
                b.split,
                a.split,
                patient_id=b.patient_id if same_patient else "",
                value=float(row.ncc),
                detail=f"{what}, {where} ({row.category})",
            )
        )
    return findings


def threshold_table(pairs: pd.DataFrame, cases: pd.DataFrame, thresholds: Sequence[float]) -> pd.DataFrame:
    """Pairs at NCC >= t per category, and val/test cases with a training match at NCC >= t."""
    rows = []
    splits = cases["split"].to_numpy()
    for t in thresholds:
        hit = pairs[(pairs["ncc"] >= t) | pairs["exact"]]
        row = {"threshold": t}
        for category in CATEGORIES:
            row[f"pairs:{category}"] = int((hit["category"] == category).sum())
        with_train = hit[hit["category"].isin(("train-val", "train-test"))]
        for split in ("val", "test"):
            leaked = {k for a, b in zip(with_train["i"], with_train["j"]) for k in (a, b) if splits[k] == split}
            total = int((splits == split).sum())
            row[f"leaked_cases:{split}"] = len(leaked)
            row[f"leaked_fraction:{split}"] = len(leaked) / total if total else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------
# Layer 3: source / header.


def header_leakage(
    features: pd.DataFrame,
    labels: pd.Series,
    splits: pd.Series,
    seed: int = 0,
    min_balanced_accuracy: float = 0.65,
    alpha: float = 0.05,
    n_permutations: int = 2000,
    min_cases: int = 10,
) -> HeaderLeakage:
    """Can acquisition metadata alone predict the tumor label? Train on ``train``, score on ``test``.

    Gradient-boosted trees (native categorical splits) on the features is fitted on the training cases
    and scored by balanced accuracy on the test cases (on val + test when test lacks a class).
    Significance: the fitted predictions against ``n_permutations`` shuffles of the evaluation
    labels. Flagged when balanced accuracy > ``min_balanced_accuracy`` and p < ``alpha``; the
    features carrying it are those whose permutation importance is positive beyond its spread.

    Args:
        features: one row per case, columns from :data:`HEADER_FEATURES_NUMERIC` and
            :data:`HEADER_FEATURES_CATEGORICAL` (missing ones are left out).
        labels: tumor label per case (0/1; others are left out).
        splits: ``train``/``val``/``test`` per case.
    """
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.inspection import permutation_importance
    from sklearn.metrics import balanced_accuracy_score
    from sklearn.preprocessing import OrdinalEncoder

    result = HeaderLeakage()
    known = labels.isin([0, 1]).to_numpy()
    features, labels, splits = features[known], labels[known].astype(int), splits[known]
    train = (splits == "train").to_numpy()
    evaluation, evaluated_on = (splits == "test").to_numpy(), "test"
    if labels[evaluation].nunique() < 2:
        evaluation, evaluated_on = splits.isin(["val", "test"]).to_numpy(), "val+test"
    result.n_train, result.n_eval, result.evaluated_on = int(train.sum()), int(evaluation.sum()), evaluated_on
    if train.sum() < min_cases or labels[train].nunique() < 2:
        present = sorted(int(v) for v in labels[train].unique())
        result.skipped = (
            f"needs {min_cases}+ training cases with both labels (has {int(train.sum())}, labels {present})"
        )
        return result
    if evaluation.sum() < 4 or labels[evaluation].nunique() < 2:
        result.skipped = f"needs evaluation cases with both labels (has {int(evaluation.sum())})"
        return result

    categorical = [c for c in HEADER_FEATURES_CATEGORICAL if c in features.columns]
    numeric = [c for c in HEADER_FEATURES_NUMERIC if c in features.columns]
    columns = categorical + numeric
    # Categories as integer codes for the trees' native categorical splits (a category unseen in
    # train becomes missing); a plain array keeps the many predictions of the importance cheap.
    encoder = OrdinalEncoder(
        handle_unknown="use_encoded_value", unknown_value=np.nan, encoded_missing_value=np.nan, max_categories=250
    )
    codes = encoder.fit(features.loc[train, categorical].astype(str)).transform(features[categorical].astype(str))
    matrix = np.column_stack([codes, features[numeric].to_numpy(dtype=float)])
    # Gradient-boosted trees, as in the audit paper; small leaves because cohorts can be small.
    model = HistGradientBoostingClassifier(
        max_iter=100,
        min_samples_leaf=5,
        class_weight="balanced",
        early_stopping=False,
        categorical_features=[True] * len(categorical) + [False] * len(numeric),
        random_state=seed,
    )
    model.fit(matrix[train], labels[train])
    truth = labels[evaluation].to_numpy()
    predicted = model.predict(matrix[evaluation])
    result.balanced_accuracy = float(balanced_accuracy_score(truth, predicted))

    rng = np.random.default_rng(seed)
    shuffled = np.stack([rng.permutation(truth) for _ in range(n_permutations)])
    positive = shuffled == 1
    sensitivity = ((predicted == 1) & positive).sum(axis=1) / positive.sum(axis=1)
    specificity = ((predicted == 0) & ~positive).sum(axis=1) / (~positive).sum(axis=1)
    null = (sensitivity + specificity) / 2
    result.p_value = float((1 + np.count_nonzero(null >= result.balanced_accuracy - 1e-12)) / (1 + n_permutations))

    importance = permutation_importance(
        model, matrix[evaluation], truth, scoring="balanced_accuracy", n_repeats=10, random_state=seed, n_jobs=1
    )
    result.importances = (
        pd.DataFrame({"feature": columns, "importance": importance.importances_mean, "std": importance.importances_std})
        .sort_values("importance", ascending=False)
        .reset_index(drop=True)
    )
    result.flagged = result.balanced_accuracy > min_balanced_accuracy and result.p_value < alpha
    carrying = result.importances[result.importances["importance"] > np.maximum(result.importances["std"], 0.01)]
    result.carrying = list(carrying["feature"]) or list(result.importances["feature"][:3])
    return result


# ----------------------------------------------------------------------------------------------
# The audit.


def _read_volumes(
    cohorts: Sequence[Cohort],
    cases: pd.DataFrame,
    lesion_class: str,
    coarse_size: int,
    fine_size: int,
    workers: int | None,
) -> list[_Volume]:
    workers = workers or min(4, os.cpu_count() or 1)
    jobs = [(cohorts[c], case_id) for case_id, c in zip(cases["case_id"], cases["cohort_index"])]

    def read(job):
        return _read_case(job[0], job[1], lesion_class, coarse_size, fine_size)

    if workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(read, jobs))
    return [read(job) for job in jobs]


def _scan(cohort, split, synthetic_cohorts, threshold, thresholds, lesion_class, coarse_size, fine_size, workers):
    cohort = _as_cohort(cohort)
    synthetic_cohorts = [_as_cohort(c) for c in synthetic_cohorts]
    split_table, digest = _as_split(split)
    cases, findings = _audited_cases(cohort, split_table, synthetic_cohorts)
    findings += patient_findings(cohort, cases)
    volumes = _read_volumes([cohort, *synthetic_cohorts], cases, lesion_class, coarse_size, fine_size, workers)
    readable = np.array([not v.error for v in volumes], dtype=bool)
    for volume in volumes:
        if volume.error:
            findings.append(
                Finding(
                    "duplicates",
                    "unreadable",
                    "warning",
                    volume.case_id,
                    detail=f"{volume.error}; not compared (run benchx validate)",
                )
            )
    cases = cases[readable].reset_index(drop=True)
    volumes = [v for v in volumes if not v.error]
    pairs, best, unconfirmed = duplicate_pairs(
        volumes, cases["split"], cases["synthetic"], min([threshold, *thresholds])
    )
    if unconfirmed:
        findings.append(
            Finding(
                "duplicates",
                "screen_truncated",
                "warning",
                detail=f"{unconfirmed} screened pair(s) beyond the {MAX_CANDIDATES} most similar were not "
                "confirmed: the cohort is very homogeneous on the coarse grid",
            )
        )
    findings += duplicate_findings(pairs, cases, threshold)
    return cohort, cases, volumes, pairs, best, findings, digest


def check_split_leakage(
    cohort: Cohort | Path | str,
    split: pd.DataFrame | Path | str,
    threshold: float = DEFAULT_THRESHOLD,
    synthetic_cohorts: Sequence[Cohort | Path | str] = (),
    lesion_class: str = "pancreatic_lesion",
    workers: int | None = None,
) -> list[str]:
    """The patient and duplicate layers only (no classifier): one message per leak, empty when clean.

    Training calls this and refuses to start on a non-empty answer unless ``data.allow_leakage``.
    """
    *_, findings, _ = _scan(
        cohort, split, synthetic_cohorts, threshold, (threshold,), lesion_class, SIGNATURE_SIZE, CONFIRM_SIZE, workers
    )
    return [str(f) for f in findings if f.severity == "leak"]


def audit(
    cohort: Cohort | Path | str,
    split: pd.DataFrame | Path | str,
    out_dir: Path | str,
    threshold: float = DEFAULT_THRESHOLD,
    thresholds: Sequence[float] = THRESHOLDS,
    synthetic_cohorts: Sequence[Cohort | Path | str] = (),
    lesion_class: str = "pancreatic_lesion",
    header_min_balanced_accuracy: float = 0.65,
    alpha: float = 0.05,
    seed: int = 0,
    coarse_size: int = SIGNATURE_SIZE,
    fine_size: int = CONFIRM_SIZE,
    workers: int | None = None,
    tracking_uri: str | None = None,
    experiment: str | None = None,
) -> AuditReport:
    """Run the three audit layers, write the findings and a summary, and log them to MLflow.

    Args:
        cohort: the cohort (or its folder).
        split: the split table or CSV; read leniently, since reporting its problems is the point.
        out_dir: where ``audit_findings.csv``, ``audit_thresholds.csv``, ``audit_best_matches.csv``,
            ``audit_header_importance.csv`` and ``audit_summary.md`` are written.
        threshold: NCC at or above which a pair is a near duplicate.
        thresholds: NCC values the counts are also reported for.
        synthetic_cohorts: SynthX output cohorts whose synthetic cases are training data to check.
        lesion_class: the mask that defines an unrecorded tumor label.
        header_min_balanced_accuracy: balanced accuracy above which header cues are flagged.
        alpha: significance level of the header classifier's permutation test.
        seed: classifier and permutation seed.
        coarse_size / fine_size: edge of the screening and confirming grids.
        workers: reader threads.
        tracking_uri / experiment: log to a new MLflow run there when no run is active (an active
            run is always used).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cohort, cases, volumes, pairs, best, findings, digest = _scan(
        cohort, split, synthetic_cohorts, threshold, thresholds, lesion_class, coarse_size, fine_size, workers
    )

    real = (cases["synthetic"] == 0).to_numpy()
    features = pd.DataFrame([v.features for v in volumes], index=cases.index)
    labels = pd.Series([v.tumor for v in volumes], index=cases.index)
    if real.any():
        header = header_leakage(
            features[real], labels[real], cases.loc[real, "split"], seed, header_min_balanced_accuracy, alpha
        )
    else:
        header = HeaderLeakage(skipped="no real cases to audit")
    if header.skipped:
        findings.append(Finding("source", "header_classifier_skipped", "info", detail=header.skipped))
    elif header.flagged:
        findings.append(
            Finding(
                "source",
                "header_predicts_label",
                "warning",
                value=header.balanced_accuracy,
                detail=f"acquisition metadata alone predicts the tumor label on {header.evaluated_on}: "
                f"balanced accuracy {header.balanced_accuracy:.3f} (p={header.p_value:.4f}); "
                f"carried by {', '.join(header.carrying)}",
            )
        )

    table = threshold_table(pairs, cases, thresholds)
    best_matches = pd.DataFrame({
        "case_id": cases["case_id"].to_numpy()[best["i"].to_numpy(int)],
        "split": cases["split"].to_numpy()[best["i"].to_numpy(int)],
        "best_train_case": cases["case_id"].to_numpy()[best["best_j"].to_numpy(int)],
        "coarse_ncc": best["coarse_ncc"].to_numpy(float),
        "ncc": best["ncc"].to_numpy(float),
    })  # fmt: skip
    metrics = _metrics(findings, pairs, table, header, threshold)
    summary = _summary(cohort, cases, findings, table, header, metrics, threshold, digest)

    files = {
        "findings": out_dir / "audit_findings.csv",
        "thresholds": out_dir / "audit_thresholds.csv",
        "best_matches": out_dir / "audit_best_matches.csv",
        "header_importance": out_dir / "audit_header_importance.csv",
        "summary": out_dir / "audit_summary.md",
    }
    finding_columns = list(Finding.__dataclass_fields__)
    pd.DataFrame([asdict(f) for f in findings], columns=finding_columns).to_csv(files["findings"], index=False)
    table.to_csv(files["thresholds"], index=False)
    best_matches.to_csv(files["best_matches"], index=False)
    header.importances.to_csv(files["header_importance"], index=False)
    files["summary"].write_text(summary)
    report = AuditReport(findings, metrics, table, best_matches, header, summary, files)
    _log_to_mlflow(report, digest, threshold, tracking_uri, experiment)
    return report


def _metrics(findings, pairs, table, header, threshold) -> dict[str, float]:
    within_train = pairs["category"] == WITHIN_TRAIN
    hit = (pairs["ncc"] >= threshold) | pairs["exact"]
    synthetic_leaks = [f for f in findings if f.kind.startswith("synthetic_") and f.severity == "leak"]
    metrics = {
        "audit/exact_duplicates": float((pairs["exact"] & ~within_train).sum()),
        "audit/near_duplicates": float((hit & ~within_train).sum()),
        "audit/within_train_duplicates": float((hit & within_train).sum()),
        "audit/within_train_same_patient": float(
            sum(f.layer == "duplicates" and f.severity == "info" for f in findings)
        ),
        "audit/patient_overlaps": float(sum(f.kind == "patient_overlap" for f in findings)),
        "audit/synthetic_source_leaks": float(len(synthetic_leaks)),
        "audit/leaks": float(sum(f.severity == "leak" for f in findings)),
        "audit/warnings": float(sum(f.severity == "warning" for f in findings)),
    }
    for values in table.to_dict("records"):
        for category in CATEGORIES:
            metrics[f"audit/near_duplicates/{category}/t{values['threshold']:g}"] = float(values[f"pairs:{category}"])
        for split in ("val", "test"):
            metrics[f"audit/leaked_cases/{split}/t{values['threshold']:g}"] = float(values[f"leaked_cases:{split}"])
    if not header.skipped:
        metrics["audit/header_balanced_accuracy"] = header.balanced_accuracy
        metrics["audit/header_p_value"] = header.p_value
    return metrics


def _summary(cohort, cases, findings, table, header, metrics, threshold, digest) -> str:
    counts = cases.groupby("split")["case_id"].count().reindex(list(SPLITS), fill_value=0)
    lines = [
        "# Leakage audit",
        "",
        f"- cohort: `{cohort.root}` ({len(cohort)} cases); split sha256: `{digest or 'in-memory table'}`",
        "- audited cases: "
        + ", ".join(f"{s} {n}" for s, n in counts.items())
        + f" (synthetic {int(cases['synthetic'].sum())})",
        f"- verdict: **{'LEAKAGE FOUND' if metrics['audit/leaks'] else 'no leakage found'}** "
        f"({int(metrics['audit/leaks'])} leak(s), {int(metrics['audit/warnings'])} warning(s))",
        "",
        "## 1. Duplicates",
        "",
        f"Exact duplicates across splits: {int(metrics['audit/exact_duplicates'])}; "
        f"near duplicates (NCC >= {threshold}) across splits: {int(metrics['audit/near_duplicates'])}; "
        f"within train: {int(metrics['audit/within_train_duplicates'])} "
        f"({int(metrics['audit/within_train_same_patient'])} of them two scans of one patient).",
        "",
        (
            table.to_markdown(index=False, floatfmt=".3g")
            if _has_tabulate()
            else "```\n" + table.to_string(index=False) + "\n```"
        ),
        "",
        "## 2. Patients",
        "",
    ]
    patient_lines = [f"- {f}" for f in findings if f.layer == "patients"]
    lines += patient_lines or ["- no patient in two splits; every synthetic canvas is a training case."]
    lines += ["", "## 3. Source / header cues", ""]
    if header.skipped:
        lines.append(f"- classifier not run: {header.skipped}")
    else:
        verdict = "WARNING: above chance" if header.flagged else "not distinguishable from chance at this threshold"
        lines.append(
            f"- gradient-boosted trees on acquisition metadata, fitted on {header.n_train} training cases, scored on "
            f"{header.n_eval} {header.evaluated_on} cases: balanced accuracy {header.balanced_accuracy:.3f}, "
            f"permutation p = {header.p_value:.4f} ({verdict})"
        )
        if header.flagged:
            lines.append(f"- features carrying it: {', '.join(header.carrying)}")
    leak_lines = [f"- {f}" for f in findings if f.layer == "duplicates"]
    if leak_lines:
        lines += ["", "## Duplicate pairs", "", *leak_lines]
    return "\n".join(lines) + "\n"


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401  (pandas' to_markdown needs it)
    except ImportError:
        return False
    return True


def _log_to_mlflow(
    report: AuditReport, digest: str, threshold: float, tracking_uri: str | None, experiment: str | None
) -> None:
    import mlflow

    def log() -> None:
        mlflow.log_metrics(report.metrics)
        mlflow.log_param("audit.threshold", threshold)
        if digest:
            mlflow.set_tag("audit.split_sha256", digest)
        for path in report.files.values():
            mlflow.log_artifact(str(path), artifact_path="audit")

    if mlflow.active_run() is not None:
        log()
        return
    if not (tracking_uri or experiment):
        return
    # Never fall back to the ./mlruns file store: DESIGN.md section 6 names sqlite:///mlflow.db.
    from lightning_modules.tracking import experiment_id as get_experiment_id
    from lightning_modules.tracking import tracking_uri as resolve_uri

    uri = resolve_uri(tracking_uri)
    mlflow.set_tracking_uri(uri)
    # An explicit experiment id: mlflow.set_experiment would also write MLFLOW_EXPERIMENT_ID into
    # the environment, leaking into later runs of this process and its children.
    with mlflow.start_run(run_name="leakage-audit", experiment_id=get_experiment_id(experiment or "benchx-audit", uri)):
        log()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchx audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="cohort folder")
    parser.add_argument("--split", required=True, help="split CSV (case_id,patient_id,split)")
    parser.add_argument("--out", required=True, help="folder for the findings CSV and the summary")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="near-duplicate NCC threshold")
    parser.add_argument("--synthetic-root", action="append", default=[], help="a SynthX cohort to check (repeatable)")
    parser.add_argument("--lesion-class", default="pancreatic_lesion")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="reader threads (default: up to 4)")
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument("--experiment", default=None)
    args = parser.parse_args(argv)
    try:
        report = audit(
            args.root, args.split, args.out, threshold=args.threshold, synthetic_cohorts=args.synthetic_root,
            lesion_class=args.lesion_class, seed=args.seed, workers=args.workers,
            tracking_uri=args.tracking_uri, experiment=args.experiment,
        )  # fmt: skip
    except (CohortError, SplitError, ValueError) as error:
        print(f"benchx audit: {error}", file=sys.stderr)
        return 2
    for finding in report.findings:
        print(finding)
    print(
        f"audit written to {report.files['summary'].parent}: {len(report.leaks)} leak(s), "
        f"{sum(f.severity == 'warning' for f in report.findings)} warning(s)"
    )
    return 1 if report.leakage_found else 0


if __name__ == "__main__":
    sys.exit(main())
