"""SynthX generation: valid layout-A cases, canvas rules, unfillable cells, provenance, determinism, resumption, CLI.

The fast tests use an untrained tiny pipeline (2 inference steps) on a hand-made 28x28x16 cohort.
The slow test trains the generator on the phantom cohort and checks that the requested phase moves
the synthetic tumors' contrast the way it moves the real ones'.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/synthx/test_synthx_generation.py -x -q [--run-slow]
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest
import torch
from scipy import ndimage

from lightning_modules.data.cohort import load_cohort, write_case, write_metadata
from lightning_modules.data.validation import validate_cohort
from synthx.commands.synthesize import main
from synthx.generation import (
    GenerationError,
    SynthesisRequest,
    SynthesisSettings,
    synthesize,
)
from synthx.generation import run as generation
from synthx.generator.provenance import GeneratorProvenance, ProvenanceError

SHAPE = (28, 28, 16)
MODEL_SPACING = (2.5, 2.5, 3.0)
ORGAN_HU = {"venous": 105.0, "arterial": 130.0}
RAS = np.diag([*MODEL_SPACING, 1.0])
LPS = np.diag([-2.5, -2.5, 3.0, 1.0])  # a DICOM-style orientation: flipped left-right and front-back
FINE = np.diag([2.0, 2.0, 2.0, 1.0])  # a canvas whose voxels differ from the generator's
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
    """An untrained SynthX pipeline small enough for seconds-long tests, saved with save_pretrained."""
    from diffusers import DDPMScheduler

    from synthx.generator.model import SynthXDenoiser
    from synthx.generator.pipeline import SynthXPipeline

    torch.manual_seed(0)
    unet = SynthXDenoiser(
        channels=(8, 8),
        attention_levels=(False, False),
        num_res_blocks=1,
        norm_num_groups=8,
        num_head_channels=8,
        spacing=MODEL_SPACING,
        patch_size=(16, 16, 16),
    )
    scheduler = DDPMScheduler(num_train_timesteps=100, prediction_type="sample")
    folder = tmp_path_factory.mktemp("pipeline")
    SynthXPipeline(unet=unet, scheduler=scheduler).save_pretrained(str(folder))
    # Trained (as far as provenance goes) on the fixture cohort's only training tumor, with condition dropout.
    GeneratorProvenance(training_cases=["T1"], split_sha256="", condition_dropout_all=0.1).write(folder)
    return folder


def _write_canvas(root, case_id, phase, affine, tumor=False):
    rng = np.random.default_rng(abs(hash(case_id)) % 2**32)
    ct = np.full(SHAPE, -100.0) + rng.normal(0, 5, SHAPE)
    pancreas = np.zeros(SHAPE, dtype=bool)
    pancreas[6:22, 9:19, 4:12] = True
    liver = np.zeros(SHAPE, dtype=bool)
    liver[2:10, 20:27, 2:14] = True
    ct[pancreas] = ORGAN_HU[phase] + rng.normal(0, 5, int(pancreas.sum()))
    ct[liver] = 90.0
    masks = {"pancreas": pancreas, "liver": liver}
    if tumor:
        lesion = np.zeros(SHAPE, dtype=bool)
        lesion[12:15, 12:15, 7:9] = True
        ct[lesion] -= 40.0
        masks["pancreatic_lesion"] = lesion
    write_case(root, case_id, np.round(ct), affine, masks)


@pytest.fixture
def cohort(tmp_path):
    """Healthy training canvases: H1 (venous, F 65, LPS), H2 (venous, M 45, 2 mm voxels), H3 (arterial, F 30);
    a training tumor case T1; healthy V1 (val) and X1 (test)."""
    root = tmp_path / "real"
    root.mkdir()
    cases = [
        ("H1", "P1", "F", 65, "venous", 0, "train", LPS),
        ("H2", "P2", "M", 45, "venous", 0, "train", FINE),
        ("H3", "P3", "F", 30, "arterial", 0, "train", RAS),
        ("T1", "P4", "F", 70, "venous", 1, "train", RAS),
        ("V1", "P5", "M", 50, "venous", 0, "val", RAS),
        ("X1", "P6", "F", 60, "arterial", 0, "test", RAS),
    ]
    rows = []
    for case_id, patient, sex, age, phase, tumor, split, affine in cases:
        _write_canvas(root, case_id, phase, affine, tumor=bool(tumor))
        rows.append(
            {"case_id": case_id, "patient_id": patient, "cohort": "SiteA", "sex": sex, "age": age, "phase": phase,
             "tumor": tumor, "split": split}
        )
    table = pd.DataFrame(rows)
    write_metadata(root, table.drop(columns=["split"]))
    split = tmp_path / "split.csv"
    table[["case_id", "patient_id", "split"]].to_csv(split, index=False)
    return root, split


REQUESTS = {("F", "60-80", "venous"): 2, ("F", "20-40", "arterial"): 1, ("M", "40-60", "venous"): 1}
FAST = dict(num_inference_steps=2, size_classes={"tiny": 1.0}, log_to_mlflow=False, progress=False)


def run(root, split, pipeline, out, requests, **settings):
    """synthesize() with the fast test settings, any of them overridden."""
    return synthesize(SynthesisSettings(root, split, pipeline, out, **{**FAST, **settings}), requests)


def _ct(path):
    return np.asarray(nib.load(path).dataobj)


def test_generated_cases_are_valid_layout_a_with_full_metadata(cohort, tiny_pipeline, tmp_path):
    root, split = cohort
    out = tmp_path / "synthetic"
    summary = run(root, split, tiny_pipeline, out, REQUESTS, seed=3)
    assert summary.complete and len(summary.generated) == 4 and not summary.failed and summary.unfillable.empty
    assert validate_cohort(out, classes=("pancreas", "pancreatic_lesion", "liver")) == []

    synthetic = load_cohort(out)
    table = synthetic.metadata.set_index("case_id")
    assert sorted(table.index) == sorted(
        ["SX3_F_60-80_venous_0000", "SX3_F_60-80_venous_0001", "SX3_F_20-40_arterial_0000", "SX3_M_40-60_venous_0000"]
    )
    assert (table["synthetic"] == 1).all() and (table["tumor"] == 1).all()
    real = load_cohort(root).metadata.set_index("case_id")
    for case_id, row in table.iterrows():
        canvas = row["source_case_id"]
        assert canvas in {"H1", "H2", "H3"}  # healthy training canvases only
        # The metadata describes the scan the tumor was painted into, which is of the requested cell.
        for column in ("phase", "sex", "age_band", "patient_id"):
            assert row[column] == real.loc[canvas, column], (case_id, column)
        assert float(row["age"]) == float(real.loc[canvas, "age"])
        assert row["synthx_request"].startswith(f"{row['sex']}/{row['age_band']}/{row['phase']}#")
        assert row["tumor_location"] in {"head", "body", "tail"}
        assert 2.0 < float(row["tumor_diameter_mm"]) <= 10.0  # the tiny size class
        case = synthetic.case(case_id)
        lesion = np.asarray(nib.load(case.mask_path("pancreatic_lesion")).dataobj) > 0
        pancreas = np.asarray(nib.load(case.mask_path("pancreas")).dataobj) > 0
        canvas_case = load_cohort(root).case(canvas)
        assert lesion.any() and not (lesion & ~pancreas).any()  # the pancreas mask includes the lesion
        assert np.array_equal(pancreas, np.asarray(nib.load(canvas_case.mask_path("pancreas")).dataobj) > 0)
        assert np.array_equal(_ct(case.mask_path("liver")), _ct(canvas_case.mask_path("liver")))
        assert np.allclose(nib.load(case.ct_path).affine, nib.load(canvas_case.ct_path).affine)
        # Only the tumor and its repainted surroundings change; the rest of the canvas is untouched.
        changed = _ct(case.ct_path) != _ct(canvas_case.ct_path)
        near_tumor = ndimage.binary_dilation(lesion, iterations=6)
        assert changed.any() and not (changed & ~near_tumor).any()
    # Several tumors into one canvas across requests are fine: both F/60-80/venous cases use H1.
    assert set(table.loc[["SX3_F_60-80_venous_0000", "SX3_F_60-80_venous_0001"], "source_case_id"]) == {"H1"}
    manifest = json.loads((out / "synthx_generation.json").read_text())
    assert manifest["seed"] == 3 and manifest["guidance_scale"] == 2.0 and len(manifest["split_sha256"]) == 64
    assert not (out / "split.csv").exists()  # synthetic cases are training data by construction


def test_the_copy_paste_painter_pastes_at_the_sites_synthx_paints(cohort, tiny_pipeline, tmp_path):
    """Same seed and mask prior: each slot gets SynthX's canvas, size class and tumor center, and a real training tumor."""
    root, split = cohort
    painted = run(root, split, tiny_pipeline, tmp_path / "synthx", REQUESTS, seed=3)
    pasted = run(root, split, None, tmp_path / "pasted", REQUESTS, seed=3, painter="copy_paste")
    assert painted.complete and pasted.complete and sorted(painted.generated) == sorted(pasted.generated)
    synthx_cases, pasted_cases = load_cohort(tmp_path / "synthx"), load_cohort(tmp_path / "pasted")
    synthx_rows, pasted_rows = (c.metadata.set_index("case_id") for c in (synthx_cases, pasted_cases))
    for case_id in painted.generated:
        for column in ("source_case_id", "synthx_size_class", "synthx_request", "patient_id", "phase"):
            assert pasted_rows.loc[case_id, column] == synthx_rows.loc[case_id, column], (case_id, column)
        centers = []
        for cases in (synthx_cases, pasted_cases):
            lesion = np.argwhere(np.asarray(nib.load(cases.case(case_id).mask_path("pancreatic_lesion")).dataobj) > 0)
            centers.append((lesion.min(axis=0) + lesion.max(axis=0)) / 2)
        assert np.abs(centers[0] - centers[1]).max() <= 1.0, case_id
        # The fixture's only training tumor is T1 (F 60-80 venous): its cell, else its phase, else any.
        match = {"F/60-80/venous": "cell", "M/40-60/venous": "phase", "F/20-40/arterial": "any"}
        assert pasted_rows.loc[case_id, "tumor_source_case_id"] == "T1"
        assert pasted_rows.loc[case_id, "copy_paste_match"] == match[synthx_rows.loc[case_id, "synthx_request"].split("#")[0]]


