"""The study's pre-specified primary endpoint and the roles of its other results (docs/explanation/study.md
"The primary endpoint").

The endpoint is fixed before any training: the study logs it on its parent run first
(:func:`log_endpoint`). The comparison table then gets a ``role`` per row: ``primary`` (the one
endpoint row), ``secondary`` (every other row of the same comparison: all attributes, metrics and
operating points, Holm-adjusted together as one family), ``schedule`` (the baseline against the
sham arm: what the augmented schedule does without synthetic tumors; its own Holm family) and
``placement`` (the copy-paste arm against the sham arm: what SynthX's canvases and placement do
with real tumors; its own Holm family).

Every place a reader meets a difference (the verdict, the study's printed summary, the results page
and the report's tables) shows one interval for it, :func:`shown_interval`: Newcombe's for a paired
proportion, else the paired bootstrap's. :func:`family_mark` is the significance mark of a row:
``**`` significant after its family's Holm, ``*`` significant by its own test only, ``~`` the test
rejects below the support rule, none when the shown interval spans 0
(docs/explanation/detection-and-statistics.md "Reading the verdict").

The endpoint has versions (:data:`ENDPOINT_VERSIONS`). Version 2, the default, judges the
subgroup's sensitivity at ``subgroup_matched_specificity``: each arm's m is matched on validation
so that its specificity within the endpoint's subgroup equals the reference's there, because a
sensitivity difference says nothing when the subgroup's specificities differ. Version 1 (the same
row at overall ``matched_specificity``) stays in the table as a secondary row, and a study logged
before versions existed reads back as version 1 (:meth:`PrimaryEndpoint.from_params`).
:func:`endpoint_rows` gives the subgroup's sensitivity, specificity and AUC at the endpoint's
thresholds with their tests (exact McNemar, DeLong), to be read together.

Example::

    endpoint = PrimaryEndpoint()                          # version 2
    table, _ = compare(runs, "test", subgroup=endpoint.subgroup)
    print(endpoint_rows(table, endpoint)[["metric", "a", "b", "delta", "test", "p_value"]])
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
    (docs/explanation/detection-and-statistics.md "Confidence intervals and comparisons"). The other intervals stay in the CSV."""
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
SUBGROUP_POINT = "subgroup_matched_specificity"
# What each version of the endpoint changed from the fields' defaults (the operating point).
# Where the endpoint is judged: the locked test cohort (the study's default) or, for a study run with
# --locked-cases 0, the split's own test set.
TEST_SET_LABELS = {"locked": "locked test cohort", "split": "split's test set"}
ENDPOINT_VERSIONS = {1: {"operating_point": "matched_specificity"}, 2: {"operating_point": SUBGROUP_POINT}}
CURRENT_VERSION = 2
# The subgroup's metrics read together with the endpoint's: the same thresholds, each its own test.
ENDPOINT_METRICS = ("sensitivity", "specificity", "auc")


@dataclass(frozen=True)
class PrimaryEndpoint:
    """One row of the comparison: ``metric`` in ``attribute:group`` at ``operating_point``, ``arm`` minus ``reference``.

    ``version`` 2 (the default) is set at ``subgroup_matched_specificity``, version 1 at overall
    ``matched_specificity`` (:meth:`of_version`).
    """

    arm: str = "synthx"
    reference: str = "sham"
    metric: str = "sensitivity"
    attribute: str = "phase"
    group: str = "arterial"  # the phantom's scarcity gap (docs/explanation/data.md "The phantom cohort")
    operating_point: str = SUBGROUP_POINT
    score: str = "volume"
    test_set: str = "locked"
    version: int = CURRENT_VERSION

    @classmethod
    def of_version(cls, version: int, **fields) -> "PrimaryEndpoint":
        """The endpoint as version ``version`` defined it, with ``fields`` overriding."""
        if int(version) not in ENDPOINT_VERSIONS:
            raise ValueError(f"unknown endpoint version {version!r}: expected one of {sorted(ENDPOINT_VERSIONS)}")
        return cls(**{**ENDPOINT_VERSIONS[int(version)], **fields, "version": int(version)})

    @property
    def subgroup(self) -> str:
        """``attribute:group``, as ``compare(..., subgroup=...)`` takes it."""
        return f"{self.attribute}:{self.group}"

    def point_label(self) -> str:
        if self.operating_point == SUBGROUP_POINT:
            return f"specificity matched within {self.subgroup}"
        return self.operating_point.replace("_", " ")

    def test_set_label(self) -> str:
        return TEST_SET_LABELS.get(self.test_set, f"{self.test_set} test set")

    def describe(self) -> str:
        return (f"{self.metric} in {self.subgroup} at {self.point_label()} "
                f"({self.score} score, {self.test_set_label()}), {self.arm} minus {self.reference} "
                f"[endpoint version {self.version}]")

    def params(self) -> dict[str, str]:
        return {f"endpoint.{key}": str(value) for key, value in asdict(self).items()}

    @classmethod
    def from_params(cls, params: dict[str, str]) -> "PrimaryEndpoint":
        """The endpoint a study logged (:func:`log_endpoint`); the default one where it logged none.

        A study logged before the endpoint had versions (endpoint params without ``endpoint.version``)
        reads back as version 1 with its logged fields.
        """
        fields = [key for key in asdict(cls()) if key != "version"]
        logged = {key: params[f"endpoint.{key}"] for key in fields if f"endpoint.{key}" in params}
        if "endpoint.version" in params:
            return cls.of_version(int(params["endpoint.version"]), **logged)
        return cls.of_version(1, **logged) if logged else cls()

    def earlier(self) -> list["PrimaryEndpoint"]:
        """The same row as each earlier version defined it: secondary rows printed beside the endpoint."""
        kept = {key: value for key, value in asdict(self).items() if key not in ("version", *ENDPOINT_VERSIONS[1])}
        return [PrimaryEndpoint.of_version(v, **kept) for v in sorted(ENDPOINT_VERSIONS) if v < self.version]

    def mask(self, table: pd.DataFrame, metric: str | None = None) -> pd.Series:
        """The table's rows of this endpoint (of ``metric`` instead of the endpoint's when given).

        Rows against another reference (a ``reference`` column) are not the endpoint's. At
        ``subgroup_matched_specificity`` only rows matched within the endpoint's own subgroup
        count (column ``matched_subgroup``): thresholds matched within another subgroup are not its.
        """
        rows = ((table["run"] == self.arm) & (table["metric"] == (metric or self.metric))
                & (table["attribute"] == self.attribute) & (table["group"].astype(str) == self.group)
                & (table["operating_point"] == self.operating_point))
        if "reference" in table.columns:  # SynthX minus sham, not SynthX minus the baseline
            rows &= table["reference"] == self.reference
        if self.operating_point == SUBGROUP_POINT and "matched_subgroup" in table.columns:
            rows &= table["matched_subgroup"].astype(str) == self.subgroup
        return rows


