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
from lightning_modules.recipe import load_recipe
from lightning_modules.models.checkpoints import build_module
from lightning_modules.infrastructure.run_folder import RunRecord
from lightning_modules.workflows.train import default_output_dir, train


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
    first_run = RunRecord.read(out).run_id
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
    run_id = RunRecord.read(default_output_dir(recipe)).run_id
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
        trainer.validate(module, datamodule=CohortDataModule(recipe.data, recipe.seed))
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


def _wait_for_step(path, step: int, process, timeout: float = 300) -> int:
    """Wait until the checkpoint at ``path`` reaches ``step`` while ``process`` runs; its step."""
    deadline, found = time.time() + timeout, 0
    while time.time() < deadline and process.poll() is None:
        if path.exists():
            try:
                found = torch.load(path, weights_only=False)["global_step"]
            except Exception:  # read while being replaced
                found = 0
            if found >= step:
                break
        time.sleep(0.5)
    return found


def test_one_process_per_folder_sigterm_ends_killed_and_another_recipe_is_refused(tiny_phantom, tmp_path, capsys):
    """Two trainings on one folder: the second is refused naming the first; SIGTERM ends the run KILLED;
    the rerun resumes it to FINISHED; a changed recipe is then refused and the run stays FINISHED."""
    from lightning_modules.cli import main as benchx

    def main(arguments):  # `benchx train ...`: expected errors are two lines on stderr and exit code 2
        return benchx(["train", *arguments])

    root, split = tiny_phantom
    folder = tmp_path / "run"
    overrides = tiny_overrides(root, split, tmp_path, steps=30)
    arguments = ["--recipe", str(RECIPES / "unet.yaml"), "--out", str(folder), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "lightning_modules.cli", "train", *arguments], cwd=REPO_ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert _wait_for_step(folder / "checkpoints" / "last.ckpt", 2, first) >= 2
    assert main(arguments) == 2
    refusal = capsys.readouterr().err
    assert f"is in use by process {first.pid}" in refusal and str(folder) in refusal
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 143, stderr[-2000:]
    assert "stopped by SIGTERM; rerun the same command to resume" in stderr
    recipe = load_recipe(RECIPES / "unet.yaml", overrides)
    run_id = RunRecord.read(folder).run_id
    client = MlflowClient(recipe.tracking.uri)
    assert client.get_run(run_id).info.status == "KILLED"

    assert main(arguments) == 0
    assert client.get_run(run_id).info.status == "FINISHED"
    assert main([*arguments, "trainer.max_steps=40"]) == 2
    refusal = capsys.readouterr().err
    assert "trainer.max_steps: 30 -> 40" in refusal and "--fresh" in refusal
    assert client.get_run(run_id).info.status == "FINISHED", "a refusal never touches the finished run"
    assert train(recipe, output_dir=folder).run_id == run_id, "same recipe: already finished, nothing to do"
    assert client.get_run(run_id).info.status == "FINISHED"


class CrashInValidation(pl.Callback):
    """Simulates a crash during the validation at ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_validation_start(self, trainer, pl_module):
        if trainer.global_step == self.step:
            raise RuntimeError("crash in validation")


def test_resume_after_a_crash_in_validation_and_a_damaged_checkpoint_logs_every_validation(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    recipe = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path, steps=6), "trainer.val_every_n_steps=2"])
    with pytest.raises(RuntimeError, match="crash in validation"):
        train(recipe, callbacks=[CrashInValidation(4)])
    checkpoints = default_output_dir(recipe) / "checkpoints"
    # The step checkpoint of a validation step is not written before that validation: resuming
    # from step 4 would skip the validation at 4.
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 3
    assert torch.load(checkpoints / "last.previous.ckpt", weights_only=False)["global_step"] == 2
    data = (checkpoints / "last.ckpt").read_bytes()
    (checkpoints / "last.ckpt").write_bytes(data[:1000])
    client = MlflowClient(recipe.tracking.uri)
    run_id = RunRecord.read(default_output_dir(recipe)).run_id
    assert client.get_run(run_id).info.status == "FAILED"

    result = train(recipe)
    assert result.run_id == run_id and result.global_step == 6
    assert client.get_run(run_id).info.status == "FINISHED"
    steps = sorted({m.step for m in client.get_metric_history(run_id, "val/dice/pancreatic_lesion")})
    # Lightning logs a validation after step k at MLflow step k - 1: the validations at 2, 4 and 6.
    assert steps == [1, 3, 5]


def test_training_without_validation_does_not_warn_about_the_missing_validation_metric(tiny_phantom, tmp_path):
    """The CPU profiles train without validation on purpose; Lightning's warning that best.ckpt's
    monitored validation Dice is missing is then expected noise. With validation it would be real."""
    import warnings

    root, split = tiny_phantom
    recipe = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path, steps=2), "trainer.val_every_n_steps=0"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(recipe)
    assert result.global_step == 2 and result.last_checkpoint.exists()
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "could not find the monitored key" in m], messages
