"""MLflow helpers shared by training, evaluation, SynthX and the sweeps (docs/design.md "MLflow runs and keys").

Tracking URI: the recipe's ``tracking.uri`` when it sets one; otherwise ``MLFLOW_TRACKING_URI`` (what
``mlflow run`` passes to its entry points); otherwise ``sqlite:///mlflow.db`` (MLflow's own default;
the ``./mlruns`` file store is refused by MLflow 3). An explicit recipe value wins over the variable
because ``mlflow.set_tracking_uri`` (called by Lightning's MLFlowLogger) writes that variable, so it
can hold a previous run's store in the same process.
Tags on every run: ``backbone``, ``recipe``, ``variant``, ``synthx_ratio``, ``split_sha256``, ``git_commit``.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
_RUN_ID = re.compile(r"[0-9a-f]{32}")


def check_run_id(run_id: str) -> str:
    """An MLflow run id (32 lowercase hexadecimal characters), checked for shape before any look-up.

    Raises:
        ValueError: anything else, e.g. ``../../etc``.
    """
    text = str(run_id).strip()
    if not _RUN_ID.fullmatch(text):
        raise ValueError(f"{run_id!r} is not an MLflow run id (32 hexadecimal characters)")
    return text


def log_metrics(client: MlflowClient, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    """Log many metrics in batches of 1,000 (MLflow's limit per call) instead of one call each."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    entries = [Metric(key, float(value), now, step) for key, value in metrics.items()]
    for start in range(0, len(entries), 1000):
        client.log_batch(run_id, metrics=entries[start : start + 1000])


def tracking_uri(recipe_uri: str | None = None) -> str:
    """The tracking URI in force: the recipe's if set, else ``MLFLOW_TRACKING_URI``, else the default."""
    return recipe_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def git_commit(path: str | Path | None = None) -> str:
    """The code version: ``git rev-parse HEAD`` of the repository holding this package, '+dirty' if modified."""
    root = Path(path) if path else Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def experiment_id(name: str, uri: str) -> str:
    """Get or create an experiment by name (used before workers start, so creation never races)."""
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name, artifact_location=default_artifact_location(uri, name))
    except mlflow.exceptions.MlflowException:
        # Another process created it between our look-up and our create.
        return client.get_experiment_by_name(name).experiment_id


def default_artifact_location(uri: str, experiment: str) -> str | None:
    """For a SQLite store, artifacts beside the database (``<db folder>/mlruns/<experiment>``)
    instead of ``./mlruns`` in whatever folder the process started; None otherwise (the server's or
    store's own default). The folder is MLflow's own ``mlruns``, so an experiment that ``mlflow run``
    created (``<working folder>/mlruns/<id>``, the database's folder when the default URI is used)
    keeps its artifacts in the same place as one that benchx created."""
    if not uri.startswith("sqlite:///"):
        return None
    database = Path(uri[len("sqlite:///") :])
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment)
    return (database.resolve().parent / "mlruns" / safe).as_uri()


def run_tags(recipe, split_sha256: str, variant: str | None = None) -> dict[str, str]:
    """The standard tags of docs/design.md "MLflow runs and keys" for a training or evaluation run."""
    ratio = float(recipe.synthx.ratio)
    tags = {
        "backbone": str(recipe.model.backbone),
        "recipe": str(recipe.name),
        "profile": str(recipe.profile),
        "variant": variant or ("synthx" if ratio > 0 else "baseline"),
        "synthx_ratio": f"{ratio:g}",
        "split_sha256": split_sha256,
        "git_commit": git_commit(),
    }
    tags.update({str(k): str(v) for k, v in dict(recipe.tracking.tags).items()})
    return tags


def flatten(mapping, prefix: str = "") -> dict[str, str]:
    """Flatten a nested mapping into dotted keys (MLflow params)."""
    flat: dict[str, str] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:6000]
    return flat


def log_dataset_input(client: MlflowClient, run_id: str, frame, source: str, name: str, context: str) -> None:
    """Log a metadata table as an MLflow dataset input of a run (``mlflow.data`` public API), with
    its ``mlflow.data.context`` tag (e.g. ``evaluation-test``)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    dataset = mlflow.data.from_pandas(frame.astype(str), source=source, name=name)
    client.log_inputs(run_id, datasets=[DatasetInput(Dataset(**dataset.to_dict()), [InputTag("mlflow.data.context", context)])])


def log_evaluation_inputs(client: MlflowClient, run_id: str, datamodule, stages) -> None:
    """The cases an evaluation run scored, one dataset input per stage (``evaluation-val``, ``evaluation-test``)."""
    datamodule._load()
    source = str(Path(datamodule.cohort.root).resolve())
    for stage in stages:
        cases = datamodule.case_ids(stage)
        if cases:
            frame = datamodule.cohort.subset(cases)
            log_dataset_input(client, run_id, frame, source, f"{stage}:{Path(str(datamodule.recipe.data.split)).name}", f"evaluation-{stage}")
