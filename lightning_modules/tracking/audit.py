"""The leakage audit's MLflow side: its report logged to a run (:mod:`lightning_modules.cohorts.audit`)."""

from __future__ import annotations

import mlflow

from lightning_modules.cohorts.audit.report import AuditReport
from lightning_modules.tracking import experiment_id as get_experiment_id
from lightning_modules.tracking import tracking_uri as resolve_uri


def log_audit(report: AuditReport, tracking_uri: str | None = None, experiment: str | None = None) -> None:
    """Log an audit's metrics, threshold, split hash and files: to the active run when there is one,
    else to a new run ``leakage-audit`` when a store or an experiment is named, else nowhere."""
    digest, threshold = report.split_sha256, report.threshold

    def log() -> None:
        mlflow.log_metrics(report.metrics)
        mlflow.log_param("audit.threshold", threshold)
        if digest:
            mlflow.set_tag("audit.split_sha256", digest)
        for path in report.files.values():
            mlflow.log_artifact(str(path), artifact_path="audit")

    if mlflow.active_run() is not None:
        log()
        return
    if not (tracking_uri or experiment):
        return
    # Never fall back to the ./mlruns file store (docs/explanation/architecture.md "MLflow runs and keys").
    uri = resolve_uri(tracking_uri)
    mlflow.set_tracking_uri(uri)
    # An explicit experiment id: mlflow.set_experiment would also write MLFLOW_EXPERIMENT_ID into
    # the environment, leaking into later runs of this process and its children.
    with mlflow.start_run(run_name="leakage-audit", experiment_id=get_experiment_id(experiment or "benchx-audit", uri)):
        log()