def test_val_and_test_canvases_are_refused(cohort, tiny_pipeline, tmp_path):
    root, split = cohort
    with pytest.raises(GenerationError, match="canvas X1 is in the test split"):
        run(root, split, tiny_pipeline, tmp_path / "out", REQUESTS, canvas_ids=["H3", "X1"])
    with pytest.raises(GenerationError, match="canvas V1 is in the val split"):
        run(root, split, tiny_pipeline, tmp_path / "out", REQUESTS, canvas_ids=["V1"])
    with pytest.raises(GenerationError, match="canvas T1 has a tumor"):
        run(root, split, tiny_pipeline, tmp_path / "out", REQUESTS, canvas_ids=["T1"])
    assert not (tmp_path / "out").exists()


def test_unmatched_cells_are_reported_unfillable_and_never_relabeled(cohort, tiny_pipeline, tmp_path):
    root, split = cohort
    out = tmp_path / "out"
    # No healthy training scan is F/le20/non-contrast nor M/le20/arterial (H3, the only arterial one, is F 30).
    requests = {("F", "le20", "non-contrast"): 2, ("M", "le20", "arterial"): 1, ("F", "60-80", "venous"): 1}
    summary = run(root, split, tiny_pipeline, out, requests)
    assert summary.complete and summary.generated == ["SX0_F_60-80_venous_0000"] and summary.requested == 1
    unfillable = summary.unfillable.set_index(["sex", "age_band", "phase"])["requested"].to_dict()
    assert unfillable == {("F", "le20", "non-contrast"): 2, ("M", "le20", "arterial"): 1} and summary.unfillable_cases == 3
    per_cell = summary.per_cell.set_index(["sex", "age_band", "phase"])
    assert per_cell.loc[("M", "le20", "arterial"), "unfillable"] == 1 and per_cell.loc[("M", "le20", "arterial"), "generated"] == 0
    assert per_cell.loc[("F", "60-80", "venous"), "generated"] == 1
    metadata = pd.read_csv(out / "metadata.csv")
    assert list(metadata["case_id"]) == ["SX0_F_60-80_venous_0000"]  # nothing relabeled into another cell
    assert not any(p.name.startswith("SX0_M_") or "non-contrast" in p.name for p in out.iterdir())


