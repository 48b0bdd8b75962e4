"""Replicated studies side by side: does a subgroup difference hold across seeds, hosts or ratios?

A study's paired bootstrap interval resamples the test patients with both trained models held
fixed, so it does not see how much a second training of the same recipe would differ
(docs/design.md "Confidence intervals and comparisons"). This module reads the test comparison
table of several finished studies (one parent run each, e.g. one per seed) and lines up, per
subgroup and metric at one operating point, each study's difference with its CI and mark, the
mean, the range, and how many studies found it significantly up or down.

The studies must have been evaluated on the same test set: every group's patients, positives and
negatives must agree, or the studies are refused with the first group that differs.

Example::

    benchx replicates <parent seed 0> <parent seed 1> <parent seed 2> --metric auc --attribute phase
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

import pandas as pd

from lightning_modules.evaluation.runs import is_flagged, significance_mark
from synthx.report import load_study

OPERATING_POINTS = ("fixed", "val_chosen", "matched_specificity")
COUNT_COLUMNS = ("n_patients", "positives", "negatives")
KEY = ["attribute", "group", "metric"]


class ReplicateError(ValueError):
    """Studies that cannot be lined up (not finished, not a study, or evaluated on different sets)."""


def study_comparison(run_id: str, uri: str) -> pd.DataFrame:
    """The test comparison table of one finished study, with its ``study`` run id, ``seed`` and ``ratio``."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            study = load_study(run_id, uri, Path(folder))
        except ValueError as error:  # ReportError: not a study's parent run
            raise ReplicateError(str(error)) from error
        missing = [step for step in ("augmented", "compare") if step not in study.steps]
        if missing:
            raise ReplicateError(f"study {run_id} has no {' or '.join(missing)} step: it did not finish; "
                                 f"resume it with the same `benchx study` command")
        table = study.csv("compare", "comparison/test_comparison.csv")
        augmented = study.run("augmented")
    # The study's comparison also holds baseline minus sham (the schedule alone): replicates line up SynthX's.
    table = table[table["run"] == "synthx"].reset_index(drop=True) if "run" in table.columns else table
    table.insert(0, "study", run_id)
    table.insert(1, "seed", augmented.data.params.get("seed", ""))
    table.insert(2, "ratio", augmented.data.tags.get("synthx_ratio", ""))
    return table


def _labels(tables: Sequence[pd.DataFrame]) -> list[str]:
    """A column label per study: its seed and ratio, made unique with the run id when two agree."""
    labels = [f"seed {t['seed'].iloc[0]} r {t['ratio'].iloc[0]}" for t in tables]
    return [label if labels.count(label) == 1 else f"{label} ({t['study'].iloc[0][:8]})"
            for label, t in zip(labels, tables)]


