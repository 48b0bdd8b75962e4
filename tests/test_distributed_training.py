"""``benchx train`` on 2 CPU processes (gloo): Lightning's launcher, torchrun, and torchrun as 2 "nodes" on
127.0.0.1 give one FINISHED MLflow run whose validation metrics equal a 1-process validation of the same
weights; a rank killed mid-run (Lightning's launcher or torchrun) ends the run FAILED and the rerun
resumes it at its checkpoint.

Each test starts 2 or 3 trainings of a few steps; on the shared 2-core machine a 2-process training
takes 1.5-2.5 minutes, hence the ``slow`` marker (``--run-slow``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import RECIPES, REPO_ROOT, tiny_overrides
from lightning_modules.data.datamodule import CohortDataModule
from lightning_modules.evaluation.callback import SubgroupEvaluation
from lightning_modules.infrastructure.run_folder import RunRecord
from lightning_modules.models.checkpoints import load_module_from_checkpoint
from lightning_modules.recipe import load_recipe
from lightning_modules.tracking.recorder import logger_recorder

DDP = ["trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


def _train_command(launcher: list[str], folder: Path, overrides: list[str]) -> list[str]:
    return [*launcher, "-m", "lightning_modules.cli", "train", "--recipe", str(RECIPES / "unet.yaml"), "--out", str(folder), *overrides, *DDP]


def _single_process_validation(recipe, checkpoint: Path) -> dict[str, float]:
    """The validation metrics of a checkpoint on one process (no logger)."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[SubgroupEvaluation.from_detection(recipe.detection, recorder=logger_recorder)])
    trainer.validate(load_module_from_checkpoint(recipe, checkpoint), datamodule=CohortDataModule(recipe.data, recipe.seed))
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}


