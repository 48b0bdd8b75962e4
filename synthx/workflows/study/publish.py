"""The study's results on its parent run: the comparison with each row's role and the primary
endpoint, the decomposition of SynthX's difference to sham (:mod:`synthx.analysis.decomposition`), the
baseline on both test sets, the command that opens the runs, and the verdict.

Example::

    table = publish_comparison(runner, comparison, settings.endpoint)
    parts = publish_decomposition(runner, evaluations, table, settings.endpoint)
    print(verdict_text(table, settings.endpoint, parts))
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

from lightning_modules.tracking import log_metrics
from lightning_modules.tracking.recorder import download_records
from synthx.analysis.decomposition import decompose, detections, paired_sensitivity_rows
from synthx.analysis.endpoint import endpoint_summary, label_results, PrimaryEndpoint, shown_interval
from synthx.analysis.verdict import arm_namer, CONTROL_ARM, decomposition_sentences, study_verdict
from synthx.workflows.study.runner import StudyRunner

# The operating points where each compared pair has its own m (the arm's matched to the reference's).
MATCHED_POINTS = ("matched_specificity", "subgroup_matched_specificity")

DECOMPOSITION_ARTIFACT = "synthx/decomposition.csv"
DECOMPOSITION_ATTRIBUTES = ("phase",)  # the designed gaps are phases (docs/explanation/data.md "The phantom cohort")


def publish_comparison(runner: StudyRunner, comparison: dict, endpoint: PrimaryEndpoint) -> pd.DataFrame:
    """Copy the comparison's text table onto the parent run with each row's role (primary, secondary,
    schedule) and the primary result; print the primary result and where the table is, and return the
    labelled comparison table."""
    client = runner.client
    with tempfile.TemporaryDirectory() as folder:
        table = pd.read_csv(client.download_artifacts(comparison["run_id"], "comparison/test_comparison.csv", folder))
        text = Path(client.download_artifacts(comparison["run_id"], "comparison/test_comparison.txt", folder)).read_text()
    table = label_results(table, endpoint)
    summary = endpoint_summary(table, endpoint)
    client.log_text(runner.parent_id, text, "comparison/test_comparison.txt")
    client.log_text(runner.parent_id, table.to_csv(index=False), "comparison/test_roles.csv")
    client.log_text(runner.parent_id, summary + "\n", "comparison/primary_endpoint.txt")
    primary = table[table["role"] == "primary"]
    if not primary.empty:
        row = primary.iloc[0]
        interval, low, high = shown_interval(row)  # the interval the verdict shows, named in a tag
        for name, value in (("delta", row["delta"]), ("ci_low", low), ("ci_high", high), ("p_family", row["p_family"])):
            if float(value) == float(value):  # NaN is not logged
                client.log_metric(runner.parent_id, f"endpoint/{name}", float(value))
        client.set_tag(runner.parent_id, "endpoint.interval", interval)
    client.set_tag(runner.parent_id, "comparison_run_id", comparison["run_id"])
    # The full table (every subgroup, metric and operating point) stays in the run; the console gets
    # the primary result and the verdict.
    print(f"[study] the full comparison ({len(text.splitlines())} lines): artifact comparison/test_comparison.txt "
          f"of run {runner.parent_id}")
    print(summary)
    return table


def baseline_test_sets(client: MlflowClient, development_run: str, locked_run: str) -> pd.DataFrame:
    """The baseline's test subgroup table on the development split beside the locked cohort's."""
    columns = ["n_patients", "positives", "negatives", "sensitivity", "specificity", "f1", "auc"]
    with tempfile.TemporaryDirectory() as folder:
        tables = [pd.read_csv(client.download_artifacts(run, "evaluation/test_subgroups.csv", f"{folder}/{i}"))
                  for i, run in enumerate((development_run, locked_run))]
    kept = [c for c in columns if c in tables[0].columns and c in tables[1].columns]
    parts = [t[["attribute", "group", *kept]].astype({"group": str}) for t in tables]
    return parts[0].merge(parts[1], on=["attribute", "group"], how="outer", suffixes=("_development", "_locked"))


def ui_command(uri: str, experiment_id: str, port: int = 5000) -> str:
    """The command that opens the study's runs in the MLflow UI, and the page to open (the runs
    view of the experiment, not MLflow 3's GenAI overview)."""
    return (f"mlflow ui --backend-store-uri {uri} --port {port}, then open "
            f"http://127.0.0.1:{port}/#/experiments/{experiment_id}/runs")


def verdict_text(comparison: pd.DataFrame, endpoint: PrimaryEndpoint | None = None,
                 decomposition: pd.DataFrame | None = None, painter: str | None = None) -> str:
    """The verdict sentences the study ends on (:func:`synthx.analysis.verdict.study_verdict`), then one per
    designed subgroup of the decomposition when there is one (:func:`synthx.analysis.verdict.decomposition_sentences`).
    ``painter`` names the augmented arm (the positive control is not called SynthX)."""
    point = (endpoint or PrimaryEndpoint()).operating_point
    lines = (study_verdict(comparison, endpoint=endpoint, name_of=arm_namer(painter))
             + decomposition_sentences(decomposition, point=point, name_of=arm_namer(painter)))
    return "Verdict (test):\n" + "\n".join(f"  {line}" for line in lines) if lines else "Verdict: no designed subgroup in the comparison"


