"""Training end to end on the tiny phantom: MLflow logging, resume, SIGKILL, evaluation, compare, DDP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import RECIPES, REPO_ROOT, tiny_overrides
from lightning_modules.data.cohort import CohortError
from lightning_modules.data.datamodule import CohortDataModule
from lightning_modules.config.recipe import load_recipe
from lightning_modules.training import build_module, default_output_dir, train


class StopAt(pl.Callback):
    """Simulates a crash after a given number of optimizer steps."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            raise RuntimeError("simulated crash")


def test_training_logs_to_mlflow_and_resumes_into_the_same_run(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    recipe = load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, split, tmp_path, steps=4))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(recipe, callbacks=[StopAt(2)])
    out = default_output_dir(recipe)
    assert (out / "checkpoints" / "last.ckpt").exists()
    first_run = (out / "mlflow_run_id.txt").read_text()
    # Lightning runs checkpoint callbacks after the others, so the crash at step 2 comes before its save.
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 1

    result = train(recipe)
    assert result.run_id == first_run, "resumed into the same MLflow run"
    assert result.global_step == 4, "resumed at step 1 and stopped at max_steps, not 1 + 4"
    client = MlflowClient(recipe.tracking.uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    for key in ("backbone", "recipe", "variant", "synthx_ratio", "split_sha256", "git_commit"):
        assert tags[key], key
    assert tags["variant"] == "baseline" and tags["resumed"] == "true"
    assert len(tags["split_sha256"]) == 64
    lr_key = next(k for k in run.data.metrics if k.startswith("lr-"))
    steps = sorted({m.step for m in client.get_metric_history(result.run_id, lr_key)})
    assert steps[-1] == 3 and len(steps) >= 3, "the learning-rate history continues across the resume"
    assert "val/dice/pancreatic_lesion" in run.data.metrics and "val/f1/overall" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"recipe.yaml", "checkpoints"} <= artifacts
    assert {a.path for a in client.list_artifacts(result.run_id, "checkpoints")} >= {"checkpoints/best.ckpt", "checkpoints/last.ckpt"}
    assert run.inputs.dataset_inputs, "the training split is logged as a dataset input"


def test_training_refuses_a_leaking_split(tiny_phantom, tmp_path):
    """A training scan copied into the test split under another patient id: refused, cached, overridable."""
    import shutil

    from lightning_modules.data.cohort import load_cohort, write_metadata

    root, split = tiny_phantom
    cohort_root = tmp_path / "cohort"
    shutil.copytree(root, cohort_root)
    table = pd.read_csv(split)
    source = table[table["split"] == "train"].iloc[0]
    shutil.copytree(cohort_root / source["case_id"], cohort_root / "DUP0001")
    metadata = load_cohort(cohort_root).metadata
    row = metadata[metadata["case_id"] == source["case_id"]].assign(case_id="DUP0001", patient_id="PT_DUP")
    write_metadata(cohort_root, pd.concat([metadata, row], ignore_index=True))
    leaky = tmp_path / "leaky.csv"
    pd.concat([table, pd.DataFrame([{"case_id": "DUP0001", "patient_id": "PT_DUP", "split": "test"}])]).to_csv(leaky, index=False)
    recipe = load_recipe(RECIPES / "unet.yaml", tiny_overrides(cohort_root, leaky, tmp_path))
    with pytest.raises(CohortError, match="DUP0001"):
        train(recipe)
    cached = list((tmp_path / "outputs" / ".leakage_checks").glob("*.json"))
    assert len(cached) == 1, "the leakage check is cached by content"
    with pytest.raises(CohortError, match="DUP0001"):
        train(recipe)  # refused again, from the cache
    override = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(cohort_root, leaky, tmp_path), "data.allow_leakage=true"])
    result = train(override)
    tags = MlflowClient(override.tracking.uri).get_run(result.run_id).data.tags
    assert tags["leakage_override"] == "true", "the override is recorded in MLflow"


