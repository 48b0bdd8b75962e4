"""A CT whose header rules it out (zero slice spacing, 30000^3 declared voxels) is named by
``benchx validate`` and refused by training before anything is read or allocated."""

from __future__ import annotations

import shutil

import nibabel as nib
import numpy as np
import pytest

from broken_volumes import write_huge_header, write_zero_spacing_ct
from conftest import RECIPES, tiny_overrides
from lightning_modules.commands.validate import main as validate_main
from lightning_modules.data.cohort import load_cohort
from lightning_modules.data.volume_checks import MAX_VOXELS, SINGULAR_AFFINE, geometry_problem, size_problem
from test_validation import make_cohort


def test_validate_names_a_ct_with_zero_slice_spacing(tmp_path, capsys):
    root = make_cohort(tmp_path / "cohort")
    ct = root / "C001" / "ct.nii.gz"
    image = nib.load(ct)
    write_zero_spacing_ct(ct, np.asarray(image.dataobj), image.affine)
    assert validate_main(["--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"C001: {ct}: {SINGULAR_AFFINE}" in out
    assert "problem(s) in 1 case(s)" in out and "(4 case(s) read)" in out, "the other cases are checked and clean"


def test_validate_refuses_a_header_declaring_30000_cubed_voxels_before_reading_it(tmp_path, capsys):
    root = make_cohort(tmp_path / "cohort")
    ct = write_huge_header(root / "C002" / "ct.nii.gz")
    assert validate_main(["--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"C002: {ct}: header declares 30000 x 30000 x 30000 = 27,000,000,000,000 voxels" in out
    assert "the data was not read" in out
    # The masks are compared with nothing (no CT grid), and no other case is affected.
    assert "C000" not in out and "C001" not in out and "C003" not in out


def test_the_size_and_geometry_checks_name_their_bounds():
    assert size_problem((512, 512, 400)) is None
    assert "more than" in size_problem((1 << 11, 1 << 11, 1 << 10))  # 2^32 voxels > MAX_VOXELS
    assert size_problem((100, 100, 100), limit_bytes=1000).startswith("header declares 100 x 100 x 100 = 1,000,000 voxels")
    assert MAX_VOXELS == 1 << 31
    assert geometry_problem(np.diag([0.8, 0.8, 2.5, 1.0])) is None
    assert geometry_problem(np.diag([0.8, 0.8, 0.0, 1.0])).startswith(SINGULAR_AFFINE)
    assert "not a finite" in geometry_problem(np.diag([np.nan, 1, 1, 1.0]))


@pytest.mark.parametrize("broken", ["zero_spacing", "huge_header"])
def test_training_refuses_the_cohort_with_exit_2_naming_the_case_and_file(broken, tiny_phantom, tmp_path, capsys):
    from lightning_modules.cli import EXIT_USAGE, main

    root, split = tiny_phantom
    cohort = tmp_path / "cohort"
    shutil.copytree(root, cohort)
    case = next(load_cohort(cohort).cases())
    if broken == "zero_spacing":
        image = nib.load(case.ct_path)
        write_zero_spacing_ct(case.ct_path, np.asarray(image.dataobj), image.affine)
        expected = SINGULAR_AFFINE
    else:
        write_huge_header(case.ct_path)
        expected = "header declares 30000 x 30000 x 30000"
    code = main(["train", "--recipe", str(RECIPES / "unet.yaml"), *tiny_overrides(cohort, split, tmp_path)])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err and "MemoryError" not in err
    assert f"{case.case_id}: {case.ct_path}: {expected}" in err
    assert not list(tmp_path.rglob("*.ckpt")), "nothing was trained"


def test_phantom_refuses_a_shape_no_memory_holds_before_allocating_anything(tmp_path, capsys):
    import tracemalloc

    from lightning_modules.cli import main

    out = tmp_path / "phantom"
    tracemalloc.start()
    try:
        code = main(["phantom", "--out", str(out), "--cases", "2", "--shape", "30000", "30000", "30000"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "--shape asks for 30000 x 30000 x 30000 = 27,000,000,000,000 voxels" in err and "nothing was written" in err
    assert peak < 200e6, f"{peak / 1e6:.0f} MB allocated before refusing"
    assert not out.exists()
