"""Patient-level bootstrap resampling (docs/explanation/detection-and-statistics.md "Confidence intervals and comparisons"):
the evaluation set's identity and seed, the patient draws, and subgroup metrics evaluated on them.

Resampling is by patient: a resample draws patients with replacement and every scan of a drawn
patient comes along, as often as the patient was drawn. The draws are derived from a seed computed
from the sorted case ids (:func:`evaluation_set_hash`), so every run evaluated on the same set uses
the same resamples whatever the row order, and two runs get a paired CI from the same draws.

A resample is a vector of patient multiplicities; a block of them is fed to
:class:`~lightning_modules.evaluation.detection.WeightedSubgroupEvaluator`, which computes every
subgroup's counts and AUC for the whole block in one sparse product. Resample r always comes from
its own random stream (``SeedSequence(seed, spawn_key=(r,))``), so the result does not depend on
how the resamples are chunked to bound memory. :func:`resample_statistics` may also evaluate
resample r at its own threshold (the nested threshold bootstrap, threshold r chosen on validation
resample r).

The intervals built on these resamples are
:func:`~lightning_modules.evaluation.subgroup_intervals.bootstrap_subgroup_metrics` (one run) and
:func:`~lightning_modules.evaluation.paired_comparison.paired_difference` (two runs).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Iterable, Iterator, Sequence

import numpy as np
import pandas as pd

from lightning_modules.evaluation.detection import RATE_METRICS, WeightedSubgroupEvaluator
from lightning_modules.evaluation.subgroups import metric_defined

CI_METRICS = RATE_METRICS
DEFAULT_MEMORY_BUDGET_MB = 256
RESAMPLES_PER_BLOCK = 32


def _clean_ids(case_ids: Iterable) -> list[str]:
    if isinstance(case_ids, (pd.Series, pd.Index, np.ndarray)):
        return pd.Series(case_ids).astype(str).str.strip().tolist()
    return [str(c).strip() for c in case_ids]


def evaluation_set_hash(case_ids: Iterable) -> str:
    """sha256 (hex) of the sorted case ids, one per line: the identity of an evaluation set.

    Raises:
        ValueError: a case id appears twice.
    """
    ids = sorted(_clean_ids(case_ids))
    duplicated = [a for a, b in zip(ids, ids[1:]) if a == b]
    if duplicated:
        raise ValueError(f"case id {duplicated[0]!r} appears more than once in the evaluation set")
    return hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()


def evaluation_seed(case_ids: Iterable) -> int:
    """The bootstrap seed of an evaluation set: its :func:`evaluation_set_hash` read as a 256-bit integer."""
    return int(evaluation_set_hash(case_ids), 16)


def patient_index(case_ids: Sequence, patient_ids: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique patient ids and, for each case, the position of its patient among them.

    Raises:
        ValueError: lengths differ, a case id repeats, or a patient id is empty.
    """
    cases = _clean_ids(pd.Series(case_ids))
    patient_series = pd.Series(patient_ids)
    patients = np.array(_clean_ids(patient_series), dtype=object)
    if len(cases) != len(patients):
        raise ValueError(f"{len(cases)} case ids but {len(patients)} patient ids")
    evaluation_set_hash(cases)
    empty = np.flatnonzero(patient_series.isna().to_numpy() | (patients == ""))
    if len(empty):
        raise ValueError(f"case {cases[empty[0]]}: empty patient id")
    unique, inverse = np.unique(patients, return_inverse=True)
    return unique, inverse


def _resample_generator(seed: int, resample: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(resample,)))


def _draw_patients(seed: int, resample: int, n_patients: int) -> np.ndarray:
    # int32 draws are about a third faster; the dtype is part of the stream, so it is fixed by size.
    dtype = np.int32 if n_patients < 2**31 else np.int64
    return _resample_generator(seed, resample).integers(0, n_patients, size=n_patients, dtype=dtype)


def _resolve_seed(case_ids: Sequence, seed: int | None) -> int:
    return evaluation_seed(case_ids) if seed is None else int(seed)


