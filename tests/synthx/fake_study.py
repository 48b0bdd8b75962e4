"""A study's runs written straight into an MLflow store, with known and distinct values per arm, so
a report test can tell which arm every number, point and label came from.

Arms (sensitivity per group, of 20 tumor scans; specificity per group, of 20 healthy scans):

- baseline: worst phase non-contrast, m = 2,249 mm³;
- sham: worst phase arterial (lower than the baseline's worst), m = 2,547 mm³;
- synthx: worst phase delayed, m = 1,800 mm³;
- copy_paste (only with ``write_study(copy_paste=True)``): worst phase non-contrast, m = 2,100 mm³,
  with a decomposition table on the parent run and a realism table on the synthesis run.

The baseline's evaluation also logs its table at the fixed m (50 mm³) with values unlike any arm's
at the validation-chosen point, so a plot or caption that mixes the two shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import new_sqlite_store  # noqa: E402
from synthx.analysis.endpoint import PrimaryEndpoint  # noqa: E402

GROUPS = [("overall", "all"), ("phase", "non-contrast"), ("phase", "arterial"), ("phase", "venous"), ("phase", "delayed")]
SENSITIVITY = {
    "baseline": [0.50, 0.30, 0.45, 0.70, 0.55],
    "sham": [0.45, 0.40, 0.20, 0.60, 0.60],
    "synthx": [0.65, 0.50, 0.75, 0.85, 0.45],
    "copy_paste": [0.55, 0.35, 0.40, 0.75, 0.65],
}
SPECIFICITY = {
    "baseline": [0.80, 0.85, 0.75, 0.80, 0.80],
    "sham": [0.70, 0.65, 0.70, 0.75, 0.70],
    "synthx": [0.90, 0.95, 0.85, 0.90, 0.90],
    "copy_paste": [0.60, 0.55, 0.60, 0.65, 0.60],
}
VAL_CHOSEN_M = {"baseline": 2249.0, "sham": 2547.0, "synthx": 1800.0, "copy_paste": 2100.0}
# At matched specificity the compared arm's m is matched to its reference's specificity, pair by pair.
MATCHED_M = {("sham", "baseline"): 2400.0, ("synthx", "baseline"): 1950.0, ("synthx", "sham"): 1900.0,
             ("copy_paste", "sham"): 2050.0}
FIXED_BASELINE = {"sensitivity": 0.91, "specificity": 0.195}
WORST_PHASE = {"baseline": ("non-contrast", 0.30), "sham": ("arterial", 0.20), "synthx": ("delayed", 0.45)}
PAIRS = [("synthx", "sham"), ("sham", "baseline"), ("synthx", "baseline")]  # (run, reference), SynthX-sham first
COPY_PASTE_PAIRS = [*PAIRS, ("copy_paste", "sham")]
# The decomposition on the parent run: (component, arm, reference, arterial difference, its CI).
DECOMPOSITION = [("placement", "copy_paste", "sham", 0.20, -0.05, 0.45), ("content", "synthx", "copy_paste", 0.35, 0.10, 0.55),
                 ("total", "synthx", "sham", 0.55, 0.30, 0.75)]


def value(arm: str, metric: str, group: str) -> float:
    table = SENSITIVITY if metric == "sensitivity" else SPECIFICITY
    return table[arm][[g for _, g in GROUPS].index(group)]


def comparison_table(rows_extra: dict | None = None, pairs=PAIRS) -> pd.DataFrame:
    """The compare step's table: every pair at two operating points, each arm's own values."""
    rows = []
    for point in ("val_chosen", "matched_specificity"):
        for run, reference in pairs:
            for attribute, group in GROUPS:
                for metric in ("sensitivity", "specificity"):
                    a, b = value(reference, metric, group), value(run, metric, group)
                    size = 80 if attribute == "overall" else 20
                    threshold_b = VAL_CHOSEN_M[run] if point == "val_chosen" else MATCHED_M[(run, reference)]
                    rows.append({
                        "run": run, "reference": reference, "operating_point": point,
                        "threshold_a": VAL_CHOSEN_M[reference], "threshold_b": threshold_b,
                        "attribute": attribute, "group": group, "metric": metric, "n": 2 * size,
                        "n_patients": 2 * size, "positives": size, "negatives": size, "a": a, "b": b,
                        "delta": b - a, "ci_low": b - a - 0.10, "ci_high": b - a + 0.10,
                        "newcombe_low": b - a - 0.12, "newcombe_high": b - a + 0.12, "defined_fraction": 1.0,
                        "p_mcnemar": 0.5, "p_bootstrap": 0.5, "test": "mcnemar_exact", "p_value": 0.5,
                        "supported": True, "significant": False, "p_holm": 1.0, "significant_holm": False,
                        **(rows_extra or {}),
                    })
    return pd.DataFrame(rows)


def subgroup_table(arm: str, fixed: bool = False) -> pd.DataFrame:
    rows = []
    for attribute, group in GROUPS:
        size = 80 if attribute == "overall" else 20
        row = {"attribute": attribute, "group": group, "n_patients": 2 * size, "positives": size, "negatives": size}
        for metric in ("sensitivity", "specificity"):
            v = FIXED_BASELINE[metric] if fixed else value(arm, metric, group)
            row.update({metric: v, f"{metric}_ci_low": v - 0.05, f"{metric}_ci_high": v + 0.05})
        rows.append(row)
    return pd.DataFrame(rows)


def decomposition_table() -> pd.DataFrame:
    """The parent run's decomposition: each component per phase (the arterial row from :data:`DECOMPOSITION`)."""
    rows = []
    for component, arm, reference, difference, low, high in DECOMPOSITION:
        for attribute, group in GROUPS:
            a, r = value(arm, "sensitivity", group), value(reference, "sensitivity", group)
            delta = difference if group == "arterial" else a - r
            rows.append({"component": component, "comparison": f"{arm} - {reference}", "arm": arm, "reference": reference,
                         "attribute": attribute, "group": group, "n_patients": 20, "positives": 20,
                         "arm_detected": round(20 * a), "reference_detected": round(20 * r), "both": 0, "only_arm": 0,
                         "only_reference": 0, "neither": 0, "arm_sensitivity": a, "reference_sensitivity": r,
                         "difference": delta, "ci_low": low if group == "arterial" else delta - 0.2,
                         "ci_high": high if group == "arterial" else delta + 0.2, "p_value": 0.25, "supported": True,
                         "significant": False})
    return pd.DataFrame(rows)


