"""The study's results on its parent run: the comparison with each row's role and the primary
endpoint, the baseline on both test sets, the command that opens the runs, and the verdict.

Example::

    table = publish_comparison(runner, comparison, settings.endpoint)
    print(verdict_text(table, settings.endpoint))
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

from synthx.endpoint import endpoint_summary, label_results, PrimaryEndpoint
from synthx.verdict import study_verdict
from synthx.workflows.study.runner import StudyRunner


def publish_comparison(runner: StudyRunner, comparison: dict, endpoint: PrimaryEndpoint) -> pd.DataFrame:
    """Copy the comparison's text table onto the parent run with each row's role (primary, secondary,
    schedule) and the primary result; print them and return the labelled comparison table."""
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
        for column in ("delta", "ci_low", "ci_high", "p_family"):
            value = float(primary[column].iloc[0])
            if value == value:  # NaN is not logged
                client.log_metric(runner.parent_id, f"endpoint/{column}", value)
    client.set_tag(runner.parent_id, "comparison_run_id", comparison["run_id"])
    print(text)
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


def verdict_text(comparison: pd.DataFrame, endpoint: PrimaryEndpoint | None = None) -> str:
    """The verdict sentences the study ends on (:func:`synthx.verdict.study_verdict`)."""
    lines = study_verdict(comparison, endpoint=endpoint)
    return "Verdict (test):\n" + "\n".join(f"  {line}" for line in lines) if lines else "Verdict: no designed subgroup in the comparison"