def resample_indices(
    case_ids: Sequence, patient_ids: Sequence, n_resamples: int = 2000, seed: int | None = None
) -> np.ndarray:
    """The patient draws of each resample: (n_resamples x n_patients) positions into the sorted
    unique patient ids (see :func:`patient_index`).

    Each row draws n_patients patients with replacement. The seed defaults to the evaluation set's
    (:func:`evaluation_seed`), so the draws depend only on which cases and patients are evaluated,
    not on row order. The bootstrap itself never holds this whole matrix (it works in blocks).

    Args:
        case_ids: the evaluation set's case ids.
        patient_ids: each case's patient id.
        n_resamples: number of resamples R.
        seed: an explicit seed instead of the one derived from the case ids.
    """
    patients, _ = patient_index(case_ids, patient_ids)
    seed = _resolve_seed(case_ids, seed)
    draws = np.empty((int(n_resamples), len(patients)), dtype=np.int64)
    for r in range(int(n_resamples)):
        draws[r] = _draw_patients(seed, r, len(patients))
    return draws


def case_weight_matrix(
    case_ids: Sequence, patient_ids: Sequence, n_resamples: int = 2000, seed: int | None = None
) -> np.ndarray:
    """Multiplicity of each case in each resample: (n_resamples x n_cases), cases in input order.

    A case's weight is the number of times its patient was drawn, so a patient's scans share one
    weight. Same draws as :func:`resample_indices`.
    """
    patients, case_patient = patient_index(case_ids, patient_ids)
    draws = resample_indices(case_ids, patient_ids, n_resamples, seed)
    patient_weights = np.stack([np.bincount(row, minlength=len(patients)) for row in draws]) if len(draws) else (
        np.zeros((0, len(patients)), dtype=np.int64)
    )
    return patient_weights[:, case_patient]


def patient_weight_blocks(
    n_patients: int, n_resamples: int, seed: int, block_size: int, dtype=np.int64
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(first_resample, weights)`` blocks with weights (n_patients x block), C-contiguous.

    Column j of a block is resample ``first_resample + j``: the multiplicity of each patient,
    identical to ``bincount`` of the corresponding :func:`resample_indices` row.
    """
    for start in range(0, n_resamples, block_size):
        stop = min(start + block_size, n_resamples)
        draws = np.stack([_draw_patients(seed, r, n_patients) for r in range(start, stop)])
        # One bincount for the whole block: resample j's draws are shifted into their own range.
        shifted = draws.astype(np.int64) + (np.arange(stop - start, dtype=np.int64) * n_patients)[:, None]
        counts = np.bincount(shifted.ravel(), minlength=(stop - start) * n_patients)
        yield start, np.ascontiguousarray(counts.reshape(stop - start, n_patients).T, dtype=dtype)


def _exact_float_dtype(evaluator: WeightedSubgroupEvaluator) -> type:
    """float32 when every weighted count of a resample is an integer below 2**24 (then float32 is exact).

    A resample draws n_patients patients, so no count can exceed n_patients x the most scans of
    one patient.
    """
    bound = evaluator.n_patients * int(evaluator.cases_per_patient.max(initial=0))
    return np.float32 if bound < 2**24 else np.float64


def _block_size(evaluators: Sequence[WeightedSubgroupEvaluator], n_resamples: int, memory_budget_mb: float) -> int:
    # Per resample: the weight column, the projected columns and about three temporaries of them.
    # Blocks of a few dozen resamples keep the sparse product's working set in cache; larger ones
    # measured slower, so the budget only ever lowers this.
    per_resample = 8 * sum(4 * e.n_columns + e.n_patients for e in evaluators)
    by_memory = int((memory_budget_mb * 2**20) // max(per_resample, 1))
    return int(max(1, min(n_resamples, RESAMPLES_PER_BLOCK, by_memory)))


def _check_settings(n_resamples: int, confidence: float) -> None:
    if int(n_resamples) < 1:
        raise ValueError(f"n_resamples must be at least 1, got {n_resamples}")
    if not 0.0 < float(confidence) < 1.0:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")


def percentile_interval(samples: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval per column over the resamples where the value is defined (not NaN).

    A resample can leave a metric undefined in a small subgroup (no positive drawn): those
    resamples are left out, so the interval is conditional on the metric being defined (the
    fraction of resamples where it was is reported beside it). Columns with no defined resample get NaN.
    """
    tail = (1.0 - confidence) / 2.0 * 100.0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="All-NaN slice encountered", category=RuntimeWarning)
        low, high = np.nanpercentile(samples, [tail, 100.0 - tail], axis=0)
    return low, high


def _defined(statistics: dict[str, np.ndarray], metric: str) -> np.ndarray:
    """The metric's values with NaN where it is undefined (``subgroups.metric_defined``)."""
    values = statistics[metric]
    return np.where(metric_defined(metric, statistics["positives"], statistics["negatives"], values), values, np.nan)


