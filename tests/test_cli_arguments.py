"""Command-line arguments refused before any work: a short message, exit code 2, no traceback, and
nothing created (no MLflow store, no Optuna storage, no output folder); recipe overrides with spaces."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from conftest import RECIPES, REPO_ROOT
from lightning_modules.cli import EXIT_USAGE
from lightning_modules.commands.common import split_overrides


def benchx(*args: str, cwd, store) -> subprocess.CompletedProcess:
    """``benchx`` in a fresh process, in ``cwd``, with ``store`` as its (not yet existing) MLflow store."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{store}"}
    return subprocess.run([sys.executable, "-m", "lightning_modules.cli", *args], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=300)


def refused(done: subprocess.CompletedProcess, *named: str) -> None:
    assert done.returncode == EXIT_USAGE, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    for text in named:
        assert text in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("arguments, named", [
    (["--locked-cases", "-5"], "argument --locked-cases: must be an integer >= 0, got -5"),
    (["--ratio", "-1"], "argument --ratio: must be a number > 0, got -1"),
    (["--ratio", "0"], "argument --ratio: must be a number > 0, got 0"),
    (["--cases", "0"], "argument --cases: must be an integer >= 1, got 0"),
    (["--seeds", "1"], "argument --seeds: must be an integer >= 2, got 1"),
    (["--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
    (["--ratio", "50"], "--ratio 50 with"),  # above the recipe's bound for its synthx.mode
    (["--ratio", "nan"], "argument --ratio: must be a number > 0, got nan"),
    (["--locked-seed", "0"], "choose another --locked-seed"),  # the settings' own check, as a usage error
])
def test_a_study_number_out_of_range_is_refused_before_anything_is_created(tmp_path, arguments, named):
    store, out = tmp_path / "mlflow.db", tmp_path / "study"
    done = benchx("study", "--recipe", str(RECIPES / "unet.yaml"), "--synthx-recipe", str(RECIPES / "generator" / "synthx.yaml"),
                  "--out", str(out), *arguments, cwd=tmp_path, store=store)
    refused(done, named)
    assert sorted(path.name for path in tmp_path.iterdir()) == [], "no store, no study folder"


def test_a_study_recipe_error_is_refused_before_torch_is_imported(tmp_path):
    probe = (
        "import sys\n"
        "from lightning_modules.cli import main\n"
        f"code = main(['study', '--recipe', {str(RECIPES / 'unet.yaml')!r}, '--out', {str(tmp_path / 'study')!r}, "
        "'trainer.max_stepz=1'])\n"
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported', code)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"})
    assert done.stdout.strip() == f"torch not imported {EXIT_USAGE}", done.stdout + done.stderr[-2000:]
    assert "trainer.max_stepz" in done.stderr and "Traceback" not in done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [
    ["synthx-train", "--recipe", str(RECIPES / "generator" / "synthx.yaml"), "zz_mistyped.key=1"],
    ["study", "--recipe", str(RECIPES / "unet.yaml"), "--synthx-recipe", str(RECIPES / "generator" / "synthx.yaml"),
     "--synthx-override", "zz_mistyped.key=1"],
])
def test_a_synthx_recipe_error_is_refused_before_torch_or_diffusers_load(tmp_path, command):
    probe = (
        "import sys\n"
        "from lightning_modules.cli import main\n"
        f"code = main({command + ['--out', str(tmp_path / 'out')]!r})\n"
        "print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules), code)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"})
    assert done.stdout.strip() == f"[] {EXIT_USAGE}", done.stdout + done.stderr[-2000:]
    assert "zz_mistyped" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("arguments, named", [
    (["--ratio-min", "0.9", "--ratio-max", "0.1"], "--ratio-min (0.9) must be below --ratio-max (0.1)"),
    (["--targeting", "foo"], "--targeting 'foo': expected RULE=COHORT"),
    (["--targeting", "need:4=missing-cohort"], "the synthetic cohort folder missing-cohort does not exist"),
    (["--storage", "bogus://x"], "--storage 'bogus://x' is not a storage URL"),
    (["--ratio-min", "20", "--ratio-max", "50"], "synthx.ratio must be in [0, 1] (displace) or [0, 10] (add), got 20.0"),
    (["--ratio-min", "-0.5"], "argument --ratio-min: must be a number >= 0, got -0.5"),
    (["--trials", "0"], "argument --trials: must be an integer >= 1, got 0"),
])
def test_a_bad_sweep_argument_is_refused_before_any_study_or_run(tmp_path, arguments, named):
    store = tmp_path / "mlflow.db"
    storage = [] if "--storage" in arguments else ["--storage", f"sqlite:///{tmp_path / 'optuna.db'}"]
    done = benchx("sweep", "--recipe", str(RECIPES / "unet.yaml"), *storage, *arguments, cwd=tmp_path, store=store)
    refused(done, named)
    assert sorted(path.name for path in tmp_path.iterdir()) == [], "no MLflow store, no Optuna storage"


@pytest.mark.parametrize("arguments, expected", [
    (["data.root=/x/my data/ph"], ["data.root=/x/my data/ph"]),  # one argument, one value with a space
    (["profile=cpu trainer.max_steps=5"], ["profile=cpu", "trainer.max_steps=5"]),  # mlflow run's one parameter
    (["profile=cpu data.root='/x/my data/ph'"], ["profile=cpu", "data.root=/x/my data/ph"]),  # quoted inside it
    (["tracking.run_name=O'Brien"], ["tracking.run_name=O'Brien"]),  # an unbalanced quote is taken as written
    (["a=1", "", "  b=2  "], ["a=1", "b=2"]),
])
def test_overrides_are_split_only_into_key_value_pairs(arguments, expected):
    assert split_overrides(arguments) == expected


def test_an_override_value_with_a_space_reaches_the_recipe(capsys):
    from omegaconf import OmegaConf

    from lightning_modules.cli import main

    assert main(["recipe", "show", "--recipe", str(RECIPES / "unet.yaml"), "data.root=/x/my data/ph"]) == 0
    assert OmegaConf.create(capsys.readouterr().out).data.root == "/x/my data/ph"


def test_mlflow_run_s_overrides_parameter_keeps_a_quoted_value_with_a_space():
    from mlflow.projects._project_spec import load_project

    from lightning_modules.commands import train

    entry = load_project(str(REPO_ROOT)).get_entry_point("train")
    for overrides in ("profile=cpu data.root='/x/my data/ph'", "data.root=/x/my data/ph"):
        command = entry.compute_command({"recipe": "recipes/unet.yaml", "overrides": overrides}, None)
        args = train.parse_args(shlex.split(command)[2:])  # as the shell hands it to `benchx train`
        assert "data.root=/x/my data/ph" in args.overrides, (command, args.overrides)
