"""The copy-paste painter: a real training tumor of the slot's cell pasted at the site SynthX paints."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pandas as pd
import pytest

from lightning_modules.data.cohort import CT_FILE, load_cohort, write_case, write_metadata
from lightning_modules.data.lesions import largest_extent_mm
from lightning_modules.data.splits import load_split
from lightning_modules.data.synthetic_provenance import cohort_provenance_problem, read_provenance
from lightning_modules.data.validation import validate_cohort
from lightning_modules.infrastructure.files import file_sha256
from synthx.generation import (
    CopyPastePainter,
    GenerationError,
    PaintSettings,
    SynthesisRequest,
    SynthesisSettings,
    canvas_table,
    choose_canvas,
    synthesize,
)
from synthx.generation.copy_paste import choose_source, cut_tumor, feather_weights, source_tumors
from synthx.generation.painting import draw_tumor, read_canvas
from synthx.painters import COPY_PASTE_PAINTER, PAINTERS

SHAPE = (28, 28, 16)
RAS = np.diag([2.5, 2.5, 3.0, 1.0])
LPS = np.diag([-2.5, -2.5, 3.0, 1.0])
FINE = np.diag([2.0, 2.0, 2.0, 1.0])
ORGAN_HU = {"venous": 105.0, "arterial": 130.0, "delayed": 90.0}
PRIOR = PaintSettings(seed=0, size_classes={"tiny": 1.0})
# case, patient, sex, age, phase, tumor, split, affine, tumor box
CASES = [
    ("H1", "P1", "F", 65, "venous", 0, "train", RAS, None),
    ("H2", "P2", "F", 65, "arterial", 0, "train", LPS, None),
    ("H3", "P3", "M", 45, "venous", 0, "train", RAS, None),
    ("H4", "P4", "M", 30, "delayed", 0, "train", FINE, None),
    ("T1", "P5", "F", 70, "venous", 1, "train", RAS, (slice(11, 15), slice(12, 16), slice(6, 9))),
    ("T2", "P6", "F", 62, "venous", 1, "train", RAS, (slice(13, 16), slice(11, 14), slice(7, 9))),
    ("T3", "P7", "F", 75, "arterial", 1, "train", RAS, (slice(10, 14), slice(12, 15), slice(5, 8))),
    ("V1", "P8", "M", 50, "venous", 1, "val", RAS, (slice(12, 15), slice(12, 15), slice(7, 9))),
    ("X1", "P9", "M", 45, "venous", 1, "test", RAS, (slice(12, 15), slice(12, 15), slice(7, 9))),
]


def _write(root, case_id, phase, affine, box):
    rng = np.random.default_rng(sum(map(ord, case_id)))
    ct = np.full(SHAPE, -100.0) + rng.normal(0, 5, SHAPE)
    pancreas = np.zeros(SHAPE, dtype=bool)
    pancreas[6:22, 9:19, 4:12] = True
    ct[pancreas] = ORGAN_HU[phase] + rng.normal(0, 5, int(pancreas.sum()))
    masks = {"pancreas": pancreas}
    if box is not None:
        lesion = np.zeros(SHAPE, dtype=bool)
        lesion[box] = True
        # A textured tumor, each voxel its own HU, so a copy is recognised voxel by voxel.
        ct[lesion] = 20.0 + rng.integers(0, 60, int(lesion.sum()))
        masks["pancreatic_lesion"] = lesion
    write_case(root, case_id, np.round(ct), affine, masks)


@pytest.fixture
def cohort(tmp_path):
    """Healthy training canvases H1 (F 65 venous), H2 (F 65 arterial, LPS), H3 (M 45 venous), H4 (M 30
    delayed, 2 mm voxels); training tumors T1, T2 (F 60-80 venous), T3 (F 60-80 arterial); tumors V1
    (val) and X1 (test) in H3's cell M 40-60 venous."""
    root = tmp_path / "real"
    root.mkdir()
    rows = []
    for case_id, patient, sex, age, phase, tumor, split, affine, box in CASES:
        _write(root, case_id, phase, affine, box)
        rows.append({"case_id": case_id, "patient_id": patient, "cohort": "SiteA", "sex": sex, "age": age, "phase": phase,
                     "tumor": tumor, "split": split})
    table = pd.DataFrame(rows)
    write_metadata(root, table.drop(columns=["split"]))
    split = tmp_path / "split.csv"
    table[["case_id", "patient_id", "split"]].to_csv(split, index=False)
    return root, split


