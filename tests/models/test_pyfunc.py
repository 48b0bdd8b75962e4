"""The trained segmentation model as an MLflow pyfunc: logged and registered by training, loaded by URI
in a fresh process, equal to ``benchx predict``; registry aliases; ``models:/`` as a model source."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import nibabel as nib
import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from conftest import RECIPES, REPO_ROOT, tiny_overrides
from lightning_modules.config.recipe import load_recipe
from lightning_modules.models.pyfunc import model_version_tags, set_aliases
from lightning_modules.training import train

FRESH_PROCESS = """
import json, sys
import mlflow, nibabel as nib, numpy as np, pandas as pd
uri, model_uri, ct, out = sys.argv[1:5]
mlflow.set_tracking_uri(uri)
model = mlflow.pyfunc.load_model(model_uri)
result = model.predict(pd.DataFrame({"ct_path": [ct]}))
np.save(out, np.asarray(result["mask"][0]).astype(np.uint8))
print(json.dumps({"case_id": result["case_id"][0], "volume": float(result["tumor_volume_mm3"][0]),
                  "modules": sorted(m for m in sys.modules if m.startswith("lightning_modules"))[:1]}))
"""


@pytest.fixture(scope="module")
def trained(tiny_phantom, tmp_path_factory):
    """Two tiny trainings (baseline ratio 0 and a differently seeded one) registered as benchx-unet."""
    root, split = tiny_phantom
    tmp_path = tmp_path_factory.mktemp("pyfunc")
    recipe = load_recipe(RECIPES / "unet.yaml", tiny_overrides(root, split, tmp_path))
    first = train(recipe)
    second = train(load_recipe(RECIPES / "unet.yaml", [*tiny_overrides(root, split, tmp_path), "seed=1"]))
    return recipe, first, second, tmp_path


def test_training_registers_a_pyfunc_model_with_signature(trained):
    recipe, first, second, _ = trained
    client = MlflowClient(recipe.tracking.uri)
    versions = {v.run_id: v for v in client.search_model_versions("name = 'benchx-unet'")}
    assert set(versions) == {first.run_id, second.run_id}
    assert versions[first.run_id].tags["variant"] == "baseline"
    from mlflow.models import get_model_info

    info = get_model_info(f"models:/benchx-unet/{versions[first.run_id].version}")
    assert {c.name for c in info.signature.inputs.inputs} == {"ct_path", "ct", "affine"}
    assert {"case_id", "mask", "tumor_volume_mm3", "tumor_detected"} <= {c.name for c in info.signature.outputs.inputs}


def test_pyfunc_in_a_fresh_process_equals_benchx_predict(trained, tiny_phantom, tmp_path):
    recipe, first, _, _ = trained
    root, _ = tiny_phantom
    uri = recipe.tracking.uri
    case = sorted(p.name for p in root.iterdir() if (p / "ct.nii.gz").exists())[0]
    ct = root / case / "ct.nii.gz"
    version = model_version_tags(first.run_id, uri)["model_version"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, uri, f"models:/benchx-unet/{version}", str(ct),
                           str(tmp_path / "mask.npy")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert printed["case_id"] == case
    mask = np.load(tmp_path / "mask.npy")

    from lightning_modules.cli import main

    assert main(["predict", "--run-id", first.run_id, "--input", str(ct), "--out", str(tmp_path / "cli")]) == 0
    expected = nib.load(str(tmp_path / "cli" / "ct" / "prediction.nii.gz"))
    assert mask.shape == expected.shape == nib.load(str(ct)).shape
    np.testing.assert_array_equal(mask, np.asarray(expected.dataobj))
    voxel = float(abs(np.linalg.det(expected.affine[:3, :3])))
    tumor_label = list(recipe.data.classes).index(recipe.data.tumor_class) + 1
    assert printed["volume"] == pytest.approx(float((mask == tumor_label).sum()) * voxel)


def test_an_in_memory_volume_predicts_like_its_file(trained, tiny_phantom):
    import mlflow

    recipe, first, _, _ = trained
    root, _ = tiny_phantom
    case = sorted(p.name for p in root.iterdir() if (p / "ct.nii.gz").exists())[1]
    image = nib.load(str(root / case / "ct.nii.gz"))
    mlflow.set_tracking_uri(recipe.tracking.uri)
    version = model_version_tags(first.run_id, recipe.tracking.uri)["model_version"]
    model = mlflow.pyfunc.load_model(f"models:/benchx-unet/{version}")
    by_path = model.predict(pd.DataFrame({"ct_path": [str(root / case / "ct.nii.gz")]}))
    by_volume = model.predict(pd.DataFrame({"ct": [np.asarray(image.dataobj, dtype=np.float32)], "affine": [image.affine]}))
    np.testing.assert_array_equal(np.asarray(by_path["mask"][0]), np.asarray(by_volume["mask"][0]))
    with pytest.raises(Exception, match="ct_path"):
        model.predict(pd.DataFrame({"affine": [image.affine]}))


def test_aliases_point_at_the_right_versions_and_resolve_as_model_sources(trained, tmp_path):
    from lightning_modules.models.checkpoints import ModelSourceError, resolve_model_source

    recipe, first, second, _ = trained
    uri = recipe.tracking.uri
    assert set_aliases(first.run_id, uri, ["baseline", "my study-baseline"]).startswith("benchx-unet/")
    set_aliases(second.run_id, uri, ["synthx"])
    client = MlflowClient(uri)
    assert client.get_model_version_by_alias("benchx-unet", "baseline").run_id == first.run_id
    assert client.get_model_version_by_alias("benchx-unet", "my-study-baseline").run_id == first.run_id
    assert client.get_model_version_by_alias("benchx-unet", "synthx").run_id == second.run_id
    tags = model_version_tags("models:/benchx-unet@synthx", uri)
    assert tags["training_run_id"] == second.run_id

    loaded, checkpoint = resolve_model_source(tmp_path / "a", run_id="models:/benchx-unet@baseline", tracking_uri=uri)
    assert loaded.model.backbone == "unet" and checkpoint.is_file()
    with pytest.raises(ModelSourceError, match="models:/benchx-unet@nope"):
        resolve_model_source(tmp_path / "b", run_id="models:/benchx-unet@nope", tracking_uri=uri)
