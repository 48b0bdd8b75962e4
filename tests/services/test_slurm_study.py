"""Seeds as the unit of inference under the local single-node Slurm: ``scripts/slurm-study.sbatch``
as a job array of two tiny replicates (seeds 0 and 1) writing to the MLflow server on PostgreSQL,
then ``benchx study --seeds 2 --pool-only`` pools them into one analysis.

Run: ``python -m pytest -q tests/services/test_slurm_study.py``
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

from conftest import RECIPES, REPO_ROOT
from service_fixtures import services  # noqa: F401 (pytest fixture)
from test_slurm import _environment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "synthx"))
from test_replicates import study_arguments  # noqa: E402
from test_synthx_study import _study_settings  # noqa: E402

SBATCH_TEMPLATE = REPO_ROOT / "scripts" / "slurm-study.sbatch"


def _array_done(job_id: str, environment) -> bool:
    queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i %T"], env=environment, capture_output=True,
                            text=True).stdout.strip()
    return queued == ""


def test_a_slurm_array_of_two_replicates_is_pooled(services, tiny_phantom, tmp_path, capsys):
    from lightning_modules.infrastructure.process import git_commit
    from lightning_modules.tracking import experiment_id
    from synthx.commands.study import main
    from synthx.workflows.replicates import finished_replicates, replicate_key

    root, split = tiny_phantom
    server = services["MLFLOW_TRACKING_URI"]
    settings = _study_settings(root, split, tmp_path)
    settings.synthx_recipe = str(RECIPES / "generator" / "synthx.yaml")
    settings.experiment = f"seeds-{uuid.uuid4().hex[:8]}"  # the server outlives the test: a new experiment
    settings.overrides = [*settings.overrides, f"tracking.uri={server}"]
    arguments = study_arguments(settings)
    script = tmp_path / "study.sbatch"  # the users' template, sized for this 2-CPU node without GPUs
    script.write_text(SBATCH_TEMPLATE.read_text().replace("#SBATCH --gpus-per-node=1\n", ""))
    environment = _environment(services)
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--array=0-1", "--cpus-per-task=1", "--time=30", f"--output={tmp_path}/task-%a.log",
         str(script), *arguments],
        cwd=tmp_path, env=environment, capture_output=True, text=True, check=True,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.time() + 1200
    while not _array_done(job_id, environment):
        assert time.time() < deadline, "the array did not finish in 20 minutes"
        time.sleep(2)
    logs = {seed: (tmp_path / f"task-{seed}.log").read_text() for seed in (0, 1)}
    for seed, log in logs.items():
        assert f"seed {seed}" in log and "[study] compare: done" in log, log[-3000:]

    client = MlflowClient(server)
    experiment = experiment_id(settings.experiment, server)
    replicates = finished_replicates(client, experiment, replicate_key(settings, git_commit()))
    assert sorted(replicates) == [0, 1]
    assert client.get_run(replicates[1].data.tags["step.baseline"]).data.params["seed"] == "1"

    assert main([*arguments, "--seeds", "2", "--pool-only"]) == 0
    assert "2 seeds pooled" in capsys.readouterr().out
    pooled = client.search_runs([experiment], "tags.stage = 'replicates_pooled'")
    assert len(pooled) == 1
    assert set(pooled[0].data.tags["replicated_studies"].split()) == {r.info.run_id for r in replicates.values()}
    table = pd.read_csv(client.download_artifacts(pooled[0].info.run_id, "pooled/test_subgroup_matched_specificity.csv", str(tmp_path / "p")))
    overall = table[(table["attribute"] == "overall") & (table["metric"] == "specificity")].iloc[0]
    assert overall["seeds"] == 2 and {"delta 0", "delta 1"} <= set(table.columns)

    from synthx.commands.report import main as report

    page = tmp_path / "seeds.md"
    assert report(["--run-id", pooled[0].info.run_id, "--markdown", str(page), "--tracking-uri", server]) == 0
    text = page.read_text()
    for seed in (0, 1):
        assert f"- Seed {seed} (study run `{replicates[seed].info.run_id}`): Primary endpoint" in text
    assert "on average over 2 seeds" in text and git_commit() in text
