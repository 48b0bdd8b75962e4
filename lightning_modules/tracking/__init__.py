"""The tracking adapter: every MLflow call of the workflows goes through this package
(``docs/explanation/architecture.md "MLflow runs and keys"``); the libraries (config, data, cohorts, models,
evaluation) import neither it nor MLflow (``tests/test_layout.py``).

- this module: runs, their tags and final status, the store, experiments, dataset inputs;
- :mod:`~lightning_modules.tracking.datasets`: training data as dataset inputs, exposures, the
  synthetic cohort of a generator run;
- :mod:`~lightning_modules.tracking.provenance`: the training cases logged with a model and checked
  by evaluation;
- :mod:`~lightning_modules.tracking.artifacts`: a model's recipe and checkpoint from a run or the registry;
- :mod:`~lightning_modules.tracking.pyfunc`: the registered pyfunc model;
- :mod:`~lightning_modules.tracking.audit`: the leakage audit's report logged to a run.

Tracking URI: the recipe's ``tracking.uri`` when it sets one; otherwise ``MLFLOW_TRACKING_URI`` (what
``mlflow run`` passes to its entry points); otherwise ``sqlite:///mlflow.db`` (MLflow's own default;
the ``./mlruns`` file store is refused by MLflow 3). An explicit recipe value wins over the variable
because ``mlflow.set_tracking_uri`` (called by Lightning's MLFlowLogger) writes that variable, so it
can hold a previous run's store in the same process.
Tags on every run: ``backbone``, ``recipe``, ``variant``, ``synthx_ratio``, ``split_sha256``, ``git_commit``.

Runs end FINISHED, FAILED or KILLED, never RUNNING: :func:`ended_run` wraps the work of a run and
sets its final status on success, on an exception and on SIGTERM/SIGINT (turned into
:class:`lightning_modules.infrastructure.process.Terminated`). A new SQLite store is created once under a file lock (:func:`prepare_store`),
so several commands started at once on a fresh ``mlflow.db`` do not race in MLflow's table setup.

Example::

    uri = tracking_uri(recipe.tracking.uri)
    run_id = start_run(uri, "benchx", "train-unet", tags)
    with ended_run(uri, run_id):
        ...  # log, train
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import time
from pathlib import Path
from typing import Iterator

import mlflow
from mlflow.tracking import MlflowClient

from lightning_modules.infrastructure.process import Terminated, git_commit, terminating_signals

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
# to one database need a shared place, or the tracking server (scripts/services.sh, docs/scaling.md).
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


_PREPARED_STORES: set[str] = set()


def prepare_store(uri: str) -> None:
    """Create a SQLite store's tables once, under an exclusive lock on ``<database>.lock``.

    MLflow creates (migrates) the tables of a new SQLite database on first use; two processes doing
    that at once fail with ``duplicate column name``. Other stores need nothing.
    """
    if uri in _PREPARED_STORES or not uri.startswith("sqlite:///"):
        return
    database = Path(uri[len("sqlite:///") :])
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{database}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _PREPARED_STORES.add(uri)


def tracking_client(uri: str) -> MlflowClient:
    """An ``MlflowClient`` on ``uri``, built after :func:`prepare_store`.

    MLflow creates (migrates) a SQLite store's tables when the client is built, so a client built
    before the lock races another process's first use of the same new store.
    """
    prepare_store(uri)
    return MlflowClient(tracking_uri=uri)


# A model-training experiment, so the MLflow UI opens it on its runs rather than on GenAI pages.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


def experiment_id(name: str, uri: str) -> str:
    """Get or create an experiment by name; safe when several processes (Slurm array tasks, sweep
    workers) do it at the same moment. A new experiment is created as a model-training one."""
    client = tracking_client(uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(
            name, artifact_location=default_artifact_location(uri, name), tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        )
    except mlflow.exceptions.MlflowException:
        # Another process created it between our look-up and our create.
        return client.get_experiment_by_name(name).experiment_id


def mark_model_experiment(client: MlflowClient, experiment: str) -> None:
    """Tag an experiment created elsewhere (``mlflow run --experiment-name``) as a model-training one.
    Concurrent processes may race to set the tag: the database refuses all but one insert, and a
    refusal is fine once the tag holds the value."""
    if client.get_experiment(experiment).tags.get(EXPERIMENT_KIND_TAG) == EXPERIMENT_KIND:
        return
    try:
        client.set_experiment_tag(experiment, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    except mlflow.exceptions.MlflowException:
        if client.get_experiment(experiment).tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
            raise


def default_artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment's artifacts go, instead of MLflow's ``./mlruns`` in whatever folder the
    process started: for SQLite beside the database (``<db folder>/mlruns/<experiment>``, the folder
    ``mlflow run`` uses when started beside the database, so both land in one place); for
    another database (PostgreSQL) under ``$BENCHX_ARTIFACT_ROOT`` (default ``~/mlartifacts``); None
    for a tracking server (its ``--artifacts-destination`` decides)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment)
    if uri.startswith("sqlite:///"):
        database = Path(uri[len("sqlite:///") :])
        return (database.resolve().parent / "mlruns" / safe).as_uri()
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
    """The standard tags (``docs/explanation/architecture.md "MLflow runs and keys"``) of a training or evaluation run."""
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
    from lightning_modules.models.backbones import backbone_tags  # heavy (MONAI): only when tagging a run

    tags.update(backbone_tags(str(recipe.model.backbone), dict(recipe.model.options)))
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


def start_run(uri: str, experiment: str, run_name: str, tags: dict[str, str]) -> str:
    """Create a RUNNING run in ``experiment`` (created if missing) and return its id."""
    client = tracking_client(uri)
    run = client.create_run(experiment_id(experiment, uri), run_name=run_name, tags=tags)
    return run.info.run_id


def run_status(uri: str, run_id: str) -> str | None:
    """The run's status (``RUNNING``, ``FINISHED``, ``FAILED``, ``KILLED``), or None if the store lacks it."""
    try:
        return tracking_client(uri).get_run(run_id).info.status
    except mlflow.exceptions.MlflowException:
        return None


