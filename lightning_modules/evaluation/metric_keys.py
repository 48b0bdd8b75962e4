"""MLflow metric keys of a subgroup table (docs/explanation/architecture.md "MLflow runs and keys").

Keys are ``<stage>/<metric>/<attribute>/<group>`` (``<stage>/<metric>/overall`` for the overall row),
``<stage>/<metric>_ci_low/...`` and ``_ci_high`` when the table has CIs, and per attribute
``<stage>/<metric>_gap/<attribute>`` and ``<stage>/<metric>_worst/<attribute>``. Pure: the callback
and the evaluation runs log what this returns.

Example::

    metrics = mlflow_metric_keys(table, "test")     # {"test/f1/phase/venous": 0.71, ...}
"""

from __future__ import annotations

import math
import re

import pandas as pd

from lightning_modules.evaluation.detection import COUNT_COLUMNS, RATE_METRICS
from lightning_modules.evaluation.subgroups import OVERALL, gaps

GAP_METRICS = ("f1", "sensitivity", "specificity", "auc_binary")
_MLFLOW_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. :]")


def mlflow_safe(name: str) -> str:
    """A name reduced to MLflow's key characters; ``/`` is replaced too, as it separates key levels."""
    safe = _MLFLOW_UNSAFE.sub("_", str(name).replace("/", "_")).strip()
    if not safe:
        raise ValueError(f"name {name!r} has no characters MLflow allows in a metric key")
    return safe


def check_stage(stage: str) -> str:
    """A stage name usable as the first key level (letters, digits, '_', '-', '.', ':' or spaces)."""
    if not stage or _MLFLOW_UNSAFE.search(stage) or "/" in stage:
        raise ValueError(f"stage {stage!r} must be a non-empty name of letters, digits, '_', '-', '.', ':' or spaces")
    return stage


def _row_suffix(attribute: str, group: str) -> str:
    if (attribute, group) == OVERALL:
        return "overall"
    return f"{mlflow_safe(attribute)}/{mlflow_safe(group)}"


def mlflow_metric_keys(table: pd.DataFrame, stage: str, ci: bool = True) -> dict[str, float]:
    """Flatten a subgroup table into MLflow metrics (see the module docstring).

    Undefined (NaN) values are left out; counts (and ``n_patients``) are always present; the gap and
    worst group are over the groups where the metric is defined (``subgroups.gaps``).

    Args:
        table: a subgroup table.
        stage: ``val``, ``test``, ``test_fixed``, ...
        ci: include CI bounds when the table has them.
    """
    check_stage(stage)
    metrics: dict[str, float] = {}
    origin: dict[str, tuple[str, str]] = {}
    count_columns = [c for c in ("n_patients", *COUNT_COLUMNS) if c in table.columns]
    value_columns = [m for m in RATE_METRICS if m in table.columns]
    if ci:
        value_columns += [c for c in (f"{m}_ci_{side}" for m in RATE_METRICS for side in ("low", "high")) if c in table.columns]
    for row in table.to_dict("records"):
        attribute, group = str(row["attribute"]), str(row["group"])
        suffix = _row_suffix(attribute, group)
        probe = f"{stage}/n/{suffix}"
        if probe in origin and origin[probe] != (attribute, group):
            raise ValueError(
                f"groups {origin[probe]} and {(attribute, group)} map to the same MLflow key {probe!r}; rename one"
            )
        origin[probe] = (attribute, group)
        for name in count_columns:
            metrics[f"{stage}/{name}/{suffix}"] = float(row[name])
        for name in value_columns:
            value = float(row[name])
            if not math.isnan(value):
                metrics[f"{stage}/{name}/{suffix}"] = value
    for metric in GAP_METRICS:
        if metric not in table.columns:
            continue
        for gap in gaps(table, metric).itertuples(index=False):
            if not math.isnan(gap.gap):
                attribute = mlflow_safe(gap.attribute)
                metrics[f"{stage}/{metric}_gap/{attribute}"] = float(gap.gap)
                metrics[f"{stage}/{metric}_worst/{attribute}"] = float(gap.worst)
    return metrics


HEADLINE_RATES = ("sensitivity", "specificity", "auc", "f1")
HEADLINE_COUNTS = ("n_patients", "n", "positives", "negatives")


def headline_metric_keys(table: pd.DataFrame, stage: str, groups: bool = True) -> dict[str, float]:
    """The few keys a person plots in the MLflow UI: overall counts, sensitivity, specificity, AUC
    and F1 overall and (``groups``) per group, and per attribute the worst group and the gap.

    The full table (CIs, counts per group) goes in as an MLflow table beside them, not as metrics.
    """
    full = mlflow_metric_keys(table, stage, ci=False)
    keep = {f"{stage}/{name}/overall" for name in (*HEADLINE_COUNTS, *HEADLINE_RATES)}
    rates = tuple(f"{stage}/{name}/" for name in HEADLINE_RATES)
    summaries = tuple(f"{stage}/{name}_{kind}/" for name in HEADLINE_RATES for kind in ("gap", "worst"))
    return {key: value for key, value in full.items()
            if key in keep or (groups and (key.startswith(rates) or key.startswith(summaries)))}
