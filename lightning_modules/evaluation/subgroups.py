"""Subgroups of an evaluation set: which cases belong to which group, the worst group and the gap,
and when a subgroup has enough patients to support a claim (docs/explanation/detection-and-statistics.md "Subgroups" and
"Confidence intervals and comparisons").

Pure functions of records and tables; no metric is computed here (see ``detection``).

Example::

    rows, membership = subgroup_membership(records)
    print(gaps(table, "f1"))                                   # worst/best group per attribute
    table["supported"] = supported(table["n_patients"], table["positives"], table["negatives"], "f1")
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from lightning_modules.evaluation.records import (
    ATTRIBUTES,
    CLOSED_GROUPS,
    EXCLUDED_VALUES,
    PREFERRED_ORDER,
    attribute_values,
)

OVERALL = ("overall", "all")

# The support rule (docs/explanation/detection-and-statistics.md "Confidence intervals and comparisons"): a subgroup supports a
# significance claim on a metric only with at least MIN_PATIENTS patients, and at least
# MIN_POSITIVES positive / MIN_NEGATIVES negative scans when the metric needs them.
MIN_PATIENTS = 10
MIN_POSITIVES = 5
MIN_NEGATIVES = 5
# Which scans each metric needs to be defined (and, in numbers, to be supported).
NEEDS_POSITIVES = frozenset({"sensitivity", "f1", "auc", "auc_binary"})
NEEDS_NEGATIVES = frozenset({"specificity", "auc", "auc_binary"})


def group_order(attribute: str, values: np.ndarray) -> list[str]:
    """The groups of an attribute, in report order: a closed vocabulary in full, else as recorded
    (anatomical order first where one exists, then sorted)."""
    present = sorted({v for v in values if v not in EXCLUDED_VALUES})
    if attribute in CLOSED_GROUPS:
        return list(CLOSED_GROUPS[attribute])
    preferred = [g for g in PREFERRED_ORDER.get(attribute, ()) if g in present]
    return preferred + [g for g in present if g not in preferred]


def subgroup_membership(
    records: pd.DataFrame, attributes: Sequence[str] = ATTRIBUTES
) -> tuple[pd.DataFrame, np.ndarray]:
    """The subgroup rows and which cases belong to each.

    Returns a table with columns ``attribute, group`` (``overall, all`` first, then each attribute's
    groups in :func:`group_order`) and a boolean membership matrix (n_cases x n_rows).
    ``Unknown``/empty values belong to no group of their attribute but are in ``overall``.

    Args:
        records: per-case records.
        attributes: attributes to split by, a subset of ``records.ATTRIBUTES``.
    """
    rows: list[tuple[str, str]] = [OVERALL]
    columns: list[np.ndarray] = [np.ones(len(records), dtype=bool)]
    for attribute in attributes:
        values = attribute_values(records, attribute)
        for group in group_order(attribute, values):
            rows.append((attribute, group))
            columns.append(values == group)
    table = pd.DataFrame(rows, columns=["attribute", "group"])
    return table, np.stack(columns, axis=1)


def metric_defined(metric: str, positives, negatives, values=None) -> np.ndarray:
    """Where ``metric`` is defined: it has the scans it needs (positives for sensitivity, F1 and AUC;
    negatives for specificity and AUC) and, when ``values`` are given, is not NaN there.

    F1 = 2TP/(2TP+FP+FN) has a value in a group without tumors (0 when anything is called
    positive), but it says nothing about detection there, so it counts as undefined.
    """
    positives = np.asarray(positives, dtype=float)
    negatives = np.asarray(negatives, dtype=float)
    defined = np.ones(np.broadcast(positives, negatives).shape, dtype=bool)
    if metric in NEEDS_POSITIVES:
        defined &= positives > 0
    if metric in NEEDS_NEGATIVES:
        defined &= negatives > 0
    if values is not None:
        defined &= ~np.isnan(np.asarray(values, dtype=float))
    return defined


def supported(n_patients, positives, negatives, metric: str) -> np.ndarray:
    """The support rule: at least MIN_PATIENTS patients, and MIN_POSITIVES positives and
    MIN_NEGATIVES negatives where ``metric`` needs them."""
    ok = np.asarray(n_patients, dtype=float) >= MIN_PATIENTS
    if metric in NEEDS_POSITIVES:
        ok = ok & (np.asarray(positives, dtype=float) >= MIN_POSITIVES)
    if metric in NEEDS_NEGATIVES:
        ok = ok & (np.asarray(negatives, dtype=float) >= MIN_NEGATIVES)
    return np.asarray(ok, dtype=bool)


def support_rule_text() -> str:
    """The support rule in words, for reports and help texts."""
    return (
        f"at least {MIN_PATIENTS} patients, with at least {MIN_POSITIVES} positives (sensitivity, F1, AUC) "
        f"and {MIN_NEGATIVES} negatives (specificity, AUC)"
    )


def gaps(table: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per attribute: the worst and best group on ``metric`` and the gap (best - worst).

    Only groups where the metric is defined count (:func:`metric_defined`: F1's worst group is
    never a group without tumors); an attribute with none has NaN values and empty group names.
    Ties go to the group listed first.

    Args:
        table: a subgroup table from ``detection.subgroup_metrics`` or the bootstrap.
        metric: a column of the table, e.g. ``f1``.
    """
    if metric not in table.columns:
        raise ValueError(f"metric {metric!r} is not a column of the subgroup table")
    rows = []
    subgroups = table[table["attribute"] != OVERALL[0]]
    for attribute in dict.fromkeys(subgroups["attribute"]):
        part = subgroups[subgroups["attribute"] == attribute]
        values = part[metric].astype(float).to_numpy()
        defined = np.flatnonzero(metric_defined(metric, part["positives"], part["negatives"], values))
        if len(defined) == 0:
            rows.append((attribute, metric, "", math.nan, "", math.nan, math.nan, 0))
            continue
        worst = defined[int(np.argmin(values[defined]))]
        best = defined[int(np.argmax(values[defined]))]
        groups = part["group"].to_numpy()
        rows.append(
            (attribute, metric, groups[worst], values[worst], groups[best], values[best],
             values[best] - values[worst], len(defined))
        )
    return pd.DataFrame(
        rows, columns=["attribute", "metric", "worst_group", "worst", "best_group", "best", "gap", "groups_defined"]
    )
