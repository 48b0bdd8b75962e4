"""Training under the local single-node Slurm: ``srun --ntasks-per-node=2`` DDP finishes; a job of
``scripts/slurm-train.sbatch`` (``--signal=SIGUSR1@... --requeue``) is requeued once on SIGUSR1 and
resumes from its checkpoint into the same MLflow run.

Run: ``python -m pytest -q tests/services/test_slurm.py``
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from mlflow.tracking import MlflowClient

from conftest import RECIPES, REPO_ROOT, tiny_overrides
from service_fixtures import services  # noqa: F401 (pytest fixture)

SBATCH_TEMPLATE = REPO_ROOT / "scripts" / "slurm-train.sbatch"


def _environment(services) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": services["SLURM_CONF"], "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def _job(job_id: str, environment) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, Restarts, ...)."""
    text = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=environment, capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def _only_run(client: MlflowClient, experiment: str):
    """The one run of an experiment: a training whose ranks each opened a run would show several."""
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [(r.info.run_id, r.info.status) for r in runs]
    return runs[0]


def test_srun_two_tasks_ddp_training_finishes(services, tiny_phantom, tmp_path):
    root, split = tiny_phantom
    out = tmp_path / "run"
    command = ["srun", "-N1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10", "benchx", "train",
               "--recipe", str(RECIPES / "unet.yaml"), "--out", str(out), *tiny_overrides(root, split, tmp_path, steps=4),
               "trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu"]
    done = subprocess.run(command, cwd=tmp_path, env=_environment(services), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    run = _only_run(MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}"), "benchx")
    assert run.info.status == "FINISHED"
    assert "val/dice/pancreatic_lesion" in run.data.metrics


def test_sbatch_job_is_requeued_on_sigusr1_and_resumes(services, tiny_phantom, tmp_path):
    root, split = tiny_phantom
    out = tmp_path / "run"
    script = tmp_path / "job.sbatch"  # the users' template, sized for this 2-CPU node without GPUs
    script.write_text(SBATCH_TEMPLATE.read_text().replace("#SBATCH --gpus-per-node=8\n", ""))
    # Tracking on the server, as the template says: Lightning's SIGUSR1 handler ends the MLflow run
    # from inside the signal handler, which can find a SQLite store locked by the interrupted write.
    server = services["MLFLOW_TRACKING_URI"]
    experiment = f"requeue-{uuid.uuid4().hex[:8]}"  # the server outlives the test: a new experiment
    overrides = [*tiny_overrides(root, split, tmp_path, steps=100), "trainer.checkpoint_every_n_steps=5",
                 f"tracking.uri={server}", f"tracking.experiment={experiment}"]
    environment = {**_environment(services), "BENCHX_OUT": str(out), "BENCHX_STRATEGY": "auto"}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=15", f"--output={tmp_path}/job.log",
         str(script), "--recipe", str(RECIPES / "unet.yaml"), *overrides, "trainer.accelerator=cpu"],
        cwd=tmp_path, env=environment, capture_output=True, text=True, check=True,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.time() + 600
    while not (out / "checkpoints" / "last.ckpt").exists():  # training is under way
        state = _job(job_id, environment).get("JobState")
        assert time.time() < deadline and state in ("PENDING", "RUNNING"), f"job {state}: " + (tmp_path / "job.log").read_text()[-3000:]
        time.sleep(1)
    # The signal Slurm sends `--signal` seconds before the time limit, sent now to the job's steps.
    subprocess.run(["scancel", "--signal=USR1", job_id], env=environment, check=True)
    while (state := _job(job_id, environment).get("JobState")) != "COMPLETED":
        assert time.time() < deadline and state in ("RUNNING", "PENDING", "REQUEUED", "COMPLETING"), f"job {state}: " + (tmp_path / "job.log").read_text()[-3000:]
        time.sleep(2)
    job = _job(job_id, environment)
    log = (tmp_path / "job.log").read_text()
    assert job["Restarts"] == "1" and "(restart 1)" in log, log[-3000:]
    assert list(out.glob("hpc_ckpt_*.ckpt")), "Lightning saved its requeue checkpoint"
    assert "Restoring states from the checkpoint path" in log, "the restarted job resumed from a checkpoint"
    client = MlflowClient(server)
    run = _only_run(client, experiment)
    run_id = run.info.run_id
    assert run.data.tags.get("resumed") == "true" and run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert max(steps) >= 90