def test_a_generator_trained_on_other_cases_is_refused(cohort, tiny_pipeline, tmp_path):
    import shutil

    root, split = cohort
    foreign = tmp_path / "foreign"
    shutil.copytree(tiny_pipeline, foreign)
    GeneratorProvenance(training_cases=["T1", "V1"], split_sha256="0" * 64, condition_dropout_all=0.1).write(foreign)
    with pytest.raises(ProvenanceError, match=r"learned from case V1, which is in the 'val' split"):
        run(root, split, foreign, tmp_path / "out", REQUESTS)
    GeneratorProvenance(training_cases=["GHOST"], condition_dropout_all=0.1).write(foreign)
    with pytest.raises(ProvenanceError, match="GHOST.*not in the current split"):
        run(root, split, foreign, tmp_path / "out", REQUESTS)
    GeneratorProvenance(training_cases=[], split_sha256="0" * 64, condition_dropout_all=0.1).write(foreign)
    with pytest.raises(ProvenanceError, match="split sha256 0000"):
        run(root, split, foreign, tmp_path / "out", REQUESTS)
    (foreign / "synthx_provenance.json").unlink()
    with pytest.raises(ProvenanceError, match="no synthx_provenance.json"):
        run(root, split, foreign, tmp_path / "out", REQUESTS)
    # Guidance needs a generator that saw the null condition in training.
    GeneratorProvenance(training_cases=["T1"], condition_dropout_all=0.0).write(foreign)
    with pytest.raises(GenerationError, match="condition_dropout.all > 0"):
        run(root, split, foreign, tmp_path / "out", REQUESTS, guidance_scale=2.0)
    assert not (tmp_path / "out").exists()
    assert run(root, split, foreign, tmp_path / "out", {("F", "60-80", "venous"): 1}, guidance_scale=1.0).complete


