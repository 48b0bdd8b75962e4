"""``benchx sweep``: an Optuna study over the synthesis ratio, each trial an augmented training run.

Each trial trains the recipe's backbone with ``synthx.ratio`` (and optionally the targeting rule
of the synthetic cohort) and is scored on the validation split by the chosen objective:

- ``f1``: overall validation F1 (maximized; pruned with optuna-integration's Lightning callback);
- ``worst_sensitivity``: the lowest validation sensitivity over the subgroups of the chosen
  attributes (maximized);
- ``both``: a multi-objective study of the two (the Pareto front of average versus worst group;
  Optuna does not prune multi-objective studies).

Storage: a SQLite file by default (``sqlite:///optuna.db``, one worker at a time), PostgreSQL
(``postgresql://...``, many workers on many machines; ``scripts/services.sh start`` runs one here)
or a journal file (``journal:<path>``, workers on one file system). The study is created (with its
MLflow parent run) once, before any worker starts (``--create-only``), so concurrent workers never
race on creating it; then each worker loads it and runs trials until the study holds ``--trials``
finished trials. On an RDB storage every running trial sends a heartbeat; a trial whose worker died
(no heartbeat for the grace period) is marked FAILED by the next worker that starts a trial, its
MLflow run is ended FAILED, and the trial is queued again with the same parameters (Optuna's
``RetryHeartbeatStaleTrialCallback``; the enqueued ratio-0 baseline included), so finished trials
are never repeated. Pruned trials end their MLflow run KILLED with the tag ``optuna_state=PRUNED``.

Every trial is scored on validation, so a recipe that validates nothing during training (some
``cpu`` profiles set ``trainer.val_every_n_steps: 0``) is refused before anything is created,
naming the setting; a recipe that validates only at the last step runs without pruning (there is
nothing earlier to prune on, and pruning at the last step would throw away a finished trial).
Each worker ends the sweep's parent run: FINISHED once the study holds its trials, FAILED when the
worker fails (KILLED on a signal); a later worker reopens it.
Each trial is an MLflow run whose parent is the sweep's run (``mlflow.parentRunId``, set
explicitly: ``nested=True`` loses the parent across processes), tagged with its trial number and
ratio. ``optuna-dashboard <storage>`` (the ``server`` extra) shows the same storage.

Example::

    benchx sweep --recipe recipes/unet.yaml --trials 8 --objective both profile=cpu trainer.val_every_n_steps=1000 synthx.cohort=data/synthetic
    benchx sweep --recipe recipes/unet.yaml --storage postgresql://postgres@db:5432/optuna --create-only ...
    benchx sweep --recipe recipes/unet.yaml --storage postgresql://postgres@db:5432/optuna --trials 8 ...   # on each worker
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import socket
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import optuna
from omegaconf import DictConfig
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from lightning_modules.evaluation.callback import SubgroupEvaluation
from lightning_modules.recipe import recipe_variant
from lightning_modules.tracking import (
    database_url,
    end_run,
    experiment_id,
    final_status,
    git_commit,
    terminating_signals,
    tracking_client,
    tracking_uri,
)
from lightning_modules.tracking.recorder import logger_recorder
from lightning_modules.workflows.train import train


log = logging.getLogger(__name__)
PARENT_ATTR = "mlflow_parent_run_id"
OBJECTIVES = {"f1": ["maximize"], "worst_sensitivity": ["maximize"], "both": ["maximize", "maximize"]}
DEFAULT_STORAGE = "sqlite:///optuna.db"


# Heartbeats: a worker's running trial is stale after GRACE_PERIODS heartbeat intervals of silence.
DEFAULT_HEARTBEAT_S = 60
GRACE_PERIODS = 3
MAX_RETRY = 2  # a trial whose worker died is queued again at most this often


@dataclass
class SweepSettings:
    """What ``benchx sweep`` does; see :func:`sweep`.

    Args:
        recipe: the loaded recipe every trial trains.
        study_name / storage: the Optuna study and its storage URL.
        objective: a key of OBJECTIVES.
        trials: finished (complete or pruned) trials the study should hold, over all workers.
        ratio_range: the sampled ``synthx.ratio`` interval.
        enqueue: ratios tried first (0 = the baseline as reference).
        attributes: the subgroup attributes of the worst-group objective.
        targeting: optional targeting rule -> synthetic cohort folder, swept as a parameter.
        heartbeat_interval: seconds between a running trial's heartbeats (RDB storage).
        create_only: create the study and its MLflow parent run, run no trial.
    """

    recipe: DictConfig
    study_name: str = "synthx-ratio"
    storage: str = DEFAULT_STORAGE
    objective: str = "f1"
    trials: int = 8
    ratio_range: tuple[float, float] = (0.0, 0.8)
    enqueue: Sequence[float] = (0.0,)
    attributes: Sequence[str] = ("age", "sex", "phase")
    targeting: dict[str, str] = field(default_factory=dict)
    heartbeat_interval: int = DEFAULT_HEARTBEAT_S
    create_only: bool = False


class SweepError(ValueError):
    """A sweep that cannot score its trials as asked; the message names the setting to change."""


def prunes(recipe: DictConfig, objective: str) -> bool:
    """Whether the trials are pruned: only the single ``f1`` objective, and only when a validation
    comes before the last step (otherwise there is nothing to prune on).

    Raises:
        SweepError: the recipe runs no validation during training, so no trial could be scored.
    """
    max_steps, every = int(recipe.trainer.max_steps), int(recipe.trainer.val_every_n_steps)
    if every <= 0 or every > max_steps:
        suggestion = max(1, max_steps // 3)
        raise SweepError(
            f"each trial is scored on validation, but trainer.val_every_n_steps={every} runs no validation within "
            f"trainer.max_steps={max_steps} (the recipe's profile trains without validation): set "
            f"trainer.val_every_n_steps, e.g. trainer.val_every_n_steps={suggestion}"
        )
    return objective == "f1" and every < max_steps


class RetryStaleTrial(optuna.storages.RetryHeartbeatStaleTrialCallback):
    """Optuna's retry of a trial whose worker died, which also ends that trial's MLflow run FAILED."""

    def __init__(self, mlflow_uri: str | None, max_retry: int = MAX_RETRY):
        super().__init__(max_retry=max_retry)
        self.mlflow_uri = mlflow_uri

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        run_id = trial.user_attrs.get("mlflow_run_id")
        if run_id and self.mlflow_uri:
            client = tracking_client(self.mlflow_uri)
            client.set_tag(run_id, "optuna_state", "FAIL (worker stopped sending heartbeats)")
            client.set_terminated(run_id, "FAILED")
        super().__call__(study, trial)


def make_storage(url: str, heartbeat_interval: int = DEFAULT_HEARTBEAT_S, mlflow_uri: str | None = None):
    """An Optuna storage from a URL: ``journal:<file>`` for a journal file, anything else as an RDB
    URL with heartbeats and the retry of trials whose worker died (:class:`RetryStaleTrial`)."""
    if url.startswith("journal:"):
        return JournalStorage(JournalFileBackend(url[len("journal:") :]))
    return optuna.storages.RDBStorage(
        database_url(url),
        heartbeat_interval=heartbeat_interval,
        grace_period=GRACE_PERIODS * heartbeat_interval,
        heartbeat_stale_trial_callback=RetryStaleTrial(mlflow_uri),
    )


@contextlib.contextmanager
def sqlite_worker_slot(url: str) -> Iterator[None]:
    """Hold the only worker slot of a SQLite storage (a lock file beside it); refuse a second worker.

    Concurrent writers on one SQLite file fail in table setup and on locks; parallel workers need
    PostgreSQL (or a journal file).
    """
    if not url.startswith("sqlite:///"):
        yield
        return
    lock_path = Path(url[len("sqlite:///") :]).resolve().with_suffix(".sweep-worker.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            raise RuntimeError(
                f"another sweep worker ({lock.read().strip() or 'unknown'}) is using {url}: SQLite takes one "
                "worker at a time. For parallel workers use PostgreSQL (--storage postgresql://...; "
                "scripts/services.sh starts one) or a journal file (--storage journal:<file>)."
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        yield


def create_sweep(
    recipe: DictConfig,
    study_name: str,
    storage_url: str,
    objective: str,
    ratios: Sequence[float] | None = None,
    heartbeat_interval: int = DEFAULT_HEARTBEAT_S,
) -> optuna.Study:
    """Create (or load) the study and its MLflow parent run; call once before starting workers."""
    storage = make_storage(storage_url, heartbeat_interval, tracking_uri(recipe.tracking.uri))
    study = optuna.create_study(
        study_name=study_name,
        storage=storage,
        directions=OBJECTIVES[objective],
        load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=int(recipe.seed)),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
    )
    if study.user_attrs.get("objective") not in (None, objective):
        raise ValueError(f"study {study_name!r} was created with objective {study.user_attrs['objective']!r}, not {objective!r}")
    if PARENT_ATTR not in study.user_attrs:
        uri = tracking_uri(recipe.tracking.uri)
        client = tracking_client(uri)
        run = client.create_run(
            experiment_id(str(recipe.tracking.experiment), uri),
            run_name=f"sweep-{study_name}",
            tags={"stage": "sweep", "optuna_study": study_name, "optuna_storage": safe_url(storage_url),
                  "backbone": str(recipe.model.backbone), "recipe": str(recipe.name), "git_commit": git_commit()},
        )
        client.log_param(run.info.run_id, "objective", objective)
        study.set_user_attr(PARENT_ATTR, run.info.run_id)
        study.set_user_attr("objective", objective)
        if ratios:
            # Seed the study with the requested ratios first (e.g. 0 = the baseline as a reference).
            for ratio in ratios:
                study.enqueue_trial({"ratio": float(ratio)}, skip_if_exists=True)
    return study


def safe_url(url: str) -> str:
    """A storage URL without its password, for tags."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def worst_group(table, metric: str, attributes: Sequence[str]) -> float:
    """The lowest defined value of a metric over the subgroups of the given attributes."""
    rows = table[table["attribute"].isin(list(attributes))][metric].astype(float)
    rows = rows[~rows.isna()]
    return float(rows.min()) if len(rows) else math.nan


