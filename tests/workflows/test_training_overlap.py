"""What a model was trained on travels with it: a checkpoint copied away from its run folder still
refuses its training cases, an evaluation whose check was unavailable is not compared, and training
scans copied into another cohort under new case and patient ids are refused like training cases."""

from __future__ import annotations

import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import RECIPES, tiny_overrides
from mlflow.tracking import MlflowClient

from lightning_modules.cli import EXIT_USAGE
from lightning_modules.cli import main as benchx
from lightning_modules.cohorts.audit.signatures import ScanSignatures
from lightning_modules.cohorts.phantom import generate_phantom_cohort
from lightning_modules.data.cohort import load_cohort, write_metadata
from lightning_modules.data.splits import make_splits, split_sha256, write_split
from lightning_modules.models.checkpoints import PROVENANCE_KEY, checkpoint_provenance
from lightning_modules.recipe import load_recipe
from lightning_modules.workflows.evaluate import OVERLAP_CHECK_TAG, OVERLAP_SOURCE_TAG, EvaluationError, compare, evaluate
from lightning_modules.workflows.train import train
from lightning_modules.workflows.training_overlap import SIGNATURES_ARTIFACT


@pytest.fixture(scope="module")
def trained(tiny_phantom, tmp_path_factory):
    """A tiny model trained on the tiny phantom: (recipe, TrainResult, its overrides' folder)."""
    root, split = tiny_phantom
    folder = tmp_path_factory.mktemp("overlap-runs")
    recipe = load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, split, folder, steps=2))
    return recipe, train(recipe), folder