def final_status(error: BaseException | None) -> str:
    """FINISHED without an error, KILLED for a signal or Ctrl+C, FAILED for anything else."""
    if error is None:
        return "FINISHED"
    if isinstance(error, (Terminated, KeyboardInterrupt)):
        return "KILLED"
    if isinstance(error, SystemExit) and error.code in (0, None):
        return "FINISHED"
    if isinstance(error, SystemExit) and type(error).__name__ == "SIGTERMException":
        return "KILLED"  # Lightning's own graceful SIGTERM exit
    return "FAILED"


def end_run(uri: str, run_id: str, status: str) -> None:
    """Set the run's final status; a run another process already marked FAILED is not relabelled KILLED."""
    client = tracking_client(uri)
    if status == "KILLED" and run_status(uri, run_id) == "FAILED":
        return
    client.set_terminated(run_id, status)


@contextlib.contextmanager
def ended_run(uri: str, run_id: str, writer: bool = True) -> Iterator[None]:
    """Run the block with SIGTERM/SIGINT turned into :class:`Terminated`; end the run by the outcome.

    Args:
        uri: the tracking store.
        run_id: the open run.
        writer: this process ends the run on success and on a signal (rank 0 of a distributed
            run); every process marks the run FAILED when its own block raises, so a failure on
            any rank ends the run FAILED.
    """
    with terminating_signals():
        try:
            yield
        except BaseException as error:
            status = final_status(error)
            if writer or status == "FAILED":
                try:
                    end_run(uri, run_id, status)
                except Exception as failure:  # the store may be unreachable; the original error matters more
                    logging.getLogger(__name__).warning("could not end MLflow run %s as %s: %s", run_id, status, failure)
            raise
    if writer:
        end_run(uri, run_id, "FINISHED")


def log_dataset_input(client: MlflowClient, run_id: str, frame, source: str, name: str, context: str) -> None:
    """Log a metadata table as an MLflow dataset input of a run (``mlflow.data`` public API), with
    its ``mlflow.data.context`` tag (e.g. ``evaluation-test``)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    dataset = mlflow.data.from_pandas(frame.astype(str), source=source, name=name)
    log_inputs(client, run_id, [DatasetInput(Dataset(**dataset.to_dict()), [InputTag("mlflow.data.context", context)])])


def log_evaluation_inputs(client: MlflowClient, run_id: str, datamodule, stages) -> None:
    """The cases an evaluation run scored, one dataset input per stage (``evaluation-val``, ``evaluation-test``)."""
    datamodule.load()
    source = str(Path(datamodule.cohort.root).resolve())
    for stage in stages:
        cases = datamodule.case_ids(stage)
        if cases:
            frame = datamodule.cohort.subset(cases)
            log_dataset_input(client, run_id, frame, source, f"{stage}:{Path(str(datamodule.data.split)).name}", f"evaluation-{stage}")