def bootstrap_threads() -> int:
    """Threads for the resample blocks: the CPUs this process may use (``os.sched_getaffinity``), at most 8.

    The sparse products and NumPy's reductions release the GIL, so blocks run in parallel threads.
    """
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, available))


def resample_statistics(
    evaluators: Sequence[WeightedSubgroupEvaluator],
    n_resamples: int,
    seed: int,
    metrics: Sequence[str] = CI_METRICS,
    memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB,
    threads: int | None = None,
    resample_thresholds: Sequence[np.ndarray | None] | None = None,
) -> list[dict[str, np.ndarray]]:
    """Each evaluator's metrics on the same patient resamples: per evaluator, metric ->
    (n_resamples x subgroup rows), NaN where undefined. The evaluators must share their patients
    (one evaluation set, e.g. two runs or two thresholds).

    ``resample_thresholds`` (one entry per evaluator, None for its own fixed m) gives a threshold
    per resample: resample r is then evaluated at threshold r (a nested threshold bootstrap, where
    threshold r was chosen on validation resample r; NaN entries keep the evaluator's m).

    Blocks of resamples are evaluated by ``threads`` threads (default :func:`bootstrap_threads`);
    each block writes its own rows, so the result is identical for any thread count, and at most
    ``threads`` blocks are in memory at once (``memory_budget_mb`` bounds all of them together).
    """
    threads = bootstrap_threads() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    n_rows = len(evaluators[0].rows)
    samples = [{metric: np.empty((n_resamples, n_rows)) for metric in metrics} for _ in evaluators]
    block_size = _block_size(evaluators, n_resamples, memory_budget_mb / threads)
    dtype = _exact_float_dtype(evaluators[0])
    per_resample = _threshold_plans(evaluators, n_resamples, resample_thresholds)

    def evaluate_block(start: int, block: np.ndarray) -> None:
        stop = start + block.shape[1]
        for evaluator, target, plan in zip(evaluators, samples, per_resample):
            if plan is None:
                statistics = evaluator.evaluate_columns(block)
                for metric in metrics:
                    target[metric][start:stop] = _defined(statistics, metric)
                continue
            thresholds, at_threshold = plan
            for value in np.unique(thresholds[start:stop]):
                columns = np.flatnonzero(thresholds[start:stop] == value)
                statistics = at_threshold[value].evaluate_columns(np.ascontiguousarray(block[:, columns]))
                for metric in metrics:
                    target[metric][start + columns] = _defined(statistics, metric)

    blocks = patient_weight_blocks(evaluators[0].n_patients, n_resamples, seed, block_size, dtype)
    if threads == 1:
        for start, block in blocks:
            evaluate_block(start, block)
        return samples
    with ThreadPoolExecutor(max_workers=threads) as pool:
        pending: set = set()
        for start, block in blocks:
            if len(pending) >= threads:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()
            pending.add(pool.submit(evaluate_block, start, block))
        for future in pending:
            future.result()
    return samples


def _threshold_plans(evaluators, n_resamples: int, resample_thresholds):
    """Per evaluator: None (its own m) or (threshold per resample, evaluator per distinct threshold).

    The evaluators per threshold are built before the threads start; validation choices cluster
    on a few values, so there are few of them.
    """
    if resample_thresholds is None:
        return [None] * len(evaluators)
    if len(resample_thresholds) != len(evaluators):
        raise ValueError(f"{len(resample_thresholds)} threshold arrays for {len(evaluators)} evaluators")
    plans = []
    for evaluator, thresholds in zip(evaluators, resample_thresholds):
        if thresholds is None:
            plans.append(None)
            continue
        thresholds = np.asarray(thresholds, dtype=float)
        if thresholds.shape != (n_resamples,):
            raise ValueError(f"{thresholds.shape[0]} resample thresholds for {n_resamples} resamples")
        thresholds = np.where(np.isnan(thresholds), evaluator.threshold, thresholds)
        plans.append((thresholds, {value: evaluator.at_threshold(value) for value in np.unique(thresholds)}))
    return plans


def _summary(samples: np.ndarray, point: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CI bounds (NaN where the point estimate is undefined) and the fraction of resamples defined."""
    low, high = percentile_interval(samples, confidence)
    undefined = np.isnan(point)
    fraction = (~np.isnan(samples)).mean(axis=0) if len(samples) else np.zeros(samples.shape[1])
    return np.where(undefined, np.nan, low), np.where(undefined, np.nan, high), fraction