def test_killed_training_resumes_with_the_same_step_count(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    overrides = tiny_overrides(root, split, tmp_path, steps=40)
    recipe = load_recipe(RECIPES / "unet.yaml", overrides)
    last = default_output_dir(recipe) / "checkpoints" / "last.ckpt"
    command = [sys.executable, "-m", "lightning_modules.cli", "train", "--recipe", str(RECIPES / "unet.yaml"), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    step = 0
    while time.time() < deadline and process.poll() is None:
        if last.exists():
            try:
                step = torch.load(last, weights_only=False)["global_step"]
            except Exception:  # caught mid-replace on some filesystems; read again
                step = 0
            if step >= 3:
                break
        time.sleep(0.5)
    assert process.poll() is None, "training finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert 3 <= step < 40
    run_id = (default_output_dir(recipe) / "mlflow_run_id.txt").read_text()
    result = train(recipe)
    assert result.run_id == run_id and result.global_step == 40
    assert MlflowClient(recipe.tracking.uri).get_run(run_id).info.status == "FINISHED"


class RecordsToDisk(pl.Callback):
    """Writes the gathered validation records (rank 0) so the test can read them back from spawned processes."""

    def __init__(self, path):
        self.path = str(path)

    def on_validation_epoch_end(self, trainer, pl_module):
        table = pl_module.collect_records("val")
        if trainer.is_global_zero:
            table.to_csv(self.path, index=False)


def test_ddp_two_processes_count_every_case_once(tiny_phantom, tmp_path):
    """2-process gloo validation equals single-process validation: same records, each case once."""
    from lightning_modules.evaluation.detection import subgroup_metrics

    root, split = tiny_phantom
    table = pd.read_csv(split)
    if (table["split"] == "val").sum() % 2 == 0:
        # An odd validation set makes DistributedSampler pad with a repeated case: move one
        # single-scan validation patient to test (patients stay whole).
        val = table[table["split"] == "val"]
        single = val.groupby("patient_id").filter(lambda g: len(g) == 1)["patient_id"].iloc[0]
        table.loc[table["patient_id"] == single, "split"] = "test"
        split = tmp_path / "odd_val.csv"
        table.to_csv(split, index=False)
    recipe = load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, split, tmp_path))
    n_val = int((table["split"] == "val").sum())
    assert n_val % 2 == 1
    pl.seed_everything(0)
    module = build_module(recipe)
    tables = {}
    for name, kwargs in (("single", dict(devices=1)), ("ddp", dict(devices=2, strategy="ddp_spawn"))):
        path = tmp_path / f"{name}.csv"
        trainer = pl.Trainer(accelerator="cpu", logger=False, callbacks=[RecordsToDisk(path)], enable_progress_bar=False,
                             enable_model_summary=False, **kwargs)
        trainer.validate(module, datamodule=CohortDataModule(recipe))
        tables[name] = pd.read_csv(path, keep_default_na=False, na_values=[""])
    single, ddp = tables["single"], tables["ddp"]
    assert len(single) == n_val and len(ddp) == n_val and ddp["case_id"].is_unique
    columns = ["case_id", "label", "volume_mm3", "max_prob"]
    pd.testing.assert_frame_equal(single[columns], ddp[columns], check_exact=False, rtol=1e-5)
    metrics_single = subgroup_metrics(single, 50.0)
    metrics_ddp = subgroup_metrics(ddp, 50.0)
    pd.testing.assert_frame_equal(metrics_single, metrics_ddp, check_exact=False, rtol=1e-9)


def test_same_recipe_and_seed_give_the_same_metrics(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    recipe = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path, steps=3), "trainer.deterministic=true"])
    first = train(recipe, output_dir=tmp_path / "first")
    second = train(recipe, output_dir=tmp_path / "second")
    keys = [k for k in first.metrics if k.startswith(("val/", "train/loss"))]
    assert keys and first.run_id != second.run_id
    for key in keys:
        assert first.metrics[key] == pytest.approx(second.metrics[key], rel=1e-6, abs=1e-9), key
    other = train(load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path, steps=3), "seed=7"]),
                  output_dir=tmp_path / "other")
    assert other.metrics["train/loss"] != first.metrics["train/loss"], "the seed matters"
