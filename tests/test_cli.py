"""The ``benchx`` dispatcher: version, help texts, and expected errors as short messages with exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import RECIPES, REPO_ROOT
from lightning_modules.cli import COMMANDS, EXIT_USAGE, main


def benchx(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``benchx`` as a user runs it: a fresh process, this checkout first on the path."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "lightning_modules.cli", *args], cwd=REPO_ROOT, env=environment,
                          capture_output=True, text=True, timeout=600)


def test_version(capsys):
    from lightning_modules import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"benchx {__version__}"


def test_a_mistyped_recipe_key_exits_2_with_a_short_message_and_no_traceback(tmp_path):
    done = benchx("train", "--recipe", str(RECIPES / "unet.yaml"), "trainer.max_stepz=1",
                  env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"})
    assert done.returncode == EXIT_USAGE, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "trainer.max_stepz" in done.stderr and "max_steps" in done.stderr, done.stderr
    assert len([line for line in done.stderr.splitlines() if line.startswith("benchx train:")]) == 1
    # --debug (anywhere on the line) shows the traceback instead.
    debug = benchx("recipe", "show", "--recipe", str(RECIPES / "unet.yaml"), "trainer.max_stepz=1", "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "RecipeError" in debug.stderr


@pytest.mark.parametrize("override", ["optim.lr=-1", "optim.lr=nan", "data.batch_size=0", "trainer.max_steps=-5",
                                      "data.patch_size=[0,32,32]"])
def test_a_value_out_of_range_exits_2_before_any_store_or_run_exists(tmp_path, capsys, override):
    store = tmp_path / "mlflow.db"
    code = main(["train", "--recipe", str(RECIPES / "unet.yaml"), "profile=cpu", override, f"tracking.uri=sqlite:///{store}",
                 f"tracking.output_dir={tmp_path / 'outputs'}"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err
    assert f"unet.yaml: {override.split('=')[0]} must be" in err
    assert not store.exists() and not (tmp_path / "outputs").exists(), "refused before any run (or store) is created"


def test_a_recipe_that_is_a_directory_exits_2(tmp_path, capsys):
    code = main(["train", "--recipe", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and f"recipe {tmp_path} is not a file" in err and "Traceback" not in err


def test_recipe_show_prints_the_resolved_recipe(capsys):
    from omegaconf import OmegaConf

    assert main(["recipe", "show", "--recipe", str(RECIPES / "unet.yaml"), "profile=cpu", "trainer.max_steps=7"]) == 0
    shown = OmegaConf.create(capsys.readouterr().out)
    assert shown.trainer.max_steps == 7 and shown.profile == "cpu" and shown.model.backbone == "unet"


def test_a_missing_run_or_model_is_named_with_exit_2(tmp_path, mlflow_uri, capsys):
    (tmp_path / "scan.nii.gz").write_bytes(b"")
    code = main(["predict", "--run-id", "0123456789abcdef0123456789abcdef", "--input", str(tmp_path / "scan.nii.gz"),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "0123456789abcdef0123456789abcdef" in err and "Traceback" not in err
    code = main(["predict", "--model-uri", "models:/benchx-unet@nothing", "--input", str(tmp_path / "scan.nii.gz"),
                 "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "models:/benchx-unet@nothing" in err
    assert len(err.strip().splitlines()) <= 3


@pytest.mark.parametrize("source", ["models:/benchx-unet@baseline", "0123456789abcdef0123456789abcdef"])
def test_a_model_without_a_tracking_store_names_the_store_and_creates_no_database(tmp_path, source):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    environment["PYTHONPATH"] = str(REPO_ROOT)
    scan = tmp_path / "scan.nii.gz"
    scan.write_bytes(b"")
    done = subprocess.run([sys.executable, "-m", "lightning_modules.cli", "predict", "--run-id", source, "--input",
                           str(scan), "--out", "predictions"], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == EXIT_USAGE, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert f"{source} needs the tracking store that holds it, and sqlite:///mlflow.db does not exist" in done.stderr
    assert "MLFLOW_TRACKING_URI" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scan.nii.gz"], "no ./mlflow.db, no output folder"


def test_a_split_naming_unknown_cases_exits_2(tiny_phantom, tmp_path, capsys):
    from conftest import tiny_overrides

    root, split = tiny_phantom
    bad = tmp_path / "split.csv"
    bad.write_text(split.read_text() + "NOT_A_CASE,NOT_A_PATIENT,train\n")
    code = main(["train", "--recipe", str(RECIPES / "unet.yaml"), *tiny_overrides(root, split, tmp_path), f"data.split={bad}"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "NOT_A_CASE" in err and "Traceback" not in err, err


def test_an_unknown_command_lists_the_commands(capsys):
    assert main(["trian"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "train" in err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_help_shows_defaults_and_an_example_without_rst_quoting(command, capsys, monkeypatch):
    import argparse

    shown = []
    format_help = argparse.ArgumentParser.format_help

    def recording(parser):
        shown.append(parser)
        return format_help(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "format_help", recording)
    args = [command, "show", "--help"] if command == "recipe" else [command, "--help"]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "`" not in text, text
    assert "example:\n  benchx " in text or "example:\n  mlflow " in text, f"benchx {command} --help has no example"
    flat = " ".join(text.split())
    for action in shown[-1]._actions:
        written = "(default:" in (action.help or "") or "%(default)" in (action.help or "")  # the help names it itself
        if action.option_strings and action.default not in (None, False, [], "", argparse.SUPPRESS) and not written:
            assert f"default: {action.default}" in flat, f"{command} {action.option_strings[0]}: default not shown"


NOISE = [
    ("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, "lightning.pytorch.utilities.data"),
    ("NvImgCodecPydicomReader: nvImageCodec decoder plugin did not register", UserWarning, "monai.data.image_reader"),
    ("The specified dataset source can be interpreted in multiple ways: ...", UserWarning, "mlflow.data.dataset_source_registry"),
    ("Setting affine, but the applied meta contains an affine. This will be overwritten.", UserWarning, "monai.data.meta_tensor"),
    ("The `srun` command is available on your system but is not used. HINT: ...", UserWarning,
     "lightning.fabric.plugins.environments.slurm"),
    ("When using the `ThroughputMonitor`, you need to define a `flops_per_batch` attribute", UserWarning,
     "lightning.pytorch.callbacks.throughput_monitor"),
    ("Using `DistributedSampler` with the dataloaders. During `trainer.test()`, it is recommended to use "
     "`Trainer(devices=1, num_nodes=1)`", UserWarning, "lightning.pytorch.trainer.connectors.data_connector"),
    ("It is recommended to use `self.log('test/f1/overall', ..., sync_dist=True)` when logging on epoch level in "
     "distributed setting", UserWarning, "lightning.pytorch.trainer.connectors.logger_connector.result"),
]


def test_the_command_line_silences_each_known_noise_warning_and_nothing_else():
    import warnings

    from lightning_modules.infrastructure import warnings_filter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings_filter.install()
        for message, category, module in NOISE:
            warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module=module)
        assert caught == []
        # The same text from another library, and another text from the same module, still show.
        warnings.warn_explicit(NOISE[3][0], UserWarning, "elsewhere.py", 1, module="lightning_modules.data.datamodule")
        warnings.warn_explicit("The model has no parameters", UserWarning, "x.py", 1, module="lightning.pytorch.trainer")
    assert [str(w.message) for w in caught] == [NOISE[3][0], "The model has no parameters"]


def test_a_mistyped_command_gets_a_did_you_mean(capsys):
    assert main(["trian"]) == EXIT_USAGE
    assert "did you mean 'train'?" in capsys.readouterr().err
    assert main(["sythesize"]) == EXIT_USAGE
    assert "did you mean 'synthesize'?" in capsys.readouterr().err
    assert main(["zzzz"]) == EXIT_USAGE
    assert "did you mean" not in capsys.readouterr().err


def test_options_and_overrides_in_any_order_and_the_profile_spelled_either_way():
    from lightning_modules.commands import train

    expected = ["profile=cpu", "trainer.max_steps=5"]
    for argv in (
        ["--recipe", "r.yaml", "profile=cpu", "trainer.max_steps=5", "--out", "o"],
        ["profile=cpu", "--out", "o", "trainer.max_steps=5", "--recipe", "r.yaml"],
        ["--profile", "cpu", "--recipe", "r.yaml", "trainer.max_steps=5", "--out", "o"],
        ["--recipe", "r.yaml", "profile=cpu trainer.max_steps=5", "--out", "o"],  # mlflow run's one parameter
    ):
        args = train.parse_args(argv)
        assert (args.recipe, args.out, args.overrides, args.profile) == ("r.yaml", "o", expected, "cpu"), argv


def test_two_different_profiles_are_refused(capsys):
    assert main(["train", "--recipe", str(RECIPES / "unet.yaml"), "--profile", "cpu", "profile=gpu"]) == EXIT_USAGE
    assert "name different profiles" in capsys.readouterr().err


def test_the_study_takes_the_profile_either_way():
    from lightning_modules.commands.common import parse_command_line
    from synthx.commands.study import build_parser

    for argv in (["--profile", "cpu", "trainer.max_steps=9"], ["trainer.max_steps=9", "profile=cpu"]):
        args = parse_command_line(build_parser(), argv)
        assert args.profile == "cpu" and "trainer.max_steps=9" in args.overrides


def test_recipe_show_takes_recipe_like_every_other_command(capsys):
    with pytest.raises(SystemExit):
        main(["recipe", "show", str(RECIPES / "unet.yaml")])  # the positional spelling is gone
    assert "--recipe" in capsys.readouterr().err
    assert main(["recipe", "show", "profile=cpu", "--recipe", str(RECIPES / "unet.yaml")]) == 0


@pytest.mark.parametrize("override, named", [
    ("trainer.max_stepz=1", "trainer.max_stepz"),  # a mistyped key
    ("data.cache=ram", "data.cache must be memory, disk or none"),  # a choice outside its Enum
    ("optim.lr=-1", "optim.lr must be a finite number > 0"),  # a value out of range
])
def test_a_recipe_error_is_reported_before_torch_is_imported(tmp_path, override, named):
    """A mistyped key or a wrong value must not wait for torch, Lightning and MLflow to import (seconds on a small machine)."""
    probe = (
        "import sys\n"
        "from lightning_modules.cli import main\n"
        f"code = main(['train', '--recipe', {str(RECIPES / 'unet.yaml')!r}, {override!r}])\n"
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported', code)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"})
    assert done.stdout.strip() == f"torch not imported {EXIT_USAGE}", done.stdout + done.stderr[-2000:]
    assert named in done.stderr
    assert not (tmp_path / "m.db").exists()


def test_the_command_line_drops_diffusers_accelerate_advice_from_its_log(caplog):
    import logging

    from lightning_modules.infrastructure import warnings_filter

    warnings_filter.install()
    logger = logging.getLogger("diffusers.models.modeling_utils")
    with caplog.at_level(logging.WARNING):
        logger.warning("Cannot initialize model with low cpu memory usage because `accelerate` was not found in the environment.")
        logger.warning("Some weights of the model checkpoint were not used")
    assert [r.getMessage() for r in caplog.records] == ["Some weights of the model checkpoint were not used"]


HEAVY = ("torch", "lightning", "mlflow", "optuna", "diffusers", "monai")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_help_answers_without_importing_torch_lightning_or_mlflow(command):
    """Structural, not timed: ``--help`` parses arguments only, so no heavy library may be imported."""
    args = [command, "show", "--help"] if command == "recipe" else [command, "--help"]
    probe = (
        "import sys\n"
        "from lightning_modules.cli import main\n"
        "try:\n"
        f"    code = main({args!r})\n"
        "except SystemExit as exit_:\n"
        "    code = exit_.code\n"
        f"print(code, sorted(name for name in {HEAVY!r} if name in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.stderr.strip().splitlines()[-1] == "0 []", done.stderr[-2000:]
    assert "usage: benchx" in done.stdout


def test_the_commands_help_defaults_are_the_libraries_defaults():
    """The commands name their defaults themselves (importing the library would make --help slow)."""
    from dataclasses import fields

    from lightning_modules.cohorts import example_ct, importers
    from lightning_modules.cohorts.audit import DEFAULT_THRESHOLD
    from lightning_modules.cohorts.phantom import DEFAULT_CASES
    from lightning_modules.commands import audit, fetch_example, import_cohort, phantom
    from synthx.commands import replicates, study, sweep
    from synthx.workflows import replicates as replicates_workflow
    from synthx.workflows import sweep as sweep_workflow
    from synthx.workflows.study.settings import StudySettings

    defaults = {field.name: field.default for field in fields(StudySettings)}
    assert study.DEFAULTS == {name: defaults[name] for name in study.DEFAULTS}
    assert (sweep.DEFAULT_STORAGE, sweep.DEFAULT_HEARTBEAT_S) == (sweep_workflow.DEFAULT_STORAGE, sweep_workflow.DEFAULT_HEARTBEAT_S)
    assert sorted(sweep.OBJECTIVE_NAMES) == sorted(sweep_workflow.OBJECTIVES)
    assert replicates.OPERATING_POINTS == replicates_workflow.OPERATING_POINTS
    assert (audit.DEFAULT_THRESHOLD, phantom.DEFAULT_CASES) == (DEFAULT_THRESHOLD, DEFAULT_CASES)
    assert import_cohort.SOURCE_KINDS == importers.SOURCE_KINDS
    assert (fetch_example.DEFAULT_OUT, fetch_example.CACHE_ENVIRONMENT_VARIABLE) == (
        str(example_ct.DEFAULT_OUT), example_ct.CACHE_ENVIRONMENT_VARIABLE)


def test_an_abbreviated_option_is_refused_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--recipe", str(RECIPES / "unet.yaml"), "--profil", "cpu"])
    assert exit_.value.code == EXIT_USAGE
    assert "unrecognized arguments: --profil" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["study", "--locked", "5"])  # would have been --locked-cases or --locked-seed
    assert exit_.value.code == EXIT_USAGE


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_parser_refuses_abbreviations(command, monkeypatch, capsys):
    import argparse

    built = []
    parse_known_args = argparse.ArgumentParser.parse_known_args

    def recording(parser, *args, **kwargs):
        built.append(parser)
        return parse_known_args(parser, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", recording)
    with pytest.raises(SystemExit):
        main([command, "show", "--help"] if command == "recipe" else [command, "--help"])
    assert built and all(parser.allow_abbrev is False for parser in built), [p.prog for p in built if p.allow_abbrev]


def test_a_mistyped_recipe_subcommand_gets_a_did_you_mean(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["recipe", "shwo", "--recipe", str(RECIPES / "unet.yaml")])
    assert exit_.value.code == EXIT_USAGE
    assert "unknown subcommand 'shwo'; did you mean 'show'?" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["recipe", "zzzz"])
    assert exit_.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "unknown subcommand 'zzzz'" in err and "did you mean" not in err and "'show'" in err


@pytest.mark.parametrize("command", [["train"], ["recipe", "show"]])
def test_a_missing_recipe_file_is_named_as_a_missing_file(command, capsys):
    missing = RECIPES / "unett.yaml"
    assert main([*command, "--recipe", str(missing)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"recipe file {missing} does not exist; did you mean {RECIPES / 'unet.yaml'}?" in err
    assert "check the key" not in err and "--recipe names a YAML file" in err and "Traceback" not in err
    assert main([*command, "--recipe", str(RECIPES / "nothing-like-it.yaml")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "nothing-like-it.yaml does not exist" in err and "did you mean" not in err


def test_train_help_states_the_exit_code_of_a_refusal(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"{EXIT_USAGE} refused" in text and "1 refused" not in text
    assert main(["train", "--recipe", str(tmp_path)]) == EXIT_USAGE  # a refusal: what the help says
