"""Tests for lightning_modules.workflows.evaluate and the evaluate/compare commands: evaluation runs on
the tiny phantom with the three operating points, paired comparisons, and the refusals (training
cases in the evaluation set, malformed run ids, a run compared with itself, different sets)."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import RECIPES, tiny_overrides
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from lightning_modules.cli import EXIT_USAGE
from lightning_modules.cli import main as benchx
from lightning_modules.commands.compare import main as compare_main
from lightning_modules.commands.compare import parser as compare_parser
from lightning_modules.commands.evaluate import main as evaluate_main
from lightning_modules.recipe import load_recipe
from lightning_modules.tracking.provenance import TRAINING_CASES_ARTIFACT, training_overlap
from lightning_modules.workflows.evaluate import (
    OVERLAP_CHECK_TAG,
    OVERLAP_OVERRIDE_TAG,
    EvaluationError,
    compare,
    evaluate,
    format_comparison,
)
from lightning_modules.evaluation.thresholds import bagged_threshold
from lightning_modules.workflows.train import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluation"))  # test_detection_metrics' records


@pytest.fixture(scope="module")
def two_models(tiny_phantom, tmp_path_factory):
    """Two tiny trained models (seeds 0 and 1) on the tiny phantom: [(recipe, TrainResult)], and the folder."""
    root, split = tiny_phantom
    folder = tmp_path_factory.mktemp("runs")
    models = []
    for seed in (0, 1):
        recipe = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, folder, steps=2), f"seed={seed}"])
        models.append((recipe, train(recipe)))
    return models, folder


def test_training_run_records_its_training_cases(two_models, tiny_phantom):
    recipe, result = two_models[0][0]
    client = MlflowClient(recipe.tracking.uri)
    assert TRAINING_CASES_ARTIFACT in {a.path for a in client.list_artifacts(result.run_id)}
    recorded = pd.read_csv(client.download_artifacts(result.run_id, TRAINING_CASES_ARTIFACT), dtype=str)
    split = pd.read_csv(tiny_phantom[1], dtype=str)
    assert sorted(recorded["case_id"]) == sorted(split.loc[split["split"] == "train", "case_id"])


def test_evaluate_and_compare_two_runs(two_models, tiny_phantom, capsys, monkeypatch):
    models, _ = two_models
    root, split = tiny_phantom
    evaluation_runs = []
    for recipe, result in models:
        run_id, tables = evaluate(recipe, result.best_checkpoint, ("val", "test"), training_run_id=result.run_id)
        evaluation_runs.append(run_id)
        assert {"val", "test", "test_fixed", "test_val_chosen", "val_fixed", "val_val_chosen"} <= set(tables)
        # BenchX's fixed m counts the raw predicted tumor voxels; the records carry every score.
        assert tables["test_fixed"].attrs["score"] == "raw_volume" and tables["test_val_chosen"].attrs["score"] == "volume"
        overall = tables["test"][tables["test"]["attribute"] == "overall"].iloc[0]
        assert overall["n"] == (pd.read_csv(split)["split"] == "test").sum()
    recipe = models[0][0]
    client = MlflowClient(recipe.tracking.uri)
    run = client.get_run(evaluation_runs[0])
    assert run.data.tags["training_run_id"] == models[0][1].run_id
    assert run.data.tags[OVERLAP_CHECK_TAG] == "passed"
    assert run.data.metrics["operating_point/fixed"] == 50.0 and "operating_point/val_chosen" in run.data.metrics
    assert run.data.metrics["test_fixed/threshold"] == 50.0 and "test_val_chosen/n_patients/overall" in run.data.metrics
    # The validation point is bagged (detection.threshold_bootstrap, 2000 by default) from the
    # logged validation records, with the spread of the resamples' choices.
    assert run.data.tags["operating_point.val_chosen.rule"].startswith("youden (mean of ")
    # The evaluation on the model's own split records that point on its registered version (the
    # pyfunc's tumor_detected applies it: tests/tracking/test_pyfunc.py).
    version = client.get_model_version(run.data.tags["registered_model"], run.data.tags["model_version"])
    assert float(version.tags["operating_point_mm3"]) == run.data.metrics["operating_point/val_chosen"]
    assert version.tags["operating_point_rule"] == run.data.tags["operating_point.val_chosen.rule"]
    assert version.tags["operating_point_run"] == evaluation_runs[0]
    val_records = pd.read_csv(client.download_artifacts(evaluation_runs[0], "evaluation/val_records.csv"))
    bagged = bagged_threshold(val_records, "youden", n_resamples=int(recipe.detection.threshold_bootstrap))
    metrics = run.data.metrics
    assert metrics["operating_point/val_chosen"] == pytest.approx(bagged.threshold, rel=1e-9)
    assert (metrics["operating_point/val_chosen_low"], metrics["operating_point/val_chosen_high"]) == pytest.approx(
        (bagged.low, bagged.high), rel=1e-9)
    # With the recipe's rule youden the callback chooses during validation and evaluate reuses its
    # point: the same bagged threshold as chosen above from the logged records.
    youden = OmegaConf.merge(recipe, {"detection": {"threshold_rule": "youden"}})
    youden_run, _ = evaluate(youden, models[0][1].best_checkpoint, ("test",), training_run_id=models[0][1].run_id)
    youden_metrics = client.get_run(youden_run).data.metrics
    assert youden_metrics["operating_point/val_chosen"] == metrics["operating_point/val_chosen"]
    assert youden_metrics["val/threshold"] == metrics["operating_point/val_chosen"], "the callback's own choice"
    assert youden_metrics["operating_point/val_chosen_high"] == metrics["operating_point/val_chosen_high"]
    artifacts = {a.path for a in client.list_artifacts(evaluation_runs[0], "evaluation")}
    assert {"evaluation/test_records.csv", "evaluation/test_subgroups.csv", "evaluation/test_subgroups.png",
            "evaluation/val_records.csv", "evaluation/test_fixed_subgroups.csv",
            "evaluation/test_val_chosen_subgroups.csv"} <= artifacts
    monkeypatch.setenv("MLFLOW_TRACKING_URI", recipe.tracking.uri)
    # As under `mlflow run`: another run in MLFLOW_RUN_ID must not receive the comparison.
    monkeypatch.setenv("MLFLOW_RUN_ID", models[0][1].run_id)
    table, compare_run = compare(evaluation_runs, "test", experiment="benchx", n_resamples=50)
    monkeypatch.delenv("MLFLOW_RUN_ID")
    assert compare_run not in {models[0][1].run_id, *evaluation_runs}, "the comparison has its own run"
    assert set(table["operating_point"]) == {"fixed", "val_chosen", "matched_specificity"}
    assert {"attribute", "group", "metric", "a", "b", "delta", "ci_low", "ci_high", "significant", "n_patients",
            "positives", "negatives", "defined_fraction", "supported", "threshold_a", "threshold_b",
            "p_value", "p_holm", "significant_holm", "a_wilson_low", "b_wilson_high", "newcombe_low", "newcombe_high",
            "p_mcnemar", "p_delong", "p_bootstrap", "test", "score", "nested_threshold"} <= set(table.columns)
    assert "auc" in set(table["metric"])
    assert set(table.loc[table["operating_point"] == "fixed", "score"]) == {"raw_volume"}
    fixed = table[table["operating_point"] == "fixed"]
    assert (fixed["threshold_a"] == 50.0).all() and (fixed["threshold_b"] == 50.0).all()
    # The tiny test split supports no claim: nothing may be marked significant.
    assert not table["supported"].any() and not table["significant"].any()
    text = format_comparison(table)
    assert "phase:" in text and "overall" in text and "matched_specificity" in text
    assert {a.path for a in client.list_artifacts(compare_run, "comparison")} >= {"comparison/test_comparison.csv"}
    # The command line: evaluate an MLflow training run by id, compare by ids.
    assert evaluate_main(["--run-id", models[0][1].run_id, "--stages", "test"]) == 0
    assert "evaluation run" in capsys.readouterr().out
    # Overrides after --stages are overrides, not stages.
    assert evaluate_main(["--run-id", models[0][1].run_id, "--stages", "val,test", "detection.threshold_mm3=10"]) == 0
    assert "  test: n=" in capsys.readouterr().out
    assert compare_main([*evaluation_runs, "--experiment", "", "--resamples", "20"]) == 0
    assert "at val_chosen" in capsys.readouterr().out
    # The localization-aware score: the validation point is chosen again on it.
    assert compare_main([*evaluation_runs, "--experiment", "", "--resamples", "20", "--score", "localized_volume"]) == 0
    assert "localized_volume" in capsys.readouterr().out


def test_compare_refuses_the_same_run_twice_malformed_ids_and_different_sets(two_models, tiny_phantom, tmp_path, capsys):
    models, store = two_models
    root, split = tiny_phantom
    recipe, result = models[0]
    run_id, _ = evaluate(recipe, result.best_checkpoint, ("test",))
    with pytest.raises(EvaluationError, match="named more than once"):
        compare([run_id, run_id], "test", uri=recipe.tracking.uri, experiment=None, n_resamples=20)
    with pytest.raises(EvaluationError, match="not an MLflow run id"):
        compare([run_id, "../../etc"], "test", uri=recipe.tracking.uri, experiment=None, n_resamples=20)
    # Through the benchx dispatcher a refused comparison is a short message with the usage exit code.
    assert benchx(["compare", run_id, run_id.upper()]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("benchx compare: ") and "not an MLflow run id" in err and "Traceback" not in err
    # An evaluation on another set (of cases the model never trained on) is refused by compare.
    frame = pd.read_csv(split)
    val = frame.index[frame["split"] == "val"]
    frame.loc[frame["split"] == "test", "split"] = "val"
    frame.loc[val[:3], "split"] = "test"
    other_split = tmp_path / "other.csv"
    frame.to_csv(other_split, index=False)
    recipe_other = load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, other_split, store, steps=2))
    other_run, _ = evaluate(recipe_other, result.best_checkpoint, ("test",), training_run_id=result.run_id)
    with pytest.raises(EvaluationError, match="different sets"):
        compare([run_id, other_run], "test", uri=recipe.tracking.uri, experiment=None, n_resamples=20)


def test_evaluate_refuses_a_run_id_of_the_wrong_shape(capsys):
    with pytest.raises(SystemExit) as exit_info:
        evaluate_main(["--run-id", "../../etc", "--stages", "test"])
    assert exit_info.value.code == 2
    assert "not an MLflow run id" in capsys.readouterr().err


def test_evaluate_refuses_training_cases_unless_overridden(two_models, tiny_phantom, tmp_path, monkeypatch, capsys):
    models, store = two_models
    root, split = tiny_phantom
    recipe, result = models[0]
    frame = pd.read_csv(split)
    # A whole training patient moved to test (the split itself stays patient-disjoint).
    patient = frame.loc[frame["split"] == "train", "patient_id"].iloc[0]
    frame.loc[frame["patient_id"] == patient, "split"] = "test"
    leaked = frame.index[frame["patient_id"] == patient][0]
    leaking_split = tmp_path / "leaking.csv"
    frame.to_csv(leaking_split, index=False)
    case_id = frame.loc[leaked, "case_id"]
    leaking = load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, leaking_split, store, steps=2))
    client = MlflowClient(leaking.tracking.uri)
    runs_before = len(client.search_runs([client.get_experiment_by_name("benchx").experiment_id]))
    with pytest.raises(EvaluationError, match=f"case {case_id}: is one of the model's training cases"):
        evaluate(leaking, result.best_checkpoint, ("test",), training_run_id=result.run_id)
    # The training run is also found from the checkpoint's run folder when not given.
    with pytest.raises(EvaluationError, match="overlap the training cases"):
        evaluate(leaking, result.best_checkpoint, ("test",))
    assert len(client.search_runs([client.get_experiment_by_name("benchx").experiment_id])) == runs_before
    # The command line refuses with the usage exit code and a short message, and logs no run.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", leaking.tracking.uri)
    assert benchx(["evaluate", "--run-id", result.run_id, "--stages", "test", f"data.split={leaking_split}"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("benchx evaluate: ") and f"case {case_id}: is one of the model's training cases" in err
    assert "Traceback" not in err
    assert len(client.search_runs([client.get_experiment_by_name("benchx").experiment_id])) == runs_before
    with pytest.raises(EvaluationError, match="not found in the tracking store"):
        evaluate(leaking, result.best_checkpoint, ("test",), training_run_id="0" * 32)
    run_id, _ = evaluate(leaking, result.best_checkpoint, ("test",), training_run_id=result.run_id, allow_training_overlap=True)
    tags = client.get_run(run_id).data.tags
    assert tags[OVERLAP_OVERRIDE_TAG] == "true" and tags[OVERLAP_CHECK_TAG].startswith("failed: ")


def test_compare_refuses_an_evaluation_made_with_the_training_overlap_allowed(two_models, tiny_phantom, tmp_path, capsys, monkeypatch):
    """A clean evaluation compared with one made with --allow-training-overlap: exit 2 naming the run, no comparison run."""
    models, store = two_models
    root, split = tiny_phantom
    recipe, result = models[0]
    clean, _ = evaluate(recipe, result.best_checkpoint, ("test",), training_run_id=result.run_id)
    frame = pd.read_csv(split)
    train_case = frame.index[frame["split"] == "train"][0]
    frame.loc[frame["patient_id"] == frame.loc[train_case, "patient_id"], "split"] = "test"
    leaking_split = tmp_path / "leaking.csv"
    frame.to_csv(leaking_split, index=False)
    leaking = load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, leaking_split, store, steps=2))
    overlapping, _ = evaluate(leaking, result.best_checkpoint, ("test",), training_run_id=result.run_id, allow_training_overlap=True)
    client = MlflowClient(recipe.tracking.uri)
    experiment = client.get_experiment_by_name("benchx").experiment_id
    compares_before = len(client.search_runs([experiment], "tags.stage = 'compare'"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", recipe.tracking.uri)
    for order in ([clean, overlapping], [overlapping, clean]):
        assert benchx(["compare", *order, "--resamples", "20"]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert f"run {overlapping} was evaluated with --allow-training-overlap" in err and "Traceback" not in err
    assert len(client.search_runs([experiment], "tags.stage = 'compare'")) == compares_before, "nothing logged"
    assert "--allow-training-overlap" in " ".join(compare_parser().format_help().split())


def test_evaluate_on_a_generator_run_or_model_uri_exits_2(mlflow_uri, capsys):
    import mlflow

    client = MlflowClient(mlflow_uri)
    experiment = client.create_experiment("synthx")
    # A generator training run: a recipe.yaml artifact but no segmentation checkpoint.
    generator_run = client.create_run(experiment).info.run_id
    client.log_text(generator_run, "model:\n  kind: synthx\n", "recipe.yaml")
    client.set_terminated(generator_run)
    assert benchx(["evaluate", "--run-id", generator_run, "--stages", "test"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("benchx evaluate: ") and "no checkpoints/best.ckpt" in err and "Traceback" not in err

    class Generator(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input: list[str], params=None) -> list[str]:
            return model_input

    with mlflow.start_run(experiment_id=experiment):
        mlflow.pyfunc.log_model(name="generator", python_model=Generator(), registered_model_name="synthx-generator")
    assert benchx(["evaluate", "--model-uri", "models:/synthx-generator/1", "--stages", "test"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "models:/synthx-generator/1 is not a benchx segmentation model" in err and "Traceback" not in err


def test_a_case_of_a_training_patient_is_named():
    frame = pd.DataFrame({"case_id": ["a", "b", "c", "d"], "patient_id": ["p1", "p2", "p3", "p4"],
                          "split": ["train", "train", "test", "test"]})
    test_case = frame.index[frame["split"] == "test"][0]
    train_patient = frame.loc[frame["split"] == "train", "patient_id"].iloc[0]
    # A test scan recorded under a training patient: the case is new, the patient is not.
    frame.loc[test_case, "patient_id"] = train_patient
    problems = training_overlap(frame[frame["split"] == "test"], frame[frame["split"] == "train"])
    assert problems == [f"case {frame.loc[test_case, 'case_id']}: patient {train_patient} has training cases"]


def test_matched_specificity_uses_the_baselines_validation_specificity_and_falls_back_when_it_cannot():
    from test_detection_metrics import random_records

    from lightning_modules.workflows.evaluate import EvaluatedRun, _compare_pair
    from lightning_modules.evaluation.thresholds import specificity_at

    test_records, val_a, val_b = random_records(150, 1), random_records(90, 2), random_records(90, 3)
    test_records["raw_volume_mm3"] = test_records["volume_mm3"] + 30.0  # uncleaned specks add raw volume
    baseline = EvaluatedRun("a" * 32, "baseline", test_records, val_a, {"fixed": 50.0, "val_chosen": 20.0})
    other = EvaluatedRun("b" * 32, "synthx", test_records.assign(volume_mm3=test_records["volume_mm3"] * 2), val_b,
                         {"fixed": 50.0, "val_chosen": 30.0})
    notes: list[str] = []
    table = _compare_pair(baseline, other, {"n_resamples": 20, "confidence": 0.95, "score": "volume"}, notes)
    matched = table[table["operating_point"] == "matched_specificity"].iloc[0]
    assert matched["threshold_a"] == 20.0 and not notes
    # BenchX's fixed m reads the raw volume; the chosen points the cleaned one, with the threshold's uncertainty.
    assert set(table.loc[table["operating_point"] == "fixed", "score"]) == {"raw_volume"}
    assert set(table.loc[table["operating_point"] != "fixed", "score"]) == {"volume"}
    assert table.loc[table["operating_point"] != "fixed", "nested_threshold"].all()
    assert not table.loc[table["operating_point"] == "fixed", "nested_threshold"].any()
    assert specificity_at(val_b, matched["threshold_b"]) >= specificity_at(val_a, 20.0) - 1e-12
    other.val_records = None
    table = _compare_pair(baseline, other, {"n_resamples": 20, "confidence": 0.95, "score": "volume"}, notes)
    assert (table.loc[table["operating_point"] == "matched_specificity", "threshold_b"] == 50.0).all()
    assert len(notes) == 1 and "matched specificity: no validation records" in notes[0]


def comparison_rows(significant: list[bool], holm: list[bool]) -> pd.DataFrame:
    """A hand-made comparison: two phases, every metric of the terminal table, marks as given."""
    rows = []
    for group, sig, sig_holm in zip(["venous", "arterial"], significant, holm):
        for metric in ("sensitivity", "specificity", "f1"):
            rows.append({"run": "synthx", "operating_point": "fixed", "threshold_a": 50.0, "threshold_b": 50.0,
                         "attribute": "phase", "group": group, "metric": metric, "n": 40, "n_patients": 40,
                         "positives": 20, "negatives": 20, "a": 0.5, "b": 0.7, "delta": 0.2, "ci_low": 0.1,
                         "ci_high": 0.3, "defined_fraction": 1.0, "supported": True, "significant": sig,
                         "p_value": 0.01, "p_holm": 0.02 if sig_holm else 0.08, "significant_holm": sig_holm})
    return pd.DataFrame(rows)


def test_tables_mark_a_difference_that_survives_holm_apart_from_one_that_does_not():
    from synthx.workflows.report.html_page import comparison_html

    table = comparison_rows(significant=[True, True], holm=[True, False])
    lines = {line.split()[0]: line for line in format_comparison(table).splitlines() if line.startswith("phase:")}
    assert "+20.0 [+10.0, +30.0]**" in lines["phase:venous"]
    assert "+20.0 [+10.0, +30.0]*" in lines["phase:arterial"] and "**" not in lines["phase:arterial"]
    assert "** also after Holm's correction" in format_comparison(table)
    # The report marks by Holm over the whole family (synthx.analysis.endpoint.label_results), not per attribute:
    # the primary row is a family of one (**); the five other rows share one family, where p 0.01 x 5
    # is no longer below 0.05 (*, though two of them survive Holm over their attribute's phases).
    from synthx.analysis.endpoint import label_results, PrimaryEndpoint

    page = comparison_html(label_results(table, PrimaryEndpoint(group="venous", operating_point="fixed")))
    assert page.count("+30.0] **") == 1 and page.count("+30.0] *<") == 5
    assert "SynthX against baseline at BenchX&#x27;s fixed m (m 50 and 50 mm³)" in page, "the heading names the operating point"


def test_a_row_whose_interval_spans_zero_is_never_marked_significant():
    from lightning_modules.workflows.comparison_table import significance_mark

    decided = {"test": "mcnemar_exact", "p_value": 0.0027, "significant": True, "significant_holm": True}
    assert significance_mark({**decided, "ci_low": 0.05, "ci_high": 0.41}) == "**"
    assert significance_mark({**decided, "significant_holm": False, "ci_low": 0.05, "ci_high": 0.41}) == "*"
    # +0.273 [-0.100, +0.411], p_holm 0.0027: the test rejects, the interval beside it does not.
    assert significance_mark({**decided, "ci_low": -0.100, "ci_high": 0.411}) == "~"
    assert significance_mark({**decided, "p_value": 0.4, "significant": False, "significant_holm": False,
                              "ci_low": -0.1, "ci_high": 0.4}) == " "


def test_compare_keeps_two_runs_of_one_variant_apart(two_models, tiny_phantom, monkeypatch):
    """Evaluation runs of one variant (two ratios of a sweep, arms evaluated with ``benchx evaluate``)
    carry the same variant tag and name: the comparison names them by their ids instead of failing."""
    models, _ = two_models
    recipe = models[0][0]
    runs = [evaluate(r, result.best_checkpoint, ("val", "test"), training_run_id=result.run_id)[0] for r, result in models]
    again, _ = evaluate(models[1][0], models[1][1].best_checkpoint, ("val", "test"), training_run_id=models[1][1].run_id)
    client = MlflowClient(recipe.tracking.uri)
    assert client.get_run(again).data.tags["variant"] == client.get_run(runs[1]).data.tags["variant"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", recipe.tracking.uri)
    table, _ = compare([*runs, again], "test", experiment="", n_resamples=20)
    names = sorted(set(table["run"]))
    assert len(names) == 2 and names == sorted(f"{client.get_run(r).data.tags['variant']} ({r[:8]})" for r in (runs[1], again))
    assert "overall" in format_comparison(table)
