"""The operating points of an evaluation: BenchX's fixed m and the m chosen on validation (with the
spread of a bagged choice), and their tables, metrics and artifacts for every evaluated stage
(docs/explanation/detection-and-statistics.md "Scan-level detection").

Example::

    points = operating_points(recipe, callback)
    tables = log_operating_points(client, run_id, recipe, callback, ["val", "test"], points)
"""

from __future__ import annotations

import logging

import pandas as pd
from omegaconf import DictConfig

from lightning_modules.evaluation.artifacts import log_evaluation_artifacts
from lightning_modules.evaluation.callback import FALLBACK_TAG, SubgroupEvaluation
from lightning_modules.evaluation.metric_keys import headline_metric_keys
from lightning_modules.evaluation.records import fixed_rule_score
from lightning_modules.evaluation.subgroup_intervals import bootstrap_subgroup_metrics
from lightning_modules.evaluation.thresholds import choose_operating_point, OperatingPoint, resampled_choices, RULES
from lightning_modules.tracking import log_metrics
from lightning_modules.tracking.recorder import MlflowRunRecorder

log = logging.getLogger(__name__)
OPERATING_POINT_METRIC = "operating_point/{name}"


def validation_rule(recipe: DictConfig) -> str:
    """The rule of the validation-chosen operating point: the recipe's ``detection.threshold_rule``
    when it is ``f1`` or ``youden``, else Youden's J."""
    rule = str(recipe.detection.threshold_rule)
    return rule if rule in ("f1", "youden") else "youden"


def point_score(point: str, score: str, records: pd.DataFrame | None) -> str:
    """The score an operating point reads: BenchX's fixed m counts the raw predicted tumor voxels
    (``records.fixed_rule_score``); records without that column keep ``score``."""
    return fixed_rule_score(score, records) if point == "fixed" else score


def nested_choices(val_records: pd.DataFrame | None, rule: str, score: str, n_resamples: int):
    """The validation rule's choice on each patient resample of the validation records, for the
    nested threshold bootstrap of the test CIs (None without validation records)."""
    if val_records is None or len(val_records) == 0 or rule not in RULES:
        return None
    return resampled_choices(val_records, rule, score, n_resamples)


def operating_points(recipe: DictConfig, callback: SubgroupEvaluation) -> list[OperatingPoint]:
    detection = recipe.detection
    fixed = float(detection.threshold_mm3)
    chosen = callback.operating_point
    if chosen.name != "val_chosen":
        # The callback chose on validation only when the recipe's rule is f1 or youden (the same
        # rule, records and bagging as here); otherwise the validation point is chosen by Youden.
        chosen = choose_operating_point(
            callback.records.get("val"), validation_rule(recipe), fixed, str(detection.score),
            int(detection.threshold_bootstrap), float(detection.confidence),
        )
    if chosen.fallback:
        log.warning("evaluate: validation operating point (%s): %s; using the fixed m = %g", chosen.rule, chosen.fallback, fixed)
    elif chosen.interval is not None:
        log.info("evaluate: validation operating point m = %g by %s; the resamples chose %g to %g (%g%% interval)",
                 chosen.threshold, chosen.rule, chosen.interval[0], chosen.interval[1], 100 * float(detection.confidence))
    return [OperatingPoint("fixed", fixed, "fixed"), chosen]


def log_operating_points(client, run_id: str, recipe: DictConfig, callback, stages, points) -> dict[str, pd.DataFrame]:
    """Tables, metrics and artifacts of every evaluated stage at the fixed and the validation-chosen m."""
    detection = recipe.detection
    tables = {}
    for point in points:
        client.log_metric(run_id, OPERATING_POINT_METRIC.format(name=point.name), point.threshold)
        client.set_tag(run_id, f"operating_point.{point.name}.rule", point.rule)
        if point.interval is not None:
            # How far the choice moves between patient resamples of validation: its uncertainty.
            low_key, high_key = (OPERATING_POINT_METRIC.format(name=f"{point.name}_{end}") for end in ("low", "high"))
            client.log_metric(run_id, low_key, point.interval[0])
            client.log_metric(run_id, high_key, point.interval[1])
        if point.fallback:
            client.set_tag(run_id, f"{FALLBACK_TAG}.{point.name}", f"{point.fallback}; the fixed m is used"[:5000])
        for stage in stages:
            records = callback.records.get(stage)
            if records is None:
                continue
            name = f"{stage}_{point.name}"
            score = point_score(point.name, str(detection.score), records)
            nested = None
            if stage == "test" and point.name == "val_chosen" and not point.fallback:
                nested = nested_choices(callback.records.get("val"), validation_rule(recipe), score,
                                        int(detection.bootstrap_resamples))
            table = bootstrap_subgroup_metrics(records, point.threshold, n_resamples=int(detection.bootstrap_resamples),
                                               confidence=float(detection.confidence), score=score,
                                               resample_thresholds=nested)
            # A few hundred keys a person can plot: per group only at the validation-chosen point
            # (its full table, CIs included, is logged as an MLflow table below).
            metrics = headline_metric_keys(table, name, groups=point.name == "val_chosen")
            metrics[f"{name}/threshold"] = point.threshold
            log_metrics(client, run_id, metrics)
            log_evaluation_artifacts(MlflowRunRecorder(client, run_id), name, None, table)
            tables[name] = table
    return tables
