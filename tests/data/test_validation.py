"""Cohort validation: a clean tiny cohort has no problems; each deliberately broken one is named.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/data/test_validation.py -x -q
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest

from lightning_modules.data.cohort import CohortError, write_case, write_metadata
from lightning_modules.commands.validate import main
from lightning_modules.data.problems import Problem
from lightning_modules.data.validation import raise_if_invalid, validate_cohort

SHAPE = (12, 12, 10)
AFFINE = np.diag([2.5, 2.5, 3.0, 1.0])


def _volumes(seed: int, tumor: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    ct = rng.normal(40, 10, SHAPE).astype(np.int16)
    pancreas = np.zeros(SHAPE, np.uint8)
    pancreas[3:9, 3:9, 3:7] = 1
    masks = {"pancreas": pancreas}
    if tumor:
        lesion = np.zeros(SHAPE, np.uint8)
        lesion[5:7, 5:7, 4:6] = 1
        masks["pancreatic_lesion"] = lesion
    return ct, masks


def make_cohort(root: Path, n: int = 4) -> Path:
    """Four clean cases in layout A: two with a lesion, two without (no lesion file)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        case_id = f"C{i:03d}"
        tumor = i % 2 == 0
        ct, masks = _volumes(i, tumor)
        write_case(root, case_id, ct, AFFINE, masks)
        rows.append(
            {
                "case_id": case_id,
                "patient_id": f"P{i:03d}",
                "sex": "F" if i % 2 else "male",
                "age": 50 + i,
                "phase": "portal venous",
                "tumor": int(tumor),
                "cohort": "site-a",
            }
        )
    write_metadata(root, pd.DataFrame(rows))
    return root


def _problems_for(problems: list[Problem], case_id: str) -> list[str]:
    return [(f"column '{p.column}': " if p.column else "") + p.message for p in problems if p.case_id == case_id]


def test_clean_cohort_has_no_problems(tmp_path):
    root = make_cohort(tmp_path / "cohort")
    assert validate_cohort(root) == []
    cohort = raise_if_invalid(root)
    assert cohort.case_ids == ["C000", "C001", "C002", "C003"]
    assert main(["--root", str(root)]) == 0


def test_layout_b_is_read_and_checked(tmp_path):
    source = make_cohort(tmp_path / "a")
    root = tmp_path / "b"
    for case_id in ["C000", "C001", "C002", "C003"]:
        (root / "image_only" / case_id).mkdir(parents=True)
        shutil.copy(source / case_id / "ct.nii.gz", root / "image_only" / case_id / "ct.nii.gz")
        shutil.copytree(source / case_id / "segmentations", root / "mask_only" / case_id / "segmentations")
    shutil.copy(source / "metadata.csv", root / "metadata.csv")
    assert validate_cohort(root) == []
    (root / "mask_only" / "C001" / "segmentations" / "pancreas.nii.gz").unlink()
    problems = validate_cohort(root)
    assert len(problems) == 1 and problems[0].case_id == "C001"
    assert "required mask 'pancreas' is missing" in problems[0].message
    assert "mask_only" in problems[0].file