def arm_thresholds(comparison: pd.DataFrame, point: str) -> tuple[dict[str, float], dict[tuple[str, str], tuple[float, float]]]:
    """Each arm's own m at ``point`` (arm -> m, as the comparison used it) and each compared pair's
    (run, reference) -> (reference's m, run's m) there."""
    rows = comparison[comparison["operating_point"] == point].drop_duplicates(["run", "reference"])
    own: dict[str, float] = {}
    pairs: dict[tuple[str, str], tuple[float, float]] = {}
    for row in rows.itertuples(index=False):
        own.setdefault(str(row.reference), float(row.threshold_a))
        pairs[str(row.run), str(row.reference)] = (float(row.threshold_a), float(row.threshold_b))
        if point not in MATCHED_POINTS:  # a compared arm's matched m is the pair's, not its own
            own.setdefault(str(row.run), float(row.threshold_b))
    return own, pairs


def common_thresholds(comparison: pd.DataFrame, point: str, arms: list[str]) -> dict[str, float]:
    """One m per arm at ``point``, the m the primary comparison used, so that every component of the
    decomposition judges an arm at the same threshold and the components add up (placement + content
    = total, per subgroup, exactly).

    At the matched points the sham arm (the reference of every comparison) keeps its
    validation-chosen m and each other arm the m that matched sham's validation specificity in its
    comparison against sham; at ``val_chosen`` and ``fixed`` every arm has its own m.

    Raises:
        LookupError: an arm has no comparison against sham at ``point``.
    """
    own, pairs = arm_thresholds(comparison, point)
    if point not in MATCHED_POINTS:
        return {arm: own[arm] for arm in arms}
    chosen = {}
    for arm in arms:
        if arm == CONTROL_ARM:
            continue
        if (arm, CONTROL_ARM) not in pairs:
            raise LookupError(f"the comparison holds no {arm} - {CONTROL_ARM} rows at {point}")
        chosen[CONTROL_ARM], chosen[arm] = pairs[arm, CONTROL_ARM]
    return chosen


def decomposition_table(client: MlflowClient, evaluations: dict[str, dict], comparison: pd.DataFrame,
                        endpoint: PrimaryEndpoint) -> pd.DataFrame | None:
    """The decomposition on the test records at the endpoint's operating point, or None without a copy-paste arm.

    Every arm is judged at the m the primary comparison gave it (:func:`common_thresholds`): sham at
    its validation-chosen m, SynthX and copy-paste each at the m matching sham's validation
    specificity. The content pair (SynthX against copy-paste) is therefore not re-matched, and
    placement + content = total. With the phantom painter (no copy-paste arm, the ``synthx`` arm is
    the phantom's) the table holds the ceiling only: phantom minus sham.
    """
    point, score = endpoint.operating_point, endpoint.score
    arms = [arm for arm in ("sham", "copy_paste", "synthx") if arm in evaluations]
    if "copy_paste" not in arms and ("synthx", CONTROL_ARM) not in arm_thresholds(comparison, point)[1]:
        return None
    m = common_thresholds(comparison, point, arms)
    with tempfile.TemporaryDirectory() as folder:
        test = {arm: download_records(client, evaluations[arm]["run_id"], "test", f"{folder}/test-{arm}") for arm in arms}
    detected = {arm: detections(test[arm], m[arm], score) for arm in arms}
    if "copy_paste" not in arms:
        table = paired_sensitivity_rows(detected["synthx"], detected["sham"], "phantom", "sham", DECOMPOSITION_ATTRIBUTES)
        return table.assign(component="ceiling", threshold_reference=m["sham"], threshold_arm=m["synthx"])
    table = decompose(detected, DECOMPOSITION_ATTRIBUTES)
    table["threshold_reference"] = table["reference"].map(m)
    table["threshold_arm"] = table["arm"].map(m)
    return table


def publish_decomposition(runner: StudyRunner, evaluations: dict[str, dict], comparison: pd.DataFrame,
                          endpoint: PrimaryEndpoint) -> pd.DataFrame | None:
    """Log the decomposition (:func:`decomposition_table`) on the parent run: ``synthx/decomposition.csv``
    and ``decomposition/<attribute>:<group>/<component>/{difference,ci_low,ci_high,p}``; print it."""
    table = decomposition_table(runner.client, evaluations, comparison, endpoint)
    if table is None:
        return None
    runner.client.log_text(runner.parent_id, table.to_csv(index=False), DECOMPOSITION_ARTIFACT)
    metrics = {}
    for row in table.to_dict("records"):
        for column, name in (("difference", "difference"), ("ci_low", "ci_low"), ("ci_high", "ci_high"), ("p_value", "p")):
            value = float(row[column])
            if value == value:  # NaN is not logged
                metrics[f"decomposition/{row['attribute']}:{row['group']}/{row['component']}/{name}"] = value
    log_metrics(runner.client, runner.parent_id, metrics)
    shown = ["component", "comparison", "attribute", "group", "positives", "arm_detected", "reference_detected",
             "difference", "ci_low", "ci_high", "p_value"]
    print(f"[study] the decomposition at the primary endpoint's operating point ({endpoint.operating_point}):")
    print(table[shown].to_string(index=False))
    return table
