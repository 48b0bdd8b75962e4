"""The study runner's bookkeeping of runs that did not end: a stopped step's runs, the runs of a
dead study process, and a comparison cut short."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import new_sqlite_store


@pytest.fixture
def runner(tmp_path):
    from synthx.workflows.study.runner import StudyRunner

    return StudyRunner(new_sqlite_store(tmp_path / "mlflow.db"), "runner-test", "abc")


def dead_pid() -> int:
    """The id of a process that has ended (and was reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def a_study(runner, folder, pid: int, host: str) -> tuple[str, str]:
    """(parent, step) ids of a study left RUNNING by process ``pid`` on ``host`` in ``folder``."""
    from synthx.workflows.study.runner import FOLDER_TAG, HOST_TAG, PARENT_TAG, PID_TAG

    parent = runner.client.create_run(runner.experiment_id, tags={
        "stage": "study", PID_TAG: str(pid), HOST_TAG: host, FOLDER_TAG: str(folder.resolve())}).info.run_id
    step = runner.client.create_run(runner.experiment_id, tags={PARENT_TAG: parent}).info.run_id
    return parent, step


def test_a_rerun_ends_the_runs_of_a_dead_study_on_this_host_only(runner, tmp_path):
    status = lambda run_id: runner.client.get_run(run_id).info.status  # noqa: E731
    folder = tmp_path / "study"
    dead = a_study(runner, folder, dead_pid(), socket.gethostname())
    alive = a_study(runner, folder, os.getppid(), socket.gethostname())
    elsewhere = a_study(runner, folder, dead_pid(), "another-host")
    other_folder = a_study(runner, tmp_path / "other", dead_pid(), socket.gethostname())

    assert sorted(runner.end_stale(folder)) == sorted(dead)
    assert [status(run_id) for run_id in dead] == ["KILLED", "KILLED"]
    for kept in (alive, elsewhere, other_folder):
        assert [status(run_id) for run_id in kept] == ["RUNNING", "RUNNING"]
    assert "was gone" in runner.client.get_run(dead[0]).data.tags["study_end"]
    assert runner.end_stale(folder) == [], "ended once"


def test_a_step_stopped_by_a_signal_ends_its_runs_and_the_parent_killed(runner):
    from lightning_modules.infrastructure.process import Terminated
    from synthx.workflows.study.runner import END_TAG, FAILED_STEP_TAG

    opened = []

    def action(tags):
        opened.append(runner.client.create_run(runner.experiment_id, tags=tags).info.run_id)
        raise Terminated(signal.SIGTERM)

    with pytest.raises(Terminated) as stopped:
        runner.step("targeting", {"rule": "need:4"}, action)
    assert runner.abort(stopped.value) == "KILLED"
    assert runner.client.get_run(opened[0]).info.status == "KILLED"
    parent = runner.client.get_run(runner.parent_id)
    assert parent.info.status == "KILLED" and parent.data.tags[FAILED_STEP_TAG] == "targeting"
    assert parent.data.tags[END_TAG] == "KILLED at step targeting: stopped by SIGTERM"


def test_a_comparison_cut_short_ends_its_run(runner, monkeypatch):
    """The comparison run carries the study's tags only once complete: a failure inside it still ends it."""
    import synthx.workflows.study.steps as steps

    evaluations = {"sham": {"run_id": "s"}, "synthx": {"run_id": "x"}, "baseline": {"run_id": "b"}}
    opened = []

    def failing(runs, stage, uri, experiment, n_resamples, subgroup=None):
        opened.append(runner.client.create_run(runner.experiment_id, tags={"compared_runs": ",".join(runs)}).info.run_id)
        raise MemoryError("bootstrap")

    monkeypatch.setattr(steps, "compare", failing)
    with pytest.raises(MemoryError):
        steps.compare_action(evaluations, runner.uri, runner.experiment, 10)({})
    assert runner.client.get_run(opened[0]).info.status == "FAILED"


def test_the_parent_run_names_what_decides_the_cpu_sums(runner):
    """A reader can tell from the parent run whether a rerun should reproduce its figures."""
    import torch

    tags = runner.client.get_run(runner.parent_id).data.tags
    assert tags["host.torch_threads"] == str(torch.get_num_threads())
    assert tags["host.cpu_arithmetic"] == "pinned"
    assert tags["host.cpu_vendor"] and tags["host.cpu_model"]
    with open("/proc/cpuinfo") as cpuinfo:
        assert f": {tags['host.cpu_vendor']}" in cpuinfo.read()

    from lightning_modules.config.numerics import arithmetic_host

    assert arithmetic_host({"BENCHX_NATIVE_CPU": "1"})["host.cpu_arithmetic"] == "native"