def replicate_table(tables: Sequence[pd.DataFrame], operating_point: str = "fixed",
                    metrics: Sequence[str] = ("auc", "sensitivity", "specificity"),
                    attributes: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per (attribute, group, metric): each study's difference, and the summary across them.

    Columns: the key, the group's counts, ``studies``, ``mean_delta``, ``min_delta``, ``max_delta``,
    ``significant_up`` / ``significant_down`` (studies whose difference is significant, by CI and
    support, in that direction), ``same_sign`` (every study's difference on the same side of 0),
    then per study ``<label>`` (the difference) and ``<label> ci`` (its interval and mark, as text).
    """
    if len(tables) < 2:
        raise ReplicateError("give at least two studies to line up")
    if operating_point not in OPERATING_POINTS:
        raise ReplicateError(f"operating point must be one of {', '.join(OPERATING_POINTS)} (got {operating_point!r})")
    labels = _labels(tables)
    parts = []
    for label, table in zip(labels, tables):
        rows = table[(table["operating_point"] == operating_point) & table["metric"].isin(list(metrics))]
        if attributes:
            rows = rows[rows["attribute"].isin(list(attributes))]
        if rows.empty:
            raise ReplicateError(f"study {table['study'].iloc[0]} has no rows for {operating_point}, "
                                 f"metrics {', '.join(metrics)}")
        parts.append(rows.set_index(KEY))
    first = parts[0]
    for label, part, table in zip(labels[1:], parts[1:], tables[1:]):
        if set(part.index) != set(first.index):
            extra = sorted(set(part.index) ^ set(first.index))[0]
            raise ReplicateError(f"study {table['study'].iloc[0]} ({label}) and study {tables[0]['study'].iloc[0]} "
                                 f"do not have the same subgroups: {' / '.join(map(str, extra))} is in one only")
        counts = part.loc[first.index, list(COUNT_COLUMNS)]
        differ = (counts != first[list(COUNT_COLUMNS)]).any(axis=1)
        if differ.any():
            key = differ[differ].index[0]
            raise ReplicateError(
                f"study {table['study'].iloc[0]} ({label}) was evaluated on another set than study "
                f"{tables[0]['study'].iloc[0]}: {' / '.join(map(str, key))} has "
                f"{dict(counts.loc[key])} against {dict(first.loc[key, list(COUNT_COLUMNS)])}")

    out = first[list(COUNT_COLUMNS)].copy()
    deltas = pd.concat([part.loc[first.index, "delta"].rename(label) for label, part in zip(labels, parts)], axis=1)
    significant = pd.concat([part.loc[first.index, "significant"].map(is_flagged).rename(label)
                             for label, part in zip(labels, parts)], axis=1)
    out["studies"] = len(tables)
    out["mean_delta"] = deltas.mean(axis=1)
    out["min_delta"] = deltas.min(axis=1)
    out["max_delta"] = deltas.max(axis=1)
    out["significant_up"] = (significant & (deltas > 0)).sum(axis=1)
    out["significant_down"] = (significant & (deltas < 0)).sum(axis=1)
    out["same_sign"] = (deltas > 0).all(axis=1) | (deltas < 0).all(axis=1)
    for label, part in zip(labels, parts):
        rows = part.loc[first.index]
        out[label] = rows["delta"]
        out[f"{label} ci"] = [_interval(row) for _, row in rows.iterrows()]
    return out.reset_index()


def _interval(row: pd.Series) -> str:
    if pd.isna(row["ci_low"]) or pd.isna(row["ci_high"]):
        return "[-, -]"
    return f"[{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]{significance_mark(row)}".rstrip()


def format_replicates(table: pd.DataFrame) -> str:
    """A plain-text table: per subgroup and metric, each study's difference [CI] and the summary."""
    labels = [c for c in table.columns if f"{c} ci" in table.columns]
    header = ["subgroup", "metric", "pat", "pos", "neg", *labels, "mean", "sig. up/down", "same sign"]
    lines = []
    for row in table.to_dict("records"):
        cells = [f"{row['attribute']}:{row['group']}", row["metric"], str(row["n_patients"]), str(row["positives"]),
                 str(row["negatives"])]
        cells += ["-" if pd.isna(row[label]) else f"{row[label]:+.3f} {row[label + ' ci']}" for label in labels]
        cells += ["-" if pd.isna(row["mean_delta"]) else f"{row['mean_delta']:+.3f}",
                  f"{row['significant_up']}/{row['significant_down']}", "yes" if row["same_sign"] else "no"]
        lines.append(cells)
    widths = [max(len(str(c)) for c in column) for column in zip(header, *lines)]
    shown = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in [header, *lines])
    notes = ["* significant in that study (CI excludes 0 and the subgroup supports it); ** also after Holm;",
             "~ the CI excludes 0 but the subgroup is below the support rule.",
             "sig. up/down: studies with a significant difference above / below 0. The intervals are each",
             "study's paired test-set bootstrap; the spread between studies is the training variance they omit."]
    return "\n".join([shown, "", *notes])
