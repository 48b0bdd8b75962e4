"""The phantom painter (the study's positive control): the canvas rendered again with a real-appearance tumor."""

from __future__ import annotations

import json
import shutil

import nibabel as nib
import numpy as np
import pandas as pd
import pytest

from lightning_modules.data.cohort import CT_FILE, load_cohort
from lightning_modules.cohorts.phantom import lesion_contrast_hu
from lightning_modules.data.splits import load_split
from synthx.generation import GenerationError, PhantomPainter, SynthesisRequest, SynthesisSettings, canvas_table, synthesize
from synthx.generation.writing import MANIFEST_FILE


def _canvases(root, split):
    cohort = load_cohort(root)
    return canvas_table(cohort, load_split(split, cohort))


def _paint(root, canvas: dict, index: int = 0, seed: int = 0):
    request = SynthesisRequest(canvas["sex"], canvas["age_band"], canvas["phase"], index)
    return PhantomPainter(root).paint(canvas, request, request.rng(seed), seed)


def test_a_painted_case_is_its_canvas_with_one_new_tumor_of_the_phase_appearance(tiny_phantom):
    root, split = tiny_phantom
    canvases = _canvases(root, split)
    strong = canvases[canvases["phase"].map(lambda p: abs(lesion_contrast_hu(p)) >= 40)]
    assert len(strong), "the tiny phantom has a healthy training canvas in a high-contrast phase"
    for canvas in strong.groupby("phase").head(1).to_dict("records"):
        case = _paint(root, canvas)
        canvas_ct = np.asarray(nib.load(root / canvas["case_id"] / CT_FILE).dataobj)
        tumor = case.masks["pancreatic_lesion"].astype(bool)
        pancreas = case.masks["pancreas"].astype(bool)
        assert tumor.any() and not (tumor & ~pancreas).any(), "the tumor lies in the (grown) pancreas mask"
        # Only the neighbourhood of the tumor changed (tumor, its rim, the blur); the rest is the canvas' scan.
        changed = np.argwhere(case.ct != canvas_ct)
        box_low, box_high = np.argwhere(tumor).min(0) - 8, np.argwhere(tumor).max(0) + 8
        assert ((changed >= box_low) & (changed <= box_high)).all(), canvas["case_id"]
        assert np.array_equal(case.affine, nib.load(root / canvas["case_id"] / CT_FILE).affine)
        # The tumor has the phantom's appearance for the canvas' phase (darker in venous, brighter in arterial).
        contrast = float(case.ct[tumor].mean() - case.ct[pancreas & ~tumor].mean())
        designed = lesion_contrast_hu(canvas["phase"])
        assert np.sign(contrast) == np.sign(designed) and abs(contrast) > abs(designed) / 4, (canvas["phase"], contrast)
        # The metadata describes the canvas: its patient, sex, age and phase.
        row = case.row
        for column in ("patient_id", "sex", "phase", "cohort", "race"):
            assert row[column] == str(canvas[column]), column
        assert row["source_case_id"] == canvas["case_id"] and row["tumor"] == 1 and row["synthetic"] == 1
        assert row["synthx_painter"] == "phantom" and row["tumor_location"] in {"head", "body", "tail"}
        assert row["tumor_diameter_mm"] > 0


def test_the_same_request_paints_the_same_case_and_another_index_another_tumor(tiny_phantom):
    root, split = tiny_phantom
    canvas = _canvases(root, split).iloc[0].to_dict()
    first, again, other = _paint(root, canvas, 0), _paint(root, canvas, 0), _paint(root, canvas, 1)
    assert np.array_equal(first.ct, again.ct) and first.row == again.row
    assert not np.array_equal(first.masks["pancreatic_lesion"], other.masks["pancreatic_lesion"])


def test_a_canvas_reused_by_several_requests_is_planned_and_checked_once(tiny_phantom, monkeypatch):
    root, split = tiny_phantom
    canvas = _canvases(root, split).iloc[0].to_dict()
    painter = PhantomPainter(root)
    rendered = []
    real_render = painter._render
    monkeypatch.setattr(painter, "_render", lambda plan: rendered.append(len(plan.lesions)) or real_render(plan))
    for index in range(3):
        request = SynthesisRequest(canvas["sex"], canvas["age_band"], canvas["phase"], index)
        painter.paint(canvas, request, request.rng(0), 0)
    healthy = len(painter.plan_of(canvas["case_id"]).lesions)
    assert rendered.count(healthy) == 1 and len(rendered) == 4, "three painted scans and one check of the canvas"