def make_objective(
    recipe: DictConfig,
    objective: str,
    parent_run_id: str,
    study_name: str,
    attributes: Sequence[str],
    ratio_range: tuple[float, float],
    targeting_rules: Sequence[str] = (),
    synthetic_cohorts: dict[str, str] | None = None,
    output_root: Path | None = None,
):
    """The Optuna objective: one augmented training run per trial, scored on the validation split."""

    def run_trial(trial: optuna.Trial):
        ratio = trial.suggest_float("ratio", *ratio_range)
        mixing: dict = {"ratio": float(ratio)}
        if targeting_rules:
            rule = trial.suggest_categorical("targeting", list(targeting_rules))
            mixing["cohort"] = str((synthetic_cohorts or {})[rule])
        # The trial's recipe: its typed values merged in memory and checked once, as a file's are.
        trial_recipe = recipe_variant(recipe, {"synthx": mixing, "tracking": {"run_name": f"{study_name}-trial-{trial.number}"}},
                                      source=f"sweep {study_name} trial {trial.number}")
        callbacks = []
        if prunes(trial_recipe, objective):
            from optuna_integration import PyTorchLightningPruningCallback

            callbacks.append(PyTorchLightningPruningCallback(trial, monitor="val/f1/overall"))

        evaluation = SubgroupEvaluation.from_detection(trial_recipe.detection, recorder=logger_recorder)
        folder = (output_root or Path(trial_recipe.tracking.output_dir)) / f"sweep-{study_name}" / f"trial-{trial.number}"
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        try:
            result = train(
                trial_recipe,
                output_dir=folder,
                callbacks=[*callbacks, evaluation],
                evaluation=False,
                resume=False,
                variant="synthx" if ratio > 0 else "baseline",
                after_run_start=lambda logger: trial.set_user_attr("mlflow_run_id", logger.run_id),
                extra_tags={
                    "mlflow.parentRunId": parent_run_id,
                    "optuna_study": study_name,
                    "optuna_trial": str(trial.number),
                    "synthx_ratio": f"{ratio:g}",
                },
            )
        except optuna.TrialPruned:
            end_pruned_run(trial, tracking_uri(recipe.tracking.uri))
            raise
        trial.set_user_attr("mlflow_run_id", result.run_id)
        table = evaluation.results.get("val")
        if table is None:
            end_pruned_run(trial, tracking_uri(recipe.tracking.uri))
            raise optuna.TrialPruned("no validation ran")
        overall_f1 = float(table.loc[table["attribute"] == "overall", "f1"].iloc[0])
        worst_sensitivity = worst_group(table, "sensitivity", attributes)
        client = tracking_client(tracking_uri(recipe.tracking.uri))
        client.log_metric(result.run_id, "objective/f1_overall", _finite(overall_f1))
        client.log_metric(result.run_id, "objective/worst_sensitivity", _finite(worst_sensitivity))
        if objective == "f1":
            return _finite(overall_f1)
        if objective == "worst_sensitivity":
            return _finite(worst_sensitivity)
        return _finite(overall_f1), _finite(worst_sensitivity)

    return run_trial