@pytest.mark.slow
def test_ddp_through_the_cli_and_torchrun_log_one_finished_run_with_single_process_metrics(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    overrides = tiny_overrides(root, split, tmp_path, steps=4)
    recipe = load_recipe(RECIPES / "unet.yaml", overrides)
    client = MlflowClient(recipe.tracking.uri)
    launchers = {
        "lightning": [sys.executable],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
    }
    runs = {}
    for name, launcher in launchers.items():
        folder = tmp_path / name
        done = subprocess.run(_train_command(launcher, folder, overrides), cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("run ") == 1, "only rank 0 reports"
        runs[name] = RunRecord.read(folder).run_id
        run = client.get_run(runs[name])
        assert run.info.status == "FINISHED"
        assert {a.path for a in client.list_artifacts(runs[name], "checkpoints")} >= {"checkpoints/best.ckpt", "checkpoints/last.ckpt"}
        # The validation at step 4 ran on the weights of best.ckpt (the only validation).
        single = _single_process_validation(recipe, folder / "checkpoints" / "best.ckpt")
        for key in ("val/dice/pancreatic_lesion", "val/f1/overall", "val/sensitivity/overall", "val/n/overall"):
            if key in single:
                assert run.data.metrics[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), (name, key)
    experiment = client.get_experiment_by_name(str(recipe.tracking.experiment))
    assert len(client.search_runs([experiment.experiment_id])) == 2, "one MLflow run per training, none from rank 1"
    first, second = (client.get_run(runs[name]).data.metrics for name in launchers)
    assert first["val/dice/pancreatic_lesion"] == pytest.approx(second["val/dice/pancreatic_lesion"], rel=1e-5)


def _children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _local_rank_of(pid: int) -> str | None:
    """The LOCAL_RANK in a process's environment (set by torchrun and by Lightning's launcher), or None."""
    try:
        variables = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [v.split(b"=", 1)[1].decode() for v in variables if v.startswith(b"LOCAL_RANK=")]
    return found[0] if found else None


def _wait_for_checkpoint_step(process: subprocess.Popen, last: Path, step: int) -> None:
    """Wait (at most 400 s) until ``last`` holds at least ``step`` steps while ``process`` still runs."""
    deadline, reached = time.time() + 400, 0
    while time.time() < deadline and process.poll() is None and reached < step:
        try:
            reached = torch.load(last, weights_only=False)["global_step"] if last.exists() else 0
        except Exception:  # read while being replaced
            reached = 0
        time.sleep(0.5)
    assert process.poll() is None and reached >= step, "training finished or failed before rank 1 could be killed"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
def test_a_killed_rank_fails_the_run_and_the_rerun_resumes_it_under_ddp(tiny_phantom, tmp_path, launcher):
    """Rank 1 SIGKILLed mid-run (Lightning's launcher: its child process; torchrun: the agent's worker
    of RANK 1, after which the agent stops rank 0): the run ends FAILED, not RUNNING, and the same
    command resumes it from the checkpoint into the same run."""
    root, split = tiny_phantom
    overrides = tiny_overrides(root, split, tmp_path, steps=30)
    recipe = load_recipe(RECIPES / "unet.yaml", overrides)
    folder = tmp_path / "ddp"
    last = folder / "checkpoints" / "last.ckpt"
    start = [sys.executable] if launcher == "lightning" else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    main = subprocess.Popen(_train_command(start, folder, overrides), cwd=REPO_ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_checkpoint_step(main, last, 3)
    # Both launchers start the process of local rank 1 as a child, with LOCAL_RANK=1 in its environment.
    rank1 = [pid for pid in _children(main.pid) if _local_rank_of(pid) == "1"]
    assert len(rank1) == 1, f"{launcher}: rank 1 is not a child process of the launching one"
    os.kill(rank1[0], signal.SIGKILL)
    main.wait(timeout=120)
    assert main.returncode != 0
    run_id = RunRecord.read(folder).run_id
    client = MlflowClient(recipe.tracking.uri)
    assert client.get_run(run_id).info.status == "FAILED"
    resumed_from = torch.load(last, weights_only=False)["global_step"]

    done = subprocess.run(_train_command(start, folder, overrides), cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"run {run_id}: 30 steps" in done.stdout
    assert f"Restoring states from the checkpoint path at {folder}" in done.stderr and resumed_from >= 3
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["resumed"] == "true"
    lr_key = next(k for k in run.data.metrics if k.startswith("lr-"))
    steps = sorted({m.step for m in client.get_metric_history(run_id, lr_key)})
    assert steps[-1] == 29 and steps[0] == 0, "one learning-rate history across the kill"


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_loopback_with_torchrun_log_one_finished_run_with_single_process_metrics(tiny_phantom, tmp_path):
    """Two torchrun agents, one process each, as node 0 and node 1 of a 2-node job on 127.0.0.1 (static
    rendezvous, as on a cluster without Slurm): one FINISHED run, created by node 0 only, whose validation
    metrics equal a 1-process validation of the same weights."""
    root, split = tiny_phantom
    overrides = tiny_overrides(root, split, tmp_path, steps=4)
    recipe = load_recipe(RECIPES / "unet.yaml", overrides)
    folder, port = tmp_path / "two_nodes", _free_port()
    nodes = [
        subprocess.Popen(
            [*_train_command([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={rank}",
                              "--master_addr=127.0.0.1", f"--master_port={port}"], folder, overrides),
             "trainer.devices=1", "trainer.num_nodes=2"],
            cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for rank, (node, (out, err)) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, (rank, err[-3000:])
    assert outputs[0][0].count("run ") == 1 and outputs[1][0].count("run ") == 0, "only node 0's rank 0 reports"
    assert "[rank: 1] Seed set to 0" in outputs[1][1], f"node 1 did not run global rank 1: {outputs[1][1][-3000:]}"
    client = MlflowClient(recipe.tracking.uri)
    run_id = RunRecord.read(folder).run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["trainer.num_nodes"] == "2"
    single = _single_process_validation(recipe, folder / "checkpoints" / "best.ckpt")
    compared = [key for key in ("val/dice/pancreatic_lesion", "val/f1/overall", "val/sensitivity/overall", "val/n/overall") if key in single]
    assert compared
    for key in compared:
        assert run.data.metrics[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), key
    experiment = client.get_experiment_by_name(str(recipe.tracking.experiment))
    assert len(client.search_runs([experiment.experiment_id])) == 1, "one MLflow run, none from node 1"


def _records(client: MlflowClient, run_id: str, stage: str, folder: Path):
    import pandas as pd

    path = client.download_artifacts(run_id, f"evaluation/{stage}_records.csv", str(folder))
    return pd.read_csv(path).sort_values("case_id").reset_index(drop=True)


@pytest.mark.slow
def test_evaluate_under_ddp_and_torchrun_gives_the_single_process_records_in_one_finished_run(tiny_phantom, tmp_path):
    """``benchx evaluate`` on 2 processes (Lightning's launcher, then torchrun): one FINISHED run each, and the
    per-case records and metrics of the 1-process evaluation (the DistributedSampler's padding de-duplicated)."""
    root, split = tiny_phantom
    overrides = tiny_overrides(root, split, tmp_path, steps=4)
    recipe = load_recipe(RECIPES / "unet.yaml", overrides)
    client = MlflowClient(recipe.tracking.uri)
    folder = tmp_path / "trained"
    single_launch = [sys.executable]
    done = subprocess.run(_train_command(single_launch, folder, overrides)[:-len(DDP)], cwd=REPO_ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    training_run = RunRecord.read(folder).run_id

    def evaluate(launcher: list[str], extra: list[str]) -> str:
        command = [*launcher, "-m", "lightning_modules.cli", "evaluate", "--run-id", training_run, "--stages", "val,test",
                   *overrides, *extra]
        env = {**ENV, "MLFLOW_TRACKING_URI": str(recipe.tracking.uri)}  # where --run-id is looked up
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        reported = [line for line in done.stdout.splitlines() if line.startswith("evaluation run ")]
        assert len(reported) == 1, f"only rank 0 reports: {done.stdout}"
        if extra and launcher == single_launch:  # Lightning's launcher started a second process (torchrun: the world of 2 is torchrun's)
            assert "MEMBER: 1/2" in done.stderr + done.stdout, done.stderr[-3000:]
        return reported[0].split()[-1]

    runs = {
        "one process": evaluate(single_launch, []),
        "lightning ddp": evaluate(single_launch, DDP),
        "torchrun": evaluate([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"], DDP),
    }
    reference = client.get_run(runs["one process"])
    for name, run_id in runs.items():
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED", name
        assert run.data.tags["training_run_id"] == training_run
        for stage in ("val", "test"):
            records, expected = _records(client, run_id, stage, tmp_path / name / stage), _records(client, runs["one process"], stage, tmp_path / "ref" / stage)
            assert records["case_id"].is_unique and len(records) == len(expected), (name, stage)
            assert records["case_id"].tolist() == expected["case_id"].tolist(), (name, stage)
            assert records["label"].tolist() == expected["label"].tolist(), (name, stage)
            for column in ("volume_mm3", "max_prob"):
                assert records[column].tolist() == pytest.approx(expected[column].tolist(), rel=1e-5, abs=1e-6), (name, stage, column)
        compared = [key for key in reference.data.metrics if key.startswith(("test", "val", "operating_point")) and key.endswith(("overall", "val_chosen", "fixed"))]
        assert len(compared) >= 5, sorted(reference.data.metrics)[:20]
        for key in compared:
            assert run.data.metrics[key] == pytest.approx(reference.data.metrics[key], rel=1e-5, abs=1e-7, nan_ok=True), (name, key)
    experiment = client.get_experiment_by_name(str(recipe.tracking.experiment))
    evaluations = [r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("stage") == "evaluation"]
    assert len(evaluations) == 3, "one MLflow run per evaluation, none from rank 1"
