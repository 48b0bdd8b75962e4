"""The study's pre-specified primary endpoint and the roles of its other results (docs/design.md
"The primary endpoint").

The endpoint is fixed before any training: the study logs it on its parent run first
(:func:`log_endpoint`). The comparison table then gets a ``role`` per row: ``primary`` (the one
endpoint row), ``secondary`` (every other row of the same comparison: all attributes, metrics and
operating points, Holm-adjusted together as one family), ``schedule`` (the baseline against the
sham arm: what the augmented schedule does without synthetic tumors; its own Holm family) and
``placement`` (the copy-paste arm against the sham arm: what SynthX's canvases and placement do
with real tumors; its own Holm family).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

ENDPOINT_TAG = "primary_endpoint"


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


def label_results(table: pd.DataFrame, endpoint: PrimaryEndpoint, alpha: float = 0.05) -> pd.DataFrame:
    """The comparison with ``role``, ``p_family`` (Holm within the role's family) and ``significant_family``.

    The primary row keeps its own p-value (a family of one). Rows that are not supported (too few
    patients, positives or negatives) or have no p-value are not tests and get no ``p_family``.
    """
    from lightning_modules.evaluation.bootstrap import holm_adjust

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
    table["significant_family"] = table["significant"].astype(bool) & (table["p_family"] < alpha)
    return table


def endpoint_summary(table: pd.DataFrame, endpoint: PrimaryEndpoint) -> str:
    """The primary result in one line, then the secondary and schedule results that survive their family's Holm."""
    labelled = table if "role" in table.columns else label_results(table, endpoint)
    lines = [f"Primary endpoint (pre-specified): {endpoint.describe()}"]
    row = labelled[labelled["role"] == "primary"]
    if row.empty:
        lines.append("  not in the comparison (the subgroup or operating point is missing)")
    else:
        r = row.iloc[0]
        lines.append(f"  {r['a']:.3f} -> {r['b']:.3f}, {r['delta']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}], "
                     f"p = {r['p_family']:.3g}, supported: {bool(r['supported'])}, significant: {bool(r['significant_family'])}")
    for role, title in (("secondary", "Secondary (Holm over all"), ("schedule", "Schedule alone, baseline minus sham (Holm over all")):
        rows = labelled[labelled["role"] == role]
        found = rows[rows["significant_family"]]
        lines.append(f"{title} {int(rows['p_family'].notna().sum())} tested rows): {len(found)} significant")
        for r in found.itertuples():
            lines.append(f"  {r.metric} {r.attribute}:{r.group} at {r.operating_point}: {r.delta:+.3f} "
                         f"[{r.ci_low:+.3f}, {r.ci_high:+.3f}], p_holm = {r.p_family:.3g}")
    return "\n".join(lines)