def end_pruned_run(trial: optuna.Trial, uri: str) -> None:
    """A pruned trial's MLflow run ends KILLED (Lightning ended it FAILED), tagged ``optuna_state=PRUNED``."""
    run_id = trial.user_attrs.get("mlflow_run_id")
    if run_id:
        client = tracking_client(uri)
        client.set_tag(run_id, "optuna_state", "PRUNED")
        client.set_terminated(run_id, "KILLED")


def _finite(value: float) -> float:
    """Undefined metrics score as 0 for the optimizer only (they are logged as undefined elsewhere)."""
    return 0.0 if value is None or math.isnan(value) else float(value)


def run_worker(study: optuna.Study, objective_fn, n_trials: int) -> None:
    """Run trials until the study holds ``n_trials`` complete or pruned trials (shared across workers).

    On an RDB storage Optuna first fails the trials of dead workers (no heartbeat for the grace
    period) and queues their retries, at the start of every trial of every worker.
    """
    from optuna.study import MaxTrialsCallback

    optuna.storages.fail_stale_trials(study)
    done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
    if done >= n_trials:
        return
    study.optimize(
        objective_fn,
        n_trials=n_trials - done,
        callbacks=[MaxTrialsCallback(n_trials, states=(TrialState.COMPLETE, TrialState.PRUNED))],
        catch=(),
        show_progress_bar=sys.stderr.isatty(),
    )


