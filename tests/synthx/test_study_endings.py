"""Every study run ends: on SIGTERM, SIGINT or a dead process (KILLED), on a failing or refused step
(FAILED), with one line naming the step and the command that resumes, and replicate workers that
die with their parent. Each test asserts that no run of the experiment is left RUNNING and that the
steps already finished are kept and reused."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import REPO_ROOT
from test_synthx_study import _study_settings


def cli_arguments(settings) -> list[str]:
    """``benchx study`` arguments for these settings (as tests/synthx/test_synthx_study.py builds them)."""
    return ["study", "--recipe", settings.recipe, "--profile", settings.profile, "--ratio", str(settings.ratio),
            "--target", settings.target, "--budget", str(settings.budget), "--synthesis-steps", str(settings.synthesis_steps),
            "--experiment", settings.experiment, "--out", settings.output_dir, "--locked-cases", str(settings.locked_cases),
            *[f"--synthx-override={item}" for item in settings.synthx_overrides], *settings.overrides]


def start(arguments: list[str], folder: Path) -> tuple[subprocess.Popen, Path, Path]:
    """Start ``python -m lightning_modules.cli <arguments>`` with its output in two files."""
    folder.mkdir(parents=True, exist_ok=True)
    out, err = folder / "stdout.txt", folder / "stderr.txt"
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    with open(out, "w") as stdout, open(err, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "lightning_modules.cli", *arguments], cwd=REPO_ROOT,
                                   stdout=stdout, stderr=stderr, env=environment)
    return process, out, err


def wait_for(path: Path, text: str, process: subprocess.Popen | None = None, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the process ended ({process.returncode}) before {text!r}: {path.read_text()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s")


def wait_for_step_run(settings, step: str, process: subprocess.Popen, timeout: float = 600) -> None:
    """Wait until the study's ``step`` has opened its MLflow run (so a signal lands inside the step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, runs = study_runs(settings)
        if any(run.data.tags.get("study_step") == step for run in runs):
            return
        assert process.poll() is None, f"the study ended ({process.returncode}) before its {step} run was opened"
        time.sleep(0.2)
    raise AssertionError(f"no {step} run after {timeout} s")


def gone(pid: int) -> bool:
    """True when the process has ended (no longer listed, or a zombie waiting for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def wait_gone(pids: list[int], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(gone(pid) for pid in pids):
        time.sleep(0.2)
    assert all(gone(pid) for pid in pids), f"still running: {[pid for pid in pids if not gone(pid)]}"


def study_runs(settings) -> tuple[MlflowClient, list]:
    """The client and every run of the study's experiment."""
    uri = next(item.split("=", 1)[1] for item in settings.overrides if item.startswith("tracking.uri="))
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(settings.experiment)
    return client, client.search_runs([experiment.experiment_id], max_results=1000)


def parents(runs) -> list:
    return sorted((run for run in runs if run.data.tags.get("stage") == "study"), key=lambda run: run.info.start_time)


def steps_of(runs, parent) -> dict:
    return {run.data.tags["study_step"]: run for run in runs
            if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id and "study_step" in run.data.tags}


def assert_nothing_running(settings) -> list:
    _, runs = study_runs(settings)
    running = [(run.info.run_name, run.info.run_id) for run in runs if run.info.status == "RUNNING"]
    assert not running, f"runs left RUNNING: {running}"
    return runs