def test_every_problem_is_listed_in_one_pass(tmp_path, capsys):
    root = make_cohort(tmp_path / "cohort", n=4)
    table = pd.read_csv(root / "metadata.csv", dtype=str, keep_default_na=False)
    extra = [
        # unknown categorical values
        {"case_id": "C100", "patient_id": "P100", "sex": "X", "phase": "hepatobiliary", "tumor": "0"},
        # duplicate case id and an unsafe one
        {"case_id": "C000", "patient_id": "P999", "sex": "F", "phase": "venous", "tumor": "1"},
        {"case_id": "../evil", "patient_id": "P101", "sex": "F", "phase": "venous", "tumor": "0"},
        # synthetic row without its source case
        {"case_id": "S001", "patient_id": "P102", "sex": "F", "phase": "venous", "tumor": "1", "synthetic": "1"},
        # a case with no folder at all
        {"case_id": "C404", "patient_id": "P404", "sex": "M", "phase": "arterial", "tumor": "0"},
    ]
    ct, masks = _volumes(7, True)
    write_case(root, "S001", ct, AFFINE, masks)
    ct, masks = _volumes(8, False)
    write_case(root, "C100", ct, AFFINE, masks)
    write_metadata(root, pd.concat([table, pd.DataFrame(extra)], ignore_index=True).fillna(""))

    # C000: truncated CT (header readable, data cut short)
    ct_path = root / "C000" / "ct.nii.gz"
    data = ct_path.read_bytes()
    ct_path.write_bytes(data[: len(data) // 2])
    # C001: pancreas mask on another grid, lesion mask not binary while tumor=0
    nib.save(nib.Nifti1Image(np.ones((12, 12, 9), np.uint8), AFFINE), root / "C001/segmentations/pancreas.nii.gz")
    lesion = np.zeros(SHAPE, np.uint8)
    lesion[1, 1, 1] = 2
    lesion[2, 2, 2] = 1
    nib.save(nib.Nifti1Image(lesion, AFFINE), root / "C001/segmentations/pancreatic_lesion.nii.gz")
    # C002: float CT with NaN, mask affine shifted by 1 mm, tumor=1 but lesion mask empty
    float_ct = np.full(SHAPE, 30.0, np.float32)
    float_ct[0, 0, 0] = np.nan
    float_ct[0, 0, 1] = np.inf
    nib.save(nib.Nifti1Image(float_ct, AFFINE), root / "C002/ct.nii.gz")
    shifted = AFFINE.copy()
    shifted[0, 3] = 1.0
    nib.save(nib.Nifti1Image(np.zeros(SHAPE, np.uint8), shifted), root / "C002/segmentations/pancreatic_lesion.nii.gz")
    # C003: required organ mask missing
    (root / "C003/segmentations/pancreas.nii.gz").unlink()
    # C100: garbage bytes where a mask should be
    (root / "C100/segmentations/pancreas.nii.gz").write_bytes(b"not a nifti file" * 10)

    problems = validate_cohort(root)
    text = "\n".join(str(p) for p in problems)

    assert any("column 'sex'" in m and "unknown sex 'X'" in m for m in _problems_for(problems, "C100"))
    assert any("column 'phase'" in m and "hepatobiliary" in m for m in _problems_for(problems, "C100"))
    assert any("unreadable or truncated" in m for m in _problems_for(problems, "C100"))
    assert any("duplicate case id" in m for m in _problems_for(problems, "C000"))
    assert any("unsafe case id" in m for m in _problems_for(problems, "../evil"))
    assert any("without a source" in m for m in _problems_for(problems, "S001"))
    assert _problems_for(problems, "C404") == ["case folder is missing"]

    c000 = [p for p in problems if p.case_id == "C000" and p.file.endswith("ct.nii.gz")]
    assert len(c000) == 1 and "unreadable or truncated NIfTI" in c000[0].message
    c001 = _problems_for(problems, "C001")
    assert any("mask shape (12, 12, 9) differs from CT shape (12, 12, 10)" in m for m in c001)
    assert any("not binary" in m and "2" in m for m in c001)
    # Any non-zero voxel is lesion (value 2 included), as the cohort derives labels.
    assert any("tumor=0 but the lesion mask has 2 voxel" in m for m in c001)
    c002 = _problems_for(problems, "C002")
    assert any("2 NaN/inf voxel(s)" in m for m in c002)
    assert any("affine differs" in m for m in c002)
    assert any("tumor=1 but the lesion mask is empty" in m for m in c002)
    assert any("required mask 'pancreas' is missing" in m for m in _problems_for(problems, "C003"))
    # Each file is named in its problem, and no file check escapes the root through '../evil'.
    assert all(p.file for p in problems)
    assert "evil/ct.nii.gz" not in text

    with pytest.raises(CohortError) as caught:
        raise_if_invalid(root)
    assert len(caught.value.problems) == len(problems)

    assert main(["--root", str(root)]) == 1
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == len(problems) + 1
    assert printed[-1].startswith(f"{len(problems)} problem(s)")


def test_small_affine_rounding_is_tolerated_and_lesion_file_optional(tmp_path):
    root = make_cohort(tmp_path / "cohort", n=2)
    nearly = AFFINE.copy()
    nearly[0, 0] += 1e-5
    mask = np.asarray(nib.load(root / "C000/segmentations/pancreas.nii.gz").dataobj)
    nib.save(nib.Nifti1Image(mask, nearly), root / "C000/segmentations/pancreas.nii.gz")
    # C001 has no lesion file and tumor=0: that is "no lesion", not a problem.
    assert not (root / "C001/segmentations/pancreatic_lesion.nii.gz").exists()
    assert validate_cohort(root) == []


def test_missing_metadata_and_missing_column_are_reported(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    problems = validate_cohort(empty)
    assert len(problems) == 1 and "metadata file is missing" in problems[0].message
    root = make_cohort(tmp_path / "cohort", n=1)
    pd.DataFrame({"patient_id": ["P1"]}).to_csv(root / "metadata.csv", index=False)
    problems = validate_cohort(root)
    assert any("case_id" in str(p) and "required column is missing" in str(p) for p in problems)


def test_tumor_label_missing_lesion_file(tmp_path):
    root = make_cohort(tmp_path / "cohort", n=2)
    (root / "C000/segmentations/pancreatic_lesion.nii.gz").unlink()
    problems = validate_cohort(root)
    assert [p.case_id for p in problems] == ["C000"]
    assert "tumor=1 but the lesion mask is missing" in problems[0].message


def test_headers_only_skips_voxel_reads(tmp_path):
    root = make_cohort(tmp_path / "cohort", n=2)
    lesion = np.zeros(SHAPE, np.uint8)
    lesion[0, 0, 0] = 3
    nib.save(nib.Nifti1Image(lesion, AFFINE), root / "C000/segmentations/pancreatic_lesion.nii.gz")
    assert validate_cohort(root, check_voxels=False) == []
    assert any("not binary" in p.message for p in validate_cohort(root, check_voxels=True))


def test_split_option_reports_split_problems(tmp_path, capsys):
    root = make_cohort(tmp_path / "cohort", n=2)
    split = tmp_path / "split.csv"
    pd.DataFrame(
        {"case_id": ["C000", "C001", "C777"], "patient_id": ["P000", "P001", "P777"], "split": ["train", "test", "val"]}
    ).to_csv(split, index=False)
    assert main(["--root", str(root), "--split", str(split)]) == 1
    out = capsys.readouterr().out
    assert "C777" in out and "not in cohort" in out


def test_a_0_255_lesion_mask_is_one_problem_not_also_an_empty_lesion(tmp_path, capsys):
    root = make_cohort(tmp_path / "cohort", n=2)  # C000 has a lesion and tumor=1
    path = root / "C000/segmentations/pancreatic_lesion.nii.gz"
    lesion = np.asarray(nib.load(path).dataobj) * 255
    nib.save(nib.Nifti1Image(lesion.astype(np.uint8), AFFINE), path)
    problems = validate_cohort(root)
    assert [p.case_id for p in problems] == ["C000"]
    assert "not binary (values such as [255])" in problems[0].message
    assert main(["--root", str(root)]) == 1
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 2 and printed[-1].startswith("1 problem(s) in 1 case(s)")


def test_a_missing_label_folder_is_one_problem(tmp_path):
    root = make_cohort(tmp_path / "cohort", n=2)
    for case_id in ("C000", "C001"):
        (root / "ct" / case_id).mkdir(parents=True)
        (root / case_id / "ct.nii.gz").rename(root / "ct" / case_id / "ct.nii.gz")
    (root / "label" / "C001" / "segmentations").mkdir(parents=True)
    (root / "C001" / "segmentations" / "pancreas.nii.gz").rename(root / "label/C001/segmentations/pancreas.nii.gz")
    problems = validate_cohort(root)
    assert [(p.case_id, p.message) for p in problems] == [("C000", "label folder of the case is missing")]
