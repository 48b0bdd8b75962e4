"""The SynthX generator as an MLflow Model (pyfunc around :class:`synthx.generator.pipeline.SynthXPipeline`).

``synthx-train`` logs its saved pipeline as the model ``generator`` and registers it as
``synthx-generator``; a study points the alias ``<study name>`` at the version it used. ``predict`` takes a DataFrame with one row per patch: ``image`` (the healthy
canvas patch in HU, 3-D, at the generator's spacing), ``tumor_mask`` (the voxels to paint, same
shape) and the conditions ``sex``, ``age`` (years or an age band), ``phase`` and ``organ``; it returns
``image`` (the painted patch: changed only inside the tumor's inpainting region) and ``tumor_mask``.
Parameters: ``num_inference_steps`` (default 20), ``seed`` (default 0) and ``guidance_scale`` (1).

Example::

    import mlflow, pandas as pd
    generator = mlflow.pyfunc.load_model("models:/synthx-generator@benchx-study")
    painted = generator.predict(pd.DataFrame({"image": [canvas], "tumor_mask": [mask], "sex": ["F"],
                                              "age": [55], "phase": ["venous"], "organ": ["pancreas"]}),
                                params={"num_inference_steps": 20, "seed": 0})
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pandas as pd

MODEL_NAME = "generator"
REGISTERED_NAME = "synthx-generator"
PIPELINE_ARTIFACT = "pipeline"
REQUIREMENTS = ("torch", "diffusers", "monai", "numpy", "pandas", "scipy", "omegaconf", "mlflow")
DEFAULT_PARAMS = {"num_inference_steps": 20, "seed": 0, "guidance_scale": 1.0}


def signature():
    """Input: canvas patch, tumor mask and conditions per row; output: painted patch and its mask."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, ParamSchema, ParamSpec, Schema

    volume = Array(Array(Array("float")))
    mask = Array(Array(Array("boolean")))
    inputs = Schema(
        [
            ColSpec(volume, "image"),
            ColSpec(mask, "tumor_mask"),
            ColSpec("string", "sex", required=False),
            ColSpec("double", "age", required=False),
            ColSpec("string", "phase", required=False),
            ColSpec("string", "organ", required=False),
        ]
    )
    outputs = Schema([ColSpec(volume, "image"), ColSpec(mask, "tumor_mask")])
    params = ParamSchema(
        [
            ParamSpec("num_inference_steps", "long", DEFAULT_PARAMS["num_inference_steps"]),
            ParamSpec("seed", "long", DEFAULT_PARAMS["seed"]),
            ParamSpec("guidance_scale", "double", DEFAULT_PARAMS["guidance_scale"]),
        ]
    )
    return ModelSignature(inputs=inputs, outputs=outputs, params=params)


class GeneratorModel(mlflow.pyfunc.PythonModel):
    """Loads the saved diffusers pipeline; paints one tumor per row."""

    def load_context(self, context) -> None:
        from synthx.generator.pipeline import SynthXPipeline

        self.pipeline = SynthXPipeline.from_pretrained(context.artifacts[PIPELINE_ARTIFACT])
        self.pipeline.set_progress_bar_config(disable=True)

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        import numpy as np
        import torch

        settings = {**DEFAULT_PARAMS, **(params or {})}
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        images, masks = [], []
        for index, row in frame.iterrows():
            # One seed per row, so a row paints the same tumor whatever else is in the batch.
            generator = torch.Generator().manual_seed(int(settings["seed"]) + len(images))
            output = self.pipeline(
                np.asarray(row["image"], dtype=np.float32),
                tumor_mask=np.asarray(row["tumor_mask"], dtype=bool),
                sex=_text(row.get("sex")),
                age=_age(row.get("age")),
                phase=_text(row.get("phase")),
                organ=_text(row.get("organ")) or "pancreas",
                num_inference_steps=int(settings["num_inference_steps"]),
                guidance_scale=float(settings["guidance_scale"]),
                generator=generator,
            )
            images.append(output.images[0])
            masks.append(output.tumor_masks[0])
        return pd.DataFrame({"image": images, "tumor_mask": masks})


def _text(value) -> str | None:
    return None if value is None or (isinstance(value, float) and value != value) or value == "" else str(value)


def _age(value):
    if value is None or (isinstance(value, float) and value != value):
        return None
    return float(value)


def log_generator_model(run_id: str, uri: str, pipeline_dir: str | Path) -> str | None:
    """Log a saved SynthX pipeline as the pyfunc ``generator`` of ``run_id``; register it as ``synthx-generator``.

    Returns the registered version (as a string), or None when registration did not happen.
    """
    from lightning_modules.tracking.pyfunc import logging_into, package_dir, pip_requirements

    with logging_into(run_id, uri), warnings.catch_warnings():
        # No input example: it would be a CT patch stored with every model version.
        warnings.filterwarnings("ignore", message=".*input example was not provided", category=UserWarning)
        info = mlflow.pyfunc.log_model(
            name=MODEL_NAME,
            python_model=str(Path(__file__).with_name("pyfunc_code.py")),
            artifacts={PIPELINE_ARTIFACT: str(pipeline_dir)},
            code_paths=[package_dir("synthx"), package_dir("lightning_modules")],
            signature=signature(),
            pip_requirements=pip_requirements(REQUIREMENTS),
            registered_model_name=REGISTERED_NAME,
            await_registration_for=60,
        )
    version = getattr(info, "registered_model_version", None)
    return None if version is None else str(version)
