"""Metadata normalization, cohort reading/writing, and recipe loading (schema, profiles, mistyped keys)."""

from __future__ import annotations

import math
import os

import nibabel as nib
import numpy as np
import pandas as pd
import pytest

from lightning_modules.data.cohort import CohortError, load_cohort, write_case, write_metadata
from lightning_modules.data.metadata import age_band, normalize_age, normalize_metadata, normalize_phase, normalize_sex
from lightning_modules.recipe import RecipeError, load_recipe
from conftest import RECIPES


@pytest.mark.parametrize(
    "raw, expected",
    [("F", "F"), ("female", "F"), (" Male ", "M"), ("m", "M"), ("", "Unknown"), ("unknown", "Unknown"), (None, "Unknown")],
)
def test_sex_synonyms(raw, expected):
    assert normalize_sex(raw) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("plain", "non-contrast"),
        ("Non-Contrast", "non-contrast"),
        ("portal venous", "venous"),
        ("PV", "venous"),
        ("delay", "delayed"),
        ("arterial phase", "arterial"),
        ("", "Unknown"),
    ],
)
def test_phase_synonyms(raw, expected):
    assert normalize_phase(raw) == expected


def test_unreadable_values_raise_with_the_value():
    with pytest.raises(ValueError, match="'X'"):
        normalize_sex("X")
    with pytest.raises(ValueError, match="'sometimes'"):
        normalize_phase("sometimes")
    with pytest.raises(ValueError, match="outside"):
        normalize_age("300")


def test_ages_and_bands_follow_design_boundaries():
    assert normalize_age("054Y") == 54.0
    assert normalize_age("18 months") == pytest.approx(1.5)
    assert math.isnan(normalize_age(""))
    # docs/explanation/detection-and-statistics.md "Subgroups": lower bound exclusive, upper inclusive.
    assert [age_band(a) for a in (20.0, 20.5, 40.0, 60.0, 80.0, 80.1)] == ["le20", "20-40", "20-40", "40-60", "60-80", "gt80"]
    assert age_band(math.nan) == "Unknown"


def test_normalize_metadata_aliases_defaults_and_problems():
    raw = pd.DataFrame(
        {
            "BDMAP ID": ["A1", "A2", "A2", "../x"],
            "contrast": ["pv", "plain", "weird", ""],
            "sex": ["female", "M", "", "F"],
            "age": ["61", "", "35", "abc"],
        }
    )
    table, problems = normalize_metadata(raw)
    assert list(table["phase"][:2]) == ["venous", "non-contrast"]
    assert table.loc[0, "age_band"] == "60-80" and table.loc[1, "age_band"] == "Unknown"
    # patient_id absent: each case its own patient, and the table says so.
    assert table.attrs["patient_id_missing"] and list(table["patient_id"]) == list(table["case_id"])
    messages = [str(p) for p in problems]
    assert any("A2" in m and "duplicate" in m for m in messages)
    assert any("../x" in m and "unsafe" in m for m in messages)
    assert any("A2" in m and "'weird'" in m and "phase" in m for m in messages)
    assert any("../x" in m and "age" in m for m in messages)


def _tiny_case(root, case_id, layout="A"):
    ct = np.full((8, 8, 6), 40, dtype=np.int16)
    mask = np.zeros_like(ct, dtype=np.uint8)
    mask[2:5, 2:5, 2:4] = 1
    affine = np.diag([2.0, 2.0, 3.0, 1.0])
    if layout == "A":
        write_case(root, case_id, ct, affine, {"pancreas": mask})
    else:
        (root / "ct" / case_id).mkdir(parents=True)
        (root / "label" / case_id / "segmentations").mkdir(parents=True)
        nib.save(nib.Nifti1Image(ct, affine), root / "ct" / case_id / "ct.nii.gz")
        nib.save(nib.Nifti1Image(mask, affine), root / "label" / case_id / "segmentations" / "pancreas.nii.gz")


@pytest.mark.parametrize("layout", ["A", "B"])
def test_both_layouts_are_read(tmp_path, layout):
    _tiny_case(tmp_path, "C1", layout)
    write_metadata(tmp_path, pd.DataFrame({"case_id": ["C1"], "sex": ["F"], "tumor": ["0"]}))
    cohort = load_cohort(tmp_path)
    case = cohort.case("C1")
    assert cohort.layout == layout
    assert case.ct_path.exists() and case.mask_path("pancreas").exists()
    assert case.available_classes() == ["pancreas"]
    assert cohort.resolve_tumor_labels().tolist() == [0]


def test_strict_load_lists_metadata_problems(tmp_path):
    _tiny_case(tmp_path, "C1")
    write_metadata(tmp_path, pd.DataFrame({"case_id": ["C1", "C1"], "sex": ["F", "Q"]}))
    with pytest.raises(CohortError) as error:
        load_cohort(tmp_path)
    assert "duplicate case id" in str(error.value) and "'Q'" in str(error.value)


def test_write_case_is_complete_or_absent_and_readable_by_others(tmp_path):
    _tiny_case(tmp_path, "C1")
    case_dir = tmp_path / "C1"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging folder left behind"
    mode = os.stat(case_dir).st_mode & 0o777
    assert mode & 0o055 == 0o055 & ~_umask() & 0o777, "case folder gets normal permissions, not mkdtemp's 0700"
    with pytest.raises(ValueError, match="shape"):
        write_case(tmp_path, "C2", np.zeros((4, 4, 4)), np.eye(4), {"pancreas": np.zeros((3, 4, 4))})
    assert not (tmp_path / "C2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(ValueError, match="unsafe"):
        write_case(tmp_path, "../evil", np.zeros((4, 4, 4)), np.eye(4), {})


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_recipe_merges_base_recipe_profile_and_overrides():
    full = load_recipe(RECIPES / "unet.yaml")
    cpu = load_recipe(RECIPES / "unet.yaml", ["profile=cpu", "trainer.max_steps=7"])
    assert full.data.patch_size == [96, 96, 96] and full.trainer.max_steps == 250_000  # BenchX table 7
    assert list(full.model.options.channels) == [64, 128, 256, 512]
    assert cpu.data.patch_size == [32, 32, 32] and list(cpu.model.options.channels) == [16, 32, 64, 128]
    assert cpu.trainer.max_steps == 7, "command-line overrides win over the profile"
    assert full.optim.name == "sgd" and full.optim.lr == 1e-2  # BenchX table 7
    assert cpu.name == "unet" and cpu.optim.name == "adamw", "the cpu profile's own optimizer (recipes/unet.yaml)"


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_stepz=3", "max_stepz"),
        ("datta.root=x", "datta"),
        ("model.options.chanels=[1,2]", "chanels"),
        ("data.patch_size=[30,32,32]", "divisible by 8"),
        ("profile=gpu", "profile 'gpu' is not defined"),
        ("optim.name=adam", "sgd or adamw"),
        ("trainer.max_steps=abc", "max_steps"),
        ("detection.threshold_bootstrap=-1", "detection.threshold_bootstrap must be 0"),
    ],
)
def test_recipe_errors_name_the_key(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(RECIPES / "unet.yaml", [override])
