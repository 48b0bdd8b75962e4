"""The trained segmentation model as an MLflow pyfunc: logged and registered by training, loaded by URI
in a fresh process, equal to ``benchx predict``; registry aliases; ``models:/`` as a model source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from conftest import RECIPES, REPO_ROOT, tiny_overrides
from lightning_modules.recipe import load_recipe
from lightning_modules.tracking.pyfunc import model_version_tags, set_aliases
from lightning_modules.workflows.train import train

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
    # <case>/ct.nii.gz is case <case> for both (the pyfunc's case_id, predict's output folder).
    expected = nib.load(str(tmp_path / "cli" / printed["case_id"] / "prediction.nii.gz"))
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
    from lightning_modules.models.checkpoints import ModelSourceError
    from lightning_modules.tracking.artifacts import resolve_model_source

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


def test_a_bad_row_gets_its_error_and_the_other_rows_are_predicted(trained, tiny_phantom, tmp_path):
    import mlflow

    recipe, first, _, _ = trained
    root, _ = tiny_phantom
    good = root / sorted(p.name for p in root.iterdir() if (p / "ct.nii.gz").exists())[0] / "ct.nii.gz"
    truncated = tmp_path / "truncated.nii.gz"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    image = nib.load(str(good))
    voxels = np.asarray(image.dataobj, dtype=np.float32)
    voxels[0, 0, :3] = np.nan
    with_nan = tmp_path / "with_nan.nii.gz"
    nib.save(nib.Nifti1Image(voxels, image.affine), str(with_nan))
    missing = tmp_path / "missing.nii.gz"
    mlflow.set_tracking_uri(recipe.tracking.uri)
    version = model_version_tags(first.run_id, recipe.tracking.uri)["model_version"]
    model = mlflow.pyfunc.load_model(f"models:/benchx-unet/{version}")
    result = model.predict(pd.DataFrame({"ct_path": [str(missing), str(good), str(truncated), str(with_nan)]}))
    assert list(result.columns) == ["case_id", "mask", "tumor_volume_mm3", "tumor_detected", "error"]
    assert result["error"][0] == f"{missing}: no such file"
    assert pd.isna(result["error"][1]) and np.asarray(result["mask"][1]).shape == image.shape
    assert result["error"][2].startswith(f"{truncated}: cannot read")
    assert result["error"][3].startswith(f"{with_nan}: 3 of {voxels.size} voxels are NaN or infinite")
    for row in (0, 2, 3):
        assert result["mask"][row] is None and np.isnan(result["tumor_volume_mm3"][row])
        assert pd.isna(result["tumor_detected"][row]), "no decision is made for a scan that was not predicted"
    # An in-memory volume with NaN is an error of its row too, named as 'ct'.
    by_volume = model.predict(pd.DataFrame({"ct": [voxels], "affine": [image.affine]}))
    assert by_volume["error"][0].startswith(f"ct: 3 of {voxels.size} voxels are NaN or infinite")


def test_zero_spacing_2d_4d_and_nameless_paths_are_errors_of_their_rows_with_no_decision(trained, tiny_phantom, tmp_path):
    import shutil

    import mlflow

    from broken_volumes import write_zero_spacing_ct

    recipe, first, _, _ = trained
    root, _ = tiny_phantom
    good = root / sorted(p.name for p in root.iterdir() if (p / "ct.nii.gz").exists())[0] / "ct.nii.gz"
    image = nib.load(str(good))
    voxels = np.asarray(image.dataobj)
    zero = write_zero_spacing_ct(tmp_path / "zero.nii.gz", voxels, image.affine)
    flat, series, nameless = tmp_path / "flat.nii.gz", tmp_path / "series.nii.gz", tmp_path / "named" / ".nii.gz"
    nib.save(nib.Nifti1Image(voxels[:, :, 0], image.affine), str(flat))
    nib.save(nib.Nifti1Image(np.stack([voxels, voxels], axis=-1), image.affine), str(series))
    nameless.parent.mkdir()
    shutil.copy(good, nameless)
    mlflow.set_tracking_uri(recipe.tracking.uri)
    version = model_version_tags(first.run_id, recipe.tracking.uri)["model_version"]
    model = mlflow.pyfunc.load_model(f"models:/benchx-unet/{version}")
    paths = [zero, good, flat, series, nameless]
    result = model.predict(pd.DataFrame({"ct_path": [str(p) for p in paths]}))
    assert result["error"][0].startswith(f"{zero}: singular affine / zero spacing")
    assert pd.isna(result["error"][1]) and np.asarray(result["mask"][1]).shape == image.shape
    assert result["error"][2].startswith(f"{flat}: not a 3D volume")
    assert result["error"][3].startswith(f"{series}: not a 3D volume")
    assert result["error"][4].startswith(f"{nameless}: the file name is only a suffix")
    for row in (0, 2, 3, 4):
        assert result["mask"][row] is None and np.isnan(result["tumor_volume_mm3"][row])
        assert pd.isna(result["tumor_detected"][row]), "no decision for a scan that was not predicted"
    # The same singular geometry given as an in-memory volume and affine: its row's error.
    singular = np.array(image.affine, dtype=float)
    singular[:3, 2] = 0.0
    by_volume = model.predict(pd.DataFrame({"ct": [voxels.astype(np.float32)], "affine": [singular]}))
    assert by_volume["error"][0].startswith("ct: singular affine / zero spacing")
    assert pd.isna(by_volume["tumor_detected"][0]) and np.isnan(by_volume["tumor_volume_mm3"][0])


def test_a_wrong_column_name_is_refused_naming_the_expected_columns(trained, tiny_phantom):
    import mlflow

    recipe, first, _, _ = trained
    root, _ = tiny_phantom
    mlflow.set_tracking_uri(recipe.tracking.uri)
    version = model_version_tags(first.run_id, recipe.tracking.uri)["model_version"]
    model = mlflow.pyfunc.load_model(f"models:/benchx-unet/{version}")
    with pytest.raises(Exception, match=r"the input has no 'ct_path' column .* no 'ct' column") as error:
        model.predict(pd.DataFrame({"ctpath": [str(root / "x" / "ct.nii.gz")], "scan": ["x"]}))
    assert "it has ['ctpath', 'scan']" in str(error.value), "the columns the input did have are named"
    # The next call with the right column is not blamed for the earlier one's columns.
    good = root / sorted(p.name for p in root.iterdir() if (p / "ct.nii.gz").exists())[0] / "ct.nii.gz"
    assert pd.isna(model.predict(pd.DataFrame({"ct_path": [str(good)]}))["error"][0])


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def test_a_served_model_answers_a_json_request_with_a_nested_list_ct(trained, tiny_phantom, tmp_path):
    """What `mlflow models serve` receives from a JSON request (ct as nested lists of numbers) is
    what the served model accepts; its answer equals the in-process prediction of the same volume."""
    import signal
    import time
    import urllib.request

    import mlflow

    recipe, first, _, _ = trained
    root, _ = tiny_phantom
    uri = recipe.tracking.uri
    version = model_version_tags(first.run_id, uri)["model_version"]
    good = root / sorted(p.name for p in root.iterdir() if (p / "ct.nii.gz").exists())[0] / "ct.nii.gz"
    image = nib.load(str(good))
    voxels = np.asarray(image.dataobj, dtype=np.float64)
    port = _free_port()
    # The server starts uvicorn by name: the interpreter's own bin folder first on PATH.
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/benchx-unet/{version}", "--env-manager",
         "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not answer /ping in 180 s"
            time.sleep(1)
        body = {"dataframe_records": [{"ct": voxels.tolist(), "affine": image.affine.tolist()}]}
        status, answer = _post_json(f"http://127.0.0.1:{port}/invocations", body)
        assert status == 200, answer
        served = answer["predictions"][0]
        assert served["error"] is None
        mlflow.set_tracking_uri(uri)
        local = mlflow.pyfunc.load_model(f"models:/benchx-unet/{version}").predict(
            pd.DataFrame({"ct": [voxels], "affine": [image.affine]}))
        assert served["tumor_volume_mm3"] == pytest.approx(float(local["tumor_volume_mm3"][0]))
        assert np.array_equal(np.asarray(served["mask"]), np.asarray(local["mask"][0]))
        # A request with the wrong column is answered with the columns it had.
        status, answer = _post_json(f"http://127.0.0.1:{port}/invocations", {"dataframe_records": [{"scan": "x"}]})
        assert status >= 400 and "it has ['scan']" in json.dumps(answer)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        log.close()


OPERATING_POINT_PROCESS = """
import json, sys
import mlflow, pandas as pd
uri, model_uri, ct, override = sys.argv[1:5]
mlflow.set_tracking_uri(uri)
scans = pd.DataFrame({"ct_path": [ct]})
default = mlflow.pyfunc.load_model(model_uri)
overridden = mlflow.pyfunc.load_model(model_uri, model_config={"threshold_mm3": float(override)})
print(json.dumps({
    "source": default.unwrap_python_model().threshold_source,
    "threshold": default.unwrap_python_model().threshold_mm3,
    "volume": float(default.predict(scans)["tumor_volume_mm3"][0]),
    "detected": bool(default.predict(scans)["tumor_detected"][0]),
    "detected_config": bool(overridden.predict(scans)["tumor_detected"][0]),
    "detected_params": bool(default.predict(scans, params={"threshold_mm3": float(override)})["tumor_detected"][0]),
}))
"""


def test_the_registered_operating_point_is_applied_in_a_fresh_process_and_can_be_overridden(trained, tiny_phantom, tmp_path):
    from lightning_modules.tracking.pyfunc import OPERATING_POINT_RULE_TAG, OPERATING_POINT_TAG

    recipe, first, _, _ = trained
    root, _ = tiny_phantom
    uri = recipe.tracking.uri
    ct = root / sorted(p.name for p in root.iterdir() if (p / "ct.nii.gz").exists())[0] / "ct.nii.gz"
    version = model_version_tags(first.run_id, uri)["model_version"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}

    def fresh_process(override: float) -> dict:
        done = subprocess.run([sys.executable, "-c", OPERATING_POINT_PROCESS, uri, f"models:/benchx-unet/{version}",
                               str(ct), str(override)], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    # Nothing recorded yet: the recipe's fixed m.
    before = fresh_process(override=-1.0)
    assert before["source"] == "recipe" and before["threshold"] == float(recipe.detection.threshold_mm3)
    volume = before["volume"]
    assert before["detected"] == (volume > recipe.detection.threshold_mm3)
    # A stored point on the other side of this scan's volume from the recipe's m flips the decision.
    stored = volume + 1.0 if before["detected"] else max(volume - 1.0, -1.0)
    client = MlflowClient(uri)
    client.set_model_version_tag("benchx-unet", version, OPERATING_POINT_TAG, repr(stored))
    client.set_model_version_tag("benchx-unet", version, OPERATING_POINT_RULE_TAG, "youden")
    override = max(volume - 1.0, -1.0) if before["detected"] else volume + 1.0
    after = fresh_process(override=override)
    assert after["source"] == f"registered model benchx-unet version {version}" and after["threshold"] == stored
    assert after["detected"] == (volume > stored) != before["detected"]
    assert after["detected_config"] == after["detected_params"] == (volume > override) != after["detected"]


ALIAS_PROCESS = """
import json, sys
import mlflow
uri, model_uri = sys.argv[1:3]
mlflow.set_tracking_uri(uri)
model = mlflow.pyfunc.load_model(model_uri).unwrap_python_model()
print(json.dumps({"threshold": model.threshold_mm3, "source": model.threshold_source}))
"""


def test_each_registered_alias_applies_the_m_its_description_states_in_a_fresh_process(trained, tiny_phantom):
    """A study evaluates its baseline on the development split and its other arms on the locked
    cohort's view (the same validation cases, another test set, so another split file): every arm's
    validation-chosen m is recorded on its version, applied when loaded, and stated in its description."""
    import re

    from lightning_modules.evaluation.bootstrap import evaluation_set_hash
    from lightning_modules.tracking.operating_point import operating_point_description, record_operating_point

    recipe, first, second, _ = trained
    _, split = tiny_phantom
    uri = recipe.tracking.uri
    client = MlflowClient(uri)
    table = pd.read_csv(split, dtype=str)
    val_hash = evaluation_set_hash(table.loc[table["split"] == "val", "case_id"])
    experiment = client.get_run(first.run_id).info.experiment_id
    arms = {"baseline": (first, client.get_run(first.run_id).data.tags["split_sha256"], 1472.0),
            "synthx": (second, "0" * 64, 733.0)}  # the locked view: another split file, same val cases
    for arm, (training, split_sha, chosen) in arms.items():
        version = model_version_tags(training.run_id, uri)["model_version"]
        evaluation = client.create_run(experiment, run_name=f"{arm}-evaluate", tags={
            "registered_model": "benchx-unet", "model_version": version, "training_run_id": training.run_id,
            "split_sha256": split_sha, "val_set_sha256": val_hash, "operating_point.val_chosen.rule": "youden"})
        client.log_metric(evaluation.info.run_id, "operating_point/val_chosen", chosen)
        assert record_operating_point(evaluation.info.run_id, uri) is not None, f"{arm}: the point is recorded"
        set_aliases(training.run_id, uri, [f"study-{arm}"])
        client.update_model_version("benchx-unet", version, description=f"{arm} arm. Operating point: "
                                    f"{operating_point_description('benchx-unet', version, uri)}.")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    for arm, (_, _, chosen) in arms.items():
        version = client.get_model_version_by_alias("benchx-unet", f"study-{arm}")
        stated = re.search(r"m = ([\d,.]+) mm³ chosen on validation", version.description)
        assert stated, version.description
        done = subprocess.run([sys.executable, "-c", ALIAS_PROCESS, uri, f"models:/benchx-unet@study-{arm}"],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        applied = json.loads(done.stdout.strip().splitlines()[-1])
        assert applied["threshold"] == float(stated.group(1).replace(",", "")) == chosen
        assert applied["source"] == f"registered model benchx-unet version {version.version}"
