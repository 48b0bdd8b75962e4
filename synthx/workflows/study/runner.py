"""The study's step runner: each step an MLflow child run of the study's parent run, skipped when an
identical finished run exists, and the locks that keep processes started together apart.

- :class:`StudyRunner`: runs named steps (``action(tags) -> outputs``) and keeps their bookkeeping
  (the step key, outputs, wall and CPU seconds on the parent run);
- :func:`cohort_lock`: one process at a time makes a cohort or its split;
- :func:`open_runner`: the runner of a study (under ``mlflow run``, the run it opened is the parent).

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
import time
from pathlib import Path
from typing import Callable

from mlflow.tracking import MlflowClient

from lightning_modules.process import git_commit
from lightning_modules.tracking import experiment_id, mark_model_experiment, tracking_uri
from synthx.workflows.study.settings import segmentation_recipe, StudySettings

STEP_KEY_TAG = "study_step_key"
STEP_NAME_TAG = "study_step"
PARENT_TAG = "mlflow.parentRunId"


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
        self.parent_id = parent_run_id or self.client.create_run(
            self.experiment_id, run_name=parent_name, tags={"stage": "study", "git_commit": code_version, **(parent_tags or {})}
        ).info.run_id
        if parent_run_id:
            for tag, value in {"stage": "study", "git_commit": code_version, "mlflow.runName": parent_name,
                               **(parent_tags or {})}.items():
                self.client.set_tag(parent_run_id, tag, value)
        self.outputs: dict[str, dict] = {}

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
        print(f"[study] {name}: running")
        started, cpu_started = time.time(), cpu_seconds()
        tags = {PARENT_TAG: self.parent_id, STEP_NAME_TAG: name}
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
        self.outputs[name] = outputs
        return outputs

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.parent_id, status)


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
    return StudyRunner(uri, settings.experiment, git_commit(), parent_name=f"study-{segmentation_recipe(settings).name}",
                       parent_run_id=parent_run_id, parent_tags=parent_tags)
