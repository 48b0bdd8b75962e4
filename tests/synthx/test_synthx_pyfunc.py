"""The SynthX generator as an MLflow pyfunc: logged and registered by synthx-train, loaded by URI,
paints a tumor inside the given mask only (the canvas is kept exactly outside the inpainting region)."""

from __future__ import annotations

import mlflow
import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

from conftest import REPO_ROOT, new_sqlite_store
from synthx.config import load_synthx_recipe
from synthx.generator.pipeline import inpainting_region
from synthx.training import train_synthx

TINY_GENERATOR = ["trainer.max_steps=2", "model.channels=[8,8,8]", "model.norm_num_groups=4", "model.num_head_channels=8",
                  "data.patch_size=[16,16,16]", "trainer.log_every_n_steps=1"]


def test_generator_pyfunc_paints_inside_the_mask_only(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    uri = new_sqlite_store(tmp_path / "mlflow.db")
    recipe = load_synthx_recipe(REPO_ROOT / "recipes" / "generator" / "synthx.yaml",
                                ["profile=cpu", f"data.root={root}", f"data.split={split}", f"tracking.uri={uri}",
                                 f"tracking.output_dir={tmp_path / 'outputs'}", *TINY_GENERATOR])
    result = train_synthx(recipe, output_dir=tmp_path / "generator")
    versions = MlflowClient(uri).search_model_versions("name = 'synthx-generator'")
    assert [v.run_id for v in versions] == [result.run_id]

    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(f"models:/synthx-generator/{versions[0].version}")
    rng = np.random.default_rng(0)
    canvas = (40.0 + 10.0 * rng.standard_normal((16, 16, 16))).astype(np.float32)
    mask = np.zeros((16, 16, 16), dtype=bool)
    mask[6:10, 6:10, 6:10] = True
    row = {"image": [canvas], "tumor_mask": [mask], "sex": ["F"], "age": [55.0], "phase": ["venous"], "organ": ["pancreas"]}
    painted = model.predict(pd.DataFrame(row), params={"num_inference_steps": 2, "seed": 0})
    image = np.asarray(painted["image"][0])
    assert image.shape == canvas.shape
    np.testing.assert_array_equal(np.asarray(painted["tumor_mask"][0]), mask)
    config = model.unwrap_python_model().pipeline.unet.config
    region = inpainting_region(mask, tuple(float(s) for s in config.spacing), float(config.inpaint_margin_mm))
    np.testing.assert_array_equal(image[~region], canvas[~region])
    assert not np.allclose(image[mask], canvas[mask]), "nothing painted inside the mask"
    again = model.predict(pd.DataFrame(row), params={"num_inference_steps": 2, "seed": 0})
    np.testing.assert_array_equal(np.asarray(again["image"][0]), image)