def test_settings_come_from_the_recipe_and_its_overrides(cohort, tiny_pipeline, tmp_path):
    from synthx.config import load_synthx_recipe

    root, split = cohort
    recipe = load_synthx_recipe(
        RECIPES / "generator" / "synthx.yaml",
        ["profile=cpu", "sampling.guidance_scale=3.5", "sampling.scheduler=dpm_solver", "sampling.num_inference_steps=3",
         "mask_prior.erosion_mm=0.5", "mask_prior.size_source=weights", "mask_prior.size_class_weights.small=0",
         "mask_prior.size_class_weights.medium=0", "seed=5"],
    )
    settings = SynthesisSettings.from_recipe(recipe, root, split, tiny_pipeline, tmp_path / "out", log_to_mlflow=False, progress=False)
    assert (settings.guidance_scale, settings.scheduler, settings.num_inference_steps, settings.erosion_mm, settings.seed) == (
        3.5, "dpm_solver", 3, 0.5, 5
    )
    assert settings.size_classes == {"tiny": 1.0, "small": 0.0, "medium": 0.0, "large": 0.0}
    summary = synthesize(settings, {("F", "60-80", "venous"): 1})
    manifest = json.loads((tmp_path / "out" / "synthx_generation.json").read_text())
    assert summary.generated == ["SX5_F_60-80_venous_0000"]
    assert (manifest["guidance_scale"], manifest["scheduler"], manifest["num_inference_steps"], manifest["erosion_mm"]) == (
        3.5, "dpm_solver", 3, 0.5
    )
    assert pd.read_csv(tmp_path / "out" / "metadata.csv")["synthx_size_class"].tolist() == ["tiny"]


def test_generation_is_deterministic_for_a_seed(cohort, tiny_pipeline, tmp_path):
    root, split = cohort
    requests = {("F", "60-80", "venous"): 1, ("M", "40-60", "venous"): 1}
    run(root, split, tiny_pipeline, tmp_path / "a", requests, seed=7)
    run(root, split, tiny_pipeline, tmp_path / "b", requests, seed=7)
    run(root, split, tiny_pipeline, tmp_path / "c", requests, seed=8)
    for case in ("SX7_F_60-80_venous_0000", "SX7_M_40-60_venous_0000"):
        for name in ("ct.nii.gz", "segmentations/pancreatic_lesion.nii.gz"):
            assert np.array_equal(_ct(tmp_path / "a" / case / name), _ct(tmp_path / "b" / case / name))
    first = _ct(tmp_path / "a" / "SX7_F_60-80_venous_0000" / "ct.nii.gz")
    other_seed = _ct(tmp_path / "c" / "SX8_F_60-80_venous_0000" / "ct.nii.gz")
    assert not np.array_equal(first, other_seed)
    meta_a = pd.read_csv(tmp_path / "a" / "metadata.csv")
    meta_b = pd.read_csv(tmp_path / "b" / "metadata.csv")
    pd.testing.assert_frame_equal(meta_a, meta_b)


def _stat(out, case_id):
    info = (out / case_id / "ct.nii.gz").stat()
    return info.st_ino, info.st_mtime_ns