def _setup(cohort, **options):
    root, split_path = cohort
    real = load_cohort(root)
    split = load_split(split_path, real)
    return real, split, canvas_table(real, split), CopyPastePainter(real, split, PRIOR, **options)


def _paint(painter, canvases, canvas_id, index=0, seed=0):
    """What the run does for a slot: the canvas drawn with the request's stream, then the painter on it."""
    canvas = canvases[canvases["case_id"] == canvas_id].iloc[0]
    request = SynthesisRequest(canvas["sex"], canvas["age_band"], canvas["phase"], index)
    rng = request.rng(seed)
    row = choose_canvas(canvases, request, rng)
    assert row["case_id"] == canvas_id
    return painter.paint(row, request, rng, seed), request


def test_copy_paste_is_a_registered_painter():
    assert COPY_PASTE_PAINTER == "copy_paste" and COPY_PASTE_PAINTER in PAINTERS and {"synthx", "phantom"} <= set(PAINTERS)


def test_an_unscaled_paste_copies_the_source_tumor_exactly_and_leaves_the_rest_of_the_canvas(cohort):
    real, split, canvases, painter = _setup(cohort, scale_to_site=False)
    case, request = _paint(painter, canvases, "H1")
    source_id = case.row["tumor_source_case_id"]
    canvas_ct = np.asarray(nib.load(real.root / "H1" / CT_FILE).dataobj)
    lesion = case.masks["pancreatic_lesion"].astype(bool)
    # Outside the pasted region every voxel is the canvas' own; the label marks the pasted region.
    assert lesion.any() and np.array_equal(case.ct[~lesion], canvas_ct[~lesion])
    assert (case.ct != canvas_ct).any() and not ((case.ct != canvas_ct) & ~lesion).any()
    # Inside it the HU are the source tumor's, voxel for voxel, in the source's shape (both grids RAS, same voxels).
    source_ct = np.asarray(nib.load(real.root / source_id / CT_FILE).dataobj)
    source_mask = np.asarray(nib.load(real.case(source_id).mask_path("pancreatic_lesion")).dataobj) > 0
    box = tuple(slice(a, b + 1) for a, b in zip(np.argwhere(source_mask).min(0), np.argwhere(source_mask).max(0)))
    pasted_box = tuple(slice(a, b + 1) for a, b in zip(np.argwhere(lesion).min(0), np.argwhere(lesion).max(0)))
    assert np.array_equal(lesion[pasted_box], source_mask[box])
    assert np.array_equal(case.ct[pasted_box][source_mask[box]], source_ct[box][source_mask[box]])
    assert case.row["copy_paste_scale"] == 1.0
    # The pancreas is grown to hold the tumor; the other masks are the canvas'.
    assert not (lesion & ~case.masks["pancreas"].astype(bool)).any()


