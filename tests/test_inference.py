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
from lightning_modules.inference import predict_scan
from lightning_modules.config.recipe import load_recipe
from lightning_modules.models.checkpoints import load_module_from_checkpoint
from lightning_modules.training import train


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
    labels, affine = predict_scan(module, recipe, path)
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
    from lightning_modules.data.example_ct import EXAMPLE_CASE_ID, example_case_dir, fetch_example
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
    labels, affine = predict_scan(module, recipe, load_cohort(cohort).case(EXAMPLE_CASE_ID).ct_path)
    assert labels.shape == ct.shape and np.allclose(affine, ct.affine)


def test_a_truncated_scan_is_named_skipped_and_listed_while_the_others_are_predicted(tiny_phantom, tmp_path, capsys):
    import shutil

    root, split = tiny_phantom
    overrides = tiny_overrides(root, split, tmp_path, steps=1)
    result = train(load_recipe(RECIPES / "unet.yaml", overrides))
    cases = list(load_cohort(root).cases())[:3]
    folder = tmp_path / "scans"
    folder.mkdir()
    for case in cases:
        shutil.copy(case.ct_path, folder / f"{case.case_id}.nii.gz")
    # The middle scan loses the second half of its bytes, as an interrupted copy would leave it.
    broken = folder / f"{cases[1].case_id}.nii.gz"
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])
    out = tmp_path / "predictions"
    code = predict_main(["--checkpoint", str(result.last_checkpoint), "--recipe", str(RECIPES / "unet.yaml"),
                         "--input", str(folder), "--out", str(out), *overrides])
    captured = capsys.readouterr()
    assert code == EXIT_SKIPPED
    assert f"{cases[1].case_id}: skipped, cannot read {broken}" in captured.out
    assert "1 file(s) skipped" in captured.err and str(broken) in captured.err.splitlines()[-1]
    for case in (cases[0], cases[2]):
        assert (out / case.case_id / "prediction.nii.gz").exists(), "the scans after the broken one are predicted too"
    assert not (out / cases[1].case_id).exists()


def test_predict_refuses_a_run_id_of_the_wrong_shape(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        predict_main(["--run-id", "../../etc", "--input", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "not an MLflow run id" in capsys.readouterr().err
