"""Tests of the phantom cohort generator (lightning_modules/cohorts/phantom/) on tiny volumes, its
designed gaps (docs/explanation/data.md "The phantom cohort") and the committed split of the main job's cohort.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/cohorts/test_phantom.py -x -q
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest
from scipy import ndimage

from lightning_modules.commands import phantom as phantom_command
from lightning_modules.cohorts import phantom
from lightning_modules.data.cohort import load_cohort
from lightning_modules.data.metadata import PHASES, normalize_metadata
from lightning_modules.data.splits import load_split, split_problems

SHAPE = (48, 48, 32)
SPACING = (2.5, 2.5, 3.0)
N_CASES = 12
LESION_ORGANS = {"pancreatic_lesion": ("pancreas",), "liver_lesion": ("liver",),
                 "kidney_lesion": ("kidney_left", "kidney_right")}


def _generate(root: Path, n_cases: int = N_CASES, seed: int = 0, **kwargs) -> pd.DataFrame:
    return phantom.generate_phantom_cohort(root, n_cases=n_cases, seed=seed, shape=SHAPE, spacing=SPACING, **kwargs)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def cohort_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("phantom") / "cohort"
    _generate(root)
    return root


def _raw_metadata(root: Path) -> pd.DataFrame:
    return pd.read_csv(root / "metadata.csv", dtype=str, keep_default_na=False)


def test_same_seed_gives_identical_files_and_other_seed_differs(cohort_dir, tmp_path):
    again = tmp_path / "again"
    table = _generate(again)
    assert table.attrs == {"written": N_CASES, "kept": 0}
    assert _files(cohort_dir) == _files(again)

    other = tmp_path / "other"
    _generate(other, seed=1)
    ct_0 = np.asarray(nib.load(cohort_dir / "PH0001" / "ct.nii.gz").dataobj)
    ct_1 = np.asarray(nib.load(other / "PH0001" / "ct.nii.gz").dataobj)
    assert not np.array_equal(ct_0, ct_1)
    assert not _raw_metadata(cohort_dir).equals(_raw_metadata(other))


def test_two_worker_processes_write_the_same_files_as_one(cohort_dir, tmp_path):
    parallel = tmp_path / "parallel"
    table = _generate(parallel, workers=2)
    assert table.attrs == {"written": N_CASES, "kept": 0}
    assert _files(parallel) == _files(cohort_dir)
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        _generate(tmp_path / "bad", workers=0)
    assert not (tmp_path / "bad").exists()


def test_a_failing_case_is_named_and_the_cases_before_it_are_kept(cohort_dir, tmp_path, monkeypatch):
    from lightning_modules.cohorts.phantom import writer

    real_render = writer.render_scan

    def render(plan, *args, **kwargs):
        if plan.case_id == "PH0004":
            raise FloatingPointError("simulated overflow")
        return real_render(plan, *args, **kwargs)

    monkeypatch.setattr(writer, "render_scan", render)
    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError, match="PH0004: rendering or writing the phantom case failed: simulated overflow"):
        _generate(failed)
    assert sorted(p.name for p in failed.iterdir() if p.name.startswith("PH")) == ["PH0001", "PH0002", "PH0003"]
    monkeypatch.setattr(writer, "render_scan", real_render)
    assert _generate(failed).attrs == {"written": N_CASES - 3, "kept": 3}
    assert _files(failed) == _files(cohort_dir)


def test_resume_rewrites_only_the_missing_case(cohort_dir, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(cohort_dir, resumed)
    shutil.rmtree(resumed / "PH0005")
    (resumed / "metadata.csv").unlink()
    before = {p: p.stat().st_mtime_ns for p in resumed.rglob("*.nii.gz")}

    table = _generate(resumed)

    assert table.attrs == {"written": 1, "kept": N_CASES - 1}
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in before.items())
    assert _files(resumed) == _files(cohort_dir)


def test_partial_run_extended_matches_fresh_run(cohort_dir, tmp_path):
    partial = tmp_path / "partial"
    small = _generate(partial, n_cases=5)
    assert list(small["case_id"]) == [f"PH{i:04d}" for i in range(1, 6)]
    extended = _generate(partial)
    assert extended.attrs == {"written": N_CASES - 5, "kept": 5}
    assert _files(partial) == _files(cohort_dir)


def test_incomplete_case_folder_is_rewritten(cohort_dir, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(cohort_dir, damaged)
    (damaged / "PH0002" / "segmentations" / "liver.nii.gz").unlink()
    table = _generate(damaged)
    assert table.attrs["written"] == 1
    assert _files(damaged) == _files(cohort_dir)


def test_a_killed_runs_staging_folder_is_removed_and_a_held_folder_is_refused(cohort_dir, tmp_path):
    from lightning_modules.infrastructure.run_folder import FolderLockedError, RunFolderLock

    killed = tmp_path / "killed"
    shutil.copytree(cohort_dir, killed)
    # What a SIGKILL during write_case leaves: a hidden staging folder with a truncated file, no case folder.
    shutil.rmtree(killed / "PH0003")
    staging = killed / ".PH0003.x1y2z3"
    (staging / "segmentations").mkdir(parents=True)
    (staging / "ct.nii.gz").write_bytes((cohort_dir / "PH0003" / "ct.nii.gz").read_bytes()[:100])
    with RunFolderLock(killed, "benchx phantom"):
        with pytest.raises(FolderLockedError, match="in use by process"):
            _generate(killed)
    table = _generate(killed)
    assert table.attrs["written"] == 1 and not staging.exists()
    assert _files(killed) == _files(cohort_dir)


def test_metadata_normalizes_without_problems(cohort_dir):
    raw = _raw_metadata(cohort_dir)
    assert list(raw.columns) == list(phantom.METADATA_COLUMNS)
    normalized, problems = normalize_metadata(raw)
    assert problems == []
    assert normalized["case_id"].is_unique
    assert set(normalized["sex"]) <= {"F", "M", "Unknown"}
    assert set(normalized["phase"]) <= set(PHASES) | {"Unknown"}
    assert (normalized["synthetic"] == 0).all()
    assert set(normalized["tumor"]) <= {0, 1}
    cohort = load_cohort(cohort_dir)  # strict: raises on any metadata problem
    assert cohort.layout == "A" and len(cohort) == N_CASES


def test_generated_metadata_equals_cheap_sampler(cohort_dir):
    sampled = phantom.sample_phantom_metadata(N_CASES, seed=0, shape=SHAPE, spacing=SPACING)
    written = pd.read_csv(cohort_dir / "metadata.csv", keep_default_na=False, dtype=str)
    expected = sampled.astype(object).where(sampled.notna(), "").astype(str)
    assert written.equals(expected)


def test_masks_are_binary_on_the_ct_grid(cohort_dir):
    cohort = load_cohort(cohort_dir)
    for case in cohort.cases():
        ct = nib.load(case.ct_path)
        assert ct.get_data_dtype() == np.int16
        assert ct.shape == SHAPE
        np.testing.assert_allclose(np.diag(ct.affine)[:3], SPACING)
        np.testing.assert_allclose(ct.affine[:3, :3], np.diag(SPACING))
        assert set(phantom.ORGAN_CLASSES) <= set(case.available_classes())
        for name in case.available_classes():
            mask = nib.load(case.mask_path(name))
            assert mask.get_data_dtype() == np.uint8, (case.case_id, name)
            assert mask.shape == ct.shape, (case.case_id, name)
            np.testing.assert_array_equal(mask.affine, ct.affine)
            values = np.unique(np.asarray(mask.dataobj))
            assert set(values.tolist()) <= {0, 1}, (case.case_id, name)
            assert values.max() == 1, f"{case.case_id}: {name} is empty"


def test_tumor_column_agrees_with_lesion_masks(cohort_dir):
    cohort = load_cohort(cohort_dir)
    raw = _raw_metadata(cohort_dir).set_index("case_id")
    for case in cohort.cases():
        path = case.mask_path("pancreatic_lesion")
        has_lesion = path.exists() and bool(np.asarray(nib.load(path).dataobj).any())
        assert int(case.metadata["tumor"]) == int(has_lesion), case.case_id
        row = raw.loc[case.case_id]
        assert (row["tumor_location"] in {"head", "body", "tail"}) == has_lesion
        assert (row["tumor_diameter_mm"] != "") == has_lesion
    assert cohort.metadata["tumor"].nunique() == 2, "12 tiny cases should hold positives and negatives"


def _plan_with_every_lesion(diameter_mm: float = 40.0) -> phantom.ScanPlan:
    plan = phantom.plan_phantom_cohort(1, seed=3)[0]
    lesions = (
        phantom.LesionPlan("pancreatic_lesion", diameter_mm, "body"),
        phantom.LesionPlan("liver_lesion", 30.0),
        phantom.LesionPlan("kidney_lesion", 25.0, "left"),
    )
    return dataclasses.replace(plan, lesions=lesions, phase="venous")


def test_lesions_lie_inside_their_organs_and_organs_include_them(cohort_dir):
    rendered = phantom.render_scan(_plan_with_every_lesion(), SHAPE, SPACING, seed=3).masks
    assert set(rendered) >= set(LESION_ORGANS)
    mask_sets = {"rendered with every lesion": rendered}
    for case in load_cohort(cohort_dir).cases():
        mask_sets[case.case_id] = {
            name: np.asarray(nib.load(case.mask_path(name)).dataobj) for name in case.available_classes()
        }
    for source, masks in mask_sets.items():
        for lesion, organs in LESION_ORGANS.items():
            if lesion not in masks:
                continue
            organ_voxels = np.logical_or.reduce([masks[organ].astype(bool) for organ in organs])
            lesion_voxels = masks[lesion].astype(bool)
            assert lesion_voxels.any(), f"{source}: {lesion} file written but empty"
            assert not (lesion_voxels & ~organ_voxels).any(), f"{source}: {lesion} outside {organs}"


def _pancreas_layout(plan: phantom.ScanPlan, seed: int = 3):
    """The tissue label map of a rendered plan (anatomy, then lesions), as render_scan builds it."""
    from lightning_modules.cohorts.phantom.anatomy import _build_labels, _draw_anatomy, _Grid
    from lightning_modules.cohorts.phantom.lesions import _place_lesions
    from lightning_modules.cohorts.phantom.render import _ANATOMY_STREAM, _stream

    anatomy = _draw_anatomy(_stream(seed, plan.patient_index, _ANATOMY_STREAM))
    grid = _Grid((96, 96, 64), (2.5, 2.5, 3.0), anatomy.placement_mm)
    layout = _build_labels(plan, grid, anatomy)
    _place_lesions(plan, grid, anatomy, layout)
    return anatomy, layout.labels


@pytest.mark.parametrize("diameter_mm, location", [(45.0, "body"), (30.0, "tail"), (20.0, "head")])
def test_a_pancreatic_tumor_sits_inside_a_rim_of_parenchyma_never_bare_in_fat_or_bowel(diameter_mm, location):
    """A tumor that outgrows the gland expands it: no tumor voxel touches fat or bowel directly, so it cannot
    look like a bare bowel loop (phantom version 3 let large tumors bulge into fat as round uniform blobs)."""
    from lightning_modules.cohorts.phantom.tissues import Tissue

    plan = dataclasses.replace(_plan_with_every_lesion(), lesions=(phantom.LesionPlan("pancreatic_lesion", diameter_mm, location),))
    _, labels = _pancreas_layout(plan)
    tumor = labels == Tissue.PANCREATIC_LESION
    shell = ndimage.binary_dilation(tumor) & ~tumor
    neighbours = np.bincount(labels[shell].ravel(), minlength=phantom.N_TISSUES)
    cavity = [Tissue.VISCERAL_FAT, Tissue.BOWEL_WALL, Tissue.BOWEL_FLUID, Tissue.BOWEL_GAS]
    assert tumor.sum() > 20
    assert neighbours[cavity].sum() == 0, {Tissue(t).name: int(n) for t, n in enumerate(neighbours) if n}
    assert neighbours[Tissue.PANCREAS] >= 0.5 * shell.sum()


def test_healthy_pancreases_have_tumor_sized_lobulations_so_a_bulge_alone_is_no_tumor():
    """Every patient's gland has 1-3 focal bulges of parenchyma the size of a tumor with its rim: without
    contrast (tumor 5 HU below the gland) the contour must not give a tumor away (the physics gap)."""
    from lightning_modules.cohorts.phantom.lesions import PANCREATIC_RIM_MM
    from lightning_modules.cohorts.phantom.tissues import Tissue

    healthy = dataclasses.replace(_plan_with_every_lesion(), lesions=())
    anatomy, labels = _pancreas_layout(healthy)
    assert 1 <= len(anatomy.pancreas_lobules) <= 3
    for _, semi, _ in anatomy.pancreas_lobules:
        assert 2.5 + PANCREATIC_RIM_MM <= semi.max() <= 20.0 + PANCREATIC_RIM_MM
    from lightning_modules.cohorts.phantom.anatomy import _build_labels, _draw_anatomy, _Grid

    counts = [len(_draw_anatomy(np.random.default_rng(i)).pancreas_lobules) for i in range(200)]
    assert set(counts) == {1, 2, 3}
    # The lobules are parenchyma: a healthy gland is larger with them than its bare tube.
    bare = dataclasses.replace(anatomy, pancreas_lobules=[])

    grid = _Grid((96, 96, 64), (2.5, 2.5, 3.0), anatomy.placement_mm)
    assert (labels == Tissue.PANCREAS).sum() > (_build_labels(healthy, grid, bare).labels == Tissue.PANCREAS).sum()


def test_kidney_lesion_is_in_the_planned_kidney():
    scan = phantom.render_scan(_plan_with_every_lesion(), SHAPE, SPACING, seed=3)
    lesion = scan.masks["kidney_lesion"].astype(bool)
    assert (lesion <= scan.masks["kidney_left"].astype(bool)).all()
    assert not (lesion & scan.masks["kidney_right"].astype(bool)).any()


def test_lesion_contrast_table_by_phase():
    contrast = {phase: phantom.lesion_contrast_hu(phase) for phase in PHASES}
    assert abs(contrast["non-contrast"]) <= 3  # iso: the physics gap
    assert -80 <= contrast["venous"] <= -30  # the reference: clearly hypo-attenuating
    assert contrast["arterial"] >= 50  # the scarcity gap: hyper-attenuating, unlike any venous tumor
    assert contrast["venous"] < contrast["delayed"] < contrast["non-contrast"] < 0
    table = phantom.phase_attenuation("venous")
    assert table["pancreatic_lesion"] == table["pancreas"] + contrast["venous"]
    with pytest.raises(ValueError, match="phase 'portal'"):
        phantom.lesion_contrast_hu("portal")


def test_rendered_lesion_contrast_is_larger_in_arterial_and_venous_than_non_contrast():
    plan = _plan_with_every_lesion(diameter_mm=44.0)
    measured = {}
    for phase in PHASES:
        scan = phantom.render_scan(dataclasses.replace(plan, phase=phase), SHAPE, SPACING, seed=3)
        lesion = scan.masks["pancreatic_lesion"].astype(bool)
        core = ndimage.binary_erosion(lesion)
        pancreas = scan.masks["pancreas"].astype(bool) & ~ndimage.binary_dilation(lesion, iterations=2)
        assert core.sum() >= 8 and pancreas.sum() >= 8
        measured[phase] = scan.ct[core].mean() - scan.ct[pancreas].mean()
    assert abs(measured["non-contrast"]) < 15
    assert measured["arterial"] > 30 and measured["venous"] < -20
    assert min(abs(measured["arterial"]), abs(measured["venous"])) > abs(measured["non-contrast"]) + 15


def test_second_scan_shares_anatomy_with_new_phase_and_noise():
    plans = phantom.plan_phantom_cohort(60, seed=0)
    by_patient: dict[str, list[phantom.ScanPlan]] = {}
    for plan in plans:
        by_patient.setdefault(plan.patient_id, []).append(plan)
    first, second = next(scans for scans in by_patient.values() if len(scans) == 2)
    assert first.phase != second.phase
    assert first.lesions == second.lesions and first.age == second.age and first.site == second.site
    scan_1 = phantom.render_scan(first, SHAPE, SPACING, seed=0)
    scan_2 = phantom.render_scan(second, SHAPE, SPACING, seed=0)
    assert scan_1.masks.keys() == scan_2.masks.keys()
    for name in scan_1.masks:
        np.testing.assert_array_equal(scan_1.masks[name], scan_2.masks[name])
    assert not np.array_equal(scan_1.ct, scan_2.ct)


def test_organ_size_follows_age_and_sex():
    plan = dataclasses.replace(phantom.plan_phantom_cohort(1, seed=5)[0], lesions=())

    def volume(organ: str, **changes) -> int:
        scan = phantom.render_scan(dataclasses.replace(plan, **changes), (64, 64, 48), SPACING, seed=5)
        return int(scan.masks[organ].sum())

    assert volume("pancreas", age=85, sex="F") < 0.75 * volume("pancreas", age=35, sex="F")
    assert volume("liver", age=50, sex="M") > volume("liver", age=50, sex="F")
    factors_young, factors_old = phantom.organ_size_factors(30, "M"), phantom.organ_size_factors(85, "M")
    assert factors_old["pancreas"] < factors_young["pancreas"]


def test_metadata_prevalence_is_skewed_and_patients_repeat():
    table = phantom.sample_phantom_metadata(400, seed=0)
    normalized, problems = normalize_metadata(table.astype(object).where(table.notna(), ""))
    assert problems == []
    phases = normalized["phase"].value_counts(normalize=True)
    assert phases.idxmax() == "venous" and 0.45 < phases["venous"] < 0.7
    assert phases["non-contrast"] < 0.2 and phases["arterial"] < 0.2
    assert "Unknown" in phases.index
    bands = normalized["age_band"].value_counts(normalize=True)
    assert bands.idxmax() == "60-80"
    assert bands.get("le20", 0) + bands.get("20-40", 0) < 0.15
    race = normalized["race"].value_counts()
    assert race["White"] > 5 * race["Pacific Islander"] > 0 and "Unknown" in race.index
    assert set(normalized["sex"]) == {"F", "M", "Unknown"}
    assert normalized["cohort"].nunique() == len(phantom.SITES)
    assert 0.35 < normalized["tumor"].mean() < 0.65
    diameters = table["tumor_diameter_mm"].dropna()
    assert 10 <= diameters.min() and diameters.max() <= 45
    assert 0.15 < (diameters <= 20).mean() < 0.5 and (diameters >= 15).mean() > 0.75

    scans_per_patient = normalized.groupby("patient_id").size()
    assert scans_per_patient.max() == 2
    assert 0.06 < (scans_per_patient == 2).mean() < 0.2
    repeated = normalized[normalized["patient_id"].duplicated(keep=False)]
    for _, scans in repeated.groupby("patient_id"):
        for column in ("cohort", "sex", "race", "tumor"):
            assert scans[column].nunique() == 1, column


def test_cohort_prefix_is_stable():
    small = phantom.sample_phantom_metadata(30, seed=7)
    large = phantom.sample_phantom_metadata(90, seed=7)
    pd.testing.assert_frame_equal(small, large.iloc[:30])


def test_refuses_foreign_folder_and_changed_parameters(cohort_dir, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a cohort")
    with pytest.raises(ValueError, match="not a phantom cohort"):
        _generate(foreign)

    changed = tmp_path / "changed"
    shutil.copytree(cohort_dir, changed)
    with pytest.raises(ValueError, match="overwrite"):
        _generate(changed, seed=1)
    table = _generate(changed, n_cases=4, seed=1, overwrite=True)
    assert table.attrs["written"] == 4
    assert sorted(p.name for p in changed.iterdir() if p.is_dir()) == [f"PH{i:04d}" for i in range(1, 5)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_cases": 0}, "n_cases"),
        ({"seed": -1}, "seed"),
        ({"shape": (8, 48, 32)}, "shape"),
        ({"spacing": (2.5, 0.0, 3.0)}, "spacing"),
    ],
)
def test_bad_arguments_are_named(tmp_path, kwargs, message):
    arguments = {"n_cases": 2, "seed": 0, "shape": SHAPE, "spacing": SPACING, **kwargs}
    with pytest.raises(ValueError, match=message):
        phantom.generate_phantom_cohort(tmp_path / "bad", **arguments)


def test_cli_writes_a_cohort_and_prints_a_summary(tmp_path, capsys):
    out = tmp_path / "cli"
    code = phantom_command.main(["--out", str(out), "--cases", "3", "--seed", "2", "--shape", *map(str, SHAPE)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "3 cases written" in printed and "phase:" in printed and "age band:" in printed
    assert len(load_cohort(out)) == 3

    code = phantom_command.main(["--out", str(out), "--cases", "3", "--seed", "9", "--shape", *map(str, SHAPE)])
    assert code == 2
    assert "overwrite" in capsys.readouterr().err


def _pancreas_and_tumor_hu(scan) -> tuple[float, float]:
    """(mean HU of the pancreas interior away from the lesion, mean HU of the lesion core)."""
    lesion = scan.masks["pancreatic_lesion"].astype(bool)
    core = ndimage.binary_erosion(lesion)
    pancreas = ndimage.binary_erosion(scan.masks["pancreas"].astype(bool)) & ~ndimage.binary_dilation(lesion, iterations=2)
    assert core.sum() >= 8 and pancreas.sum() >= 8
    return float(scan.ct[pancreas].mean()), float(scan.ct[core].mean())


def test_designed_gaps_show_in_rendered_contrast_to_noise_per_phase():
    # The same 30 mm tumor rendered at the main job's shape in each phase, at the quietest and the
    # noisiest site, averaged over four patients (per-scan enhancement, jitter, texture and noise differ).
    plan = _plan_with_every_lesion(diameter_mm=30.0)
    for site in (phantom.SITES_BY_NAME["PH-Academic"], phantom.SITES_BY_NAME["PH-Rural"]):
        measured = {}
        for phase in ("non-contrast", "arterial", "venous"):
            values = [
                _pancreas_and_tumor_hu(phantom.render_scan(dataclasses.replace(plan, phase=phase, site=site),
                                                           (96, 96, 64), SPACING, seed=seed))
                for seed in range(4)
            ]
            measured[phase] = np.mean(values, axis=0)
        cnr = {phase: (pancreas - tumor) / site.noise_sigma_hu for phase, (pancreas, tumor) in measured.items()}
        # Physics gap: the non-contrast tumor is iso-attenuating against the noise.
        assert abs(cnr["non-contrast"]) < 0.5, (site.name, cnr)
        # Scarcity gap: the arterial tumor is clearly visible, more than the venous one, and of the
        # opposite sign: brighter than its (brighter) pancreas where every venous tumor is darker.
        assert -cnr["arterial"] > 2.5 and -cnr["arterial"] > cnr["venous"] > 1.5, (site.name, cnr)
        assert measured["arterial"][0] > measured["venous"][0] + 20, (site.name, measured)
        assert measured["arterial"][1] > measured["arterial"][0] + 40 > measured["venous"][1] + 40, (site.name, measured)
    gaps = phantom.designed_gaps()
    assert (gaps["scarcity"]["phase"], gaps["physics"]["phase"], gaps["reference"]["phase"]) == (
        "arterial", "non-contrast", "venous")
    assert abs(gaps["physics"]["contrast_hu"]) < 0.25 * min(site.noise_sigma_hu for site in phantom.SITES)
    assert gaps["scarcity"]["contrast_hu"] > 0 > gaps["reference"]["contrast_hu"]


def test_committed_split_has_a_scarce_arterial_training_set_and_a_large_test_set():
    """splits/phantom.csv belongs to the default cohort: arterial rare among training positives, >= 150 test scans."""
    metadata = phantom.sample_phantom_metadata(phantom.DEFAULT_CASES, seed=0)
    split_path = Path(__file__).resolve().parents[2] / "splits" / "phantom.csv"
    split = load_split(split_path)
    assert split_problems(split) == []
    assert sorted(split["case_id"]) == sorted(metadata["case_id"])
    table = metadata.merge(split[["case_id", "split"]], on="case_id")
    positives = table[table["tumor"] == 1]
    train_phases = positives[positives["split"] == "train"]["phase"].value_counts(normalize=True)
    assert train_phases["arterial"] < 0.15 and train_phases["venous"] > 0.5
    test = table[table["split"] == "test"]
    assert len(test) >= 150
    test_positives = test[test["tumor"] == 1]["phase"].value_counts()
    test_negatives = test[test["tumor"] == 0]["phase"].value_counts()
    for phase, least in (("arterial", 10), ("non-contrast", 10), ("venous", 40)):
        assert test_positives[phase] >= least, (phase, test_positives.to_dict())
        assert test_negatives[phase] >= 5, (phase, test_negatives.to_dict())


def test_different_patients_do_not_line_up_like_copies_for_the_leakage_audit(tmp_path):
    """Patients sit at different places in the field of view and their organs vary, so the audit's
    screen (coarse NCC >= 0.90) passes few pairs of different patients and none reaches the leak
    threshold, while the two scans of one patient still correlate like one anatomy. With every
    patient centred alike (the earlier phantom), the median pair was at 0.975 and the audit of the
    main job's 440 scans spent over 10 minutes confirming nearly all 96,580 pairs."""
    from lightning_modules.cohorts.audit.volumes import volume_signatures

    root = tmp_path / "cohort"
    table = phantom.generate_phantom_cohort(root, n_cases=40, seed=0, shape=(64, 64, 48), spacing=(3.75, 3.75, 4.0))
    coarse = []
    for case_id in table["case_id"]:
        signature = volume_signatures(np.asarray(nib.load(root / case_id / "ct.nii.gz").dataobj))
        coarse.append(signature[0])
    coarse = np.stack(coarse).astype(np.float32)
    ncc = coarse @ coarse.T
    patients = table["patient_id"].to_numpy()
    upper = np.triu(np.ones_like(ncc, dtype=bool), 1)
    different = ncc[upper & (patients[:, None] != patients[None, :])]
    same = ncc[upper & (patients[:, None] == patients[None, :])]
    assert np.median(different) < 0.85, np.median(different)
    assert (different >= 0.90).mean() < 0.25
    assert different.max() < 0.98
    assert len(same) and same.min() > 0.97
