"""The study's pre-specified primary endpoint and the roles of its other results (docs/design.md
"The primary endpoint").

The endpoint is fixed before any training: the study logs it on its parent run first
(:func:`log_endpoint`). The comparison table then gets a ``role`` per row: ``primary`` (the one
endpoint row), ``secondary`` (every other row of the same comparison: all attributes, metrics and
operating points, Holm-adjusted together as one family) and ``schedule`` (the baseline against the
sham arm: what the augmented schedule does without synthetic tumors; its own Holm family).

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
SUBGROUP_POINT = "subgroup_matched_specificity"
# What each version of the endpoint changed from the fields' defaults (the operating point).
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
    group: str = "arterial"  # the phantom's scarcity gap (docs/design.md "The phantom cohort")
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

    def describe(self) -> str:
        return (f"{self.metric} in {self.subgroup} at {self.point_label()} "
                f"({self.score} score, {self.test_set} test cohort), {self.arm} minus {self.reference} "
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

        At ``subgroup_matched_specificity`` only rows matched within the endpoint's own subgroup
        count (column ``matched_subgroup``): thresholds matched within another subgroup are not its.
        """
        rows = ((table["run"] == self.arm) & (table["metric"] == (metric or self.metric))
                & (table["attribute"] == self.attribute) & (table["group"].astype(str) == self.group)
                & (table["operating_point"] == self.operating_point))
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


def label_results(table: pd.DataFrame, endpoint: PrimaryEndpoint, alpha: float = 0.05) -> pd.DataFrame:
    """The comparison with ``role``, ``p_family`` (Holm within the role's family) and ``significant_family``.

    The primary row keeps its own p-value (a family of one). Rows that are not supported (too few
    patients, positives or negatives) or have no p-value are not tests and get no ``p_family``.
    """
    from lightning_modules.evaluation.bootstrap import holm_adjust

    table = table.copy()
    primary = endpoint.mask(table)
    table["role"] = np.where(primary, "primary", np.where(table["run"] == endpoint.arm, "secondary", "schedule"))
    tested = pd.to_numeric(table["p_value"], errors="coerce").where(table["supported"].astype(bool))
    table["p_family"] = np.nan
    for role in ("secondary", "schedule"):
        rows = table["role"] == role
        table.loc[rows, "p_family"] = holm_adjust(tested[rows].to_numpy())
    table.loc[primary, "p_family"] = tested[primary]
    table["significant_family"] = table["significant"].astype(bool) & (table["p_family"] < alpha)
    return table


TEST_LABELS = {"mcnemar_exact": "exact McNemar", "delong": "DeLong"}


def _row_text(r) -> str:
    p_value = r.get("p_value")
    test = TEST_LABELS.get(str(r.get("test", "")), str(r.get("test", "")))
    tested = f"{test} p = {float(p_value):.3g}" if pd.notna(p_value) else f"{test} p undefined"
    return f"{r['a']:.3f} -> {r['b']:.3f}, {r['delta']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}], {tested}"


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
    earlier versions' rows, then the secondary and schedule results that survive their family's Holm."""
    labelled = table if "role" in table.columns else label_results(table, endpoint)
    lines = [f"Primary endpoint (pre-specified): {endpoint.describe()}"]
    row = labelled[labelled["role"] == "primary"]
    if row.empty:
        lines.append("  not in the comparison (the subgroup or operating point is missing)")
    else:
        r = row.iloc[0]
        lines.append(f"  {r['a']:.3f} -> {r['b']:.3f}, {r['delta']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}], "
                     f"p = {r['p_family']:.3g}, supported: {bool(r['supported'])}, significant: {bool(r['significant_family'])}")
    lines.extend(_beside_lines(labelled, endpoint))
    for role, title in (("secondary", "Secondary (Holm over all"), ("schedule", "Schedule alone, baseline minus sham (Holm over all")):
        rows = labelled[labelled["role"] == role]
        found = rows[rows["significant_family"]]
        lines.append(f"{title} {int(rows['p_family'].notna().sum())} tested rows): {len(found)} significant")
        for r in found.itertuples():
            lines.append(f"  {r.metric} {r.attribute}:{r.group} at {r.operating_point}: {r.delta:+.3f} "
                         f"[{r.ci_low:+.3f}, {r.ci_high:+.3f}], p_holm = {r.p_family:.3g}")
    return "\n".join(lines)
