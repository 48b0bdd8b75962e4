"""SynthX-augmented training (ratio mixing and its refusals), the study end to end with resume, and the sweep."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import optuna
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from conftest import RECIPES, REPO_ROOT, new_sqlite_store, tiny_overrides
from lightning_modules.data.cohort import CohortError, load_cohort, write_metadata
from lightning_modules.data.datamodule import CohortDataModule
from lightning_modules.recipe import load_recipe
from lightning_modules.data.mixing import MixingSampler
from lightning_modules.data.splits import split_sha256
from lightning_modules.data.synthetic_provenance import GeneratorProvenance
from lightning_modules.workflows.train import recipe_datamodule, train


def fake_synthetic_cohort(root, split, out, canvas_split: str = "train", n: int = 3):
    """A 'synthetic' cohort made of copies of real cases (their own canvases), marked synthetic=1."""
    table = pd.read_csv(split)
    cohort = load_cohort(root)
    canvases = list(table.loc[table["split"] == canvas_split, "case_id"][:n])
    out.mkdir(parents=True)
    rows = []
    for index, canvas in enumerate(canvases):
        case_id = f"SX{index:04d}"
        shutil.copytree(root / canvas, out / case_id)
        row = cohort.row(canvas)
        rows.append({"case_id": case_id, "patient_id": row["patient_id"], "cohort": "synthx", "sex": row["sex"],
                     "age": row["age"], "phase": row["phase"], "race": row["race"], "synthetic": 1,
                     "source_case_id": canvas, "generator_run_id": "gen-run-1"})
    write_metadata(out, pd.DataFrame(rows))
    # As benchx synthesize records it: a generator that learned from the split's training cases.
    training = list(table.loc[table["split"] == "train", "case_id"])
    GeneratorProvenance(training_cases=training, split_sha256=split_sha256(split), generator_run_id="gen-run-1").write(out)
    return out


def test_ratio_sampler_respects_the_ratio_within_sampling_error():
    sampler = MixingSampler(n_real=200, n_synthetic=40, ratio=0.3, seed=0, mode="displace")
    draws = []
    for epoch in range(25):
        sampler.set_epoch(epoch)
        draws.extend(list(sampler))
    draws = np.array(draws)
    fraction = float((draws >= 200).mean())
    sigma = np.sqrt(0.3 * 0.7 / len(draws))
    assert abs(fraction - 0.3) < 4 * sigma
    assert draws.min() >= 0 and draws.max() < 240
    sampler.set_epoch(3)
    assert list(sampler) == list(sampler), "deterministic for an epoch"
    with pytest.raises(ValueError, match="no cases"):
        MixingSampler(10, 0, 0.2, mode="displace")


def test_ratio_zero_is_exactly_the_baseline_data(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    synthetic = fake_synthetic_cohort(root, split, tmp_path / "synthetic")
    base = load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, split, tmp_path))
    zero = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path), "synthx.ratio=0", f"synthx.cohort={synthetic}"])
    mixed_dm, plain_dm = recipe_datamodule(zero), CohortDataModule(base.data, base.seed)
    assert type(mixed_dm) is CohortDataModule and mixed_dm.train_dataset_factory is None
    mixed_dm.setup("fit")
    plain_dm.setup("fit")
    assert mixed_dm.datasets["train"].data == plain_dm.datasets["train"].data
    assert getattr(mixed_dm.datasets["train"], "sampler", None) is None


def test_synthetic_canvases_outside_training_are_refused(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    bad = fake_synthetic_cohort(root, split, tmp_path / "from_test", canvas_split="test", n=1)
    recipe = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path), "synthx.ratio=0.5", f"synthx.cohort={bad}"])
    with pytest.raises(CohortError, match="validation/test case"):
        recipe_datamodule(recipe).setup("fit")
    stray = fake_synthetic_cohort(root, split, tmp_path / "stray", n=1)
    rows = load_cohort(stray).metadata
    rows.loc[0, "source_case_id"] = "NOT_IN_SPLIT"
    write_metadata(stray, rows)
    recipe = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path), "synthx.ratio=0.5", f"synthx.cohort={stray}"])
    with pytest.raises(CohortError, match="not a real training case"):
        recipe_datamodule(recipe).setup("fit")
    with pytest.raises(CohortError, match="needs synthx.cohort"):
        recipe_datamodule(load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path), "synthx.ratio=0.5"]))


def test_augmented_training_logs_the_synthetic_cohort_as_a_dataset_input(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    synthetic = fake_synthetic_cohort(root, split, tmp_path / "synthetic")
    recipe = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path), "synthx.ratio=0.5", f"synthx.cohort={synthetic}"])
    result = train(recipe)
    run = MlflowClient(recipe.tracking.uri).get_run(result.run_id)
    contexts = {tag.value for d in run.inputs.dataset_inputs for tag in d.tags if tag.key == "mlflow.data.context"}
    assert contexts == {"training", "training-synthetic"}
    assert run.data.tags["variant"] == "synthx" and run.data.tags["synthx_ratio"] == "0.5"
    assert run.data.tags["generator_run_ids"] == "gen-run-1"


def _study_settings(root, split, tmp_path):
    from synthx.workflows.study.settings import StudySettings

    overrides = [o for o in tiny_overrides(root, split, tmp_path) if not o.startswith("profile=")]
    return StudySettings(
        recipe=str(RECIPES / "unet.yaml"),
        profile="cpu",
        overrides=overrides,
        synthx_overrides=["trainer.max_steps=2", "model.channels=[8,8,8]", "model.norm_num_groups=4",
                          "model.num_head_channels=8", "data.patch_size=[16,16,16]", "trainer.log_every_n_steps=1",
                          f"tracking.output_dir={tmp_path / 'outputs'}"],
        ratio=0.5,
        target="match:uniform",  # need:B is tested below on records with a known deficit: a 2-step
        budget=2,                # baseline may detect every validation tumor, leaving no need to fill
        synthesis_steps=2,
        experiment="study-test",
        output_dir=str(tmp_path / "study"),
        locked_cases=8,  # the locked test cohort: a tiny phantom of another seed
    )


def test_study_end_to_end_and_resume_after_a_killed_step(tiny_phantom, tmp_path, monkeypatch, capsys):
    import synthx.workflows.study.steps as study
    from synthx.workflows.study.run import run_study
    from synthx.workflows.study.settings import COPY_PASTE_STEPS, STEPS
    from synthx.workflows.study.steps import read_targets

    root, split = tiny_phantom
    settings = _study_settings(root, split, tmp_path)
    real_synthesize = study.synthesize

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("simulated kill during synthesis")

    monkeypatch.setattr(study, "synthesize", killed)
    with pytest.raises(SystemExit) as stopped:
        run_study(settings)
    assert stopped.value.code == 130, "Ctrl+C ends the study with the shell's code for SIGINT"
    first = capsys.readouterr().out
    for step in ("data", "locked_cohort", "baseline", "evaluate_baseline", "targeting"):
        assert f"[study] {step}: done" in first, step
    # The copy-paste synthesis, the first to paint, needs no generator: it comes before synthx_train.
    assert "[study] synthesize_copy_paste: running" in first and "synthx_train" not in first

    monkeypatch.setattr(study, "synthesize", real_synthesize)
    table = run_study(settings)
    second = capsys.readouterr().out
    for step in ("data", "locked_cohort", "baseline", "evaluate_baseline", "targeting"):
        assert f"[study] {step}: identical finished run" in second, step
    for step in ("synthesize_copy_paste", "synthx_train", "synthesize", "sham", "augmented", "copy_paste",
                 "evaluate_locked_baseline", "evaluate_sham", "evaluate_synthx", "evaluate_copy_paste", "compare"):
        assert f"[study] {step}: done" in second, step
    assert {"attribute", "group", "metric", "delta", "ci_low", "ci_high", "significant", "role", "p_family"} <= set(table.columns)
    assert "phase" in set(table["attribute"])
    # SynthX, copy-paste and the baseline are each compared with the sham arm; the endpoint row is the one primary.
    assert set(table["run"]) == {"synthx", "copy_paste", "baseline"}
    assert set(table.loc[table["run"] == "baseline", "role"]) == {"schedule"}
    assert set(table.loc[table["run"] == "copy_paste", "role"]) == {"placement"}
    assert (table["role"] == "primary").sum() <= 1 and "secondary" in set(table["role"])
    assert "Primary endpoint (pre-specified)" in second

    uri = load_recipe(RECIPES / "unet.yaml", settings.overrides).tracking.uri
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("study-test")
    parents = client.search_runs([experiment.experiment_id], "tags.stage = 'study'", order_by=["attributes.start_time DESC"])
    latest = parents[0]
    assert latest.info.status == "FINISHED"
    steps = {k[len("step."):]: v for k, v in latest.data.tags.items() if k.startswith("step.")}
    assert set(steps) == set(STEPS)
    assert latest.data.params["endpoint.group"] == "arterial" and latest.data.params["endpoint.reference"] == "sham"
    artifacts = {a.path for a in client.list_artifacts(latest.info.run_id, "comparison")}
    assert {"comparison/primary_endpoint.txt", "comparison/test_roles.csv"} <= artifacts
    # The arms share their real draws case by case; the sham arm's extra draws are real positives.
    exposures = {}
    for step in ("baseline", "sham", "augmented"):
        path = client.download_artifacts(steps[step], "exposure/cases.csv", str(tmp_path / f"exposure-{step}"))
        table_ = pd.read_csv(path)
        exposures[step] = table_
    real = {k: t[t["synthetic"] == 0].set_index("case_id")["real_draws"] for k, t in exposures.items()}
    pd.testing.assert_series_equal(real["sham"], real["baseline"])
    pd.testing.assert_series_equal(real["augmented"], real["baseline"])
    slots = exposures["augmented"].loc[exposures["augmented"]["synthetic"] == 1, "slot_draws"].sum()
    assert slots > 0 and exposures["sham"]["slot_draws"].sum() == slots
    # The locked cohort: another seed, no shared case or patient, and it is the compared test set.
    locked = client.get_run(steps["locked_cohort"])
    assert locked.data.params["locked_seed"] != locked.data.params["development_seed"]
    view = pd.read_csv(client.download_artifacts(steps["locked_cohort"], "split/split.csv", str(tmp_path / "view")))
    development = load_cohort(root).metadata
    test_ids = set(view.loc[view["split"] == "test", "case_id"])
    assert len(test_ids) == 8 and not test_ids & set(development["case_id"])
    assert not set(view.loc[view["split"] == "test", "patient_id"]) & set(development["patient_id"].astype(str))
    assert set(view.loc[view["split"] == "val", "case_id"]) == set(pd.read_csv(split).query("split == 'val'")["case_id"])
    from lightning_modules.tracking.recorder import download_records

    for step in ("evaluate_locked_baseline", "evaluate_sham", "evaluate_synthx", "evaluate_copy_paste"):
        assert client.get_run(steps[step]).data.tags["test_set"] == "locked"
        records = download_records(client, steps[step], "test", str(tmp_path / f"records-{step}"))
        assert set(records["case_id"]) == test_ids, step
    assert "baseline_test_sets.csv" in {Path(a.path).name for a in client.list_artifacts(latest.info.run_id, "study")}
    for name, run_id in steps.items():
        assert client.get_run(run_id).info.status == "FINISHED", name
        # A reused step keeps the parent of the study run that made it.
        assert client.get_run(run_id).data.tags["mlflow.parentRunId"] in {p.info.run_id for p in parents}, name
    augmented = client.get_run(steps["augmented"])
    assert augmented.data.tags["variant"] == "synthx"
    assert {t.value for d in augmented.inputs.dataset_inputs for t in d.tags} >= {"training-synthetic"}
    # The copy-paste arm: SynthX's targets, canvases and sites with real training tumors pasted, no
    # generator; SynthX's recipe variant but the cohort; the realism of both cohorts on SynthX's synthesis run.
    pasted_run = client.get_run(steps["synthesize_copy_paste"])
    assert pasted_run.data.tags["painter"] == "copy_paste" and not pasted_run.data.tags.get("generator_run_id")
    assert pasted_run.data.params["seed"] == client.get_run(steps["synthesize"]).data.params["seed"]
    pasted = load_cohort(Path(json.loads(pasted_run.data.tags["study_outputs"])["cohort"])).metadata
    painted = load_cohort(Path(client.get_run(steps["augmented"]).data.params["synthx.cohort"])).metadata
    assert sorted(pasted["source_case_id"]) == sorted(painted["source_case_id"]), "the same canvases"
    assert set(pasted["tumor_source_case_id"]) <= set(pd.read_csv(split).query("split == 'train'")["case_id"])
    trained_cp, trained_sx = client.get_run(steps["copy_paste"]).data, client.get_run(steps["augmented"]).data
    assert trained_cp.tags["variant"] == "copy_paste"
    assert {k: v for k, v in trained_cp.params.items() if k != "synthx.cohort"} == \
        {k: v for k, v in trained_sx.params.items() if k != "synthx.cohort"}
    assert trained_cp.params["synthx.cohort"] != trained_sx.params["synthx.cohort"]
    realism = pd.read_csv(client.download_artifacts(steps["synthesize"], "synthx_quality/realism.csv",
                                                    str(tmp_path / "realism")))
    assert {"synthetic", "copy_paste"} <= set(realism["comparison"])
    # The decomposition at matched specificity on the parent run: per component, overall and per phase.
    parts = pd.read_csv(client.download_artifacts(latest.info.run_id, "synthx/decomposition.csv", str(tmp_path / "parts")))
    assert list(dict.fromkeys(parts["component"])) == ["placement", "content", "total"]
    for component, arm, reference in (("placement", "copy_paste", "sham"), ("content", "synthx", "copy_paste"),
                                      ("total", "synthx", "sham")):
        rows = parts[parts["component"] == component]
        assert set(rows["arm"]) == {arm} and set(rows["reference"]) == {reference}
        assert rows["attribute"].iloc[0] == "overall" and "phase" in set(rows["attribute"])
        assert (rows["positives"] == rows["both"] + rows["only_arm"] + rows["only_reference"] + rows["neither"]).all()
    placement, content, total = (parts[parts["component"] == c].set_index(["attribute", "group"])["difference"]
                                 for c in ("placement", "content", "total"))
    tested = set(total.index) & set(placement.index) & set(content.index)
    assert tested, "the components share subgroups"
    # One m per arm in every component (the primary comparison's), so the components add up exactly.
    for key in tested:
        assert placement[key] + content[key] == pytest.approx(total[key], nan_ok=True), key
    m = {}
    for row in parts.itertuples(index=False):
        for arm, value in ((row.arm, row.threshold_arm), (row.reference, row.threshold_reference)):
            assert m.setdefault(arm, value) == value, f"{arm} judged at two m"
    # ... the m each arm has in its comparison against sham at the endpoint's operating point.
    at_point = table[table["operating_point"] == latest.data.params["endpoint.operating_point"]]
    for arm in ("synthx", "copy_paste"):
        pair = at_point[(at_point["run"] == arm) & (at_point["reference"] == "sham")].iloc[0]
        assert (m[arm], m["sham"]) == pytest.approx((pair["threshold_b"], pair["threshold_a"])), arm
    metrics = client.get_run(latest.info.run_id).data.metrics
    assert metrics["decomposition/overall:all/placement/difference"] == pytest.approx(placement["overall", "all"])
    assert {"decomposition/overall:all/content/ci_low", "decomposition/overall:all/total/p"} <= set(metrics)
    # The targeting step is linked to the baseline evaluation whose validation records it was given.
    targeting = client.get_run(steps["targeting"])
    assert targeting.data.params["baseline_evaluation_run"] == steps["evaluate_baseline"]
    assert targeting.data.params["rule"] == "match:uniform"
    assert read_targets(client, steps["targeting"])["requested"].sum() == 2

    # A third run finds every step finished and redoes nothing.
    run_study(settings)
    third = capsys.readouterr().out
    assert third.count("identical finished run") == len(STEPS)
    # The study ends on the command that opens its runs view (not MLflow's GenAI pages) and the verdict.
    tail = [line.strip() for line in third.rstrip().splitlines()]
    verdict_at = tail.index("Verdict (test):")
    assert f"/#/experiments/{experiment.experiment_id}/runs" in tail[verdict_at - 1]
    # The console carries the primary result and the verdict; the full comparison table stays in the run.
    assert "artifact comparison/test_comparison.txt" in third and not any(line.startswith("== ") for line in tail)
    assert len(tail) < 120, len(tail)
    assert tail[verdict_at + 1].startswith("Scarcity gap (arterial)")
    primary_at = next(i for i, line in enumerate(tail) if line.startswith("Primary endpoint (sensitivity in arterial)"))
    assert tail[primary_at].endswith(".")
    # Then the decomposition, one line per designed subgroup with tumor scans in the locked cohort.
    decomposed = tail[primary_at + 1:]
    assert decomposed and all(line.startswith(("Scarcity gap (", "Physics gap (")) for line in decomposed)
    scarcity = decomposed[0]
    assert scarcity.startswith("Scarcity gap (arterial), decomposed on") and "at subgroup-matched specificity" in scarcity
    assert "copy-paste - sham (canvases and placement)" in scarcity and "SynthX - copy-paste (generated content)" in scarcity
    assert scarcity.count("95% CI") == 2 and "together SynthX - sham" in scarcity
    assert client.get_experiment(experiment.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"

    # Another target in the same output folder: its own synthetic folder, synthesis run and augmented
    # model; the first study's cohort is left as its augmented model saw it.
    output_dir = Path(settings.output_dir)
    first_cohort = Path(client.get_run(steps["augmented"]).data.params["synthx.cohort"])
    first_cases = sorted(load_cohort(first_cohort).case_ids)
    settings.budget = 3
    run_study(settings)
    fourth = capsys.readouterr().out
    for step in ("data", "locked_cohort", "baseline", "evaluate_baseline", "synthx_train", "evaluate_locked_baseline"):
        assert f"[study] {step}: identical finished run" in fourth, step
    for step in ("targeting", "synthesize", "synthesize_copy_paste", "sham", "augmented", "copy_paste", "evaluate_sham",
                 "evaluate_synthx", "evaluate_copy_paste", "compare"):
        assert f"[study] {step}: done" in fourth, step
    newest = client.search_runs([experiment.experiment_id], "tags.stage = 'study'", order_by=["attributes.start_time DESC"])[0]
    new_steps = {k[len("step."):]: v for k, v in newest.data.tags.items() if k.startswith("step.")}
    assert new_steps["synthesize"] != steps["synthesize"] and new_steps["augmented"] != steps["augmented"]
    second_cohort = Path(client.get_run(new_steps["augmented"]).data.params["synthx.cohort"])
    assert second_cohort != first_cohort and second_cohort.parent == first_cohort.parent == output_dir / "synthetic"
    assert sorted(load_cohort(first_cohort).case_ids) == first_cases, "the first study's cohort is unchanged"
    assert len(load_cohort(second_cohort).case_ids) == 3

    # The generator has its own folder per recipe key, apart from the augmented backbone's folders.
    generators = list((output_dir / "generator").iterdir())
    assert len(generators) == 1 and (generators[0] / "checkpoints" / "last.ckpt").is_file()
    assert not (output_dir / "synthx" / "checkpoints").exists(), "the generator is not in the augmented model's folder"

    assert "Positive control:" not in (output_dir / "study_report.html").read_text()

    # The positive control: the phantom paints the same targets into the same kind of canvases; no
    # generator is trained, the baseline and targeting are reused, and the comparison is made.
    control = dataclasses.replace(settings, painter="phantom", synthx_overrides=[], synthesis_steps=None)
    run_study(control)
    fifth = capsys.readouterr().out
    for step in ("data", "locked_cohort", "baseline", "evaluate_baseline", "targeting", "evaluate_locked_baseline"):
        assert f"[study] {step}: identical finished run" in fifth, step
    for step in ("synthesize", "sham", "augmented", "evaluate_sham", "evaluate_synthx", "compare"):
        assert f"[study] {step}: done" in fifth, step
    assert "synthx_train" not in fifth
    # No copy-paste arm in the positive control (the phantom plans its own sites), and it says why.
    assert "[study] no copy-paste arm: the positive control's tumors sit at sites the phantom plans" in fifth
    latest = client.search_runs([experiment.experiment_id], "tags.stage = 'study'", order_by=["attributes.start_time DESC"])[0]
    control_steps = {k[len("step."):]: v for k, v in latest.data.tags.items() if k.startswith("step.")}
    assert set(control_steps) == set(STEPS) - {"synthx_train", *COPY_PASTE_STEPS} and latest.info.status == "FINISHED"
    ceiling = pd.read_csv(client.download_artifacts(latest.info.run_id, "synthx/decomposition.csv", str(tmp_path / "ceiling")))
    assert set(ceiling["component"]) == {"ceiling"} and set(ceiling["arm"]) == {"phantom"}
    assert client.get_run(control_steps["synthesize"]).data.tags["painter"] == "phantom"
    control_cohort = Path(client.get_run(control_steps["augmented"]).data.params["synthx.cohort"])
    assert control_cohort.parent == output_dir / "synthetic" and control_cohort != second_cohort
    painted = load_cohort(control_cohort).metadata
    assert len(painted) == 3 and set(painted["synthx_painter"]) == {"phantom"}
    report = (output_dir / "study_report.html").read_text()
    assert "Positive control:" in report and "--painter phantom" in report


def test_primary_endpoint_is_logged_before_any_step(tiny_phantom, tmp_path, monkeypatch):
    """The parent run carries the endpoint before the data step, let alone a training, has started."""
    import synthx.workflows.study.run as study

    root, split = tiny_phantom
    seen = {}

    def first_steps(runner, *args):
        run = runner.client.get_run(runner.parent_id)
        seen.update(params=dict(run.data.params), tag=run.data.tags.get("primary_endpoint"), steps=dict(runner.outputs))
        raise KeyboardInterrupt("stop before the first step")

    monkeypatch.setattr(study, "_baseline_steps", first_steps)
    with pytest.raises(SystemExit):
        study.run_study(_study_settings(root, split, tmp_path))
    assert seen["steps"] == {}, "no step ran before"
    assert seen["params"]["endpoint.metric"] == "sensitivity" and seen["params"]["endpoint.group"] == "arterial"
    assert seen["params"]["endpoint.operating_point"] == "subgroup_matched_specificity"
    assert seen["params"]["endpoint.version"] == "2"
    assert seen["params"]["endpoint.arm"] == "synthx" and seen["params"]["endpoint.reference"] == "sham"
    assert "synthx minus sham" in seen["tag"]


def test_study_trains_a_changed_generator_recipe_into_its_own_folder(tmp_path, monkeypatch):
    import synthx.workflows.study.steps as study
    from synthx.config import load_synthx_recipe
    from synthx.workflows.study.steps import generator_action

    folders = []

    def fake_train(recipe, output_dir):
        folders.append(output_dir)
        return type("Result", (), {"run_id": "r", "pipeline_dir": output_dir / "pipeline"})()

    monkeypatch.setattr(study, "train_synthx", fake_train)
    generator = REPO_ROOT / "recipes" / "generator" / "synthx.yaml"
    for overrides in (["profile=cpu"], ["profile=cpu", "data.patch_size=[16,16,16]"], ["profile=cpu", "trainer.max_steps=7"]):
        generator_action(load_synthx_recipe(generator, overrides), tmp_path)({})
    assert folders[0].parent == tmp_path / "generator"
    assert folders[0] != folders[1], "another generator recipe trains into another folder"
    assert folders[2] == folders[0], "more steps of the same recipe continue it"


def test_targeting_reads_validation_records_only(tiny_phantom, tmp_path):
    """The targeting step needs only evaluation/val_records.csv: an evaluation run without test records suffices."""
    from synthx.workflows.study.settings import StudySettings
    from synthx.workflows.study.steps import read_targets, targeting_action, validation_records

    root, split = tiny_phantom
    uri = new_sqlite_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    experiment = client.create_experiment("targeting-test")
    split_table = pd.read_csv(split)
    metadata = load_cohort(root).metadata.set_index("case_id")
    val_ids = list(split_table.loc[split_table["split"] == "val", "case_id"])
    records = pd.DataFrame({
        "case_id": val_ids,
        "patient_id": [metadata.loc[c, "patient_id"] for c in val_ids],
        "label": [int(metadata.loc[c, "tumor"]) for c in val_ids],
        "sex": [metadata.loc[c, "sex"] for c in val_ids],
        "age_band": ["60-80"] * len(val_ids),
        "phase": [metadata.loc[c, "phase"] for c in val_ids],
        "volume_mm3": [0.0] * len(val_ids),  # the baseline misses everything
    })
    evaluation = client.create_run(experiment).info.run_id
    client.log_text(evaluation, records.to_csv(index=False), "evaluation/val_records.csv")
    client.log_metric(evaluation, "operating_point/val_chosen", 50.0)
    read, threshold = validation_records(client, evaluation)
    assert threshold == 50.0 and list(read["case_id"]) == val_ids
    settings = StudySettings(target="need:3")
    outputs = targeting_action(client, experiment, root, split, settings, evaluation, "volume")({})
    assert read_targets(client, outputs["run_id"])["requested"].sum() == 3
    # Restricted to some phases, the budget goes to those phases' cells only.
    restricted = StudySettings(target="need:3", target_phases=["Venous", "pv", "arterial"])
    restricted.check()
    assert restricted.target_phases == ["arterial", "venous"]
    outputs = targeting_action(client, experiment, root, split, restricted, evaluation, "volume")({})
    targets = read_targets(client, outputs["run_id"])
    assert targets["requested"].sum() == 3 and set(targets.loc[targets["requested"] > 0, "phase"]) <= {"arterial", "venous"}
    assert client.get_run(outputs["run_id"]).data.params["target_phases"] == "arterial,venous"
    for bad in (["hepatobiliary"], ["Unknown"], []):
        with pytest.raises(ValueError, match="phase"):
            StudySettings(target_phases=bad).check()
    # A test record among them is refused: targeting never sees test labels.
    test_id = split_table.loc[split_table["split"] == "test", "case_id"].iloc[0]
    leaked = pd.concat([records, records.iloc[[0]].assign(case_id=test_id)], ignore_index=True)
    evaluation = client.create_run(experiment).info.run_id
    client.log_text(evaluation, leaked.to_csv(index=False), "evaluation/val_records.csv")
    with pytest.raises(ValueError, match=test_id):
        targeting_action(client, experiment, root, split, settings, evaluation, "volume")({})


def _sweep_recipe_args(root, split, tmp_path, synthetic):
    return [*tiny_overrides(root, split, tmp_path), f"synthx.cohort={synthetic}"]


def test_three_trial_sweep_links_trials_to_the_sweep_run(tiny_phantom, tmp_path):
    from synthx.commands.sweep import main as sweep_main
    from synthx.workflows.sweep import PARENT_ATTR

    root, split = tiny_phantom
    synthetic = fake_synthetic_cohort(root, split, tmp_path / "synthetic")
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    args = ["--recipe", str(RECIPES / "unet.yaml"), "--storage", storage, "--study-name", "s3", "--trials", "3",
            "--objective", "both", *_sweep_recipe_args(root, split, tmp_path, synthetic)]
    assert sweep_main(args) == 0
    study = optuna.load_study(study_name="s3", storage=storage)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 3 and complete[0].params["ratio"] == 0.0, "the enqueued baseline ratio runs first"
    uri = load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, split, tmp_path)).tracking.uri
    mlflow.set_tracking_uri(uri)
    parent = study.user_attrs[PARENT_ATTR]
    children = mlflow.search_runs(search_all_experiments=True, filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert len(children) == 3
    assert sorted(children["tags.optuna_trial"]) == ["0", "1", "2"]
    assert set(children["tags.synthx_ratio"]) == {f"{t.params['ratio']:g}" for t in complete}
    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(parent, "sweep")}
    assert {"sweep/trials.csv", "sweep/pareto_front.json", "sweep/pareto_front.png"} <= artifacts
    # One importance plot per objective (three trials, three ratios).
    assert {"sweep/importance_overall_F1.png", "sweep/importance_worst_group_sensitivity.png"} <= artifacts
    # Resume: asking again for 3 trials runs none.
    assert sweep_main(args) == 0
    assert len(optuna.load_study(study_name="s3", storage=storage).trials) == 3


def test_sweep_importances_rank_what_makes_a_maximized_objective_high():
    """A two-objective sweep's importance plot asks what the *best* trials share, not the worst.

    Overall F1 is high when ``targeting`` is "young" and low when ``ratio`` is under 0.1; the second
    objective is constant. Read as "lower is better" (Optuna's reading of an explicit target),
    ``ratio`` would come first. 600 trials: PED-ANOVA's density estimates of a few top trials are
    too noisy to rank two parameters reliably.
    """
    from synthx.workflows.sweep import importance_target

    rng = np.random.default_rng(0)
    distributions = {"ratio": optuna.distributions.FloatDistribution(0.0, 1.0),
                     "targeting": optuna.distributions.CategoricalDistribution(["young", "arterial", "none"])}
    study = optuna.create_study(directions=["maximize", "maximize"])
    for _ in range(600):
        ratio, targeting = float(rng.uniform()), str(rng.choice(["young", "arterial", "none"]))
        f1 = 0.5 + 0.4 * (targeting == "young") - 0.4 * (ratio < 0.1) + 0.01 * rng.normal()
        study.add_trial(optuna.trial.create_trial(params={"ratio": ratio, "targeting": targeting},
                                                  distributions=distributions, values=[f1, 0.5]))
    with pytest.warns(UserWarning, match="achieve low `target` values"):  # Optuna's reading of any target
        importances = optuna.importance.get_param_importances(study, target=importance_target(study, 0))
        worst_first = optuna.importance.get_param_importances(study, target=lambda t: t.values[0])
    assert list(importances)[0] == "targeting" and importances["targeting"] > 2 * importances["ratio"]
    assert list(worst_first)[0] == "ratio"  # the reading the negation corrects
    single = optuna.create_study(direction="maximize")
    assert importance_target(single, 0) is None  # the study's own direction is used


def test_two_concurrent_workers_share_one_journal_study(tiny_phantom, tmp_path):
    from synthx.commands.sweep import main as sweep_main

    root, split = tiny_phantom
    synthetic = fake_synthetic_cohort(root, split, tmp_path / "synthetic")
    storage = f"journal:{tmp_path / 'journal.log'}"
    args = ["--recipe", str(RECIPES / "unet.yaml"), "--storage", storage, "--study-name", "shared", "--trials", "4",
            "--objective", "worst_sensitivity", "--no-enqueue", *_sweep_recipe_args(root, split, tmp_path, synthetic)]
    assert sweep_main([*args, "--create-only"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lightning_modules.cli", "sweep", *args]
    workers = [subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for _ in range(2)]
    outputs = [w.communicate(timeout=900)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), outputs[0][-3000:] + outputs[1][-3000:]
    from synthx.workflows.sweep import make_storage

    study = optuna.load_study(study_name="shared", storage=make_storage(storage))
    finished = [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    numbers = [t.number for t in study.trials]
    assert len(numbers) == len(set(numbers)) and 4 <= len(finished) <= 5
    runs = {t.user_attrs.get("mlflow_run_id") for t in finished}
    assert len(runs) == len(finished), "every trial trained its own run"
    # A single-objective sweep's plots keep their names (importance: from three trials of different ratios).
    from synthx.workflows.sweep import PARENT_ATTR

    uri = load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, split, tmp_path)).tracking.uri
    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(study.user_attrs[PARENT_ATTR], "sweep")}
    assert {"sweep/history_objective.png", "sweep/ratio_vs_objective_objective.png"} <= artifacts
    complete = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
    plotted = len(complete) >= 3 and len({t.params["ratio"] for t in complete}) > 1
    assert ("sweep/importance.png" in artifacts) == plotted


def test_step_cpu_seconds_count_finished_child_processes():
    """The data step renders the phantom in worker processes: a step's CPU figure must include them."""
    from synthx.workflows.study.runner import cpu_seconds

    before = cpu_seconds()
    subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"],
                   check=True)
    assert cpu_seconds() - before >= 0.45


