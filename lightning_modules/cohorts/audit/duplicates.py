"""The audit's duplicate layer: exact copies by hash, near copies by shift-tolerant NCC, across splits.

Near duplicates: Pearson correlation (normalized cross-correlation, NCC) of the volumes' signatures
(:mod:`lightning_modules.cohorts.audit.volumes`). All pairs are screened as chunked matrix products of
16^3 signatures (N x 4,096), and candidates are confirmed on 32^3 copies, allowing a shift of one
cell (a copy re-exported with an offset). Reported across splits (train-val, train-test,
val-test: leaks) and within train (a warning; two scans of one patient are only info), with counts
for thresholds 0.95-0.995 (the flagged count stays flat from 0.98 to 0.995 when the pairs are true
duplicates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from lightning_modules.cohorts.audit.findings import Finding, split_order
from lightning_modules.cohorts.audit.volumes import AuditedVolume
from lightning_modules.data.splits import SPLITS

THRESHOLDS = (0.95, 0.96, 0.97, 0.98, 0.99, 0.995)
DEFAULT_THRESHOLD = 0.98
# Pair categories reported by the duplicate layer; within val or within test is not leakage.
CROSS_SPLIT = ("train-val", "train-test", "val-test")
WITHIN_TRAIN = "train-train"
CATEGORIES = CROSS_SPLIT + (WITHIN_TRAIN,)
# The confirming NCC allows a shift of up to MAX_SHIFT fine cells (a copy re-exported with an
# offset), so it can exceed the unshifted coarse NCC: the screen keeps pairs down to the lowest
# threshold minus this margin (the screen's one-cell blur closes most of that gap).
SCREEN_MARGIN = 0.05
MAX_SHIFT = 1
# Above this many screened pairs only the highest (by coarse NCC) are confirmed, and the audit says so.
MAX_CANDIDATES = 200_000


def _category(split_a: str, split_b: str) -> str:
    first, second = sorted((split_a, split_b), key=split_order)
    return f"{first}-{second}"


def duplicate_pairs(
    volumes: Sequence[AuditedVolume],
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
    splits = np.asarray(splits)
    split_code = np.array([SPLITS.index(s) for s in splits], dtype=int)
    synthetic = np.asarray(synthetic, dtype=bool)
    screen = _screen(volumes, split_code, synthetic, lowest_threshold - screen_margin, chunk_size)
    unconfirmed = max(len(screen.i) - max_candidates, 0)
    if unconfirmed:
        keep = np.argsort(-screen.coarse_ncc, kind="stable")[:max_candidates]
        screen.i, screen.j, screen.coarse_ncc = screen.i[keep], screen.j[keep], screen.coarse_ncc[keep]
    _add_exact_pairs(screen, volumes, split_code, synthetic)
    i, j = screen.i, screen.j
    pairs = pd.DataFrame(
        {
            "i": i,
            "j": j,
            "category": np.array([_category(splits[a], splits[b]) for a, b in zip(i, j)], dtype=object),
            "coarse_ncc": screen.coarse_ncc,
            "ncc": _fine_ncc(volumes, i, j),
            "exact": np.array([volumes[a].sha256 == volumes[b].sha256 for a, b in zip(i, j)], dtype=bool),
        }
    )
    pairs = pairs[(pairs["ncc"] >= lowest_threshold) | pairs["exact"]].reset_index(drop=True)
    return pairs, _best_matches(screen, volumes, pairs, split_code == 0), unconfirmed


@dataclass
class _Screen:
    """Screened candidate pairs (i < j) with their coarse NCC, and each evaluation case's best
    training match on the coarse grid (-1 for training cases)."""

    i: np.ndarray
    j: np.ndarray
    coarse_ncc: np.ndarray
    best_j: np.ndarray
    best_coarse: np.ndarray


def _screen(volumes, split_code: np.ndarray, synthetic: np.ndarray, screen: float, chunk_size: int) -> _Screen:
    n = len(volumes)
    coarse = np.stack([v.coarse for v in volumes]).astype(np.float32) if n else np.zeros((0, 1), np.float32)
    is_train = split_code == 0
    rows_i, rows_j, rows_coarse = [np.zeros(0, int)], [np.zeros(0, int)], [np.zeros(0, np.float32)]
    best_j = np.full(n, -1)
    best_coarse = np.full(n, -np.inf, dtype=np.float32)
    for start in range(0, n, chunk_size):
        own = np.arange(start, min(start + chunk_size, n))
        block = coarse[own] @ coarse.T  # (chunk, n) Pearson correlations on the coarse grid
        if is_train.any():
            # Best training match of every val/test case (the audit paper's Fig. 3 distribution).
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
    return _Screen(
        np.concatenate(rows_i).astype(int), np.concatenate(rows_j).astype(int), np.concatenate(rows_coarse),
        best_j, best_coarse,
    )  # fmt: skip


def _add_exact_pairs(screen: _Screen, volumes, split_code: np.ndarray, synthetic: np.ndarray) -> None:
    """Exact duplicates are found by hash, whatever the screen says."""
    is_train = split_code == 0
    by_hash: dict[str, list[int]] = {}
    for index, volume in enumerate(volumes):
        by_hash.setdefault(volume.sha256, []).append(index)
    exact_pairs = {(a, b) for group in by_hash.values() for x, a in enumerate(group) for b in group[x + 1 :]}
    extra = [
        (a, b)
        for a, b in sorted(exact_pairs - set(zip(screen.i.tolist(), screen.j.tolist())))
        if split_code[a] != split_code[b] or (is_train[a] and not (synthetic[a] or synthetic[b]))
    ]
    if extra:
        screen.i = np.concatenate([screen.i, [a for a, _ in extra]]).astype(int)
        screen.j = np.concatenate([screen.j, [b for _, b in extra]]).astype(int)
        extra_ncc = [float(volumes[a].coarse.astype(np.float32) @ volumes[b].coarse.astype(np.float32)) for a, b in extra]
        screen.coarse_ncc = np.concatenate([screen.coarse_ncc, extra_ncc])


def _best_matches(screen: _Screen, volumes, pairs: pd.DataFrame, is_train: np.ndarray) -> pd.DataFrame:
    """Each val/test case's best training match, confirmed on the fine grid."""
    best_j, best_coarse = screen.best_j.copy(), screen.best_coarse.copy()
    evaluated = np.flatnonzero(best_j >= 0)
    best_ncc = np.full(len(volumes), np.nan, dtype=np.float32)
    best_ncc[evaluated] = _fine_ncc(volumes, evaluated, best_j[evaluated])
    # A confirmed pair can beat the coarse best match on the fine grid.
    for row in pairs[pairs["category"].isin(("train-val", "train-test"))].itertuples():
        eval_index, train_index = (row.j, row.i) if is_train[row.i] else (row.i, row.j)
        if row.ncc > best_ncc[eval_index]:
            best_j[eval_index], best_coarse[eval_index], best_ncc[eval_index] = train_index, row.coarse_ncc, row.ncc
    return pd.DataFrame(
        {"i": evaluated, "best_j": best_j[evaluated], "coarse_ncc": best_coarse[evaluated], "ncc": best_ncc[evaluated]}
    )


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
    volumes: Sequence[AuditedVolume], i: np.ndarray, j: np.ndarray, max_shift: int = MAX_SHIFT, batch: int = 256
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


