"""The study's pre-specified primary endpoint and the roles of its other results (docs/design.md
"The primary endpoint").

The endpoint is fixed before any training: the study logs it on its parent run first
(:func:`log_endpoint`). The comparison table then gets a ``role`` per row: ``primary`` (the one
endpoint row), ``secondary`` (every other row of the same comparison: all attributes, metrics and
operating points, Holm-adjusted together as one family) and ``schedule`` (the baseline against the
sham arm: what the augmented schedule does without synthetic tumors; its own Holm family).

Every place a reader meets a difference (the verdict, the study's printed summary, the results page
and the report's tables) shows one interval for it, :func:`shown_interval`: Newcombe's for a paired
proportion, else the paired bootstrap's. :func:`family_mark` is the significance mark of a row:
``**`` significant after its family's Holm, ``*`` significant by its own test only, ``~`` the test
rejects below the support rule, none when the shown interval spans 0
(docs/design.md "Reading the verdict").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

ENDPOINT_TAG = "primary_endpoint"
ALPHA = 0.05
TEST_NAMES = {"mcnemar_exact": "exact McNemar test", "delong": "DeLong test", "bootstrap": "paired bootstrap",
              "bootstrap+mcnemar": "paired bootstrap with McNemar"}


PAIRED_PROPORTIONS = ("sensitivity", "specificity")


def shown_interval(row) -> tuple[str, float, float]:
    """(name, low, high): the one 95% interval a reader is shown for a row's difference: Newcombe's
    for a paired proportion (it holds at small counts, where the percentile bootstrap collapses to
    [0, 0] at 0 of 11), else the paired bootstrap's. A sensitivity or specificity row keeps
    Newcombe's name even where it is undefined (no scan to judge), so one column of a table holds
    one kind of interval; a row without a metric is judged by the interval it carries
    (docs/design.md "Confidence intervals and comparisons"). The other intervals stay in the CSV."""
    low, high = row.get("newcombe_low"), row.get("newcombe_high")
    if low is not None and high is not None:
        metric = row.get("metric")
        if metric in PAIRED_PROPORTIONS or (metric is None and not (pd.isna(low) or pd.isna(high))):
            return "Newcombe", float(low), float(high)
    return "bootstrap", float(row["ci_low"]), float(row["ci_high"])


def interval_excludes_zero(row) -> bool:
    _, low, high = shown_interval(row)
    return low > 0 or high < 0


def _flag(value) -> bool:
    return str(value).strip().lower() in ("true", "1", "1.0") if isinstance(value, str) else bool(value) and value == value


def family_mark(row) -> str:
    """``**``, ``*``, ``~`` or "" for a labelled row (:func:`label_results`): ``**`` significant after
    Holm over its family, ``*`` significant by its own test only, ``~`` the test rejects at 5% but the
    subgroup is below the support rule. A row whose shown interval spans 0 gets no mark."""
    if not interval_excludes_zero(row):
        return ""
    if _flag(row.get("significant_family", False)):
        return "**"
    if _flag(row.get("significant", False)):
        return "*"
    p_value = row.get("p_value")
    rejects = p_value is not None and not pd.isna(p_value) and float(p_value) < ALPHA
    return "~" if rejects and not _flag(row.get("supported", True)) else ""


@dataclass(frozen=True)
class PrimaryEndpoint:
    """One row of the comparison: ``metric`` in ``attribute:group`` at ``operating_point``, ``arm`` minus ``reference``."""

    arm: str = "synthx"
    reference: str = "sham"
    metric: str = "sensitivity"
    attribute: str = "phase"
    group: str = "arterial"  # the phantom's scarcity gap (docs/design.md "The phantom cohort")
    operating_point: str = "matched_specificity"
    score: str = "volume"
    test_set: str = "locked"

    def describe(self) -> str:
        return (f"{self.metric} in {self.attribute}:{self.group} at {self.operating_point.replace('_', ' ')} "
                f"({self.score} score, {self.test_set} test cohort), {self.arm} minus {self.reference}")

    def params(self) -> dict[str, str]:
        return {f"endpoint.{key}": str(value) for key, value in asdict(self).items()}

    @classmethod
    def from_params(cls, params: dict[str, str]) -> "PrimaryEndpoint":
        """The endpoint a study logged (:func:`log_endpoint`); the default one where it logged none."""
        logged = {key: params[f"endpoint.{key}"] for key in asdict(cls()) if f"endpoint.{key}" in params}
        return cls(**logged)

    def mask(self, table: pd.DataFrame) -> pd.Series:
        return ((table["run"] == self.arm) & (table["metric"] == self.metric) & (table["attribute"] == self.attribute)
                & (table["group"].astype(str) == self.group) & (table["operating_point"] == self.operating_point))


def log_endpoint(client, run_id: str, endpoint: PrimaryEndpoint) -> None:
    """Put the endpoint on the study's parent run (params and a tag); done before any training."""
    for key, value in endpoint.params().items():
        client.log_param(run_id, key, value)
    client.set_tag(run_id, ENDPOINT_TAG, endpoint.describe())


