"""Bootstrap CIs of one run's subgroup detection metrics: the subgroup table with percentile intervals
over patient resamples and Wilson intervals (docs/explanation/detection-and-statistics.md "Confidence intervals and comparisons").

Example::

    table = bootstrap_subgroup_metrics(test_records, threshold, n_resamples=2000)
"""

from __future__ import annotations

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
from lightning_modules.evaluation.records import ATTRIBUTES
from lightning_modules.evaluation.small_counts import wilson_interval


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
