"""A leak through the generator: a synthetic cohort whose canvases are all training cases under a new
split, painted by a generator that learned from that split's validation or test cases, is refused
wherever it is used -- mixing into training (``benchx train``, exit 2), the leakage audit, and
evaluation's overlap check -- naming the offending case."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import RECIPES, new_sqlite_store, tiny_overrides  # noqa: E402
from test_synthx_generation import cohort, run, tiny_pipeline  # noqa: E402,F401  (fixtures)

from lightning_modules.cli import main as benchx  # noqa: E402
from lightning_modules.recipe import load_recipe  # noqa: E402
from lightning_modules.cohorts.audit import check_split_leakage  # noqa: E402
from lightning_modules.data.cohort import CohortError, load_cohort, write_metadata  # noqa: E402
from lightning_modules.workflows.train import recipe_datamodule  # noqa: E402
from lightning_modules.tracking.datasets import SYNTHETIC_COHORT_TAG, log_dataset_inputs  # noqa: E402
from lightning_modules.data.synthetic_provenance import (  # noqa: E402
    PROVENANCE_FILE,
    GeneratorProvenance,
    generator_training_cases,
    provenance_problem,
    read_provenance,
)
from lightning_modules.tracking.provenance import (  # noqa: E402
    GENERATOR_CASES_ARTIFACT,
    log_generator_training_cases,
    log_training_cases,
)
from lightning_modules.workflows.evaluate import OVERLAP_CHECK_TAG, OVERLAP_OVERRIDE_TAG, EvaluationError, check_training_overlap  # noqa: E402

LEAK = "learned from case T1, which is in the 'test' split"


@pytest.fixture
def attack(cohort, tiny_pipeline, tmp_path):  # noqa: F811
    """The issue's attack on the tiny generation fixture: a cohort painted by a generator that learned
    from T1 (a training case of the original split) on healthy training canvases, and a new split
    under which T1 is a test case while every canvas stays a training case."""
    root, split = cohort
    synthetic = tmp_path / "synthetic"
    assert run(root, split, tiny_pipeline, synthetic, {("F", "60-80", "venous"): 1, ("M", "40-60", "venous"): 1}).complete
    table = pd.read_csv(split, dtype=str)
    moved = table.copy()  # was: H1 H2 H3 T1 train, V1 val, X1 test
    moved["split"] = moved["case_id"].map({"T1": "test", "X1": "val"}).fillna("train")
    new_split = tmp_path / "split1.csv"
    moved.to_csv(new_split, index=False)
    canvases = set(load_cohort(synthetic).metadata["source_case_id"])
    assert canvases and canvases <= set(moved.loc[moved["split"] == "train", "case_id"]), "every canvas trains under split1"
    return root, split, new_split, synthetic


def _recipe(root, split, tmp_path, synthetic):
    return load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path), f"synthx.cohort={synthetic}", "synthx.ratio=0.5"])


def test_synthesize_records_the_generators_provenance_in_the_cohort(attack, tmp_path):
    root, split, _, synthetic = attack
    provenance = read_provenance(synthetic)
    assert provenance.training_cases == ["T1"] and provenance.trained
    # Under the split the generator was trained on, the cohort mixes in.
    datamodule = recipe_datamodule(_recipe(root, split, tmp_path, synthetic))
    assert datamodule.synthetic_cohort.root == synthetic


@pytest.mark.parametrize("schedule", [
    [],                                                                    # additive mixing
    ["synthx.real_steps=2", "trainer.max_steps=3"],                        # the study's exposure-matched SynthX arm
    ["synthx.real_steps=2", "trainer.max_steps=3", "synthx.sham=true"],    # its sham arm
], ids=["mixed", "matched", "sham"])
def test_benchx_train_refuses_the_attack_before_any_run(attack, tmp_path, capsys, schedule):
    root, _, new_split, synthetic = attack
    overrides = [*tiny_overrides(root, new_split, tmp_path), f"synthx.cohort={synthetic}", "synthx.ratio=0.5", *schedule]
    assert benchx(["train", "--recipe", str(RECIPES / "unet.yaml"), *overrides]) == 2
    err = capsys.readouterr().err
    assert LEAK in err and "Traceback" not in err
    client = MlflowClient(new_sqlite_store(tmp_path / "mlflow.db"))
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == [], "refused before any run"
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("run.json"))


def test_mixing_refuses_a_cohort_without_provenance_or_with_a_second_generator(attack, tmp_path):
    root, split, _, synthetic = attack
    unknown = tmp_path / "unknown"
    shutil.copytree(synthetic, unknown)
    (unknown / PROVENANCE_FILE).unlink()
    with pytest.raises(CohortError, match=f"has no {PROVENANCE_FILE}"):
        recipe_datamodule(_recipe(root, split, tmp_path, unknown))
    mixed = tmp_path / "mixed"
    shutil.copytree(synthetic, mixed)
    GeneratorProvenance(training_cases=["T1"], generator_run_id="a" * 32).write(mixed)
    rows = load_cohort(mixed).metadata
    rows["generator_run_id"] = "a" * 32
    rows.loc[1, "generator_run_id"] = "b" * 32
    write_metadata(mixed, rows)
    with pytest.raises(CohortError, match=f"{rows.loc[1, 'case_id']}: made by generator run {'b' * 32}"):
        recipe_datamodule(_recipe(root, split, tmp_path, mixed))


def test_the_audit_reports_the_generator_leak(attack):
    root, split, new_split, synthetic = attack
    leaks = check_split_leakage(root, new_split, synthetic_cohorts=[synthetic])
    generator = [leak for leak in leaks if "synthetic_generator_learned_eval" in leak]
    assert len(generator) == 1 and "T1 (test)" in generator[0] and LEAK in generator[0]
    assert not [leak for leak in check_split_leakage(root, split, synthetic_cohorts=[synthetic]) if "generator" in leak]


def test_evaluation_refuses_cases_the_generator_learned_from(attack, tmp_path):
    """A model trained as the attack did (its run records split1's training cases and the generator's):
    evaluating it on split1 is refused naming T1, and tagged failed when overridden, never passed."""
    root, split, new_split, synthetic = attack
    uri = new_sqlite_store(tmp_path / "eval.db")
    client = MlflowClient(uri)
    table = pd.read_csv(new_split, dtype=str)
    # What training logs: the dataset inputs (with the generator's cases) of a legitimate mixed run...
    legit = client.create_run(client.create_experiment("leak")).info.run_id
    datamodule = recipe_datamodule(_recipe(root, split, tmp_path, synthetic))
    log_dataset_inputs(client, legit, datamodule, str(split))
    logged = pd.read_csv(client.download_artifacts(legit, GENERATOR_CASES_ARTIFACT, str(tmp_path)), dtype=str)
    assert logged.to_dict("records") == [{"case_id": "T1", "patient_id": "P4"}]
    # ... and the attack's run, trained under split1 before mixing checked the generator.
    attacked = client.create_run(client.get_experiment_by_name("leak").experiment_id, tags={SYNTHETIC_COHORT_TAG: str(synthetic)}).info.run_id
    log_training_cases(client, attacked, table)
    log_generator_training_cases(client, attacked, generator_training_cases(synthetic, load_cohort(root).metadata))
    evaluated = table[table["split"].isin(["val", "test"])]
    with pytest.raises(EvaluationError, match="case T1: the generator of the model's synthetic training data learned from it"):
        check_training_overlap(client, attacked, evaluated, allow=False)
    tags = check_training_overlap(client, attacked, evaluated, allow=True)
    assert tags[OVERLAP_CHECK_TAG] == "failed: 1 case(s)" and tags[OVERLAP_OVERRIDE_TAG] == "true"
    # A mixed run that records no generator cases is not reported as plainly passed.
    older = client.create_run(client.get_experiment_by_name("leak").experiment_id, tags={SYNTHETIC_COHORT_TAG: str(synthetic)}).info.run_id
    log_training_cases(client, older, table)
    assert check_training_overlap(client, older, evaluated, allow=False)[OVERLAP_CHECK_TAG] != "passed"


def test_the_check_names_the_first_offending_case_and_spares_a_painter_that_learned_nothing():
    split = pd.DataFrame({"case_id": ["A", "B", "C", "D"], "split": ["train", "val", "test", "train"]})
    problem = provenance_problem(GeneratorProvenance(training_cases=["A", "C", "B"], split_sha256="s0"), split, "s1", "generator g")
    assert problem.startswith("generator g learned from case C, which is in the 'test' split (1 more of its 3 training")
    assert provenance_problem(GeneratorProvenance(training_cases=["A", "D"]), split, "s1") is None
    assert provenance_problem(GeneratorProvenance(trained=False), split, "s1") is None
    assert "not recorded" in provenance_problem(GeneratorProvenance(split_sha256="s0"), split, "s1")
