"""`mlflow run . -e train --env-manager local` trains into the run that `mlflow run` opened."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient

from conftest import REPO_ROOT, new_sqlite_store, tiny_overrides

MLPROJECT_ENTRIES = {
    "main", "train", "evaluate", "compare", "predict", "phantom", "make_splits", "validate", "audit", "import",
    "fetch_example", "synthx_train", "synthesize", "synthx_quality", "sweep", "replicates", "report",
}


def test_mlproject_has_typed_entry_points_for_every_command():
    spec = yaml.safe_load((REPO_ROOT / "MLproject").read_text())
    assert set(spec["entry_points"]) == MLPROJECT_ENTRIES
    from lightning_modules.cli import COMMANDS

    for name, entry in spec["entry_points"].items():
        command = entry["command"].split()[1]
        assert command in COMMANDS, f"{name}: benchx {command} is not a command"
        for parameter in entry.get("parameters", {}).values():
            assert parameter["type"] in {"string", "path", "float", "uri"}
    # Every command but `recipe` (it prints a recipe for a person to read) can be run by `mlflow run`.
    entered = {entry["command"].split()[1] for entry in spec["entry_points"].values()}
    assert set(COMMANDS) - entered == {"recipe"}


def test_mlflow_run_train_entry_point(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    uri = new_sqlite_store(tmp_path / "mlflow.db")
    overrides = [o for o in tiny_overrides(root, split, tmp_path) if not o.startswith("tracking.uri")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env = {**env, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    command = [str(Path(sys.executable).parent / "mlflow"), "run", str(REPO_ROOT), "-e", "train", "--env-manager", "local",
               "--experiment-name", "mlproject-test", "-P", "recipe=recipes/unet.yaml", "-P", "overrides=" + " ".join(overrides)]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("mlproject-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "the training logged into the run that `mlflow run` opened, not a second one"
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["backbone"] == "unet" and run.data.tags["mlflow.project.entryPoint"] == "train"
    assert "val/dice/pancreatic_lesion" in run.data.metrics