def test_the_source_is_a_training_tumor_of_the_slots_cell_and_the_row_records_it(cohort):
    real, split, canvases, painter = _setup(cohort)
    seen = set()
    for index in range(12):
        case, request = _paint(painter, canvases, "H1", index=index)
        row = case.row
        assert row["tumor_source_case_id"] in {"T1", "T2"} and row["copy_paste_match"] == "cell"
        assert row["tumor_source_patient_id"] == {"T1": "P5", "T2": "P6"}[row["tumor_source_case_id"]]
        assert dict(zip(split["case_id"], split["split"]))[row["tumor_source_case_id"]] == "train"
        seen.add(row["tumor_source_case_id"])
        # The canvas describes the case, as with the other painters.
        assert row["source_case_id"] == "H1" and row["sex"] == "F" and row["phase"] == "venous" and row["synthetic"] == 1
        assert row["synthx_painter"] == "copy_paste" and row["synthx_request"] == request.key
    assert seen == {"T1", "T2"}, "both tumors of the cell are drawn"


def test_a_cell_without_a_training_tumor_falls_back_to_its_phase_then_to_any_never_to_val_or_test(cohort):
    real, split, canvases, painter = _setup(cohort)
    assert sorted(painter.source_case_ids) == ["T1", "T2", "T3"], "val and test tumors are never sources"
    # M 40-60 venous: its own cell holds only the val and test tumors, so a venous training tumor is pasted.
    for index in range(6):
        case, _ = _paint(painter, canvases, "H3", index=index)
        assert case.row["copy_paste_match"] == "phase" and case.row["tumor_source_case_id"] in {"T1", "T2"}
    # Delayed: no training tumor of that phase at all, so any training tumor.
    case, _ = _paint(painter, canvases, "H4")
    assert case.row["copy_paste_match"] == "any" and case.row["tumor_source_case_id"] in {"T1", "T2", "T3"}
    # The order itself, on a table.
    sources = source_tumors(real, split)
    rng = np.random.default_rng(0)
    assert choose_source(sources, ("F", "60-80", "arterial"), rng) == (sources.iloc[2].to_dict(), "cell")
    assert choose_source(sources, ("M", "20-40", "arterial"), rng) == (sources.iloc[2].to_dict(), "phase")
    assert choose_source(sources, ("M", "20-40", "delayed"), rng)[1] == "any"


def test_a_source_outside_the_training_split_is_refused(cohort):
    real, split, canvases, painter = _setup(cohort)
    with pytest.raises(GenerationError, match="V1 is in the 'val' split"):
        painter.cut("V1", "P8")
    no_tumors = split[~split["case_id"].isin(["T1", "T2", "T3"])]
    with pytest.raises(GenerationError, match="no real training tumor|has none"):
        CopyPastePainter(real, no_tumors, PRIOR)


def test_the_paste_sits_at_synthx_site_scaled_to_its_size(cohort):
    real, split, canvases, painter = _setup(cohort)
    case, request = _paint(painter, canvases, "H1", index=3, seed=7)
    # SynthX's site for this slot: the same stream, canvas, then draw_tumor with the same mask prior.
    rng = request.rng(7)
    choose_canvas(canvases, request, rng)
    site, size_class = draw_tumor(read_canvas(real, "H1"), rng, PRIOR)
    lesion = case.masks["pancreatic_lesion"].astype(bool)  # the canvas is RAS, so no reorientation
    center = lambda mask: (np.argwhere(mask).min(0) + np.argwhere(mask).max(0)) / 2  # noqa: E731
    assert np.abs(center(lesion) - center(site)).max() <= 1.0
    source = cut_tumor(real, case.row["tumor_source_case_id"], "")
    site_mm = largest_extent_mm(site, (2.5, 2.5, 3.0))
    assert case.row["copy_paste_scale"] == pytest.approx(site_mm / source.diameter_mm, abs=1e-3)
    assert abs(case.row["tumor_diameter_mm"] - site_mm) <= 3.0, "the pasted tumor has the site's size within a voxel"
    assert case.row["synthx_size_class"] == size_class