def log_sweep_summary(study: optuna.Study, recipe: DictConfig) -> None:
    """Best trial (or Pareto front), trial table and Optuna's plots on the sweep's parent run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as optuna_plots

    client = tracking_client(tracking_uri(recipe.tracking.uri))
    run_id = study.user_attrs[PARENT_ATTR]
    trials = study.trials_dataframe(attrs=("number", "value", "values", "params", "state", "user_attrs"))
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    client.log_metric(run_id, "sweep/complete_trials", len(complete))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trials.csv"
        trials.to_csv(path, index=False)
        client.log_artifact(run_id, str(path), "sweep")
        if complete:
            best = study.best_trials
            front = [{"trial": t.number, "ratio": t.params.get("ratio"), "values": t.values, "mlflow_run_id": t.user_attrs.get("mlflow_run_id")} for t in best]

            (Path(folder) / "pareto_front.json").write_text(json.dumps(front, indent=2))
            client.log_artifact(run_id, str(Path(folder) / "pareto_front.json"), "sweep")
            if len(study.directions) == 1:
                client.log_metric(run_id, "sweep/best_value", float(study.best_value))
                client.log_param(run_id, "best_ratio", study.best_params.get("ratio"))
                client.set_tag(run_id, "best_trial_run_id", study.best_trial.user_attrs.get("mlflow_run_id", ""))
            else:
                client.set_tag(run_id, "pareto_trials", ",".join(str(t.number) for t in best))
    if len(complete) < 2:
        return
    single = len(study.directions) == 1
    names = ["objective"] if single else ["overall F1", "worst-group sensitivity"]
    slugs = [name.replace(" ", "_").replace("-", "_") for name in names]
    for index, (name, slug) in enumerate(zip(names, slugs)):
        target = None if single else (lambda t, i=index: t.values[i])
        for plot, label in (
            (optuna_plots.plot_optimization_history, "history"),
            (optuna_plots.plot_slice, "ratio_vs_objective"),
        ):
            axes = plot(study, target=target, target_name=name)
            figure = axes.flat[0].figure if hasattr(axes, "flat") else axes.figure
            client.log_figure(run_id, figure, f"sweep/{label}_{slug}.png")
            plt.close(figure)
    if not single:
        axes = optuna_plots.plot_pareto_front(study, target_names=names)
        client.log_figure(run_id, axes.figure, "sweep/pareto_front.png")
        plt.close(axes.figure)
    if len(complete) >= 3 and len({t.params.get("ratio") for t in complete}) > 1:
        for index, (name, slug) in enumerate(zip(names, slugs)):
            with warnings.catch_warnings():  # its advice (negate a maximized target) is followed
                warnings.filterwarnings("ignore", message=".*importances of params to achieve low")
                axes = optuna_plots.plot_param_importances(
                    study, target=importance_target(study, index), target_name=name
                )
            client.log_figure(run_id, axes.figure, "sweep/importance.png" if single else f"sweep/importance_{slug}.png")
            plt.close(axes.figure)


def importance_target(study: optuna.Study, index: int):
    """The target whose parameter importances say what makes objective ``index`` better.

    Optuna's default importance evaluator (PED-ANOVA) asks which parameters the best trials share.
    Without a target it takes "best" from the study's direction, but an explicit target (needed for
    one objective of a multi-objective study) it always reads as lower is better. Both objectives
    here are maximized, so their targets are negated: otherwise the plot would rank the parameters
    by how much they matter for the worst trials. None for a single-objective study.
    """
    if len(study.directions) == 1:
        return None
    sign = -1.0 if study.directions[index] == optuna.study.StudyDirection.MAXIMIZE else 1.0
    return lambda trial: sign * trial.values[index]


def finished_trials(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


@contextlib.contextmanager
def parent_run_ended(study: optuna.Study, uri: str, trials: int) -> Iterator[None]:
    """Around one worker's work: the sweep's parent run is RUNNING meanwhile and then ends FINISHED
    when the study holds ``trials`` finished trials, FAILED when the worker fails, KILLED on a
    signal; never left RUNNING by its last worker."""
    run_id = study.user_attrs[PARENT_ATTR]
    tracking_client(uri).update_run(run_id, status="RUNNING")
    with terminating_signals():
        try:
            yield
        except BaseException as error:
            end_run(uri, run_id, final_status(error))
            raise
    if finished_trials(study) >= trials:
        end_run(uri, run_id, "FINISHED")


def sweep(settings: SweepSettings) -> optuna.Study:
    """Create the study (once) and, unless ``create_only``, work on it as one worker; returns the study.

    Raises:
        SweepError: the recipe validates nothing during training (checked before anything is created).
    """
    recipe = settings.recipe
    if not prunes(recipe, settings.objective) and settings.objective == "f1":
        log.warning("trainer.val_every_n_steps=%d validates only at the last step: trials run without pruning",
                    int(recipe.trainer.val_every_n_steps))
    enqueue = list(settings.enqueue)
    shared = not settings.storage.startswith("sqlite:")
    if shared and not settings.create_only and settings.study_name not in optuna.get_all_study_names(make_storage(settings.storage)):
        # Workers started together would each create the study's MLflow parent run.
        raise RuntimeError(
            f"study {settings.study_name!r} does not exist in {safe_url(settings.storage)}: create it once with "
            "--create-only (same arguments), then start the workers"
        )
    study = create_sweep(recipe, settings.study_name, settings.storage, settings.objective, enqueue, settings.heartbeat_interval)
    if settings.create_only:
        return study
    with sqlite_worker_slot(settings.storage), parent_run_ended(study, tracking_uri(recipe.tracking.uri), settings.trials):
        objective = make_objective(
            recipe, settings.objective, study.user_attrs[PARENT_ATTR], settings.study_name, settings.attributes,
            settings.ratio_range, list(settings.targeting), settings.targeting,
        )
        run_worker(study, objective, settings.trials)
        log_sweep_summary(study, recipe)
    return study