def test_the_study_loads_its_recipe_once_and_builds_the_arms_in_memory(tmp_path, monkeypatch):
    """Every arm's recipe is the loaded recipe with the arm's typed values merged in; the YAML is read
    once, and the arms equal what the same values as command-line overrides give."""
    import synthx.workflows.study.settings as study
    from lightning_modules.recipe import load_recipe

    settings = _study_settings(tmp_path / "cohort", tmp_path / "split.csv", tmp_path)
    study._loaded_recipe.cache_clear()
    loads = []
    monkeypatch.setattr(study, "load_recipe", lambda *a, **k: loads.append(a) or load_recipe(*a, **k))
    arms = {arm: study.segmentation_recipe(settings, study.arm_values(settings, arm, "synthetic"))
            for arm in ("baseline", "sham", "synthx")}
    study.segmentation_recipe(settings, arms["sham"], {"data": {"root": "locked", "split": "locked.csv"}})
    assert len(loads) == 1
    steps = int(study.segmentation_recipe(settings).trainer.max_steps)
    common = [f"profile={settings.profile}", f"tracking.experiment={settings.experiment}", "data.validate=false",
              *settings.overrides]
    as_overrides = load_recipe(settings.recipe, [*common, "synthx.ratio=0.5", "synthx.cohort=synthetic",
                                                 f"synthx.real_steps={steps}", f"trainer.max_steps={steps + round(0.5 * steps)}",
                                                 "synthx.sham=true"])
    assert arms["sham"] == as_overrides
    assert arms["synthx"].synthx.sham is False and arms["baseline"].synthx.ratio == 0.0
    assert arms["baseline"].trainer.max_steps == steps