def stop_at_the_baseline(monkeypatch):
    """Ctrl+C as the baseline training starts: a rerun that stops right after the cohort steps."""
    import synthx.workflows.study.steps as steps

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(steps, "train", interrupted)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_signal_during_a_step_ends_its_runs_killed_and_the_rerun_resumes(tiny_phantom, tmp_path, monkeypatch, capsys,
                                                                          signum):
    """SIGTERM or Ctrl+C at the locked_cohort step: exit 143/130, one line, the step run and the study
    run KILLED. SIGKILL leaves them RUNNING; the rerun ends them KILLED, as its process is gone."""
    from synthx.workflows.study.run import run_study
    from synthx.workflows.study.runner import END_TAG, FAILED_STEP_TAG

    root, split = tiny_phantom
    # A locked cohort of 120 scans takes seconds to write: the signal lands inside that step even on a
    # loaded machine (8 scans were written before a SIGKILL arrived, and the baseline had begun).
    settings = dataclasses.replace(_study_settings(root, split, tmp_path), locked_cases=120)
    process, _, err = start(cli_arguments(settings), tmp_path / "first")
    wait_for(tmp_path / "first" / "stdout.txt", "[study] locked_cohort: running", process)
    wait_for_step_run(settings, "locked_cohort", process)
    os.kill(process.pid, signum)
    assert process.wait(timeout=600) == (-signal.SIGKILL if signum == signal.SIGKILL else 128 + signum)
    _, runs = study_runs(settings)
    [first] = parents(runs)
    steps = steps_of(runs, first)
    assert steps["data"].info.status == "FINISHED" and set(steps) == {"data", "locked_cohort"}
    if signum == signal.SIGKILL:
        assert first.info.status == "RUNNING" and steps["locked_cohort"].info.status == "RUNNING"
    else:
        stderr = err.read_text()
        assert "Traceback" not in stderr
        [line] = [line for line in stderr.splitlines() if line.startswith("benchx study:")]
        assert line.startswith(f"benchx study: stopped by {signum.name}; step locked_cohort: its run and the study "
                               f"run {first.info.run_id} ended KILLED; finished steps are kept, resume with: benchx study ")
        assert f"--out {settings.output_dir}" in line
        assert first.info.status == "KILLED" and steps["locked_cohort"].info.status == "KILLED"
        assert first.data.tags[FAILED_STEP_TAG] == "locked_cohort"
        assert first.data.tags[END_TAG] == f"KILLED at step locked_cohort: stopped by {signum.name}"
        assert_nothing_running(settings)

    stop_at_the_baseline(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        run_study(settings)
    assert stopped.value.code == 130
    printed = capsys.readouterr()
    assert f"[study] data: identical finished run {steps['data'].info.run_id} reused" in printed.out
    assert "[study] locked_cohort: done" in printed.out
    assert "benchx study: stopped by SIGINT; step baseline: its run and the study run" in printed.err
    if signum == signal.SIGKILL:
        assert "took over the lock of process" in printed.out
        assert "[study] ended 2 run(s) that a study whose process is gone left RUNNING (KILLED)" in printed.out
    client, _ = study_runs(settings)
    runs = assert_nothing_running(settings)
    assert client.get_run(first.info.run_id).info.status == "KILLED"
    assert client.get_run(steps["locked_cohort"].info.run_id).info.status == "KILLED"
    assert client.get_run(steps["data"].info.run_id).info.status == "FINISHED"
    second = parents(runs)[-1]
    assert second.info.status == "KILLED" and second.data.tags[FAILED_STEP_TAG] == "baseline"
    assert steps_of(runs, second)["locked_cohort"].info.status == "FINISHED"


def test_a_failing_step_ends_its_run_and_the_study_failed_naming_the_step(tiny_phantom, tmp_path, monkeypatch, capsys):
    """An error inside the locked_cohort step: both runs FAILED, the step named on stderr and in a tag;
    the finished data step is reused by the rerun."""
    import synthx.workflows.study.steps as study_steps
    from synthx.workflows.study.run import run_study
    from synthx.workflows.study.runner import END_TAG, FAILED_STEP_TAG

    root, split = tiny_phantom
    settings = _study_settings(root, split, tmp_path)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(study_steps, "generate_phantom_cohort", full_disk)
    with pytest.raises(OSError, match="No space left"):
        run_study(settings)
    printed = capsys.readouterr()
    runs = assert_nothing_running(settings)
    [first] = parents(runs)
    steps = steps_of(runs, first)
    assert first.info.status == "FAILED" and steps["locked_cohort"].info.status == "FAILED"
    assert steps["data"].info.status == "FINISHED"
    assert first.data.tags[FAILED_STEP_TAG] == "locked_cohort"
    assert first.data.tags[END_TAG].startswith("FAILED at step locked_cohort: OSError:")
    assert (f"[study] locked_cohort failed (OSError); step locked_cohort: its run and the study run {first.info.run_id} "
            "ended FAILED; finished steps are kept, fix the cause, then run the same command again to resume") in printed.err

    monkeypatch.undo()
    stop_at_the_baseline(monkeypatch)
    with pytest.raises(SystemExit):
        run_study(settings)
    printed = capsys.readouterr()
    assert f"[study] data: identical finished run {steps['data'].info.run_id} reused" in printed.out
    assert "[study] locked_cohort: done" in printed.out
    assert_nothing_running(settings)


def test_a_broken_cohort_ends_the_data_run_and_the_study_failed_with_a_short_message(tiny_phantom, tmp_path, capsys):
    from lightning_modules.cli import main
    from synthx.workflows.study.runner import FAILED_STEP_TAG

    root, split = tiny_phantom
    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    case = sorted(path for path in broken.iterdir() if path.is_dir())[0]
    image = sorted(case.rglob("*.nii.gz"))[0]
    image.write_bytes(b"not a NIfTI file")
    settings = _study_settings(broken, split, tmp_path)

    assert main(cli_arguments(settings)) == 2
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err
    assert f"benchx study: cohort {broken}: 1 problem(s):\n  - {case.name}: {image}: unreadable" in printed.err
    runs = assert_nothing_running(settings)
    [study] = parents(runs)
    assert study.info.status == "FAILED" and study.data.tags[FAILED_STEP_TAG] == "data"
    assert steps_of(runs, study)["data"].info.status == "FAILED"
    assert f"[study] data failed (CohortError); step data: its run and the study run {study.info.run_id} ended FAILED" in printed.err


def test_a_refused_targeting_rule_ends_both_runs_failed_and_keeps_the_baseline(tiny_phantom, tmp_path, monkeypatch, capsys):
    """``--target need:4`` when the baseline detects every validation tumor: exit 2, a short message,
    the targeting run and the study run FAILED; a rerun reuses the data, cohort and baseline steps."""
    import synthx.workflows.study.steps as study_steps
    from lightning_modules.cli import main
    from synthx.workflows.study.runner import FAILED_STEP_TAG

    real_records = study_steps.validation_records

    def every_tumor_detected(client, run_id):
        records, threshold = real_records(client, run_id)
        return records.assign(prediction=records["label"]), threshold

    monkeypatch.setattr(study_steps, "validation_records", every_tumor_detected)
    root, split = tiny_phantom
    settings = dataclasses.replace(_study_settings(root, split, tmp_path), target="need:4", budget=None)
    arguments = [item for item in cli_arguments(settings) if item not in ("--budget", "None")]

    assert main(arguments) == 2
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err
    assert "benchx study: need: no cell with a canvas has a validation deficit" in printed.err
    runs = assert_nothing_running(settings)
    [study] = parents(runs)
    steps = steps_of(runs, study)
    assert study.info.status == "FAILED" and study.data.tags[FAILED_STEP_TAG] == "targeting"
    assert steps["targeting"].info.status == "FAILED"
    done = ("data", "locked_cohort", "baseline", "evaluate_baseline")
    assert all(steps[name].info.status == "FINISHED" for name in done)
    assert f"[study] targeting failed (TargetingError); step targeting: its run and the study run {study.info.run_id}" in printed.err

    assert main(arguments) == 2
    printed = capsys.readouterr()
    for name in done:
        assert f"[study] {name}: identical finished run {steps[name].info.run_id} reused" in printed.out, name
    assert_nothing_running(settings)


SLEEPER = "import sys, time; print('ready', sys.argv[1:], flush=True); time.sleep(600)"
REPLICATES = """
import json, sys
from synthx.workflows.replicates import run_replicates
from synthx.workflows.study.settings import StudySettings
run_replicates(StudySettings(**json.loads(sys.argv[1])), [0, 1], 2, [sys.executable, "-c", sys.argv[2]])
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_replicate_workers_are_stopped_with_their_parent(tmp_path, signum):
    """SIGTERM to ``--seeds``' parent stops its workers and exits 143 with one line; SIGKILL kills
    the parent alone, and its workers still end (they asked for SIGTERM when their parent dies)."""
    from synthx.workflows.study.settings import StudySettings

    settings = StudySettings(overrides=[f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"], experiment="replicates-test",
                             output_dir=str(tmp_path / "study"))
    fields = {key: value for key, value in dataclasses.asdict(settings).items() if key != "endpoint"}
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        parent = subprocess.Popen([sys.executable, "-c", REPLICATES, json.dumps(fields), SLEEPER], cwd=REPO_ROOT,
                                  stdout=stdout, stderr=stderr, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    for seed in (0, 1):
        wait_for(tmp_path / "study" / f"seed-{seed}.log", "ready", parent, timeout=300)
    workers = children_of(parent.pid)
    assert len(workers) == 2
    os.kill(parent.pid, signum)
    assert parent.wait(timeout=120) == (143 if signum == signal.SIGTERM else -signal.SIGKILL)
    wait_gone(workers, timeout=60)
    if signum == signal.SIGTERM:
        stderr_text = err.read_text()
        assert "Traceback" not in stderr_text
        assert stderr_text.strip().splitlines()[-1] == (
            "benchx study: stopped by SIGTERM; replicate(s) 0, 1 stopped; resume with: the same command")


def test_a_killed_seeds_parent_leaves_no_study_worker_and_no_run_running(tiny_phantom, tmp_path):
    """``benchx study --seeds 2`` killed by SIGKILL: each replicate gets SIGTERM, ends its runs KILLED
    and its folder's lock, so a rerun is not refused."""
    from lightning_modules.infrastructure.run_folder import RunFolderLock

    root, split = tiny_phantom
    settings = _study_settings(root, split, tmp_path)
    process, _, _ = start([*cli_arguments(settings), "--seeds", "2", "--workers", "2"], tmp_path / "parent")
    logs = [Path(settings.output_dir) / f"seed-{seed}.log" for seed in (0, 1)]
    for log in logs:
        wait_for(log, "[study] locked_cohort: running", process)
    workers = children_of(process.pid)
    assert len(workers) == 2
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    wait_gone(workers)
    for log in logs:
        assert "benchx study: stopped by SIGTERM; step " in log.read_text()
    runs = assert_nothing_running(settings)
    assert [run.info.status for run in parents(runs)] == ["KILLED", "KILLED"]
    for seed in (0, 1):
        with RunFolderLock(Path(settings.output_dir) / f"seed-{seed}", "test") as lock:
            assert lock.takeover_note is None, "the replicate released its folder's lock"
