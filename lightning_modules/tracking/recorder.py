"""The recording interface (:class:`lightning_modules.infrastructure.recording.RunRecorder`) on
MLflow: :class:`MlflowRunRecorder` for one run, :func:`logger_recorder` for the run of a Lightning
trainer's MLflow logger, and :func:`download_records`, the evaluation records read back.

Example::

    recorder = MlflowRunRecorder(client, run_id)
    log_evaluation_artifacts(recorder, "test", records, table)
    SubgroupEvaluation.from_detection(recipe.detection, recorder=logger_recorder)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import pandas as pd
from mlflow.tracking import MlflowClient

from lightning_modules.evaluation.artifacts import RECORDS_ARTIFACT
from lightning_modules.evaluation.records import read_records
from lightning_modules.tracking import log_metrics


class MlflowRunRecorder:
    """Records on one MLflow run through a client."""

    def __init__(self, client: MlflowClient, run_id: str):
        self.client, self.run_id = client, run_id

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        log_metrics(self.client, self.run_id, dict(metrics), step)

    def log_table(self, table: pd.DataFrame, path: str, ui: bool = False) -> None:
        self.client.log_text(self.run_id, table.to_csv(index=False), path)
        if ui:
            self.client.log_table(self.run_id, data=table, artifact_file=str(Path(path).with_suffix(".json")))

    def log_text(self, text: str, path: str) -> None:
        self.client.log_text(self.run_id, text, path)

    def log_dict(self, data: Any, path: str) -> None:
        self.client.log_dict(self.run_id, data, path)

    def log_figure(self, figure: Any, path: str) -> None:
        self.client.log_figure(self.run_id, figure, path)


def logger_recorder(trainer) -> MlflowRunRecorder | None:
    """The recorder of a trainer's MLflow run: None off rank 0 and without an MLflow logger (on ranks
    above 0 Lightning's ``MLFlowLogger`` has no run id)."""
    run_id = getattr(trainer.logger, "run_id", None)
    if not trainer.is_global_zero or not run_id:
        return None
    return MlflowRunRecorder(trainer.logger.experiment, run_id)


def download_records(client: MlflowClient, run_id: str, stage: str, folder: str | Path) -> pd.DataFrame | None:
    """A run's per-case records of a stage (:data:`~lightning_modules.evaluation.artifacts.RECORDS_ARTIFACT`),
    or None when the run has none."""
    artifact = RECORDS_ARTIFACT.format(stage=stage)
    names = {item.path for item in client.list_artifacts(run_id, "evaluation")}
    if artifact not in names:
        return None
    path = client.download_artifacts(run_id, artifact, str(Path(folder) / run_id))
    return read_records(path, source=f"run {run_id}: {artifact}")


__all__ = ["MlflowRunRecorder", "download_records", "logger_recorder"]