def endpoint_rows(table: pd.DataFrame, endpoint: PrimaryEndpoint) -> pd.DataFrame:
    """The endpoint's subgroup rows, ``arm`` minus ``reference`` at its operating point: sensitivity,
    specificity and AUC (:data:`ENDPOINT_METRICS`, in that order; a metric the table lacks is left
    out), each with its own test (exact McNemar on the subgroup's positive or healthy scans,
    DeLong for AUC). All come from one pair of thresholds; a sensitivity difference means little
    when the specificity row beside it differs too.

    Raises:
        ValueError: the rows hold more than one pair of thresholds (not one comparison).
    """
    rows = table[pd.concat([endpoint.mask(table, metric) for metric in ENDPOINT_METRICS], axis=1).any(axis=1)]
    rows = rows.set_index("metric").reindex([m for m in ENDPOINT_METRICS if m in set(rows["metric"])]).reset_index()
    if {"threshold_a", "threshold_b"} <= set(rows.columns) and len(rows.drop_duplicates(["threshold_a", "threshold_b"])) > 1:
        raise ValueError(f"the endpoint rows of {endpoint.subgroup} at {endpoint.operating_point} hold several thresholds")
    return rows


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
    roles = np.where(table["run"] == endpoint.arm, "secondary", np.where(table["run"] == "copy_paste", "placement", "schedule"))
    table["role"] = np.where(primary, "primary", roles)
    tested = pd.to_numeric(table["p_value"], errors="coerce").where(table["supported"].astype(bool))
    table["p_family"] = np.nan
    for role in ("secondary", "schedule", "placement"):
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


def _row_text(r) -> str:
    """A row's two values, its difference with the shown interval, and what decided it."""
    return f"{100 * r['a']:.1f}% -> {100 * r['b']:.1f}%: {difference_text(r)}; {decision_text(r)}"


def _beside_lines(table: pd.DataFrame, endpoint: PrimaryEndpoint) -> list[str]:
    """The subgroup's specificity and AUC at the endpoint's thresholds, then each earlier version's row."""
    lines = []
    rows = endpoint_rows(table, endpoint)
    beside = rows[rows["metric"] != endpoint.metric]
    if not beside.empty:
        thresholds = ""
        if {"threshold_a", "threshold_b"} <= set(rows.columns):
            thresholds = f" (m {rows['threshold_a'].iloc[0]:g} vs {rows['threshold_b'].iloc[0]:g})"
        lines.append(f"  at the same thresholds in {endpoint.subgroup}{thresholds}:")
        lines.extend(f"    {r['metric']}: {_row_text(r)}" for _, r in beside.iterrows())
    for earlier in endpoint.earlier():
        row = endpoint_rows(table, earlier)
        row = row[row["metric"] == earlier.metric]
        if not row.empty:
            lines.append(f"Endpoint version {earlier.version}, now secondary ({earlier.metric} at {earlier.point_label()}): "
                         f"{_row_text(row.iloc[0])}")
    return lines


def endpoint_summary(table: pd.DataFrame, endpoint: PrimaryEndpoint) -> str:
    """The primary result in one line, the subgroup's specificity and AUC at its thresholds, the
    earlier versions' rows, then the secondary and schedule results that survive their family's Holm,
    each with its shown interval (:func:`shown_interval`) and what decided it."""
    labelled = table if "role" in table.columns else label_results(table, endpoint)
    lines = [f"Primary endpoint (pre-specified): {endpoint.describe()}"]
    row = labelled[labelled["role"] == "primary"]
    if row.empty:
        lines.append("  not in the comparison (the subgroup or operating point is missing)")
    else:
        r = row.iloc[0]
        lines.append(f"  {_row_text(r)}")
    lines.extend(_beside_lines(labelled, endpoint))
    for role, title in (("secondary", "Secondary (Holm over all"), ("schedule", "Schedule alone, baseline minus sham (Holm over all")):
        rows = labelled[labelled["role"] == role]
        found = rows[rows["significant_family"].astype(bool)]
        lines.append(f"{title} {int(rows['p_family'].notna().sum())} tested rows): {len(found)} significant")
        for _, r in found.iterrows():
            lines.append(f"  {r['metric']} {r['attribute']}:{r['group']} at {r['operating_point']}: {difference_text(r)}; "
                         f"{decision_text(r, 'p_family')}")
    return "\n".join(lines)
