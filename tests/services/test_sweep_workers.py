"""Sweep workers on one PostgreSQL study: a SIGKILLed worker's trial is failed and retried once,
no trial runs twice, the best trial and the parent/child MLflow runs are right; pruned trials end
their MLflow runs KILLED; SQLite refuses a second parallel worker.

Run: ``python -m pytest -q tests/services/test_sweep_workers.py``
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from conftest import RECIPES, REPO_ROOT, tiny_overrides
from service_fixtures import postgres_database, services  # noqa: F401 (pytest fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "synthx"))
from test_synthx_study import fake_synthetic_cohort  # noqa: E402

from lightning_modules.recipe import load_recipe  # noqa: E402
from synthx.commands.sweep import main as sweep_main  # noqa: E402
from synthx.workflows.sweep import PARENT_ATTR, create_sweep, make_objective, make_storage, sqlite_worker_slot  # noqa: E402


def _arguments(tiny_phantom, tmp_path, storage, *extra):
    root, split = tiny_phantom
    synthetic = tmp_path / "synthetic"
    if not synthetic.exists():
        fake_synthetic_cohort(root, split, synthetic)
    return ["--recipe", str(RECIPES / "unet.yaml"), "--storage", storage, "--study-name", "workers", *extra,
            *tiny_overrides(root, split, tmp_path), f"synthx.cohort={synthetic}"]


def _wait_for_running_trial(storage, number: int, timeout: float = 600) -> int:
    """The PID of the worker running trial ``number`` once its MLflow run exists."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        trials = optuna.load_study(study_name="workers", storage=storage).trials
        trial = next((t for t in trials if t.number == number), None)
        if trial is not None and trial.state == TrialState.RUNNING and "mlflow_run_id" in trial.user_attrs:
            return int(trial.user_attrs["worker"].rsplit(":", 1)[1])
        time.sleep(1)
    raise AssertionError(f"trial {number} never started")


def test_three_workers_one_killed_mid_trial(services, postgres_database, tiny_phantom, tmp_path):
    storage = postgres_database
    uri = services["MLFLOW_TRACKING_URI"]  # the shared server, as workers on several machines would use
    arguments = _arguments(tiny_phantom, tmp_path, storage, "--objective", "worst_sensitivity", "--trials", "4",
                           "--heartbeat-interval", "1", "--ratio-max", "0.5")
    arguments += [f"tracking.uri={uri}", f"tracking.experiment=workers-{Path(storage).name}"]
    assert sweep_main([*arguments, "--create-only"]) == 0
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "lightning_modules.cli", "sweep", *arguments]
    workers = [subprocess.Popen(command, cwd=tmp_path, env=environment, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for _ in range(3)]
    victim = _wait_for_running_trial(storage, 0)  # the enqueued ratio-0 baseline
    os.kill(victim, signal.SIGKILL)
    outputs = {w.pid: w.communicate(timeout=900)[0] for w in workers}
    survivors = [w for w in workers if w.pid != victim]
    assert len(survivors) == 2 and all(w.returncode == 0 for w in survivors), "\n".join(o[-3000:] for o in outputs.values())

    study = optuna.load_study(study_name="workers", storage=make_storage(storage))
    trials = {t.number: t for t in study.trials}
    assert trials[0].state == TrialState.FAIL, "the killed worker's trial is failed"
    retries = [t for t in trials.values() if t.system_attrs.get("failed_trial") == 0]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE and retries[0].params["ratio"] == 0.0
    finished = [t for t in trials.values() if t.state == TrialState.COMPLETE]
    assert 4 <= len(finished) <= 5 and all(t.state != TrialState.RUNNING for t in trials.values())
    run_ids = [t.user_attrs["mlflow_run_id"] for t in trials.values()]
    assert len(set(run_ids)) == len(run_ids), "every trial trained its own run: none ran twice"

    client = MlflowClient(uri)
    parent = study.user_attrs[PARENT_ATTR]
    children = client.search_runs([client.get_run(parent).info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(int(r.data.tags["optuna_trial"]) for r in children) == sorted(trials)
    status = {r.data.tags["optuna_trial"]: r.info.status for r in children}
    assert status.pop("0") == "FAILED" and set(status.values()) == {"FINISHED"}
    assert client.get_run(parent).data.tags["best_trial_run_id"] == study.best_trial.user_attrs["mlflow_run_id"]


def test_pruned_trial_ends_its_run_killed(tiny_phantom, tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    arguments = _arguments(tiny_phantom, tmp_path, storage)
    # A validation before the last step, the only kind a trial is pruned on (synthx.workflows.sweep.prunes).
    overrides = [*arguments[arguments.index("profile=cpu"):], "trainer.max_steps=4", "trainer.val_every_n_steps=2"]
    recipe = load_recipe(RECIPES / "unet.yaml", overrides)
    study = create_sweep(recipe, "pruned", storage, "f1", [0.0])
    study.pruner = optuna.pruners.ThresholdPruner(lower=2.0)  # F1 <= 1: every reported value is pruned
    objective = make_objective(recipe, "f1", study.user_attrs[PARENT_ATTR], "pruned", ["sex"], (0.0, 0.0))
    study.optimize(objective, n_trials=1)
    trial = study.trials[0]
    assert trial.state == TrialState.PRUNED
    run = MlflowClient(recipe.tracking.uri).get_run(trial.user_attrs["mlflow_run_id"])
    assert run.info.status == "KILLED" and run.data.tags["optuna_state"] == "PRUNED"


def test_sqlite_refuses_a_second_parallel_worker(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    lock = tmp_path / "optuna.sweep-worker.lock"
    with sqlite_worker_slot(storage):
        assert lock.read_text() == f"pid {os.getpid()} on {socket.gethostname()}", "the slot names its holder"
        with pytest.raises(RuntimeError, match=f"pid {os.getpid()}.*use PostgreSQL"):
            with sqlite_worker_slot(storage):
                raise AssertionError("a second worker entered the slot")
    with sqlite_worker_slot(storage):  # free again once the first worker is done
        assert lock.read_text() == f"pid {os.getpid()} on {socket.gethostname()}"


def test_optuna_dashboard_reads_the_sweep_storage(postgres_database, tiny_phantom, tmp_path):
    import json
    import urllib.request

    recipe = load_recipe(RECIPES / "unet.yaml", tiny_overrides(*tiny_phantom, tmp_path))
    create_sweep(recipe, "dashboard", postgres_database, "f1", [0.0])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dashboard = subprocess.Popen([str(Path(sys.executable).parent / "optuna-dashboard"), postgres_database,
                                  "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as answer:
                    studies = json.load(answer)["study_summaries"]
                break
            except OSError:
                assert time.time() < deadline and dashboard.poll() is None, "optuna-dashboard did not answer"
                time.sleep(0.5)
        assert [s["study_name"] for s in studies] == ["dashboard"]
    finally:
        dashboard.terminate()
        dashboard.wait(30)


def test_worker_refuses_a_shared_study_that_was_not_created(tiny_phantom, tmp_path, capsys):
    storage = f"journal:{tmp_path / 'journal.log'}"
    assert sweep_main(_arguments(tiny_phantom, tmp_path, storage)) == 1
    assert "create it once with --create-only" in capsys.readouterr().err
