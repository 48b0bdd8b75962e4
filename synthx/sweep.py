"""``benchx sweep``: an Optuna study over the synthesis ratio, each trial an augmented training run.

Each trial trains the recipe's backbone with ``synthx.ratio`` (and optionally the targeting rule
of the synthetic cohort) and is scored on the validation split by the chosen objective:

- ``f1``: overall validation F1 (maximized; pruned with optuna-integration's Lightning callback);
- ``worst_sensitivity``: the lowest validation sensitivity over the subgroups of the chosen
  attributes (maximized);
- ``both``: a multi-objective study of the two (the Pareto front of average versus worst group;
  Optuna does not prune multi-objective studies).

Storage: a SQLite file by default (``sqlite:///optuna.db``), any RDB URL (PostgreSQL), or a
journal file (``journal:<path>``). The study is created (with its MLflow parent run) before any
worker starts (``--create-only``), so concurrent workers never race on creating it; then each
worker loads it and runs trials until the study holds ``--trials`` finished trials. A rerun after
an interruption resumes: finished trials are never repeated (a trial left RUNNING by a killed
worker is marked FAILED and its slot is run again). Each trial is an MLflow run whose parent is the
sweep's run (``mlflow.parentRunId``, set explicitly: ``nested=True`` loses the parent across
processes), tagged with its trial number and ratio. ``optuna-dashboard <storage>`` works on the
same storage.

Example::

    benchx sweep --recipe recipes/unet.yaml --trials 8 --objective both profile=cpu synthx.cohort=data/synthetic
    benchx sweep --recipe recipes/unet.yaml --create-only ...        # then start workers:
    benchx sweep --recipe recipes/unet.yaml --trials 8 ... &  benchx sweep --recipe recipes/unet.yaml --trials 8 ...
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import mlflow
import optuna
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from lightning_modules.commands.common import split_overrides
from lightning_modules.config.recipe import load_recipe
from lightning_modules.tracking import experiment_id, git_commit, tracking_uri
from lightning_modules.training import train

PARENT_ATTR = "mlflow_parent_run_id"
OBJECTIVES = {"f1": ["maximize"], "worst_sensitivity": ["maximize"], "both": ["maximize", "maximize"]}
DEFAULT_STORAGE = "sqlite:///optuna.db"


def make_storage(url: str):
    """An Optuna storage from a URL: ``journal:<file>`` for a journal file, anything else as an RDB URL."""
    if url.startswith("journal:"):
        return JournalStorage(JournalFileBackend(url[len("journal:") :]))
    return optuna.storages.RDBStorage(url, heartbeat_interval=60, grace_period=180)


def create_sweep(
    recipe: DictConfig, study_name: str, storage_url: str, objective: str, ratios: Sequence[float] | None = None
) -> optuna.Study:
    """Create (or load) the study and its MLflow parent run; call once before starting workers."""
    storage = make_storage(storage_url)
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
        client = MlflowClient(tracking_uri=uri)
        run = client.create_run(
            experiment_id(str(recipe.tracking.experiment), uri),
            run_name=f"sweep-{study_name}",
            tags={"stage": "sweep", "optuna_study": study_name, "optuna_storage": _safe_url(storage_url),
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


def _safe_url(url: str) -> str:
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
        overrides = [f"synthx.ratio={ratio}"]
        if targeting_rules:
            rule = trial.suggest_categorical("targeting", list(targeting_rules))
            overrides.append(f"synthx.cohort={(synthetic_cohorts or {})[rule]}")
        trial_recipe = OmegaConf.merge(recipe, OmegaConf.from_dotlist(overrides))
        trial_recipe.tracking.run_name = f"{study_name}-trial-{trial.number}"
        callbacks = []
        if len(OBJECTIVES[objective]) == 1 and objective == "f1":
            from optuna_integration import PyTorchLightningPruningCallback

            callbacks.append(PyTorchLightningPruningCallback(trial, monitor="val/f1/overall"))
        from lightning_modules.evaluation.callback import SubgroupEvaluation

        evaluation = SubgroupEvaluation.from_recipe(trial_recipe)
        folder = (output_root or Path(trial_recipe.tracking.output_dir)) / f"sweep-{study_name}" / f"trial-{trial.number}"
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
        trial.set_user_attr("mlflow_run_id", result.run_id)
        table = evaluation.results.get("val")
        if table is None:
            raise optuna.TrialPruned("no validation ran")
        overall_f1 = float(table.loc[table["attribute"] == "overall", "f1"].iloc[0])
        worst_sensitivity = worst_group(table, "sensitivity", attributes)
        client = MlflowClient(tracking_uri=tracking_uri(recipe.tracking.uri))
        client.log_metric(result.run_id, "objective/f1_overall", _finite(overall_f1))
        client.log_metric(result.run_id, "objective/worst_sensitivity", _finite(worst_sensitivity))
        if objective == "f1":
            return _finite(overall_f1)
        if objective == "worst_sensitivity":
            return _finite(worst_sensitivity)
        return _finite(overall_f1), _finite(worst_sensitivity)

    return run_trial


def _finite(value: float) -> float:
    """Undefined metrics score as 0 for the optimizer only (they are logged as undefined elsewhere)."""
    return 0.0 if value is None or math.isnan(value) else float(value)


def fail_stale_trials(study: optuna.Study) -> None:
    """Mark trials left RUNNING by a killed worker as FAILED, so their slot is run again."""
    storage = study._storage
    if isinstance(storage, optuna.storages.RDBStorage) and storage.heartbeat_interval:
        optuna.storages.fail_stale_trials(study)


def run_worker(study: optuna.Study, objective_fn, n_trials: int) -> None:
    """Run trials until the study holds ``n_trials`` complete or pruned trials (shared across workers)."""
    from optuna.study import MaxTrialsCallback

    fail_stale_trials(study)
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

    client = MlflowClient(tracking_uri=tracking_uri(recipe.tracking.uri))
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
            import json

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
    targets = [(None, "objective")] if len(study.directions) == 1 else [
        (lambda t: t.values[0], "overall F1"), (lambda t: t.values[1], "worst-group sensitivity")
    ]
    for target, name in targets:
        slug = name.replace(" ", "_").replace("-", "_")
        for plot, label in (
            (optuna_plots.plot_optimization_history, "history"),
            (optuna_plots.plot_slice, "ratio_vs_objective"),
        ):
            axes = plot(study, target=target, target_name=name)
            figure = axes.flat[0].figure if hasattr(axes, "flat") else axes.figure
            client.log_figure(run_id, figure, f"sweep/{label}_{slug}.png")
            plt.close(figure)
    if len(study.directions) > 1:
        axes = optuna_plots.plot_pareto_front(study, target_names=["overall F1", "worst-group sensitivity"])
        client.log_figure(run_id, axes.figure, "sweep/pareto_front.png")
        plt.close(axes.figure)
    if len(complete) >= 3 and len({t.params.get("ratio") for t in complete}) > 1:
        axes = optuna_plots.plot_param_importances(study, target=targets[0][0], target_name=targets[0][1])
        client.log_figure(run_id, axes.figure, "sweep/importance.png")
        plt.close(axes.figure)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchx sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--study-name", default="synthx-ratio")
    parser.add_argument("--storage", default=DEFAULT_STORAGE, help="sqlite:///file.db, postgresql://..., or journal:<file>")
    parser.add_argument("--objective", choices=sorted(OBJECTIVES), default="f1")
    parser.add_argument("--trials", type=int, default=8, help="finished trials the study should hold (across workers)")
    parser.add_argument("--ratio-min", type=float, default=0.0)
    parser.add_argument("--ratio-max", type=float, default=0.8)
    parser.add_argument("--enqueue", type=float, action="append", default=None, metavar="RATIO",
                        help="a ratio tried first (repeatable; default 0 = the baseline as reference)")
    parser.add_argument("--no-enqueue", action="store_true", help="let the sampler choose every ratio")
    parser.add_argument("--attributes", nargs="+", default=["age", "sex", "phase"], help="for the worst-group objective")
    parser.add_argument("--targeting", nargs="*", default=[], metavar="RULE=COHORT",
                        help="optional targeting rules to sweep, each with its synthetic cohort folder")
    parser.add_argument("--create-only", action="store_true", help="create the study and its MLflow run, then exit")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    overrides = split_overrides(args.overrides)
    recipe = load_recipe(args.recipe, overrides)
    cohorts = dict(item.split("=", 1) for item in args.targeting)
    enqueue = [] if args.no_enqueue else (args.enqueue if args.enqueue is not None else [0.0])
    study = create_sweep(recipe, args.study_name, args.storage, args.objective, enqueue)
    if args.create_only:
        print(f"study {args.study_name} ready in {_safe_url(args.storage)}; MLflow parent run {study.user_attrs[PARENT_ATTR]}")
        return 0
    objective = make_objective(
        recipe, args.objective, study.user_attrs[PARENT_ATTR], args.study_name, args.attributes,
        (args.ratio_min, args.ratio_max), list(cohorts), cohorts,
    )
    run_worker(study, objective, args.trials)
    log_sweep_summary(study, recipe)
    for trial in study.best_trials:
        print(f"trial {trial.number}: ratio={trial.params.get('ratio'):.3f} values={trial.values} run={trial.user_attrs.get('mlflow_run_id')}")
    return 0