def test_a_cohort_that_is_not_the_phantom_or_an_edited_canvas_is_refused(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    with pytest.raises(GenerationError, match="phantom.json"):
        PhantomPainter(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    canvas = _canvases(root, split).iloc[0].to_dict()
    path = copy / canvas["case_id"] / CT_FILE
    image = nib.load(path)
    ct = np.asarray(image.dataobj).copy()
    ct[0, 0, 0] += 1
    nib.save(nib.Nifti1Image(ct, image.affine, image.header), path)
    with pytest.raises(GenerationError, match=f"canvas {canvas['case_id']}: .*differs from the phantom's rendering"):
        _paint(copy, canvas)
    params = json.loads((copy / "phantom.json").read_text())
    (copy / "phantom.json").write_text(json.dumps({**params, "version": "0"}))
    with pytest.raises(GenerationError, match="phantom version"):
        PhantomPainter(copy)


def test_synthesize_with_the_phantom_painter_writes_a_cohort_and_reports_unfillable_cells(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    canvas = _canvases(root, split).iloc[0]
    cell = (canvas["sex"], canvas["age_band"], canvas["phase"])
    empty_cell = next((s, "le20", "arterial") for s in ("F", "M")
                      if _canvases(root, split).query("sex == @s and age_band == 'le20' and phase == 'arterial'").empty)
    out = tmp_path / "synthetic"
    settings = SynthesisSettings(root, split, None, out, painter="phantom", log_to_mlflow=False, progress=False)
    summary = synthesize(settings, {cell: 2, empty_cell: 1})
    assert summary.complete and len(summary.generated) == 2
    assert summary.unfillable_cases == 1, "a cell without a canvas is reported, not painted elsewhere"
    cohort = load_cohort(out)
    table = cohort.metadata
    assert set(table["source_case_id"]) <= set(_canvases(root, split)["case_id"])
    assert (table["sex"] == cell[0]).all() and (table["phase"] == cell[2]).all()
    assert json.loads((out / MANIFEST_FILE).read_text())["pipeline"] == "phantom"
    assert set(pd.read_csv(out / "metadata.csv", keep_default_na=False)["generator_run_id"]) == {""}
    # A rerun finds both cases made and makes nothing again.
    assert len(synthesize(settings, {cell: 2}).skipped) == 2
    with pytest.raises(GenerationError, match="uses no generator"):
        synthesize(SynthesisSettings(root, split, "runs:/x/pipeline", out, painter="phantom", log_to_mlflow=False), {cell: 1})
    with pytest.raises(GenerationError, match="unknown painter"):
        synthesize(SynthesisSettings(root, split, None, out, painter="oracle", log_to_mlflow=False), {cell: 1})


def test_a_phantom_painter_study_refuses_generator_settings_it_would_ignore():
    from synthx.workflows.study.settings import StudySettings

    for changed in ({"synthx_overrides": ["seed=1"]}, {"synthesis_steps": 5}, {"synthx_recipe": "other.yaml"}):
        with pytest.raises(ValueError, match="would be ignored"):
            StudySettings(painter="phantom", **changed).check()
    with pytest.raises(ValueError, match="unknown painter"):
        StudySettings(painter="oracle").check()
    StudySettings(painter="phantom").check()
    StudySettings(synthx_overrides=["seed=1"]).check()


def test_the_study_command_passes_painter_and_target_phases(monkeypatch):
    import synthx.commands.study as command

    seen = []
    monkeypatch.setattr(command, "run_study", seen.append)
    assert command.main(["--painter", "phantom", "--target-phases", "arterial, venous"]) == 0
    assert seen[0].painter == "phantom" and seen[0].target_phases == ["arterial", "venous"]
    assert command.main([]) == 0
    assert seen[1].painter == "synthx" and seen[1].target_phases is None
    with pytest.raises(SystemExit) as exit_info:
        command.main(["--painter", "oracle"])
    assert exit_info.value.code == 2


def test_the_study_refuses_the_copy_paste_painter_pointing_to_its_copy_paste_arm(monkeypatch, capsys):
    """copy_paste is a painter the command line knows, but the SynthX study already trains it as its
    own arm: the study command ends with exit code 2 naming that arm, and the settings refuse it too."""
    import synthx.commands.study as command
    from synthx.workflows.study.settings import copy_paste_skipped, StudySettings

    seen = []
    monkeypatch.setattr(command, "run_study", seen.append)
    with pytest.raises(SystemExit) as exit_info:
        command.main(["--painter", "copy_paste"])
    assert exit_info.value.code == 2 and not seen
    message = capsys.readouterr().err
    assert "--painter copy_paste" in message and "synthesize_copy_paste" in message and "--painter synthx" in message
    with pytest.raises(ValueError, match="already trains a copy-paste arm"):
        StudySettings(painter="copy_paste").check()
    # The positive control trains no copy-paste arm and says why; a SynthX study trains one.
    assert "sites the phantom plans" in copy_paste_skipped(StudySettings(painter="phantom"))
    assert copy_paste_skipped(StudySettings()) is None