def label_results(table: pd.DataFrame, endpoint: PrimaryEndpoint, alpha: float = ALPHA) -> pd.DataFrame:
    """The comparison with ``role``, ``p_family`` (Holm within the role's family) and ``significant_family``.

    The primary row keeps its own p-value (a family of one). Rows that are not supported (too few
    patients, positives or negatives) or have no p-value are not tests and get no ``p_family``.
    ``significant_family``: significant by its own test, ``p_family`` below ``alpha``, and its shown
    interval (:func:`shown_interval`) excludes 0.
    """
    from lightning_modules.evaluation.multiplicity import holm_adjust

    table = table.copy()
    primary = endpoint.mask(table)
    table["role"] = np.where(primary, "primary", np.where(table["run"] == endpoint.arm, "secondary", "schedule"))
    tested = pd.to_numeric(table["p_value"], errors="coerce").where(table["supported"].astype(bool))
    table["p_family"] = np.nan
    for role in ("secondary", "schedule"):
        rows = table["role"] == role
        table.loc[rows, "p_family"] = holm_adjust(tested[rows].to_numpy())
    table.loc[primary, "p_family"] = tested[primary]
    excludes = table.apply(interval_excludes_zero, axis=1).astype(bool) if len(table) else False
    table["significant_family"] = table["significant"].map(_flag).astype(bool) & (table["p_family"] < alpha) & excludes
    return table


def family_marks(table: pd.DataFrame, endpoint: PrimaryEndpoint) -> pd.Series:
    """Each row's :func:`family_mark` once the table is labelled (:func:`label_results`), by row index."""
    labelled = table if "significant_family" in table.columns else label_results(table, endpoint)
    return pd.Series([family_mark(row) for _, row in labelled.iterrows()], index=table.index, dtype=object)


def difference_text(row, scale: float = 100.0, unit: str = " points") -> str:
    """``+22.2 points, Newcombe 95% CI +0.2 to +45.2``: a row's difference with its shown interval."""
    name, low, high = shown_interval(row)
    return f"{scale * float(row['delta']):+.1f}{unit}, {name} 95% CI {scale * low:+.1f} to {scale * high:+.1f}"


def decision_text(row, p_column: str = "p_value") -> str:
    """What decided the row, in words: its test, its p, and whether that makes it significant."""
    test = TEST_NAMES.get(str(row.get("test", "")), str(row.get("test", "")) or "test")
    p_value = row.get(p_column)
    if p_value is None or pd.isna(p_value):
        return f"no {test} p (not a test: the subgroup is below the support rule or the difference is undefined)"
    if not _flag(row.get("supported", True)):
        return f"{test} p = {float(p_value):.3g}, but the subgroup is below the support rule: not a test"
    word = "significant" if _flag(row.get("significant_family", False)) else "not significant"
    reason = "" if word == "significant" or interval_excludes_zero(row) or float(p_value) >= ALPHA else \
        " (the shown interval spans 0)"
    return f"{test} p = {float(p_value):.3g}{' (Holm over its family)' if p_column == 'p_family' else ''}: {word} at 5%{reason}"


def endpoint_summary(table: pd.DataFrame, endpoint: PrimaryEndpoint) -> str:
    """The primary result in one line, then the secondary and schedule results that survive their
    family's Holm, each with its shown interval (:func:`shown_interval`) and what decided it."""
    labelled = table if "role" in table.columns else label_results(table, endpoint)
    lines = [f"Primary endpoint (pre-specified): {endpoint.describe()}"]
    row = labelled[labelled["role"] == "primary"]
    if row.empty:
        lines.append("  not in the comparison (the subgroup or operating point is missing)")
    else:
        r = row.iloc[0]
        lines.append(f"  {100 * r['a']:.1f}% -> {100 * r['b']:.1f}%: {difference_text(r)}; {decision_text(r)}")
    for role, title in (("secondary", "Secondary (Holm over all"), ("schedule", "Schedule alone, baseline minus sham (Holm over all")):
        rows = labelled[labelled["role"] == role]
        found = rows[rows["significant_family"].astype(bool)]
        lines.append(f"{title} {int(rows['p_family'].notna().sum())} tested rows): {len(found)} significant")
        for _, r in found.iterrows():
            lines.append(f"  {r['metric']} {r['attribute']}:{r['group']} at {r['operating_point']}: {difference_text(r)}; "
                         f"{decision_text(r, 'p_family')}")
    return "\n".join(lines)
