"""MLflow helpers: store preparation under concurrency, run endings by outcome and signal, tags, URIs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from conftest import REPO_ROOT
from lightning_modules.infrastructure.process import Terminated
from lightning_modules.trainer import RunLogger
from lightning_modules.tracking import (
    default_artifact_location,
    ended_run,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    experiment_id,
    flatten,
    mark_model_experiment,
    run_status,
    start_run,
    tracking_uri,
)

# Each process imports first, then waits for the go-file, so their first store accesses coincide.
# argv: uri, go-file, index, entry point (experiment_id, or start_run as `benchx train` opens its run).
FIRST_USE = """
import sys, time
from pathlib import Path
from lightning_modules.tracking import experiment_id, start_run
go = Path(sys.argv[2])
(go.parent / f"ready-{sys.argv[3]}").touch()
while not go.exists():
    time.sleep(0.01)
if sys.argv[4] == "start_run":
    run_id = start_run(sys.argv[1], "concurrent", "train", {})
print(experiment_id("concurrent", sys.argv[1]))
"""


@pytest.mark.parametrize("entry", ["experiment_id", "start_run"])
def test_concurrent_first_use_of_a_new_sqlite_store(tmp_path, entry):
    """Processes on a fresh database at once: without the lock MLflow's table setup fails
    (duplicate column name / alembic "Online migration expected to match one row"); with it all
    get the same experiment. ``start_run`` is the path of two ``benchx train`` on a new store."""
    uri = f"sqlite:///{tmp_path / 'new.db'}"
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    count = 3 if entry == "experiment_id" else 2
    processes = [
        subprocess.Popen([sys.executable, "-c", FIRST_USE, uri, str(go), str(i), entry], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for i in range(count)
    ]
    deadline = time.time() + 300
    while len(list(tmp_path.glob("ready-*"))) < count and time.time() < deadline:
        time.sleep(0.2)
    go.touch()
    outputs = [p.communicate(timeout=300) for p in processes]
    for process, (out, err) in zip(processes, outputs):
        assert process.returncode == 0, err[-2000:]
    assert len({out.strip() for out, _ in outputs}) == 1, "every process found the same experiment"
    if entry == "start_run":
        client = MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("concurrent").experiment_id])
        assert len(runs) == count and {run.info.status for run in runs} == {"RUNNING"}


def test_ended_run_sets_the_status_by_outcome(mlflow_uri):
    ids = [start_run(mlflow_uri, "outcomes", f"run-{i}", {"k": "v"}) for i in range(4)]
    with ended_run(mlflow_uri, ids[0]):
        pass
    with pytest.raises(ValueError):
        with ended_run(mlflow_uri, ids[1]):
            raise ValueError("boom")
    with pytest.raises(Terminated) as stopped:
        with ended_run(mlflow_uri, ids[2]):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    assert stopped.value.exit_code == 143
    # Another process marked the run FAILED (a rank that crashed): this one's SIGINT does not relabel it.
    MlflowClient(mlflow_uri).set_terminated(ids[3], "FAILED")
    with pytest.raises(Terminated):
        with ended_run(mlflow_uri, ids[3]):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert [run_status(mlflow_uri, run_id) for run_id in ids] == ["FINISHED", "FAILED", "KILLED", "FAILED"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the previous handler is restored"


def test_a_process_that_is_not_the_writer_only_marks_failures(mlflow_uri):
    run_id = start_run(mlflow_uri, "ranks", "ddp", {})
    with ended_run(mlflow_uri, run_id, writer=False):
        pass
    assert run_status(mlflow_uri, run_id) == "RUNNING", "only rank 0 ends a run that succeeded"
    with pytest.raises(RuntimeError):
        with ended_run(mlflow_uri, run_id, writer=False):
            raise RuntimeError("rank 1 crashed")
    assert run_status(mlflow_uri, run_id) == "FAILED"


def test_run_logger_leaves_the_status_to_ended_run(mlflow_uri):
    run_id = start_run(mlflow_uri, "logger", "run", {})
    logger = RunLogger("logger", mlflow_uri, run_id)
    logger.log_metrics({"train/loss": 1.0}, step=3)
    logger.finalize("failed")
    assert run_status(mlflow_uri, run_id) == "RUNNING"
    assert logger.run_id == run_id
    history = MlflowClient(mlflow_uri).get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(3, 1.0)]
    assert run_status(mlflow_uri, "0" * 32) is None


def test_uri_precedence_artifact_location_and_flatten(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///from-env.db")
    assert tracking_uri("sqlite:///recipe.db") == "sqlite:///recipe.db"
    assert tracking_uri(None) == "sqlite:///from-env.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking_uri(None) == "sqlite:///mlflow.db"
    location = default_artifact_location(f"sqlite:///{tmp_path / 'm.db'}", "my exp/1")
    assert location == (tmp_path / "mlruns" / "my_exp_1").as_uri()
    assert default_artifact_location("http://127.0.0.1:5000", "x") is None
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None}) == {"a.b": "1", "a.c.d": "[1, 2]", "e": "None"}
    uri = f"sqlite:///{tmp_path / 'e.db'}"
    assert experiment_id("same", uri) == experiment_id("same", uri)


def test_a_new_experiment_is_a_model_experiment(tmp_path):
    uri = f"sqlite:///{tmp_path / 'k.db'}"
    client = MlflowClient(uri)
    assert client.get_experiment(experiment_id("new", uri)).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


class RacingClient:
    """A client whose tag write loses a race: another process set the tag first, the database refuses."""

    def __init__(self, client: MlflowClient, other_value: str):
        self.client, self.other_value, self.writes = client, other_value, 0

    def get_experiment(self, experiment):
        return self.client.get_experiment(experiment)

    def set_experiment_tag(self, experiment, key, value):
        self.writes += 1
        self.client.set_experiment_tag(experiment, key, self.other_value)
        raise MlflowException("duplicate key value violates unique constraint \"experiment_tag_pk\"")


def test_marking_an_experiment_tolerates_a_concurrent_writer(tmp_path):
    """Slurm array tasks on one experiment made by ``mlflow run``: each tags it; one insert wins, the
    others' refusals must not end their replicate (they did: UniqueViolation on PostgreSQL)."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'race.db'}")
    made_elsewhere = client.create_experiment("from-mlflow-run", artifact_location=(tmp_path / "a").as_uri())
    racing = RacingClient(client, EXPERIMENT_KIND)
    mark_model_experiment(racing, made_elsewhere)
    assert racing.writes == 1 and client.get_experiment(made_elsewhere).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    mark_model_experiment(racing, made_elsewhere)
    assert racing.writes == 1, "a tagged experiment is not written again"
    other = client.create_experiment("other-kind", artifact_location=(tmp_path / "b").as_uri())
    with pytest.raises(MlflowException):
        mark_model_experiment(RacingClient(client, "genai_development"), other)
