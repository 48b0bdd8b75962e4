"""Tracking on the shared MLflow server (PostgreSQL behind it) works as on SQLite; a direct PostgreSQL
URI puts artifacts in the defined place, never in ./mlruns.

Run: ``python -m pytest -q tests/services/test_tracking_server.py``
"""

from __future__ import annotations

import uuid
from pathlib import Path
from urllib.parse import urlparse

import mlflow
from mlflow.tracking import MlflowClient

from conftest import RECIPES, tiny_overrides
from service_fixtures import postgres_database, services  # noqa: F401 (pytest fixtures)
from lightning_modules.recipe import load_recipe
from lightning_modules.workflows.evaluate import compare, evaluate
from lightning_modules.workflows.train import train


def test_train_evaluate_compare_through_the_server(services, tiny_phantom, tmp_path, monkeypatch):
    server = services["MLFLOW_TRACKING_URI"]
    experiment = f"server-{uuid.uuid4().hex[:8]}"
    monkeypatch.chdir(tmp_path)
    root, split = tiny_phantom
    evaluations, trainings = [], []
    for seed in (0, 1):
        recipe = load_recipe(RECIPES / "unet.yaml", [
            *tiny_overrides(root, split, tmp_path, steps=2), f"seed={seed}",
            f"tracking.uri={server}", f"tracking.experiment={experiment}",
            f"tracking.output_dir={tmp_path / f'outputs-{seed}'}",
        ])
        result = train(recipe)
        trainings.append(result.run_id)
        evaluations.append(evaluate(recipe, result.best_checkpoint, ("test",), training_run_id=result.run_id)[0])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    table, compare_run = compare(evaluations, "test", uri=server, experiment=experiment, n_resamples=20)
    assert len(table) > 0

    client = MlflowClient(server)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 5 and {r.info.status for r in runs} == {"FINISHED"}
    training = client.get_run(trainings[0])
    assert "train/loss" in training.data.metrics or any(k.startswith("train/") for k in training.data.metrics)
    assert [i.dataset.name for i in training.inputs.dataset_inputs] == [f"train:{Path(split).name}"]
    checkpoint = client.download_artifacts(trainings[0], "checkpoints", str(tmp_path / "download"))
    assert sorted(p.name for p in Path(checkpoint).iterdir()) == ["best.ckpt", "last.ckpt"]
    assert client.download_artifacts(trainings[0], "recipe.yaml", str(tmp_path / "download"))
    assert client.get_run(evaluations[1]).data.tags["training_run_id"] == trainings[1]
    assert "evaluation/test_records.csv" in {a.path for a in client.list_artifacts(evaluations[0], "evaluation")}
    assert "comparison/test_comparison.csv" in {a.path for a in client.list_artifacts(compare_run, "comparison")}
    # Artifacts travel through the server (proxied), none lands in the working folder.
    assert client.get_run(trainings[0]).info.artifact_uri.startswith("mlflow-artifacts:/")
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlartifacts").exists()


def test_direct_postgresql_uri_puts_artifacts_under_the_artifact_root(postgres_database, tmp_path, monkeypatch):
    from lightning_modules.tracking import ARTIFACT_ROOT_VARIABLE, experiment_id

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ARTIFACT_ROOT_VARIABLE, str(tmp_path / "artifact-root"))
    uri = postgres_database.replace("postgresql+psycopg://", "postgresql://")  # as a user types it
    client = MlflowClient(uri)
    run = client.create_run(experiment_id("direct db", uri))
    (tmp_path / "note.txt").write_text("hello")
    client.log_artifact(run.info.run_id, str(tmp_path / "note.txt"))
    location = Path(urlparse(client.get_experiment_by_name("direct db").artifact_location).path)
    assert location == tmp_path / "artifact-root" / "direct_db"
    assert (location / run.info.run_id / "artifacts" / "note.txt").read_text() == "hello"
    assert not (tmp_path / "mlruns").exists()
    mlflow.set_tracking_uri(None)