def realism_table() -> pd.DataFrame:
    """A realism table (:func:`synthx.analysis.realism.realism_table` columns) with SynthX and copy-paste per phase."""
    rows = []
    for phase in ("arterial", "venous"):
        for comparison, auc, edge in (("synthetic", 0.91, 9.5), ("copy_paste", 0.62, 4.5)):
            base = {"phase": phase, "comparison": comparison, "n_real": 12, "n_other": 4, "null": 0.0, "method": "m"}
            rows.append({**base, "metric": "edge_gradient", "real": 3.0, "other": edge, "value": edge - 3.0,
                         "ci_low": edge - 4.0, "ci_high": edge - 2.0, "p_value": float("nan")})
            rows.append({**base, "metric": "classifier_auc", "real": float("nan"), "other": float("nan"), "value": auc,
                         "ci_low": auc - 0.1, "ci_high": min(auc + 0.1, 1.0), "null": 0.5, "p_value": 0.01})
    return pd.DataFrame(rows)


def write_study(folder: Path, painter: str = "synthx", comparison: pd.DataFrame | None = None,
                copy_paste: bool = False) -> tuple[str, str]:
    """(tracking uri, parent run id) of a finished fake study in ``folder`` (with the copy-paste arm when asked)."""
    uri = new_sqlite_store(Path(folder) / "mlflow.db")
    client = MlflowClient(uri)
    experiment = client.create_experiment("fake-study", artifact_location=str(Path(folder) / "artifacts"))
    parent = client.create_run(experiment, run_name="study-unet", tags={"stage": "study", "git_commit": "abc123"})
    parent_id = parent.info.run_id
    # A study that judged the endpoint at overall matched specificity (version 1, logged before versions).
    for key, value in PrimaryEndpoint.of_version(1).params().items():
        if key != "endpoint.version":
            client.log_param(parent_id, key, value)

    def child(step: str, tags: dict | None = None):
        run = client.create_run(experiment, run_name=step, tags={"mlflow.parentRunId": parent_id, **(tags or {})})
        client.set_tag(parent_id, f"step.{step}", run.info.run_id)
        return run.info.run_id

    trained = [("baseline", "baseline"), ("sham", "sham"), ("augmented", "synthx")]
    for step, arm in trained + ([("copy_paste", "copy_paste")] if copy_paste else []):
        run_id = child(step, {"variant": arm})
        client.log_text(run_id, f"arm: {arm}\n", "recipe.yaml")
        client.set_terminated(run_id)
    synthesis = child("synthesize", {"painter": painter})
    evaluation = child("evaluate_baseline", {"variant": "baseline"})
    client.log_text(evaluation, subgroup_table("baseline").to_csv(index=False), "evaluation/test_val_chosen_subgroups.csv")
    client.log_text(evaluation, subgroup_table("baseline", fixed=True).to_csv(index=False), "evaluation/test_subgroups.csv")
    client.log_metric(evaluation, "operating_point/val_chosen", VAL_CHOSEN_M["baseline"])
    client.log_metric(evaluation, "test/threshold", 50.0)
    for arm in ("sham", "synthx", "copy_paste") if copy_paste else ("sham", "synthx"):
        run_id = child(f"evaluate_{arm}", {"variant": arm})
        client.log_metric(run_id, "operating_point/val_chosen", VAL_CHOSEN_M[arm])
    if copy_paste:
        child("synthesize_copy_paste", {"painter": "copy_paste"})
        client.log_text(synthesis, realism_table().to_csv(index=False), "synthx_quality/realism.csv")
        client.log_text(parent_id, decomposition_table().to_csv(index=False), "synthx/decomposition.csv")
    compare = child("compare")
    default = comparison_table(pairs=COPY_PASTE_PAIRS if copy_paste else PAIRS)
    table = default if comparison is None else comparison
    client.log_text(compare, table.to_csv(index=False), "comparison/test_comparison.csv")
    client.set_terminated(parent_id)
    return uri, parent_id