def test_resume_after_a_kill_redoes_nothing_finished(cohort, tiny_pipeline, tmp_path, monkeypatch):
    root, split = cohort
    out = tmp_path / "out"
    real_write_case = generation.write_case
    calls = []

    def killed_on_third_case(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 3:
            raise KeyboardInterrupt  # what a kill looks like to the loop: nothing of the case is written
        return real_write_case(*args, **kwargs)

    monkeypatch.setattr(generation, "write_case", killed_on_third_case)
    with pytest.raises(KeyboardInterrupt):
        run(root, split, tiny_pipeline, out, REQUESTS, seed=1)
    finished = calls[:2]
    assert sorted(pd.read_csv(out / "metadata.csv")["case_id"]) == sorted(finished)
    assert not (out / calls[2]).exists()
    before = {case_id: _stat(out, case_id) for case_id in finished}

    monkeypatch.setattr(generation, "write_case", real_write_case)
    summary = run(root, split, tiny_pipeline, out, REQUESTS, seed=1)
    assert sorted(summary.skipped) == sorted(finished)
    assert len(summary.generated) == 2 and summary.complete
    assert {case_id: _stat(out, case_id) for case_id in finished} == before  # not rewritten
    assert len(pd.read_csv(out / "metadata.csv")) == 4
    assert validate_cohort(out, classes=("pancreas", "pancreatic_lesion")) == []

    # A case whose files were damaged since is not "complete": the next rerun makes it again.
    damaged = finished[0]
    (out / damaged / "segmentations" / "pancreatic_lesion.nii.gz").unlink()
    repaired = run(root, split, tiny_pipeline, out, REQUESTS, seed=1)
    assert repaired.generated == [damaged] and len(repaired.skipped) == 3
    assert validate_cohort(out, classes=("pancreas", "pancreatic_lesion")) == []


def test_max_cases_leaves_the_rest_for_a_rerun(cohort, tiny_pipeline, tmp_path):
    root, split = cohort
    out = tmp_path / "out"
    first = run(root, split, tiny_pipeline, out, REQUESTS, max_cases=1)
    assert len(first.generated) == 1 and first.not_reached == 3 and not first.complete
    assert first.per_cell["pending"].sum() == 3
    second = run(root, split, tiny_pipeline, out, REQUESTS)
    assert second.skipped == first.generated and len(second.generated) == 3


def fail_one_of(real_generate, index):
    """generate_case that fails for the F/60-80/venous request with this index."""

    def generate(cohort_, canvas, request, *args, **kwargs):
        if (request.sex, request.age_band, request.phase, request.index) == ("F", "60-80", "venous", index):
            raise RuntimeError("simulated generator failure")
        return real_generate(cohort_, canvas, request, *args, **kwargs)

    return generate


def test_a_failing_case_is_quarantined_and_the_others_are_made(cohort, tiny_pipeline, tmp_path, monkeypatch):
    root, split = cohort
    out = tmp_path / "out"
    real_generate = generation.generate_case

    monkeypatch.setattr(generation, "generate_case", fail_one_of(real_generate, index=1))
    summary = run(root, split, tiny_pipeline, out, REQUESTS)
    bad = "SX0_F_60-80_venous_0001"
    assert list(summary.failed) == [bad] and "simulated generator failure" in summary.failed[bad]
    assert len(summary.generated) == 3
    assert not (out / bad).exists()
    assert bad not in set(pd.read_csv(out / "metadata.csv")["case_id"])
    record = json.loads((out / ".quarantine" / f"{bad}.json").read_text())
    assert record["request"] == "F/60-80/venous#1" and "RuntimeError" in record["error"]

    monkeypatch.setattr(generation, "generate_case", real_generate)
    rerun = run(root, split, tiny_pipeline, out, REQUESTS)
    assert rerun.generated == [bad] and rerun.complete
    assert not (out / ".quarantine" / f"{bad}.json").exists()

    # A damaged case that then fails again leaves the cohort: its folder moves to the quarantine, its row goes.
    good = "SX0_F_60-80_venous_0000"
    (out / good / "ct.nii.gz").unlink()
    monkeypatch.setattr(generation, "generate_case", fail_one_of(real_generate, index=0))
    third = run(root, split, tiny_pipeline, out, REQUESTS)
    assert list(third.failed) == [good] and not (out / good).exists()
    assert (out / ".quarantine" / f"{good}.incomplete" / "segmentations").is_dir()
    assert good not in set(pd.read_csv(out / "metadata.csv")["case_id"])
    assert validate_cohort(out, classes=("pancreas", "pancreatic_lesion")) == []


def test_rerun_with_other_settings_is_refused(cohort, tiny_pipeline, tmp_path):
    root, split = cohort
    out = tmp_path / "out"
    requests = {("F", "60-80", "venous"): 1}
    run(root, split, tiny_pipeline, out, requests)
    with pytest.raises(GenerationError, match="num_inference_steps: 2 before, 3 now"):
        run(root, split, tiny_pipeline, out, requests, num_inference_steps=3)


def test_request_ids_and_random_streams_depend_on_seed_cell_and_index_only():
    a = SynthesisRequest("F", "20-40", "arterial", 3)
    assert a.case_id(0) == "SX0_F_20-40_arterial_0003" and a.key == "F/20-40/arterial#3"
    assert a.rng(5).integers(1 << 30) == SynthesisRequest("F", "20-40", "arterial", 3).rng(5).integers(1 << 30)
    assert a.rng(5).integers(1 << 30) != SynthesisRequest("F", "20-40", "arterial", 4).rng(5).integers(1 << 30)


def test_cli_with_an_mlflow_run_id_logs_lineage(cohort, tiny_pipeline, tmp_path, mlflow_uri):
    import mlflow

    root, split = cohort
    with mlflow.start_run() as generator_run:
        mlflow.log_artifacts(str(tiny_pipeline), artifact_path="pipeline")
    out = tmp_path / "synthetic"
    counts = tmp_path / "counts.csv"
    counts.write_text("sex,age_band,phase,requested\nF,20-40,arterial,1\nM,gt80,venous,1\n")
    argv = ["--root", str(root), "--split", str(split), "--pipeline", generator_run.info.run_id, "--out", str(out),
            "--target", f"counts:{counts}", "--recipe", str(RECIPES / "generator" / "synthx.yaml"), "--device", "cpu",
            "profile=cpu", "sampling.num_inference_steps=2", f"tracking.uri={mlflow_uri}"]
    assert main(argv) == 0
    metadata = pd.read_csv(out / "metadata.csv")
    # M/gt80/venous has no healthy training scan: reported, not painted into another patient.
    assert sorted(metadata["case_id"]) == ["SX0_F_20-40_arterial_0000"]
    # The recipe's default mask prior copies the training tumors' sizes: T1's lesion is 7.7 mm, tiny.
    assert list(metadata["synthx_size_class"]) == ["tiny"]
    assert (metadata["generator_run_id"] == generator_run.info.run_id).all()
    runs = mlflow.search_runs(experiment_names=["synthx"], filter_string="tags.mlflow.runName = 'synthesize'", output_format="list")
    assert len(runs) == 1
    run = runs[0]
    assert run.data.metrics["synthx/cases_generated"] == 1 and run.data.metrics["synthx/seconds_per_case"] > 0
    assert run.data.metrics["synthx/cases_unfillable"] == 1 and run.data.metrics["synthx/cells_unfillable"] == 1
    assert run.data.tags["generator_run_id"] == generator_run.info.run_id
    assert len(run.data.tags["split_sha256"]) == 64 and run.data.params["guidance_scale"] == "4.0"  # the CPU profile's
    assert (metadata["synthesis_run_id"] == run.info.run_id).all()
    import io

    per_cell = pd.read_csv(io.StringIO(mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/synthx/per_cell.csv")))
    assert per_cell["generated"].sum() == 1 and per_cell["unfillable"].sum() == 1
    assert main(argv) == 0  # a rerun finds everything done, in the same synthesis run
    again = mlflow.search_runs(experiment_names=["synthx"], filter_string="tags.mlflow.runName = 'synthesize'", output_format="list")
    assert [r.info.run_id for r in again] == [run.info.run_id]
    assert again[0].data.metrics["synthx/cases_skipped"] == 1 and again[0].info.status == "FINISHED"


def test_an_interrupted_synthesis_continues_its_mlflow_run_and_a_held_folder_is_refused(
    cohort, tiny_pipeline, tmp_path, mlflow_uri, monkeypatch
):
    import mlflow

    from lightning_modules.infrastructure.run_folder import FolderLockedError, RunFolderLock

    root, split = cohort
    out = tmp_path / "out"
    with RunFolderLock(out, "benchx synthesize"):
        with pytest.raises(FolderLockedError, match=f"{out} is in use by process {os.getpid()}"):
            run(root, split, tiny_pipeline, out, REQUESTS, log_to_mlflow=True, tracking_uri=mlflow_uri)
    real_write_case = generation.write_case
    calls = []

    def killed_on_second_case(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_write_case(*args, **kwargs)

    monkeypatch.setattr(generation, "write_case", killed_on_second_case)
    with pytest.raises(KeyboardInterrupt):
        run(root, split, tiny_pipeline, out, REQUESTS, log_to_mlflow=True, tracking_uri=mlflow_uri)
    [first] = mlflow.search_runs(experiment_names=["synthx"], output_format="list")
    assert first.info.status == "KILLED" and not (out / ".lock").exists()
    monkeypatch.setattr(generation, "write_case", real_write_case)
    summary = run(root, split, tiny_pipeline, out, REQUESTS, log_to_mlflow=True, tracking_uri=mlflow_uri)
    assert summary.synthesis_run_id == first.info.run_id and summary.complete
    [after] = mlflow.search_runs(experiment_names=["synthx"], output_format="list")
    assert after.info.run_id == first.info.run_id and after.info.status == "FINISHED"


@pytest.mark.slow
def test_trained_generator_follows_the_phase_contrast_of_real_phantom_tumors(tmp_path, mlflow_uri):
    """Train the generator (recipe profile cpu: 500 steps of 24^3 patches) on the phantom, paint tumors into canvases of
    each phase, and check that the synthetic tumors' contrast against the pancreas orders the phases
    as the real tumors' does: arterial (hyper-attenuating) above non-contrast (iso) and venous (hypo)."""
    from lightning_modules.cohorts.phantom import generate_phantom_cohort
    from lightning_modules.data.splits import make_splits, write_split
    from synthx.config import load_synthx_recipe
    from synthx.analysis.quality import quality_report
    from synthx.training import train_synthx

    root, split = tmp_path / "phantom", tmp_path / "split.csv"
    generate_phantom_cohort(root, n_cases=60, seed=0)
    write_split(make_splits(load_cohort(root).metadata, seed=0), split)
    recipe = load_synthx_recipe(
        RECIPES / "generator" / "synthx.yaml", ["profile=cpu", f"data.root={root}", f"data.split={split}", f"tracking.uri={mlflow_uri}"]
    )
    trained = train_synthx(recipe, output_dir=tmp_path / "generator", enable_progress_bar=False)

    phases = ("non-contrast", "arterial", "venous")
    out = tmp_path / "synthetic"
    settings = SynthesisSettings.from_recipe(recipe, root, split, trained.pipeline_dir, out, log_to_mlflow=False, progress=False)
    summary = synthesize(settings, {(sex, band, phase): 2 for sex in ("F", "M") for band in ("40-60", "60-80") for phase in phases})
    assert summary.complete, summary.failed
    assert validate_cohort(out, classes=("pancreas", "pancreatic_lesion")) == []
    table = quality_report(root, split, out).intensity
    by_phase = table[table["attribute"] == "phase"].set_index("group")
    real = by_phase.loc[list(phases), "contrast_real"]
    synthetic = by_phase.loc[list(phases), "contrast_synthetic"]
    # The phantom's design (docs/explanation/data.md "The phantom cohort"): non-contrast iso, arterial hyper-attenuating.
    assert real["arterial"] > real["non-contrast"]
    assert synthetic["arterial"] > synthetic["non-contrast"], by_phase[["contrast_real", "contrast_synthetic"]]
    assert synthetic["arterial"] > synthetic["venous"], by_phase[["contrast_real", "contrast_synthetic"]]


def _tumor_cohort(tmp_path, recorded_mm: dict[str, float]):
    """T1 (train, lesion 3x3x2 voxels of 2.5x2.5x3 mm: 7.7 mm), T2 (train, the same lesion), V1 (val
    tumor), X1 (test tumor) and a healthy training scan H1; ``recorded_mm`` fills ``tumor_diameter_mm``."""
    root = tmp_path / "sizes"
    root.mkdir()
    rows = []
    for case_id, split in (("T1", "train"), ("T2", "train"), ("V1", "val"), ("X1", "test"), ("H1", "train")):
        tumor = case_id != "H1"
        _write_canvas(root, case_id, "venous", RAS, tumor=tumor)
        rows.append({"case_id": case_id, "patient_id": f"P{case_id}", "cohort": "SiteA", "sex": "F", "age": 60,
                     "phase": "venous", "tumor": int(tumor), "tumor_diameter_mm": recorded_mm.get(case_id, np.nan),
                     "split": split})
    table = pd.DataFrame(rows)
    write_metadata(root, table.drop(columns=["split"]))
    split = tmp_path / "sizes.csv"
    table[["case_id", "patient_id", "split"]].to_csv(split, index=False)
    return root, split


def test_the_default_mask_prior_copies_the_training_tumors_sizes_and_never_reads_val_or_test(tmp_path):
    from lightning_modules.data.splits import load_split
    from synthx.generation.canvases import training_tumor_diameters
    from synthx.generator.mask_prior import size_class_weights

    # Recorded sizes win; a case without one is measured on its mask (largest 3D extent); the
    # validation and test tumors' (huge) recorded sizes are never read.
    root, split = _tumor_cohort(tmp_path, {"T1": 25.0, "V1": 55.0, "X1": 55.0})
    cohort = load_cohort(root)
    sizes = training_tumor_diameters(cohort, load_split(split, cohort))
    assert sorted(sizes.index) == ["T1", "T2"]
    assert sizes["T1"] == 25.0
    assert sizes["T2"] == pytest.approx(np.sqrt(5.0**2 + 5.0**2 + 3.0**2))
    assert size_class_weights(sizes) == {"tiny": 1.0, "small": 0.0, "medium": 1.0, "large": 0.0}
    # Beyond the classes: counted in the nearest one; not a size: refused.
    assert size_class_weights([75.0, 1.0]) == {"tiny": 1.0, "small": 0.0, "medium": 0.0, "large": 1.0}
    for bad in ([np.nan], [-3.0], []):
        with pytest.raises(ValueError):
            size_class_weights(bad)


def test_a_tumor_case_without_a_size_or_a_lesion_is_named(tmp_path):
    from lightning_modules.data.splits import load_split
    from synthx.generation.canvases import training_tumor_diameters

    root, split = _tumor_cohort(tmp_path, {"T1": 25.0})
    empty = root / "T2" / "segmentations" / "pancreatic_lesion.nii.gz"
    image = nib.load(empty)
    nib.save(nib.Nifti1Image(np.zeros(image.shape, dtype=np.uint8), image.affine), empty)
    cohort = load_cohort(root)
    with pytest.raises(GenerationError, match=r"T2: .*pancreatic_lesion\.nii\.gz is empty"):
        training_tumor_diameters(cohort, load_split(split, cohort))
    # No tumor in the training split: nothing to copy sizes from, and the error says what to set.
    table = pd.read_csv(split)
    table.loc[table["case_id"].isin(["T1", "T2"]), "split"] = "val"
    table.to_csv(split, index=False)
    with pytest.raises(GenerationError, match="no real tumor case .* mask_prior.size_source=weights"):
        training_tumor_diameters(cohort, load_split(split, cohort))


def test_synthesis_with_the_default_prior_draws_the_training_sizes_and_records_them(cohort, tiny_pipeline, tmp_path):
    root, split = cohort
    summary = run(root, split, tiny_pipeline, tmp_path / "out", {("F", "60-80", "venous"): 2}, size_classes=None)
    assert summary.complete
    manifest = json.loads((tmp_path / "out" / "synthx_generation.json").read_text())
    # The only training tumor (T1, 7.7 mm, measured on its mask) is tiny: so is every drawn tumor.
    assert manifest["size_classes"] == {"large": 0.0, "medium": 0.0, "small": 0.0, "tiny": 1.0}
    assert set(pd.read_csv(tmp_path / "out" / "metadata.csv")["synthx_size_class"]) == {"tiny"}


def _generation_after_two_cases(root, split, pipeline, out, requests, settings: str):
    """A generating process (``synthesize`` with ``settings``), returned once two cases are written."""
    import subprocess
    import sys
    import time

    script = (
        "import sys; from synthx.generation import SynthesisSettings, synthesize\n"
        f"synthesize(SynthesisSettings({str(root)!r}, {str(split)!r}, {str(pipeline)!r}, {str(out)!r}, seed=1,"
        f" num_inference_steps=10, size_classes={{'tiny': 1.0}}, progress=False, {settings}), {requests!r})\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if (out / "metadata.csv").exists() and len(pd.read_csv(out / "metadata.csv")) >= 2:
            break
        time.sleep(0.2)
    assert process.poll() is None, "generation finished before it could be stopped: " + (process.stderr.read() or "")[-2000:]
    return process


def test_generation_killed_with_sigkill_resumes_without_redoing_finished_cases(cohort, tiny_pipeline, tmp_path):
    """A real SIGKILL of a generating process: every case is complete or absent, and a rerun only does the rest."""
    import signal

    root, split = cohort
    out = tmp_path / "out"
    requests = {("F", "60-80", "venous"): 6, ("M", "40-60", "venous"): 6}
    process = _generation_after_two_cases(root, split, tiny_pipeline, out, requests, "log_to_mlflow=False")
    process.send_signal(signal.SIGKILL)
    process.wait()
    finished = list(pd.read_csv(out / "metadata.csv")["case_id"])
    assert 2 <= len(finished) < 12
    case_dirs = [p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")]
    for case_id in case_dirs:  # a case folder is complete (atomic rename) even if its row was not yet written
        assert (out / case_id / "ct.nii.gz").exists() and (out / case_id / "segmentations" / "pancreatic_lesion.nii.gz").exists()
    before = {case_id: _stat(out, case_id) for case_id in finished}
    summary = run(root, split, tiny_pipeline, out, requests, seed=1, num_inference_steps=10)
    assert summary.complete and set(finished) <= set(summary.skipped)
    assert len(summary.generated) + len(summary.skipped) == 12
    assert {case_id: _stat(out, case_id) for case_id in finished} == before, "finished cases were not rewritten"
    assert validate_cohort(out, classes=["pancreas", "pancreatic_lesion"]) == []


def test_synthesis_stopped_with_sigterm_ends_its_run_killed_and_the_rerun_continues_it(
    cohort, tiny_pipeline, tmp_path, mlflow_uri
):
    """SIGTERM (a scheduler's stop) ends the synthesis run KILLED, never RUNNING, and releases the
    folder; the rerun continues the same MLflow run and finishes it."""
    import signal

    import mlflow

    root, split = cohort
    out = tmp_path / "out"
    requests = {("F", "60-80", "venous"): 6, ("M", "40-60", "venous"): 6}
    process = _generation_after_two_cases(root, split, tiny_pipeline, out, requests, f"tracking_uri={mlflow_uri!r}")
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)
    assert process.returncode != 0
    [stopped] = mlflow.search_runs(experiment_names=["synthx"], output_format="list")
    assert stopped.info.status == "KILLED" and not (out / ".lock").exists()
    summary = run(root, split, tiny_pipeline, out, requests, seed=1, num_inference_steps=10, log_to_mlflow=True,
                  tracking_uri=mlflow_uri)
    assert summary.complete and summary.synthesis_run_id == stopped.info.run_id
    [finished] = mlflow.search_runs(experiment_names=["synthx"], output_format="list")
    assert finished.info.status == "FINISHED"
    assert finished.data.metrics["synthx/cases_generated"] + finished.data.metrics["synthx/cases_skipped"] == 12


def test_a_rim_from_the_recipe_grows_the_gland_around_the_painted_tumor_and_only_there(cohort, tiny_pipeline, tmp_path):
    """mask_prior.rim_mm reaches the diffusion painter: the same tumor, the pancreas label grown by a
    rim that was fat in the canvas and now has the gland's HU; a run without a rim records none."""
    from synthx.config import load_synthx_recipe

    root, split = cohort
    cases = {}
    for rim in (0, 4):
        recipe = load_synthx_recipe(RECIPES / "generator" / "synthx.yaml", ["profile=cpu", f"mask_prior.rim_mm={rim}"])
        out = tmp_path / f"rim{rim}"
        settings = SynthesisSettings.from_recipe(recipe, root, split, tiny_pipeline, out, **FAST)
        assert settings.paint_settings().rim_mm == rim
        summary = synthesize(settings, {("F", "20-40", "arterial"): 1})
        manifest = json.loads((out / "synthx_generation.json").read_text())
        assert manifest.get("rim_mm") == (float(rim) if rim else None)
        case = summary.generated[0]
        masks = {name: np.asarray(nib.load(out / case / "segmentations" / f"{name}.nii.gz").dataobj) > 0
                 for name in ("pancreas", "pancreatic_lesion")}
        cases[rim] = (_ct(out / case / "ct.nii.gz"), masks)
    (plain_ct, plain), (grown_ct, grown) = cases[0], cases[4]
    assert np.array_equal(plain["pancreatic_lesion"], grown["pancreatic_lesion"])
    rim = grown["pancreas"] & ~plain["pancreas"]
    canvas = _ct(root / "H3" / "ct.nii.gz")
    assert rim.any() and float(canvas[rim].mean()) < -50, "the rim was fat in the canvas"
    assert abs(float(grown_ct[rim].mean()) - ORGAN_HU["arterial"]) < 15, "and has the gland's HU now"
    far = ndimage.distance_transform_edt(~grown["pancreatic_lesion"]) > 7  # voxels of at least 1 mm: beyond the rim and its edge
    assert np.array_equal(grown_ct[far], plain_ct[far])
