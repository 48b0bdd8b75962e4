"""Predictions are written on each scan's own grid and affine, for the phantom and for the real example CT."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pandas as pd
import pytest

from conftest import RECIPES, tiny_overrides
from lightning_modules.data.cohort import load_cohort, write_metadata
from lightning_modules.commands.predict import EXIT_SKIPPED
from lightning_modules.commands.predict import main as predict_main
from lightning_modules.inference import PredictionInputError, input_cases, predict_scan
from lightning_modules.recipe import load_recipe
from lightning_modules.models.checkpoints import load_module_from_checkpoint
from lightning_modules.workflows.train import train


def test_prediction_is_on_the_scan_grid_after_reorientation_and_resampling(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    # A recipe spacing different from the phantom's makes the inverse resampling do real work.
    recipe = load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path, steps=1), "data.spacing=[3.0,3.0,3.5]"])
    result = train(recipe)
    module = load_module_from_checkpoint(recipe, result.last_checkpoint)
    case = next(load_cohort(root).cases())
    # Store the CT flipped (LAS) to check the orientation is undone too.
    image = nib.load(case.ct_path)
    flipped = nib.Nifti1Image(np.asarray(image.dataobj)[::-1].copy(), image.affine @ np.array(
        [[-1, 0, 0, image.shape[0] - 1], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=float))
    path = tmp_path / "flipped.nii.gz"
    nib.save(flipped, path)
    labels, affine = predict_scan(module, recipe.data, path)
    assert labels.shape == flipped.shape and np.allclose(affine, flipped.affine)
    assert set(np.unique(labels)) <= {0, 1, 2}
    out = tmp_path / "predictions"
    assert predict_main(["--checkpoint", str(result.last_checkpoint), "--recipe", str(RECIPES / "unet.yaml"),
                         "--input", str(path), "--out", str(out), *tiny_overrides(root, split, tmp_path, steps=1),
                         "data.spacing=[3.0,3.0,3.5]"]) == 0
    written = nib.load(out / "flipped" / "prediction.nii.gz")
    assert written.shape == flipped.shape and np.allclose(written.affine, flipped.affine)
    lesion = nib.load(out / "flipped" / "segmentations" / "pancreatic_lesion.nii.gz")
    assert np.array_equal(np.asarray(lesion.dataobj), (np.asarray(written.dataobj) == 2).astype(np.uint8))


def test_real_ct_validate_train_step_and_prediction_on_its_own_grid(tiny_phantom, tmp_path):
    """The TotalSegmentator example CT (fetched from the package registry): validate, train, predict."""
    from lightning_modules.cohorts.example_ct import EXAMPLE_CASE_ID, example_case_dir, fetch_example
    from lightning_modules.data.validation import validate_cohort

    phantom_root, phantom_split = tiny_phantom
    fetch_example(tmp_path / "example")
    real = tmp_path / "example"
    assert validate_cohort(real, classes=["pancreas"]) == []
    # One cohort: the real scan for training, two phantom scans for validation.
    cohort = tmp_path / "mixed"
    cohort.mkdir()
    import shutil

    shutil.copytree(example_case_dir(tmp_path / "example"), cohort / EXAMPLE_CASE_ID)
    phantom = load_cohort(phantom_root)
    val_ids = list(pd.read_csv(phantom_split).query("split == 'val'")["case_id"][:2])
    for case_id in val_ids:
        shutil.copytree(phantom_root / case_id, cohort / case_id)
    rows = pd.concat([load_cohort(real).metadata, phantom.subset(val_ids)], ignore_index=True)
    write_metadata(cohort, rows[["case_id", "patient_id", "cohort", "age", "sex", "race", "phase", "synthetic"]].assign(tumor=""))
    split = tmp_path / "mixed_split.csv"
    pd.DataFrame({"case_id": rows["case_id"], "patient_id": rows["patient_id"],
                  "split": ["train"] + ["val"] * len(val_ids)}).to_csv(split, index=False)
    recipe = load_recipe(RECIPES / "unet.yaml", tiny_overrides(cohort, split, tmp_path, steps=2))
    result = train(recipe)
    assert result.global_step == 2
    module = load_module_from_checkpoint(recipe, result.last_checkpoint)
    ct = nib.load(load_cohort(cohort).case(EXAMPLE_CASE_ID).ct_path)
    labels, affine = predict_scan(module, recipe.data, load_cohort(cohort).case(EXAMPLE_CASE_ID).ct_path)
    assert labels.shape == ct.shape and np.allclose(affine, ct.affine)


def test_a_truncated_scan_and_a_scan_with_nan_voxels_are_named_skipped_and_listed_while_the_others_are_predicted(
    tiny_phantom, tmp_path, capsys
):
    import shutil

    root, split = tiny_phantom
    overrides = tiny_overrides(root, split, tmp_path, steps=1)
    result = train(load_recipe(RECIPES / "unet.yaml", overrides))
    cases = list(load_cohort(root).cases())[:4]
    folder = tmp_path / "scans"
    folder.mkdir()
    for case in cases[:3]:
        shutil.copy(case.ct_path, folder / f"{case.case_id}.nii.gz")
    # The middle scan loses the second half of its bytes, as an interrupted copy would leave it.
    broken = folder / f"{cases[1].case_id}.nii.gz"
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])
    # The last scan is a float CT with a slab of NaN and one infinite voxel (a failed conversion).
    clean = nib.load(str(cases[3].ct_path))
    voxels = np.asarray(clean.dataobj, dtype=np.float32)
    voxels[:, :, :2] = np.nan
    voxels[0, 0, 5] = np.inf
    with_nan = folder / f"{cases[3].case_id}.nii"
    nib.save(nib.Nifti1Image(voxels, clean.affine), str(with_nan))
    n_bad = voxels.shape[0] * voxels.shape[1] * 2 + 1
    out = tmp_path / "predictions"
    code = predict_main(["--checkpoint", str(result.last_checkpoint), "--recipe", str(RECIPES / "unet.yaml"),
                         "--input", str(folder), "--out", str(out), *overrides])
    captured = capsys.readouterr()
    assert code == EXIT_SKIPPED
    assert f"{cases[1].case_id}: skipped, cannot read {broken}" in captured.out
    assert f"{cases[3].case_id}: skipped, {with_nan}: {n_bad} of {voxels.size} voxels are NaN or infinite" in captured.out
    assert "2 file(s) skipped" in captured.err
    assert f"{broken}: " in captured.err and f"{with_nan}: {n_bad} of {voxels.size} voxels" in captured.err
    for case in (cases[0], cases[2]):
        assert (out / case.case_id / "prediction.nii.gz").exists(), "the scans after the broken one are predicted too"
    assert not (out / cases[1].case_id).exists() and not (out / cases[3].case_id).exists()


def test_inputs_whose_outputs_collide_are_named_and_refused_before_anything_is_written(tiny_phantom, tmp_path, capsys):
    import shutil

    from lightning_modules.cli import EXIT_USAGE, main

    root, _ = tiny_phantom
    case = next(load_cohort(root).cases())
    folder = tmp_path / "scans"
    folder.mkdir()
    shutil.copy(case.ct_path, folder / "x.nii.gz")
    image = nib.load(str(case.ct_path))
    nib.save(nib.Nifti1Image(np.asarray(image.dataobj), image.affine), str(folder / "x.nii"))
    out = tmp_path / "predictions"
    # The input is checked before the model is looked at: the missing checkpoint is never reached.
    code = main(["predict", "--checkpoint", str(tmp_path / "none.ckpt"), "--recipe", str(RECIPES / "unet.yaml"),
                 "--input", str(folder), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err
    assert f"{folder / 'x.nii'} and {folder / 'x.nii.gz'} would both be written to the output folder 'x'" in err
    assert not out.exists()
    # Ids that differ only in letter case are one folder on case-insensitive file systems.
    (folder / "x.nii").rename(folder / "X.nii")
    with pytest.raises(PredictionInputError, match="would both be written"):
        input_cases(folder)


def test_an_output_that_is_a_file_is_refused_with_exit_2(tiny_phantom, tmp_path, capsys):
    from lightning_modules.cli import EXIT_USAGE, main

    root, _ = tiny_phantom
    case = next(load_cohort(root).cases())
    existing = tmp_path / "predictions.txt"
    existing.write_text("keep me")
    code = main(["predict", "--checkpoint", str(tmp_path / "none.ckpt"), "--recipe", str(RECIPES / "unet.yaml"),
                 "--input", str(case.ct_path), "--out", str(existing)])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and f"--out {existing} is an existing file" in err and "Traceback" not in err
    assert existing.read_text() == "keep me"


def test_predict_refuses_a_run_id_of_the_wrong_shape(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        predict_main(["--run-id", "../../etc", "--input", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "not an MLflow run id" in capsys.readouterr().err


def test_zero_spacing_2d_4d_and_nameless_files_are_skipped_each_named_and_the_rest_predicted(tiny_phantom, tmp_path, capsys):
    import shutil

    from broken_volumes import write_zero_spacing_ct

    root, split = tiny_phantom
    overrides = tiny_overrides(root, split, tmp_path, steps=1)
    result = train(load_recipe(RECIPES / "unet.yaml", overrides))
    cases = list(load_cohort(root).cases())[:3]
    folder = tmp_path / "scans"
    folder.mkdir()
    shutil.copy(cases[0].ct_path, folder / f"{cases[0].case_id}.nii.gz")
    shutil.copy(cases[1].ct_path, folder / f"{cases[1].case_id}.nii.gz")
    image = nib.load(cases[2].ct_path)
    voxels = np.asarray(image.dataobj)
    flat = folder / "flat.nii.gz"
    nib.save(nib.Nifti1Image(voxels[:, :, 0], image.affine), str(flat))
    series = folder / "series.nii.gz"
    nib.save(nib.Nifti1Image(np.stack([voxels, voxels], axis=-1), image.affine), str(series))
    zero = write_zero_spacing_ct(folder / "zero.nii.gz", voxels, image.affine)
    nameless = folder / ".nii.gz"
    shutil.copy(cases[2].ct_path, nameless)
    out = tmp_path / "predictions"
    code = predict_main(["--checkpoint", str(result.last_checkpoint), "--recipe", str(RECIPES / "unet.yaml"),
                         "--input", str(folder), "--out", str(out), *overrides])
    captured = capsys.readouterr()
    assert code == EXIT_SKIPPED and "Traceback" not in captured.err
    assert f"flat: skipped, {flat}: not a 3D volume (shape {voxels.shape[:2]})" in captured.out
    assert f"series: skipped, {series}: not a 3D volume (shape {(*voxels.shape, 2)})" in captured.out
    assert f"zero: skipped, {zero}: singular affine / zero spacing" in captured.out
    assert f"{nameless}: skipped, {nameless}: the file name is only a suffix" in captured.out
    assert "4 file(s) skipped" in captured.err
    for case in cases[:2]:
        assert (out / case.case_id / "prediction.nii.gz").exists()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(c.case_id for c in cases[:2])
    # The per-case table: a decision at m for each predicted case, the error (and no decision) for each skipped file.
    table = pd.read_csv(out / "predictions.csv", keep_default_na=False)
    assert list(table.columns) == ["case_id", "ct_path", "score", "threshold_mm3", "decision", "error"]
    assert len(table) == 6 and set(table["threshold_mm3"]) == {50.0}
    predicted = table[table["error"] == ""]
    assert sorted(predicted["case_id"]) == sorted(c.case_id for c in cases[:2])
    for _, row in predicted.iterrows():
        assert row["decision"] == ("tumor" if float(row["score"]) > 50.0 else "no tumor")
        assert f"{row['case_id']}: predicted pancreatic_lesion volume {float(row['score']):.1f} mm^3, m = 50 mm^3: {row['decision']}" in captured.out
    skipped = table[table["error"] != ""].set_index("ct_path")
    assert skipped.loc[str(zero), "error"].startswith("singular affine / zero spacing")
    assert set(skipped["decision"]) == {""} and set(skipped["score"]) == {""}
    assert "operating point: m = 50 mm^3 (recipe)" in captured.out


def test_a_case_folder_ct_is_named_by_its_folder_and_out_has_help(tiny_phantom, tmp_path, capsys):
    from lightning_modules.commands.predict import parser

    root, _ = tiny_phantom
    case = next(load_cohort(root).cases())
    assert input_cases(case.ct_path) == [(case.case_id, case.ct_path)]
    assert "predictions.csv" in parser().format_help().split("--out OUT", 1)[1]