def _runs(uri: str):
    client = MlflowClient(uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def _checkpoint_command(checkpoint: Path, root: Path, split: Path, folder: Path) -> list[str]:
    return ["evaluate", "--checkpoint", str(checkpoint), "--recipe", str(RECIPES / "unet.yaml"), "--stages", "test",
            *tiny_overrides(root, split, folder, steps=2)]


def test_a_copied_checkpoint_refuses_its_training_cases_and_compare_refuses_an_unchecked_evaluation(
        trained, tiny_phantom, tmp_path, capsys):
    recipe, result, folder = trained
    root, split = tiny_phantom
    frame = pd.read_csv(split, dtype=str)
    train_ids = sorted(frame.loc[frame["split"] == "train", "case_id"])
    # The checkpoint says what it was trained on, the way a generator's provenance does.
    copy = tmp_path / "elsewhere" / "model.ckpt"
    copy.parent.mkdir()
    shutil.copyfile(result.best_checkpoint, copy)
    provenance = checkpoint_provenance(copy)
    assert sorted(provenance["training_cases"]) == train_ids
    assert provenance["split_sha256"] == split_sha256(split) and provenance["training_run_id"] == result.run_id
    assert sorted(provenance["scan_signatures"]["case_ids"]) == train_ids
    assert checkpoint_provenance(result.last_checkpoint)["training_cases"] == provenance["training_cases"]
    # A split whose test set holds 6 or more training cases: whole training patients moved to test.
    leaking = frame.copy()
    for patient in dict.fromkeys(frame.loc[frame["split"] == "train", "patient_id"]):
        if (leaking["split"].eq("test") & leaking["case_id"].isin(train_ids)).sum() >= 6:
            break
        leaking.loc[leaking["patient_id"] == patient, "split"] = "test"
    leaked = sorted(leaking.loc[(leaking["split"] == "test") & leaking["case_id"].isin(train_ids), "case_id"])
    assert len(leaked) >= 6
    leaking_split = tmp_path / "leaking.csv"
    leaking.to_csv(leaking_split, index=False)
    before = len(_runs(recipe.tracking.uri))
    assert benchx(_checkpoint_command(copy, root, leaking_split, folder)) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("benchx evaluate: ") and f"{len(leaked)} evaluated case(s) overlap the training cases of checkpoint model.ckpt" in err
    assert all(f"case {case}: is one of the model's training cases" in err for case in leaked)
    assert "Traceback" not in err
    runs = _runs(recipe.tracking.uri)
    assert len(runs) == before and "RUNNING" not in {run.info.status for run in runs}
    # On a clean split the copy is evaluated, checked against what it carries.
    clean_recipe = load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, split, folder, steps=2))
    checked, _ = evaluate(clean_recipe, copy, ("test",))
    client = MlflowClient(recipe.tracking.uri)
    tags = client.get_run(checked).data.tags
    assert tags[OVERLAP_CHECK_TAG] == "passed" and tags[OVERLAP_SOURCE_TAG] == "checkpoint model.ckpt"
    # An older checkpoint (no provenance) is evaluated with the check unavailable; compare refuses it.
    older = tmp_path / "older" / "model.ckpt"
    older.parent.mkdir()
    state = torch.load(copy, map_location="cpu", weights_only=False)
    del state[PROVENANCE_KEY]
    torch.save(state, older)
    assert checkpoint_provenance(older) is None
    unchecked, _ = evaluate(clean_recipe, older, ("test",))
    assert client.get_run(unchecked).data.tags[OVERLAP_CHECK_TAG].startswith("unavailable: ")
    compares = len(client.search_runs([client.get_experiment_by_name("benchx").experiment_id], "tags.stage = 'compare'"))
    with pytest.raises(EvaluationError, match=f"run {unchecked} was evaluated without the training-overlap check"):
        compare([checked, unchecked], "test", uri=recipe.tracking.uri, experiment="benchx", n_resamples=20)
    assert benchx(["compare", unchecked, checked, "--resamples", "20"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"run {unchecked} was evaluated without the training-overlap check" in err and "--run-id" in err
    assert "Traceback" not in err
    assert len(client.search_runs([client.get_experiment_by_name("benchx").experiment_id], "tags.stage = 'compare'")) == compares


def _renamed_cohort(source: Path, dest: Path, prefix: str) -> pd.DataFrame:
    """A copy of a cohort with every case and patient id new (``<prefix>C0001``, ``<prefix>P0001``)."""
    metadata = load_cohort(source).metadata.copy()
    cases = {case: f"{prefix}C{i:04d}" for i, case in enumerate(metadata["case_id"], start=1)}
    patients = {p: f"{prefix}P{i:04d}" for i, p in enumerate(dict.fromkeys(metadata["patient_id"]), start=1)}
    dest.mkdir(parents=True)
    for old, new in cases.items():
        shutil.copytree(source / old, dest / new)
    metadata["case_id"] = metadata["case_id"].map(cases)
    metadata["patient_id"] = metadata["patient_id"].map(patients)
    write_metadata(dest, metadata)
    return metadata


def test_training_scans_under_new_ids_are_refused_and_a_different_cohort_passes(trained, tiny_phantom, tmp_path, capsys,
                                                                                monkeypatch):
    recipe, result, _ = trained
    root, split = tiny_phantom
    client = MlflowClient(recipe.tracking.uri)
    assert SIGNATURES_ARTIFACT in {a.path for a in client.list_artifacts(result.run_id)}
    frame = pd.read_csv(split, dtype=str)
    train_ids = list(frame.loc[frame["split"] == "train", "case_id"])
    # An "external" cohort of other patients (another phantom seed) under ids of its own...
    generate_phantom_cohort(tmp_path / "source", n_cases=24, seed=1, shape=(48, 48, 32))
    metadata = _renamed_cohort(tmp_path / "source", tmp_path / "external", "EXT")
    external_split = tmp_path / "external.csv"
    write_split(make_splits(metadata, seed=0, val_fraction=0.25, test_fraction=0.5), external_split)
    evaluated = pd.read_csv(external_split, dtype=str).query("split != 'train'")["case_id"].tolist()
    # ... and the same cohort with 12 of its evaluated scans replaced by training scans: 11 copied
    # files and one re-saved as float32 with its intensities shifted (no longer identical voxels).
    copies = tmp_path / "copies"
    shutil.copytree(tmp_path / "external", copies)
    pairs = dict(zip(evaluated[:12], train_ids[:12]))
    for case, training_case in pairs.items():
        shutil.copyfile(root / training_case / "ct.nii.gz", copies / case / "ct.nii.gz")
    resaved, resaved_from = evaluated[0], pairs[evaluated[0]]
    image = nib.load(root / resaved_from / "ct.nii.gz")
    affine = image.affine.copy()
    affine[:3, :3] *= 1.01
    nib.save(nib.Nifti1Image(np.asarray(image.dataobj, dtype=np.float32) + 3.0, affine), copies / resaved / "ct.nii.gz")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", recipe.tracking.uri)
    before = len(_runs(recipe.tracking.uri))
    command = ["evaluate", "--run-id", result.run_id, "--stages", "val,test", f"data.split={external_split}"]
    assert benchx([*command, f"data.root={copies}"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("benchx evaluate: ") and "12 evaluated case(s) overlap the training cases" in err
    assert f"case {resaved}: its scan duplicates training case {resaved_from} (NCC " in err
    second = evaluated[1]
    assert f"case {second}: its scan duplicates training case {pairs[second]} (identical voxels)" in err
    assert "Traceback" not in err
    runs = _runs(recipe.tracking.uri)
    assert len(runs) == before and "RUNNING" not in {run.info.status for run in runs}
    # The genuinely different cohort passes, and the signatures of its scans were cached.
    assert benchx([*command, f"data.root={tmp_path / 'external'}"]) == 0
    run_id = capsys.readouterr().out.split("evaluation run ")[1].split()[0]
    assert client.get_run(run_id).data.tags[OVERLAP_CHECK_TAG] == "passed"
    assert len(list((Path(recipe.tracking.output_dir) / ".scan_signatures").glob("*.npz"))) >= len(train_ids) + len(evaluated)


def test_the_run_and_the_checkpoint_record_the_same_signatures(trained):
    recipe, result, _ = trained
    client = MlflowClient(recipe.tracking.uri)
    logged = ScanSignatures.from_npz(client.download_artifacts(result.run_id, SIGNATURES_ARTIFACT))
    carried = ScanSignatures.from_payload(checkpoint_provenance(result.best_checkpoint)["scan_signatures"])
    assert logged.case_ids == carried.case_ids and logged.sha256 == carried.sha256
    assert np.array_equal(logged.coarse, carried.coarse) and logged.coarse.shape == (len(logged.case_ids), 16 ** 3)