def test_painting_is_deterministic_for_a_seed_and_reorients_to_the_canvas(cohort):
    real, split, canvases, painter = _setup(cohort)
    first, _ = _paint(painter, canvases, "H2", index=1, seed=3)
    again, _ = _paint(CopyPastePainter(real, split, PRIOR), canvases, "H2", index=1, seed=3)
    assert np.array_equal(first.ct, again.ct) and first.row == again.row
    assert all(np.array_equal(first.masks[k], again.masks[k]) for k in first.masks)
    # H2 is stored LPS: the case is on its grid, and outside the label it is the canvas.
    canvas = nib.load(real.root / "H2" / CT_FILE)
    assert np.array_equal(first.affine, canvas.affine)
    lesion = first.masks["pancreatic_lesion"].astype(bool)
    assert np.array_equal(first.ct[~lesion], np.asarray(canvas.dataobj)[~lesion])
    assert first.row["tumor_source_case_id"] == "T3"


def test_a_feathered_edge_blends_toward_the_canvas_and_keeps_the_core(cohort):
    mask = np.zeros((9, 9, 9), dtype=bool)
    mask[1:8, 1:8, 1:8] = True
    weights = feather_weights(mask, np.array([1.0, 1.0, 1.0]), 2.0)
    assert weights[4, 4, 4] == 1.0 and weights[1, 4, 4] == pytest.approx(0.25) and weights[0, 4, 4] == 0.0
    assert np.array_equal(feather_weights(mask, np.ones(3), 0.0), mask.astype(np.float32))
    real, split, canvases, painter = _setup(cohort, scale_to_site=False, feather_mm=2.5)
    hard = _paint(_setup(cohort, scale_to_site=False)[3], canvases, "H1")[0]
    soft = _paint(painter, canvases, "H1")[0]
    lesion = soft.masks["pancreatic_lesion"].astype(bool)
    assert np.array_equal(lesion, hard.masks["pancreatic_lesion"].astype(bool))
    assert np.array_equal(soft.ct[~lesion], hard.ct[~lesion])
    assert (soft.ct[lesion] != hard.ct[lesion]).any(), "the edge is blended"


def test_synthesize_with_the_copy_paste_painter_writes_a_cohort_whose_provenance_lists_its_sources(cohort, tmp_path):
    root, split = cohort
    out = tmp_path / "pasted"
    settings = SynthesisSettings(root, split, None, out, painter="copy_paste", size_classes={"tiny": 1.0},
                                 log_to_mlflow=False, progress=False)
    requests = {("F", "60-80", "venous"): 2, ("M", "40-60", "venous"): 1, ("F", "20-40", "arterial"): 1}
    summary = synthesize(settings, requests)
    assert summary.complete and len(summary.generated) == 3 and summary.unfillable_cases == 1
    metadata = pd.read_csv(out / "metadata.csv", dtype=str)
    assert set(metadata["synthx_painter"]) == {"copy_paste"} and set(metadata["tumor_source_case_id"]) <= {"T1", "T2"}
    assert validate_cohort(out, classes=("pancreas", "pancreatic_lesion")) == []
    provenance = read_provenance(out)
    assert provenance.trained and sorted(provenance.training_cases) == ["T1", "T2", "T3"]
    real = load_cohort(root)
    split_table = load_split(split, real)
    assert cohort_provenance_problem(out, split_table, file_sha256(split)) is None
    moved = split_table.assign(split=np.where(split_table["case_id"] == "T2", "test", split_table["split"]))
    assert "T2" in cohort_provenance_problem(out, moved, file_sha256(split))
    manifest = json.loads((out / "synthx_generation.json").read_text())
    assert manifest["copy_paste"] == {"scale_to_site": True, "feather_mm": 0.0} and manifest["pipeline"] == "copy_paste"
    # A rerun redoes nothing; a pipeline with this painter is refused.
    assert len(synthesize(settings, requests).skipped) == 3
    with pytest.raises(GenerationError, match="uses no generator"):
        synthesize(SynthesisSettings(root, split, "some/pipeline", tmp_path / "x", painter="copy_paste",
                                     log_to_mlflow=False, progress=False), requests)
