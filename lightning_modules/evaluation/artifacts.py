"""What an evaluation leaves in its MLflow run, and reading it back: per-case records, subgroup
tables, figures (docs/explanation/architecture.md "MLflow runs and keys").

Artifacts of stage ``<stage>`` (``val``, ``test``; an operating point adds ``_<point>``, e.g.
``test_fixed``): ``evaluation/<stage>_records.csv``, ``evaluation/<stage>_subgroups.csv`` (+ the
same as an MLflow table ``.json``) and ``evaluation/<stage>_subgroups.png``.

Example::

    log_evaluation_artifacts(client, run_id, "test", records, table)
    records = download_records(client, run_id, "test", folder)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd

from lightning_modules.evaluation.bootstrap import evaluation_set_hash
from lightning_modules.evaluation.figures import close, subgroup_figure
from lightning_modules.evaluation.records import read_records

RECORDS_ARTIFACT = "evaluation/{stage}_records.csv"
SUBGROUP_ARTIFACT = "evaluation/{stage}_subgroups.csv"
FIGURE_ARTIFACT = "evaluation/{stage}_subgroups.png"


def log_evaluation_artifacts(client, run_id: str, stage: str, records: pd.DataFrame | None, table: pd.DataFrame) -> None:
    """Per-case records (when given), the subgroup table (CSV + MLflow table) and the subgroup figure.

    Args:
        client: an ``MlflowClient``.
        run_id: the evaluation (or training) run.
        stage: the artifact prefix, e.g. ``test`` or ``test_fixed``.
        records: the stage's per-case records (None for an extra operating point of the same records).
        table: the subgroup table.
    """
    with tempfile.TemporaryDirectory() as folder:
        frames = [(SUBGROUP_ARTIFACT, table)]
        if records is not None:
            client.set_tag(run_id, f"{stage}_set_sha256", evaluation_set_hash(records["case_id"]))
            client.set_tag(run_id, f"{stage}_n_cases", str(len(records)))
            frames.append((RECORDS_ARTIFACT, records))
        for template, frame in frames:
            path = Path(folder) / Path(template.format(stage=stage)).name
            frame.to_csv(path, index=False)
            client.log_artifact(run_id, str(path), "evaluation")
    client.log_table(run_id, data=table, artifact_file=f"evaluation/{stage}_subgroups.json")
    figure = subgroup_figure(table, title=f"{stage}: sensitivity and F1 by subgroup")
    client.log_figure(run_id, figure, FIGURE_ARTIFACT.format(stage=stage))
    close(figure)


def download_records(client, run_id: str, stage: str, folder: str | Path) -> pd.DataFrame | None:
    """A run's per-case records of a stage, or None when the run has none."""
    artifact = RECORDS_ARTIFACT.format(stage=stage)
    names = {item.path for item in client.list_artifacts(run_id, "evaluation")}
    if artifact not in names:
        return None
    path = client.download_artifacts(run_id, artifact, str(Path(folder) / run_id))
    return read_records(path, source=f"run {run_id}: {artifact}")
