"""Paired comparison of two runs on the same evaluation set: the bootstrap CI of each subgroup's
difference (B minus A) from the same patient resamples, the small-count tests beside it, and the
decision of significance (docs/explanation/detection-and-statistics.md "Confidence intervals and comparisons").

Example::

    diff = paired_difference(baseline_records, synthx_records, m_baseline, m_synthx)
    print(diff[diff["significant"]])

A difference is significant only when its metric's test decides so (``SIGNIFICANCE_TESTS``) and the
subgroup supports the claim (``subgroups.supported``: at least 10 patients, with 5 positives and 5
negatives where the metric needs them). Every row carries its patients, positives, negatives and
the fraction of resamples in which both runs' metric was defined.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import pandas as pd

from lightning_modules.evaluation.bootstrap import (
    CI_METRICS,
    DEFAULT_MEMORY_BUDGET_MB,
    _check_settings,
    _defined,
    _resolve_seed,
    _summary,
    evaluation_set_hash,
    resample_statistics,
)
from lightning_modules.evaluation.detection import WeightedSubgroupEvaluator
from lightning_modules.evaluation.multiplicity import holm_adjust
from lightning_modules.evaluation.records import ATTRIBUTE_COLUMNS, ATTRIBUTES, attribute_values, labels
from lightning_modules.evaluation.small_counts import delong_test, mcnemar_exact_p, newcombe_paired_interval, wilson_interval
from lightning_modules.evaluation.subgroups import supported


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


# The test that decides a difference's significance, per metric
# (docs/explanation/detection-and-statistics.md "Confidence intervals and comparisons"). F1 and auc_binary have no exact paired test: their bootstrap interval
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
