"""The sweep's refusals and endings: a recipe that validates nothing during training is refused
before anything is created, the parent run always ends (FINISHED or FAILED), and a pruned trial's
run ends KILLED with ``optuna_state=PRUNED``."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient

from conftest import RECIPES, tiny_overrides
from lightning_modules.recipe import load_recipe
from lightning_modules.data.cohort import CohortError
from synthx.commands.sweep import main as sweep_main
from synthx.workflows.sweep import PARENT_ATTR, SweepSettings, make_objective, sweep


def _runs(uri: str):
    client = MlflowClient(uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def test_the_cpu_profile_without_validation_is_refused_before_anything_is_created(tiny_phantom, tmp_path, capsys):
    root, split = tiny_phantom
    # The cpu profile as the help example uses it: unet's sets trainer.val_every_n_steps: 0.
    overrides = [o for o in tiny_overrides(root, split, tmp_path) if not o.startswith(("trainer.max_steps", "trainer.val_every"))]
    storage = tmp_path / "optuna.db"
    assert load_recipe(RECIPES / "unet.yaml", overrides).trainer.val_every_n_steps == 0
    args = ["--recipe", str(RECIPES / "unet.yaml"), "--storage", f"sqlite:///{storage}", "--trials", "2", *overrides]
    assert sweep_main(args) == 2
    err = capsys.readouterr().err
    assert "trainer.val_every_n_steps=0 runs no validation" in err and "set trainer.val_every_n_steps" in err
    assert not storage.exists(), "no study created"
    assert _runs(load_recipe(RECIPES / "unet.yaml", overrides).tracking.uri) == [], "no parent run left behind"


def test_the_parent_run_ends_finished_after_the_trials_and_failed_when_a_trial_fails(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    recipe = load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, split, tmp_path))
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = sweep(SweepSettings(recipe, study_name="one", storage=storage, trials=1))
    client = MlflowClient(recipe.tracking.uri)
    assert len(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))) == 1
    assert client.get_run(study.user_attrs[PARENT_ATTR]).info.status == "FINISHED"
    # A trial that fails (its synthetic cohort does not exist) ends the parent FAILED, not RUNNING.
    broken = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path), f"synthx.cohort={tmp_path / 'missing'}"])
    with pytest.raises(CohortError):
        sweep(SweepSettings(broken, study_name="broken", storage=storage, trials=1, enqueue=(), ratio_range=(0.3, 0.8)))
    parent = optuna.load_study(study_name="broken", storage=storage).user_attrs[PARENT_ATTR]
    assert client.get_run(parent).info.status == "FAILED"
    assert "RUNNING" not in {run.info.status for run in _runs(recipe.tracking.uri)}


def test_a_pruned_trial_ends_killed_with_the_optuna_state_tag(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    # Validation at steps 1 and 2: the first report comes before the end, so the f1 objective prunes.
    recipe = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path), "trainer.val_every_n_steps=1"])
    parent = MlflowClient(recipe.tracking.uri).create_run(MlflowClient(recipe.tracking.uri).create_experiment("prune")).info.run_id
    # A real pruner that prunes at the first report: every F1 is below 2.
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.ThresholdPruner(lower=2.0))
    objective = make_objective(recipe, "f1", parent, "prune", ["sex"], (0.0, 0.0), output_root=Path(tmp_path / "trials"))
    study.optimize(objective, n_trials=1)
    trial = study.trials[0]
    assert trial.state == optuna.trial.TrialState.PRUNED
    run = MlflowClient(recipe.tracking.uri).get_run(trial.user_attrs["mlflow_run_id"])
    assert run.info.status == "KILLED" and run.data.tags["optuna_state"] == "PRUNED"
