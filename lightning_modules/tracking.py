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


# Where a direct database store (postgresql://, mysql://, mssql://) puts artifacts: this folder or
# URI (s3://...) if set, else ~/mlartifacts; one sub-folder per experiment. Several machines writing
# to one database need a shared place, or the tracking server (scripts/services.sh, README "Scaling").
ARTIFACT_ROOT_VARIABLE = "BENCHX_ARTIFACT_ROOT"
DATABASE_SCHEMES = ("postgresql", "mysql", "mssql")


def tracking_uri(recipe_uri: str | None = None) -> str:
    """The tracking URI in force: the recipe's if set, else ``MLFLOW_TRACKING_URI``, else the default."""
    return database_url(recipe_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI)


def database_url(url: str) -> str:
    """``postgresql://`` as ``postgresql+psycopg://`` when only psycopg 3 (the ``server`` extra) is installed.

    SQLAlchemy's plain ``postgresql://`` means psycopg2; MLflow and Optuna both open URLs through it.
    """
    if url.startswith("postgresql://"):
        import importlib.util

        if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
            return "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


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
    """Where a new experiment's artifacts go, instead of MLflow's ``./mlruns`` in whatever folder the
    process started: for SQLite beside the database (``<db folder>/mlartifacts/<experiment>``); for
    another database (PostgreSQL) under ``$BENCHX_ARTIFACT_ROOT`` (default ``~/mlartifacts``); None
    for a tracking server (its ``--artifacts-destination`` decides)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment)
    if uri.startswith("sqlite:///"):
        database = Path(uri[len("sqlite:///") :])
        return (database.resolve().parent / "mlartifacts" / safe).as_uri()
    if uri.split(":", 1)[0].split("+", 1)[0] in DATABASE_SCHEMES:
        root = os.environ.get(ARTIFACT_ROOT_VARIABLE) or str(Path.home() / "mlartifacts")
        if "://" in root:
            return f"{root.rstrip('/')}/{safe}"
        return (Path(root).expanduser().resolve() / safe).as_uri()
    return None


def log_inputs(client: MlflowClient, run_id: str, datasets: list) -> None:
    """``client.log_inputs`` that survives concurrent runs logging the same dataset.

    MLflow looks a dataset up and inserts it when absent; two processes (sweep workers) doing so at
    once collide on the (experiment, name, digest) key and one fails. Its retry finds the dataset.
    """
    for attempt in range(3):
        try:
            client.log_inputs(run_id, datasets=datasets)
            return
        except mlflow.exceptions.MlflowException as error:
            text = str(error).lower()
            if attempt == 2 or not ("unique" in text or "duplicate" in text):
                raise


def run_tags(recipe, split_sha256: str, variant: str | None = None) -> dict[str, str]:
    """The standard tags (docs/design.md "MLflow runs and keys") for a training or evaluation run."""
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
