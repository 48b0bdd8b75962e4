"""The study's step runner: each step an MLflow child run of the study's parent run, skipped when an
identical finished run exists, and the locks that keep processes started together apart.

- :class:`StudyRunner`: runs named steps (``action(tags) -> outputs``) and keeps their bookkeeping
  (the step key, outputs, wall and CPU seconds on the parent run);
- :func:`cohort_lock`: one process at a time makes a cohort or its split;
- :func:`open_runner`: the runner of a study (under ``mlflow run``, the run it opened is the parent).

Every study run ends: :meth:`StudyRunner.abort` ends the step run in flight and the parent run
KILLED on a signal (FAILED on an error) and names the step in the tag ``study_failed_step``;
:meth:`StudyRunner.end_stale` ends the runs a study left RUNNING when its process died without
ending them (the parent run records its process, host and output folder).

Example::

    runner = open_runner(settings)
    outputs = runner.step("data", {"root": "data/phantom"}, lambda tags: data_step(...))
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import resource
import socket
import time
from pathlib import Path
from typing import Callable

from mlflow.tracking import MlflowClient

from lightning_modules.config.numerics import arithmetic_host
from lightning_modules.infrastructure.process import git_commit, held_signals, stop_reason
from lightning_modules.infrastructure.run_folder import pid_alive
from lightning_modules.tracking import end_run, experiment_id, final_status, mark_model_experiment, tracking_uri
from synthx.workflows.study.settings import segmentation_recipe, StudySettings

STEP_KEY_TAG = "study_step_key"
STEP_NAME_TAG = "study_step"
PARENT_TAG = "mlflow.parentRunId"
FAILED_STEP_TAG = "study_failed_step"  # the step in flight when the study stopped or failed
END_TAG = "study_end"  # why the study's parent run ended KILLED or FAILED
# The process that owns a study's parent run: a rerun ends the runs of a dead owner (end_stale).
PID_TAG, HOST_TAG, FOLDER_TAG = "study_pid", "study_host", "study_output_dir"


def cpu_seconds() -> float:
    """CPU seconds of this process and of its finished child processes (the phantom's render workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class StudyRunner:
    """Runs named steps as child runs of one parent, skipping those already finished identically."""

    def __init__(
        self, uri: str, experiment: str, code_version: str, parent_name: str = "study", parent_run_id: str | None = None,
        parent_tags: dict[str, str] | None = None,
    ):
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.experiment = experiment
        self.experiment_id = experiment_id(experiment, uri)
        mark_model_experiment(self.client, self.experiment_id)
        self.code_version = code_version
        parent_tags = {**arithmetic_host(), **(parent_tags or {})}
        self.parent_id = parent_run_id or self.client.create_run(
            self.experiment_id, run_name=parent_name, tags={"stage": "study", "git_commit": code_version, **(parent_tags or {})}
        ).info.run_id
        if parent_run_id:
            for tag, value in {"stage": "study", "git_commit": code_version, "mlflow.runName": parent_name,
                               **(parent_tags or {})}.items():
                self.client.set_tag(parent_run_id, tag, value)
        self.outputs: dict[str, dict] = {}
        self.current: str | None = None  # the step in flight

    def key(self, name: str, params: dict) -> str:
        payload = json.dumps({"step": name, "params": params, "code": self.code_version}, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:20]

    def finished(self, key: str) -> dict | None:
        """Outputs of a finished run with this step key, if any (the most recent)."""
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.{STEP_KEY_TAG} = '{key}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if not runs:
            return None
        outputs = runs[0].data.tags.get("study_outputs")
        return json.loads(outputs) if outputs else None

    def step(self, name: str, params: dict, action: Callable[[dict], dict]) -> dict:
        """Run ``action(tags) -> outputs`` unless an identical finished step exists.

        ``tags`` must be put on the MLflow run the action creates; ``outputs`` must hold its
        ``run_id``. Outputs are stored on that run, so a later study can reuse them.
        """
        key = self.key(name, params)
        previous = self.finished(key)
        if previous is not None:
            print(f"[study] {name}: identical finished run {previous['run_id']} reused")
            self.client.set_tag(self.parent_id, f"step.{name}", previous["run_id"])
            self.outputs[name] = previous
            return previous
        print(f"[study] {name}: running", flush=True)
        started, cpu_started = time.time(), cpu_seconds()
        tags = {PARENT_TAG: self.parent_id, STEP_NAME_TAG: name}
        self.current = name
        outputs = action(tags)
        run_id = outputs["run_id"]
        outputs = {k: (str(v) if isinstance(v, Path) else v) for k, v in outputs.items()}
        for tag, value in tags.items():
            self.client.set_tag(run_id, tag, value)
        self.client.set_tag(run_id, "study_outputs", json.dumps(outputs, default=str))
        run = self.client.get_run(run_id)
        if run.info.status != "FINISHED":
            self.client.set_terminated(run_id, "FINISHED")
        # The key goes on last: a run carries it only once its outputs are complete.
        self.client.set_tag(run_id, STEP_KEY_TAG, key)
        self.client.set_tag(self.parent_id, f"step.{name}", run_id)
        wall, cpu = time.time() - started, cpu_seconds() - cpu_started
        self.client.log_metric(self.parent_id, f"study/seconds/{name}", wall)
        self.client.log_metric(self.parent_id, f"study/cpu_seconds/{name}", cpu)
        print(f"[study] {name}: done in {wall:.0f} s wall, {cpu:.0f} s CPU (run {run_id})")
        self.current = None
        self.outputs[name] = outputs
        return outputs

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.parent_id, status)

    def open_runs(self, parent_id: str | None = None) -> list[str]:
        """The ids of the RUNNING child runs of a parent (this study's by default)."""
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{parent_id or self.parent_id}' and attributes.status = 'RUNNING'",
        )
        return [run.info.run_id for run in runs]

    def abort(self, error: BaseException) -> str:
        """End the step runs still open and the parent run, KILLED for a signal, FAILED for an error.

        The step in flight is named on the parent (tag ``study_failed_step``) with the reason (tag
        ``study_end``). A second signal during this is recorded, not raised, so every run is ended.
        Returns the status given.
        """
        status = final_status(error)
        with held_signals():
            for run_id in self.open_runs():
                end_run(self.uri, run_id, status)
            if self.current is not None:
                self.client.set_tag(self.parent_id, FAILED_STEP_TAG, self.current)
            reason = stop_reason(error) if status == "KILLED" else f"{type(error).__name__}: {error}"
            self.client.set_tag(self.parent_id, END_TAG, f"{status} at step {self.current or '(between steps)'}: {reason}"[:5000])
            end_run(self.uri, self.parent_id, status)
        return status

    def end_stale(self, output_dir: str | Path) -> list[str]:
        """End (KILLED) the study runs of this output folder left RUNNING by a process that is gone.

        A parent run is stale when the process it records ran on this host and is no longer alive
        (the caller holds the folder's lock, so no live study writes there); its RUNNING step runs
        are ended with it. A run recorded on another host is left alone: its process cannot be
        checked from here. Returns the ids of the ended runs.
        """
        folder = str(Path(output_dir).resolve())
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.{FOLDER_TAG} = '{folder}' and attributes.status = 'RUNNING'")
        ended: list[str] = []
        host = socket.gethostname()
        for run in runs:
            tags = run.data.tags
            if run.info.run_id == self.parent_id or tags.get(HOST_TAG) != host or not tags.get(PID_TAG, "").isdigit():
                continue
            pid = int(tags[PID_TAG])
            if pid != os.getpid() and pid_alive(pid):
                continue
            for run_id in [*self.open_runs(run.info.run_id), run.info.run_id]:
                end_run(self.uri, run_id, "KILLED")
                ended.append(run_id)
            self.client.set_tag(run.info.run_id, END_TAG, f"KILLED by a later study: its process {pid} on {host} was gone")
        return ended


@contextlib.contextmanager
def cohort_lock(root: Path):
    """An exclusive ``flock`` on ``<root>.lock`` while a process makes the cohort or its split, so
    that processes started together wait for the first instead of writing the same files."""
    lock = Path(root).parent / f".{Path(root).name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def open_runner(settings: StudySettings, parent_tags: dict[str, str] | None = None) -> StudyRunner:
    """The runner; under ``mlflow run`` the run it opened is the study's parent, and its experiment the study's."""
    uri = tracking_uri(segmentation_recipe(settings).tracking.uri)
    parent_run_id = os.environ.get("MLFLOW_RUN_ID")
    if parent_run_id:
        client = MlflowClient(tracking_uri=uri)
        settings.experiment = client.get_experiment(client.get_run(parent_run_id).info.experiment_id).name
    owner = {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname(), FOLDER_TAG: str(Path(settings.output_dir).resolve())}
    return StudyRunner(uri, settings.experiment, git_commit(), parent_name=f"study-{segmentation_recipe(settings).name}",
                       parent_run_id=parent_run_id, parent_tags={**(parent_tags or {}), **owner})
