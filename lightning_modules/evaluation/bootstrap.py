"""Patient-level bootstrap CIs for subgroup detection metrics and paired run comparisons
(docs/design.md "Confidence intervals and comparisons").

Resampling is by patient: a resample draws patients with replacement and every scan of a drawn
patient comes along, as often as the patient was drawn. The draws are derived from a seed computed
from the sorted case ids (:func:`evaluation_set_hash`), so every run evaluated on the same set uses
the same resamples whatever the row order, and two runs get a paired CI from the same draws.

A resample is a vector of patient multiplicities; a block of them is fed to
:class:`~lightning_modules.evaluation.detection.WeightedSubgroupEvaluator`, which computes every
subgroup's counts and AUC for the whole block in one sparse product. Resample r always comes from
its own random stream (``SeedSequence(seed, spawn_key=(r,))``), so the result does not depend on
how the resamples are chunked to bound memory.

Example::

    table = bootstrap_subgroup_metrics(test_records, threshold, n_resamples=2000)
    diff = paired_difference(baseline_records, synthx_records, m_baseline, m_synthx)
    print(diff[diff["significant"]])

A difference is significant only when its CI excludes 0 and the subgroup supports the claim
(``subgroups.supported``: at least 10 patients, with 5 positives and 5 negatives where the metric
needs them). Every row carries its patients, positives, negatives and the fraction of resamples in
which the metric (or both runs' metric, for a difference) was defined.
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
from lightning_modules.evaluation.records import ATTRIBUTE_COLUMNS, ATTRIBUTES, attribute_values, labels
from lightning_modules.evaluation.small_counts import delong_test, mcnemar_exact_p, newcombe_paired_interval, wilson_interval
from lightning_modules.evaluation.subgroups import metric_defined, supported

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


def bootstrap_subgroup_metrics(
    records: pd.DataFrame,
    threshold: float,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    score: str = "volume",
    attributes: Sequence[str] = ATTRIBUTES,
    seed: int | None = None,
    memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB,
    resample_thresholds: np.ndarray | None = None,
) -> pd.DataFrame:
    """The subgroup table of :func:`~lightning_modules.evaluation.detection.subgroup_metrics` plus
    ``<metric>_ci_low`` / ``<metric>_ci_high`` and ``<metric>_defined`` (fraction of resamples
    where the metric was defined) for sensitivity, specificity, f1, auc, auc_binary, and the
    Wilson intervals ``sensitivity_wilson_low`` / ``_high`` and ``specificity_wilson_low`` /
    ``_high`` (scans as units; they do not collapse at 0 or n of n as the bootstrap does).

    Percentile bootstrap over patients. A CI is NaN where the point estimate is undefined, and for
    F1 in a group without tumors (``subgroups.metric_defined``). ``table.attrs`` records the
    threshold, score, resamples, confidence and the evaluation set's sha256.

    Args:
        records: per-case records.
        threshold: detection threshold m.
        n_resamples: bootstrap resamples (docs/design.md: 2,000).
        confidence: CI level (0.95 -> 2.5th and 97.5th percentiles).
        score: ``volume`` or ``max_prob``.
        attributes: attributes to split by.
        seed: an explicit seed instead of the evaluation set's.
        memory_budget_mb: bound on the working memory of one block of resamples.
        resample_thresholds: a threshold per resample (chosen on validation resample r and applied
            to resample r: the CIs then include the threshold's uncertainty); None keeps m fixed.
    """
    _check_settings(n_resamples, confidence)
    evaluator = WeightedSubgroupEvaluator(records, threshold, score=score, attributes=attributes)
    point = evaluator.evaluate(np.ones(evaluator.n_patients))
    table = evaluator.table(point)
    seed = _resolve_seed(evaluator.case_ids, seed)
    (samples,) = resample_statistics([evaluator], n_resamples, seed, CI_METRICS, memory_budget_mb,
                                     resample_thresholds=None if resample_thresholds is None else [resample_thresholds])
    for metric in CI_METRICS:
        low, high, fraction = _summary(samples[metric], _defined(point, metric)[0], confidence)
        table[f"{metric}_ci_low"], table[f"{metric}_ci_high"] = low, high
        table[f"{metric}_defined"] = fraction
    for metric, successes, total in (("sensitivity", "tp", "positives"), ("specificity", "tn", "negatives")):
        table[f"{metric}_wilson_low"], table[f"{metric}_wilson_high"] = wilson_interval(table[successes], table[total], confidence)
    table.attrs.update(
        {
            "threshold": float(threshold),
            "score": score,
            "n_resamples": int(n_resamples),
            "confidence": float(confidence),
            "evaluation_set_sha256": evaluation_set_hash(evaluator.case_ids),
            "nested_threshold": resample_thresholds is not None,
        }
    )
    return table


def _comparison_columns(records: pd.DataFrame, attributes: Sequence[str]) -> tuple[pd.Index, dict[str, np.ndarray]]:
    """Case ids and the per-case values two runs of a paired comparison must share."""
    ids = pd.Index(records["case_id"].astype(str).str.strip())
    values = {"patient_id": records["patient_id"].astype(str).str.strip().to_numpy(), "label": labels(records)}
    for attribute in attributes:
        values[ATTRIBUTE_COLUMNS[attribute]] = attribute_values(records, attribute)
    return ids, values


def _check_same_evaluation_set(
    records_a: pd.DataFrame, records_b: pd.DataFrame, attributes: Sequence[str], reference=None
) -> None:
    """Raise ValueError unless both runs hold the same cases with the same patients, labels and attributes.

    ``reference``: :func:`_comparison_columns` of ``records_a``, when several runs are checked against it.
    """
    ids_a, values_a = reference or _comparison_columns(records_a, attributes)
    ids_b, values_b = _comparison_columns(records_b, attributes)
    hash_a, hash_b = evaluation_set_hash(ids_a), evaluation_set_hash(ids_b)
    if hash_a != hash_b:
        only_a, only_b = ids_a.difference(ids_b), ids_b.difference(ids_a)
        raise ValueError(
            "paired comparison needs the same evaluation set in both runs: "
            f"{len(only_a)} case(s) only in A (e.g. {list(only_a[:3])}), "
            f"{len(only_b)} only in B (e.g. {list(only_b[:3])}); "
            f"set sha256 A={hash_a[:12]} B={hash_b[:12]}"
        )
    order = ids_b.get_indexer(ids_a)
    for column, column_a in values_a.items():
        column_b = values_b[column][order]
        differs = np.flatnonzero(column_a != column_b)
        if len(differs):
            i = differs[0]
            raise ValueError(
                f"case {ids_a[i]}: column '{column}' differs between the two runs "
                f"({column_a[i]!r} vs {column_b[i]!r}); a paired comparison needs identical case metadata"
            )


def bootstrap_p_values(differences: np.ndarray, point: np.ndarray) -> np.ndarray:
    """Two-sided percentile-bootstrap p-value per column of paired differences (resamples x columns).

    p = 2 x the smaller share of the defined resamples at or below 0 and at or above 0, at most 1:
    the smallest two-sided level at which the percentile interval would exclude 0. It is 0 when no
    defined resample reaches 0 (then p < 1/B). NaN where the point difference is undefined or no
    resample defines it. Resamples with a difference of exactly 0 count on both sides.
    """
    count = (~np.isnan(differences)).sum(axis=0)
    # A comparison with NaN is False, so undefined resamples fall on neither side.
    below, above = (differences <= 0).sum(axis=0), (differences >= 0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.minimum(1.0, 2.0 * np.minimum(below, above) / count)
    return np.where(np.isnan(np.asarray(point, dtype=float)) | (count == 0), np.nan, p)


def holm_adjust(p_values) -> np.ndarray:
    """Holm's step-down adjustment of a family of p-values; NaN entries are not tests (kept NaN, not counted).

    The k-th smallest of m p-values becomes max over j <= k of min(1, (m - j + 1) p_(j)); rejecting
    where the adjusted value is below alpha controls the family-wise error rate at alpha.
    """
    p = np.asarray(p_values, dtype=float)
    adjusted = np.full(p.shape, np.nan)
    tested = np.flatnonzero(~np.isnan(p))
    m = len(tested)
    if m:
        order = tested[np.argsort(p[tested], kind="stable")]
        adjusted[order] = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    return adjusted


# The test that decides a difference's significance, per metric
# (docs/design.md "Confidence intervals and comparisons"). F1 and auc_binary have no exact paired test: their bootstrap interval
# must exclude 0 and the exact McNemar test must find changed decisions on the positives or the
# negatives (Bonferroni over the two); their p is the larger of the two p-values.
SIGNIFICANCE_TESTS = {"sensitivity": "mcnemar_exact", "specificity": "mcnemar_exact", "auc": "delong",
                      "f1": "bootstrap+mcnemar", "auc_binary": "bootstrap+mcnemar"}
SMALL_COUNT_COLUMNS = ("a_wilson_low", "a_wilson_high", "b_wilson_low", "b_wilson_high", "newcombe_low", "newcombe_high",
                       "p_mcnemar", "p_delong")


def paired_small_count_columns(
    evaluator_a: WeightedSubgroupEvaluator, evaluator_b: WeightedSubgroupEvaluator, metric: str, confidence: float
) -> dict[str, np.ndarray]:
    """Per subgroup row, the small-count statistics of one metric of two runs on the same scans.

    Sensitivity (over the positive scans) and specificity (over the negatives): each run's Wilson
    interval, Newcombe's interval of the paired difference (B - A) and the exact McNemar p of the
    scans one run decides correctly and the other not. AUC: DeLong's p of the paired difference.
    F1 and auc_binary: ``p_mcnemar`` is the Bonferroni minimum of the exact McNemar p on the
    positives and on the negatives (did the decisions change at all). NaN where a column does not
    apply or the row lacks the scans it needs.
    """
    columns = {name: np.full(len(evaluator_a.rows), np.nan) for name in SMALL_COUNT_COLUMNS}
    truth = evaluator_a.truth
    if metric in ("f1", "auc_binary"):
        on_positives = paired_small_count_columns(evaluator_a, evaluator_b, "sensitivity", confidence)["p_mcnemar"]
        on_negatives = paired_small_count_columns(evaluator_a, evaluator_b, "specificity", confidence)["p_mcnemar"]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="All-NaN", category=RuntimeWarning)
            smaller = np.nanmin(np.stack([on_positives, on_negatives]), axis=0)
        columns["p_mcnemar"] = np.minimum(1.0, 2.0 * smaller)
    elif metric in ("sensitivity", "specificity"):
        counted = truth if metric == "sensitivity" else ~truth
        correct_a = (evaluator_a.values > evaluator_a.threshold) == truth
        correct_b = (evaluator_b.values > evaluator_b.threshold) == truth
        for row in range(len(evaluator_a.rows)):
            members = evaluator_a.member_cases(row)
            scans = members[counted[members]]
            if len(scans) == 0:
                continue
            a, b = correct_a[scans], correct_b[scans]
            both, only_a, only_b = int((a & b).sum()), int((a & ~b).sum()), int((~a & b).sum())
            neither = len(scans) - both - only_a - only_b
            for arm, found in (("a", both + only_a), ("b", both + only_b)):
                (low,), (high,) = wilson_interval([found], [len(scans)], confidence)
                columns[f"{arm}_wilson_low"][row], columns[f"{arm}_wilson_high"][row] = low, high
            # Newcombe's table puts the first proportion's solo successes in b: B - A.
            columns["newcombe_low"][row], columns["newcombe_high"][row] = newcombe_paired_interval(
                both, only_b, only_a, neither, confidence
            )
            columns["p_mcnemar"][row] = mcnemar_exact_p(only_a, only_b)
    elif metric == "auc":
        for row in range(len(evaluator_a.rows)):
            members = evaluator_a.member_cases(row)
            if truth[members].any() and (~truth[members]).any():
                columns["p_delong"][row] = delong_test(truth[members], evaluator_a.values[members], evaluator_b.values[members]).p_value
    return columns


def _difference_frame(
    evaluators: tuple[WeightedSubgroupEvaluator, WeightedSubgroupEvaluator],
    metric: str,
    points: tuple[dict, dict],
    samples: tuple[dict, dict],
    confidence: float,
) -> pd.DataFrame:
    """One metric's comparison rows: counts, both values, the difference, its CIs, tests and significance."""
    evaluator = evaluators[0]
    point_a, point_b = points
    a, b = _defined(point_a, metric)[0], _defined(point_b, metric)[0]
    delta = b - a
    differences = samples[1][metric] - samples[0][metric]
    low, high, fraction = _summary(differences, delta, confidence)
    frame = evaluator.rows.copy()
    frame["metric"] = metric
    frame["n_patients"] = evaluator.row_patients
    for name in ("n", "positives", "negatives"):
        frame[name] = np.rint(point_a[name][0]).astype(np.int64)
    frame["a"], frame["b"], frame["delta"] = a, b, delta
    frame["ci_low"], frame["ci_high"], frame["defined_fraction"] = low, high, fraction
    for name, values in paired_small_count_columns(*evaluators, metric, confidence).items():
        frame[name] = values
    frame["p_bootstrap"] = bootstrap_p_values(differences, delta)
    frame["supported"] = supported(frame["n_patients"], frame["positives"], frame["negatives"], metric)
    # Which test decides: the exact McNemar test for sensitivity and specificity (it holds its level
    # at any count, where the bootstrap and even Newcombe's interval can call a few discordant scans
    # significant), DeLong's for AUC, the bootstrap interval together with McNemar for F1 and auc_binary.
    test = SIGNIFICANCE_TESTS.get(metric, "bootstrap")
    frame["test"] = test
    if test == "bootstrap+mcnemar":
        p_value = np.fmax(frame["p_bootstrap"].to_numpy(), frame["p_mcnemar"].to_numpy())
    else:
        p_value = frame[{"mcnemar_exact": "p_mcnemar", "delong": "p_delong", "bootstrap": "p_bootstrap"}[test]].to_numpy()
    frame["p_value"] = np.where(np.isnan(delta), np.nan, p_value)
    alpha = 1.0 - confidence
    excludes_zero = (low > 0) | (high < 0)
    if test == "bootstrap":
        decided = excludes_zero
    elif test == "bootstrap+mcnemar":
        decided = excludes_zero & (frame["p_mcnemar"] < alpha).to_numpy()
    else:
        decided = (frame["p_value"] < alpha).to_numpy()
    frame["significant"] = decided & frame["supported"].to_numpy()
    # Multiplicity: Holm within each attribute (its supported groups, this metric), so "does SynthX
    # change sensitivity in some phase?" is tested at the family-wise level, not once per phase.
    tested = frame["p_value"].where(frame["supported"])
    frame["p_holm"] = tested.groupby(frame["attribute"], sort=False).transform(lambda p: holm_adjust(p.to_numpy()))
    frame["significant_holm"] = frame["significant"] & (frame["p_holm"] < alpha).to_numpy()
    return frame


def paired_difference(
    records_a: pd.DataFrame,
    records_b: pd.DataFrame,
    threshold_a: float,
    threshold_b: float,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    score: str = "volume",
    metrics: Sequence[str] = CI_METRICS,
    attributes: Sequence[str] = ATTRIBUTES,
    seed: int | None = None,
    memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB,
    resample_thresholds: tuple[np.ndarray | None, np.ndarray | None] | None = None,
) -> pd.DataFrame:
    """Paired bootstrap comparison of two runs on the same evaluation set (B minus A).

    Both runs are evaluated on the same patient resamples; the CI of delta = metric(B) - metric(A)
    is the percentile interval of the per-resample differences (over resamples where both are
    defined). A difference is significant only when its CI excludes 0 and the subgroup supports
    it (``subgroups.supported``). Each row also has its bootstrap p-value
    (:func:`bootstrap_p_values`) and, for supported rows, Holm's adjustment over the supported
    groups of its attribute for that metric (:func:`holm_adjust`); ``significant_holm`` marks a
    significant difference that survives it.

    Beside the bootstrap each row has the small-count statistics of
    :func:`paired_small_count_columns`; ``test`` names the test whose p (``p_value``) decides
    significance (``SIGNIFICANCE_TESTS``: exact McNemar for sensitivity and specificity, DeLong for
    AUC, the bootstrap interval for F1 and auc_binary).

    Returns one row per (attribute, group, metric): n_patients, n, positives, negatives, a, b,
    delta, ci_low, ci_high, defined_fraction, a_wilson_low, a_wilson_high, b_wilson_low,
    b_wilson_high, newcombe_low, newcombe_high, p_mcnemar, p_delong, p_bootstrap, supported, test,
    p_value, significant, p_holm, significant_holm.

    Args:
        records_a: the reference run's records (e.g. the baseline).
        records_b: the other run's records (e.g. SynthX-augmented).
        threshold_a: detection threshold of run A.
        threshold_b: detection threshold of run B.
        n_resamples: bootstrap resamples.
        confidence: CI level.
        score: ``volume`` or ``max_prob``.
        metrics: metrics to compare.
        attributes: attributes to split by.
        seed: an explicit seed instead of the evaluation set's.
        memory_budget_mb: bound on the working memory of one block of resamples.
        resample_thresholds: (A's, B's) threshold per resample, each chosen on validation resample r
            (a nested threshold bootstrap); None or a None entry keeps that run's m fixed.

    Raises:
        ValueError: the two record sets have different case ids, or a case's patient, label or
            attributes differ between them.
    """
    (result,) = paired_differences(
        records_a, [(records_b, threshold_a, threshold_b)], n_resamples, confidence, score, metrics, attributes, seed,
        memory_budget_mb, resample_thresholds=None if resample_thresholds is None else [resample_thresholds],
    )  # fmt: skip
    return result


def paired_differences(
    records_a: pd.DataFrame,
    comparisons: Sequence[tuple[pd.DataFrame, float, float]],
    n_resamples: int = 2000,
    confidence: float = 0.95,
    score: str = "volume",
    metrics: Sequence[str] = CI_METRICS,
    attributes: Sequence[str] = ATTRIBUTES,
    seed: int | None = None,
    memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB,
    resample_thresholds: Sequence[tuple[np.ndarray | None, np.ndarray | None] | None] | None = None,
) -> list[pd.DataFrame]:
    """Several :func:`paired_difference` comparisons with one reference run, in one pass over the resamples.

    ``comparisons`` holds ``(records_b, threshold_a, threshold_b)`` per comparison (another model,
    or the same model at another operating point). The reference run is evaluated once per distinct
    ``threshold_a`` and every run on the same patient resamples, so comparing 12 models with one
    baseline evaluates 13 models per resample instead of 24, and each result equals the one
    :func:`paired_difference` gives for that pair alone.

    ``resample_thresholds`` holds per comparison None or (A's, B's) threshold per resample (see
    :func:`paired_difference`); a reference run with its own per-resample thresholds is evaluated
    apart from the same run at a fixed m.

    Returns:
        one table per comparison, in order (the columns of :func:`paired_difference`).
    """
    _check_settings(n_resamples, confidence)
    unknown = [m for m in metrics if m not in CI_METRICS]
    if unknown:
        raise ValueError(f"unknown metrics {unknown}: expected a subset of {CI_METRICS}")
    if not comparisons:
        return []
    columns_a = _comparison_columns(records_a, attributes)
    for records_b, _, _ in comparisons:
        _check_same_evaluation_set(records_a, records_b, attributes, reference=columns_a)
    # The subgroups are built once, on the reference run; every other evaluator reuses them (the
    # checks above guarantee the same cases, patients, labels and attributes) and reads only its scores.
    first = WeightedSubgroupEvaluator(records_a, comparisons[0][1], score=score, attributes=attributes)
    per_comparison = list(resample_thresholds) if resample_thresholds is not None else [None] * len(comparisons)
    if len(per_comparison) != len(comparisons):
        raise ValueError(f"{len(per_comparison)} resample threshold entries for {len(comparisons)} comparisons")
    evaluators: list[WeightedSubgroupEvaluator] = []
    thresholds_by_evaluator: list[np.ndarray | None] = []
    reference: dict[tuple, int] = {}
    pairs = []
    for (records_b, threshold_a, threshold_b), nested in zip(comparisons, per_comparison):
        nested_a, nested_b = nested if nested is not None else (None, None)
        key = (float(threshold_a), None if nested_a is None else id(nested_a))
        if key not in reference:
            reference[key] = len(evaluators)
            evaluators.append(WeightedSubgroupEvaluator.on_same_cases(first, records_a, threshold_a))
            thresholds_by_evaluator.append(nested_a)
        pairs.append((reference[key], len(evaluators)))
        evaluators.append(WeightedSubgroupEvaluator.on_same_cases(first, records_b, threshold_b))
        thresholds_by_evaluator.append(nested_b)
    ones = np.ones(evaluators[0].n_patients)
    points = [evaluator.evaluate(ones) for evaluator in evaluators]
    seed = _resolve_seed(evaluators[0].case_ids, seed)
    samples = resample_statistics(evaluators, n_resamples, seed, metrics, memory_budget_mb,
                                  resample_thresholds=thresholds_by_evaluator)
    results = []
    for (a, b), (_, threshold_a, threshold_b), nested in zip(pairs, comparisons, per_comparison):
        frames = [
            _difference_frame((evaluators[a], evaluators[b]), metric, (points[a], points[b]), (samples[a], samples[b]),
                              confidence)
            for metric in metrics
        ]
        result = pd.concat(frames, ignore_index=True)
        result.attrs.update(
            {
                "n_resamples": int(n_resamples),
                "confidence": float(confidence),
                "evaluation_set_sha256": evaluation_set_hash(evaluators[0].case_ids),
                "threshold_a": float(threshold_a),
                "threshold_b": float(threshold_b),
                "nested_threshold": nested is not None and any(t is not None for t in nested),
            }
        )
        results.append(result)
    return results
