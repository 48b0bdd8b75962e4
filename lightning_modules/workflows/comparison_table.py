"""The comparison of evaluation runs as a terminal table (BenchX table 6 shape), and its cells:
percentages, intervals and significance marks (``benchx compare`` prints it; the study report and
the replicates read the marks).

Example::

    print(format_comparison(table))
"""

from __future__ import annotations

import math
from typing import Sequence

import pandas as pd

from lightning_modules.evaluation.subgroups import support_rule_text


TEST_NAMES = {"mcnemar_exact": "McNemar", "delong": "DeLong", "bootstrap": "bootstrap",
              "bootstrap+mcnemar": "boot+McNemar"}


def format_comparison(
    comparison: pd.DataFrame, metrics: Sequence[str] = ("sensitivity", "specificity", "f1", "auc")
) -> str:
    """The comparison as a terminal table (BenchX table 6 shape), one block per run and operating
    point and one line per subgroup and metric: its patients, positives and negatives, baseline and
    other with their Wilson intervals (sensitivity, specificity), the difference with its paired
    bootstrap CI, Newcombe's interval, the p of the test that decides significance and the share of
    resamples where the difference was defined."""
    lines = []
    for (run, point), table in comparison.groupby(["run", "operating_point"], sort=False):
        threshold = f"m {table['threshold_a'].iloc[0]:g} vs {table['threshold_b'].iloc[0]:g}"
        details = [str(table["score"].iloc[0])] if "score" in table else []
        if "nested_threshold" in table and bool(table["nested_threshold"].iloc[0]):
            details.append("CIs include the threshold's uncertainty")
        detail = f"; {', '.join(details)}" if details else ""
        lines.append(f"== {comparison.attrs.get('baseline', 'baseline')} (base) vs {run} (new) at {point} "
                     f"({threshold}{detail}), in % ==")
        lines.append(f"{'subgroup':<26}{'pat':>5}{'pos':>5}{'neg':>5}  {'metric':<12}{'base [Wilson]':<21}{'new [Wilson]':<21}"
                     f"{'delta [bootstrap 95% CI]':<26}{'[Newcombe]':<17}{'p (test)':<20}{'def':>5}")
        for (attribute, group), rows in table.groupby(["attribute", "group"], sort=False):
            by_metric = rows.set_index("metric")
            first = rows.iloc[0]
            label = f"{(str(attribute) + ':' + str(group))[:25]:<26}{int(first['n_patients']):>5}" \
                    f"{int(first['positives']):>5}{int(first['negatives']):>5}"
            for metric in metrics:
                if metric not in by_metric.index:
                    continue
                row = by_metric.loc[metric]
                interval = f"{percent(row['delta'], True)} [{percent(row['ci_low'], True)}, {percent(row['ci_high'], True)}]{significance_mark(row)}"
                newcombe = f"[{percent(row.get('newcombe_low'), True)}, {percent(row.get('newcombe_high'), True)}]" \
                    if not pd.isna(row.get("newcombe_low")) else ""
                test = TEST_NAMES.get(str(row.get("test", "bootstrap")), str(row.get("test", "")))
                p_value = f"{float(row['p_value']):.3g} ({test})" if not pd.isna(row.get("p_value")) else "-"
                defined = f"{100 * float(row['defined_fraction']):.0f}%"
                lines.append(f"{label}  {metric:<12}{_with_interval(row, 'a'):<21}{_with_interval(row, 'b'):<21}"
                             f"{interval:<26}{newcombe:<17}{p_value:<20}{defined:>5}")
    lines.append("* significant: the test of the metric rejects at 5% (exact McNemar for sensitivity and "
                 "specificity, DeLong for AUC, for F1 the paired bootstrap CI and McNemar on the positives or "
                 "negatives), the subgroup has "
                 f"{support_rule_text()} and the bootstrap CI excludes 0;  ** also after Holm's correction over "
                 "the groups of its attribute;  ~ the test rejects but the subgroup is below that rule or the CI "
                 "spans 0;  - undefined;  "
                 "def: share of resamples where the difference was defined")
    lines += [f"note: {note}" for note in comparison.attrs.get("notes", [])]
    return "\n".join(lines)


def _with_interval(row, arm: str) -> str:
    """A run's value with its Wilson interval when the row has one."""
    low, high = row.get(f"{arm}_wilson_low"), row.get(f"{arm}_wilson_high")
    if low is None or pd.isna(low):
        return percent(row[arm])
    return f"{percent(row[arm])} [{percent(low)}, {percent(high)}]"


def is_flagged(value) -> bool:
    """A significance cell, also as read back from CSV: True only when it says so (an empty cell is not)."""
    return False if pd.isna(value) else value is True or str(value).strip().lower() in {"true", "1"}


def significance_mark(row) -> str:
    """``**`` significant after Holm, ``*`` significant, ``~`` the deciding test rejects but the
    subgroup is below the support rule or the interval shown beside it spans 0, else a space. Rows
    without a ``test`` column are decided by their CI; a row whose interval spans 0 is never marked
    significant, whatever its test says."""
    test = row.get("test", "bootstrap")
    low, high = float(row["ci_low"]), float(row["ci_high"])
    excludes_zero = low > 0 or high < 0
    if excludes_zero and is_flagged(row.get("significant_holm", False)):
        return "**"
    if excludes_zero and is_flagged(row["significant"]):
        return "*"
    rejects = excludes_zero
    if test == "bootstrap+mcnemar":
        rejects = rejects and float(row.get("p_mcnemar", math.nan)) < 0.05
    elif isinstance(test, str) and test != "bootstrap":
        rejects = float(row.get("p_value", math.nan)) < 0.05
    return "~" if rejects else " "


def percent(value, sign: bool = False) -> str:
    """A fraction as % with one decimal (``+`` sign when asked); ``-`` when undefined."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return "-"
    if math.isnan(value):
        return "-"
    return f"{value * 100:+.1f}" if sign else f"{value * 100:.1f}"
