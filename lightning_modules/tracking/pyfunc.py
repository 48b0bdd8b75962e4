"""A trained segmentation model as an MLflow Model (pyfunc) in the model registry.

Every training run logs its model as ``model`` (a pyfunc with the checkpoint and the resolved recipe
as artifacts, the ``lightning_modules`` package as code and an input/output signature) and registers
it as ``benchx-<backbone>``; a study then points the aliases ``baseline``, ``synthx`` and
``<study>-baseline`` / ``<study>-synthx`` at its two versions (:func:`set_aliases`).

``predict`` takes a DataFrame with one row per scan: either ``ct_path`` (a NIfTI file) or ``ct`` (a
3-D volume in HU) with an optional ``affine`` (4x4, default identity = 1 mm voxels); an input with
neither column is refused, naming them. Each scan goes through
:func:`lightning_modules.inference.predict_scan`, the same path as ``benchx predict``, and comes
back as a row with ``mask`` (the label map on the scan's own grid, labels in recipe class order),
``tumor_volume_mm3`` (the scan-level score of docs/explanation/detection-and-statistics.md "Scan-level detection"),
``tumor_detected`` (that score above the operating point) and ``error``: a row whose scan cannot be
read, holds NaN or infinite voxels, or has no input gets its problem there (naming the file) and
empty results, and the other rows are still predicted.

The operating point (docs/pyfunc.md): an evaluation on the model's own split records the threshold
it chose on validation on the registered version (tags ``operating_point_mm3``, ``operating_point_rule``,
``operating_point_run``; :func:`record_operating_point`), and the loaded model applies it; a model
with none recorded applies its recipe's ``detection.threshold_mm3``. ``model_config={"threshold_mm3": m}``
at load, or ``params={"threshold_mm3": m}`` per call, overrides it.

Example::

    import mlflow, pandas as pd
    model = mlflow.pyfunc.load_model("models:/benchx-unet@benchx-study-baseline")
    result = model.predict(pd.DataFrame({"ct_path": ["data/example_ct/TS_EXAMPLE/ct.nii.gz"]}))
    strict = mlflow.pyfunc.load_model("models:/benchx-unet@benchx-study-baseline", model_config={"threshold_mm3": 200.0})
    mlflow models predict -m models:/benchx-unet@benchx-study-baseline -i scans.json -t json --env-manager local
"""

from __future__ import annotations

import ast
import logging
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pandas as pd

from lightning_modules.models.checkpoints import CHECKPOINT_ARTIFACT, RECIPE_ARTIFACT
from lightning_modules.tracking.operating_point import (  # noqa: F401 (the pyfunc's names for them)
    OPERATING_POINT_RULE_TAG,
    OPERATING_POINT_RUN_TAG,
    OPERATING_POINT_TAG,
    applied_operating_point,
    is_model_uri,
    model_versions_of_run,
    operating_point_description,
    record_operating_point,
    same_validation_cases,
    version_operating_point,
)

MODEL_NAME = "model"
REGISTERED_PREFIX = "benchx-"
OUTPUT_COLUMNS = ["case_id", "mask", "tumor_volume_mm3", "tumor_detected", "error"]
# The override key (model_config at load, params per call); the version tags are in tracking.operating_point.
THRESHOLD_KEY = "threshold_mm3"
REQUIREMENTS = ("torch", "lightning", "monai", "nibabel", "numpy", "pandas", "omegaconf", "einops", "mlflow")


def registered_name(backbone: str) -> str:
    return f"{REGISTERED_PREFIX}{backbone}"


def signature():
    """Input: ``ct_path`` or ``ct`` (+ ``affine``) per row; output: mask, tumor volume, decision, error;
    parameter: ``threshold_mm3`` (the operating point of this call)."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, ParamSchema, ParamSpec, Schema

    inputs = Schema(
        [
            ColSpec("string", "ct_path", required=False),
            # double: a JSON request (mlflow models serve) carries numbers as float64; float32 is refused there.
            ColSpec(Array(Array(Array("double"))), "ct", required=False),
            ColSpec(Array(Array("double")), "affine", required=False),
        ]
    )
    outputs = Schema(
        [
            ColSpec("string", "case_id"),
            ColSpec(Array(Array(Array("integer"))), "mask"),
            ColSpec("double", "tumor_volume_mm3"),
            ColSpec("boolean", "tumor_detected"),
            ColSpec("string", "error", required=False),
        ]
    )
    params = ParamSchema([ParamSpec(THRESHOLD_KEY, "double", None)])
    return ModelSignature(inputs=inputs, outputs=outputs, params=params)


def pip_requirements(names=REQUIREMENTS) -> list[str]:
    """The installed versions of what a model imports (no inference subprocess at log time)."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            pins.append(name)
    return pins


def package_dir(name: str) -> str:
    """The folder of an importable top-level package (logged as the model's code)."""
    import importlib

    return str(Path(importlib.import_module(name).__file__).parent)


class SegmentationModel(mlflow.pyfunc.PythonModel):
    """The pyfunc wrapper: rebuilds the module from the recipe and checkpoint artifacts.

    Attributes (after loading):
        threshold_mm3: the operating point ``tumor_detected`` applies by default.
        threshold_source: where it comes from: ``model_config``, ``registered model version N`` or ``recipe``.
    """

    def load_context(self, context) -> None:
        from lightning_modules.recipe import load_recipe

        _remember_dropped_columns()
        from lightning_modules.models.checkpoints import load_module_from_checkpoint

        self.recipe = load_recipe(context.artifacts[RECIPE_ARTIFACT], resolved=True)
        self.module = load_module_from_checkpoint(self.recipe, context.artifacts[CHECKPOINT_ARTIFACT])
        self.module.eval()
        config = dict(getattr(context, "model_config", None) or {})
        if config.get(THRESHOLD_KEY) is not None:
            self.threshold_mm3, self.threshold_source = _threshold(config[THRESHOLD_KEY], "model_config"), "model_config"
            return
        recorded = recorded_operating_point(Path(context.artifacts[RECIPE_ARTIFACT]).parents[1])
        if recorded is not None:
            self.threshold_mm3, self.threshold_source = recorded
        else:
            self.threshold_mm3, self.threshold_source = float(self.recipe.detection.threshold_mm3), "recipe"

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        dropped, _DROPPED.columns = getattr(_DROPPED, "columns", None), None
        if not {"ct_path", "ct"} & set(frame.columns):
            got = sorted({*map(str, frame.columns), *(dropped or [])})
            raise ValueError(
                f"the input has no 'ct_path' column (a NIfTI file per row) and no 'ct' column (a 3-D volume in HU, "
                f"with an optional 'affine'); it has {got if got else 'no columns'}"
            )
        threshold = self.threshold_mm3
        if params and params.get(THRESHOLD_KEY) is not None:
            threshold = _threshold(params[THRESHOLD_KEY], "params")
        rows = [self._predict_row(index, row, threshold) for index, row in frame.iterrows()]
        return pd.DataFrame(rows, columns=OUTPUT_COLUMNS)

    def _predict_row(self, index, row, threshold: float) -> dict:
        """One scan's result, or its problem in ``error``: a bad file or input must not cost the other rows."""
        import numpy as np

        from lightning_modules.inference import UnusableScanError, predict_scan, unreadable_reason

        path = row.get("ct_path") if "ct_path" in row else None
        volume_in = row.get("ct") if "ct" in row else None
        try:
            if isinstance(path, str) and path:
                case_id = _case_id(path)
                if not Path(path).is_file():
                    raise ValueError(f"{path}: no such file")
                try:
                    labels, affine = predict_scan(self.module, self.recipe.data, path)
                except UnusableScanError:
                    raise
                except Exception as error:
                    reason = unreadable_reason(Path(path))
                    if reason is None:
                        raise
                    raise ValueError(f"{path}: cannot read: {reason}") from error
            elif volume_in is not None and not (np.isscalar(volume_in) and pd.isna(volume_in)):
                case_id = str(index)
                labels, affine = self._predict_volume(np.asarray(volume_in, dtype=np.float32), row.get("affine"))
            else:
                raise ValueError(f"row {index}: give ct_path (a NIfTI file) or ct (a 3-D volume in HU)")
        except (ValueError, OSError) as error:
            return {"case_id": _case_id(path) if isinstance(path, str) and path else str(index), "mask": None,
                    "tumor_volume_mm3": float("nan"), "tumor_detected": None, "error": str(error)}
        voxel = float(abs(np.linalg.det(np.asarray(affine)[:3, :3])))
        volume = float((labels == self.module.tumor_label).sum()) * voxel
        return {
            "case_id": case_id,
            "mask": labels,
            "tumor_volume_mm3": volume,
            "tumor_detected": volume > threshold,
            "error": None,
        }

    def _predict_volume(self, volume, affine):
        """An in-memory volume goes through a temporary NIfTI so it takes exactly ``predict_scan``'s path."""
        import nibabel as nib
        import numpy as np

        from lightning_modules.data.volume_checks import geometry_problem
        from lightning_modules.inference import predict_scan

        if volume.ndim != 3:
            raise ValueError(f"ct must be a 3-D volume, got shape {volume.shape}")
        affine = np.eye(4) if affine is None else np.asarray([np.asarray(r, dtype=float) for r in affine])
        problem = geometry_problem(affine)
        if problem:
            raise ValueError(f"ct: {problem}; no prediction is made")
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "ct.nii.gz"
            nib.save(nib.Nifti1Image(volume, affine), str(path))
            try:
                return predict_scan(self.module, self.recipe.data, path)
            except ValueError as error:
                raise ValueError(str(error).replace(str(path), "ct")) from error


# The columns MLflow's schema enforcement dropped before the last call of this thread: it drops the
# columns the signature does not declare (logging them) and calls predict with the rest.
_DROPPED = threading.local()
ENFORCEMENT_LOGGER = "mlflow.models.utils"


class _DroppedColumns(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text.startswith("Found extra inputs"):
            match = re.search(r"`(\[.*\])`", text)
            try:
                _DROPPED.columns = [str(c) for c in ast.literal_eval(match.group(1))] if match else None
            except (ValueError, SyntaxError):
                _DROPPED.columns = None
        return True


def _remember_dropped_columns() -> None:
    logger = logging.getLogger(ENFORCEMENT_LOGGER)
    if not any(isinstance(f, _DroppedColumns) for f in logger.filters):
        logger.addFilter(_DroppedColumns())


def _threshold(value, source: str) -> float:
    import math

    try:
        threshold = float(value)
    except (TypeError, ValueError):
        threshold = float("nan")
    if not math.isfinite(threshold):
        raise ValueError(f"{source} {THRESHOLD_KEY} must be a finite number of mm^3, got {value!r}")
    return threshold


def recorded_operating_point(model_dir: Path) -> tuple[float, str] | None:
    """The operating point recorded on the registered version of a downloaded model (its ``MLmodel``
    names the run and logged model), or None: not registered, none recorded, or no store reachable."""
    from mlflow.models import Model
    from mlflow.tracking import MlflowClient

    uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
        return None  # no store here (opening it would create an empty ./mlflow.db)
    try:
        info = Model.load(str(model_dir))
        versions = MlflowClient(tracking_uri=uri).search_model_versions(f"run_id = '{info.run_id}'")
    except Exception as error:  # no store, another store, a model logged outside a run: the recipe's point
        warnings.warn(f"the registered model's operating point could not be looked up ({error}); "
                      "the recipe's detection.threshold_mm3 is used", stacklevel=2)
        return None
    model_id = getattr(info, "model_id", None)
    mine = [v for v in versions if model_id is None or getattr(v, "model_id", None) in (None, model_id)]
    for version in sorted(mine, key=lambda v: int(v.version), reverse=True):
        point = version_operating_point(version)
        if point is not None:
            return point
    return None


def _case_id(path: str) -> str:
    path = Path(path)
    if path.name in ("ct.nii.gz",):
        return path.parent.name
    return path.name[: -len(".nii.gz")] if path.name.endswith(".nii.gz") else path.stem


def log_segmentation_model(run_id: str, uri: str, recipe, checkpoint: str | Path, recipe_yaml: str) -> str | None:
    """Log the trained model of ``run_id`` as a pyfunc and register it as ``benchx-<backbone>``.

    Returns the registered version (as a string); the version is tagged with the run's ``variant``.
    """
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as folder:
        recipe_path = Path(folder) / "recipe.yaml"
        recipe_path.write_text(recipe_yaml)
        with logging_into(run_id, uri), warnings.catch_warnings():
            # No input example: it would be a whole CT volume stored with every model version.
            warnings.filterwarnings("ignore", message=".*input example was not provided", category=UserWarning)
            info = mlflow.pyfunc.log_model(
                name=MODEL_NAME,
                python_model=str(Path(__file__).with_name("pyfunc_code.py")),
                artifacts={CHECKPOINT_ARTIFACT: str(checkpoint), RECIPE_ARTIFACT: str(recipe_path)},
                code_paths=[package_dir("lightning_modules")],
                signature=signature(),
                # A key MLflow lets `load_model(..., model_config=...)` override; None: the recorded point.
                model_config={THRESHOLD_KEY: None},
                pip_requirements=pip_requirements(),
                registered_model_name=registered_name(str(recipe.model.backbone)),
                await_registration_for=60,
            )
    version = getattr(info, "registered_model_version", None)
    if version is not None:
        client = MlflowClient(tracking_uri=uri)
        run = client.get_run(run_id)
        for key in ("variant", "recipe", "synthx_ratio", "split_sha256"):
            if key in run.data.tags:
                client.set_model_version_tag(registered_name(str(recipe.model.backbone)), str(version), key, run.data.tags[key])
    return None if version is None else str(version)


class logging_into:
    """``mlflow.start_run(run_id)`` on the given store, restoring the fluent state afterwards.

    The run's status is left as it was (a finished training run stays finished, a running one running).
    """

    def __init__(self, run_id: str, uri: str):
        self.run_id, self.uri = run_id, uri

    def __enter__(self):
        from mlflow.tracking import MlflowClient

        self.previous_uri = mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(self.uri)
        self.status = MlflowClient(tracking_uri=self.uri).get_run(self.run_id).info.status
        active = mlflow.active_run()
        self.reused = active is not None and active.info.run_id == self.run_id
        if not self.reused:
            mlflow.start_run(run_id=self.run_id, nested=active is not None)
        return self

    def __exit__(self, *exc):
        if not self.reused:
            mlflow.end_run(status=self.status)
        mlflow.set_tracking_uri(self.previous_uri)
        return False


def set_aliases(training_run_id: str, uri: str, aliases: list[str], prefix: str = REGISTERED_PREFIX) -> str | None:
    """Point ``aliases`` at the registered version of a training run (the newest of the models whose
    name starts with ``prefix``); returns ``name/version``, or None when the run registered none."""
    from mlflow.tracking import MlflowClient

    versions = [v for v in model_versions_of_run(training_run_id, uri) if v.name.startswith(prefix)]
    if not versions:
        return None
    latest = max(versions, key=lambda v: int(v.version))
    client = MlflowClient(tracking_uri=uri)
    for alias in aliases:
        client.set_registered_model_alias(latest.name, alias_name(alias), latest.version)
    return f"{latest.name}/{latest.version}"


def alias_name(text: str) -> str:
    """An alias MLflow accepts (letters, digits, '_' and '-'; not 'latest' or 'v<number>')."""
    alias = "".join(c if c.isalnum() or c in "-_" else "-" for c in text).strip("-") or "study"
    return f"{alias}-model" if alias == "latest" or (alias[0] == "v" and alias[1:].isdigit()) else alias


def model_version_tags(source: str | None, uri: str) -> dict[str, str]:
    """Tags naming the registered model version an evaluation used (``models:/`` URI or training run)."""
    from mlflow.tracking import MlflowClient

    if not source:
        return {}
    client = MlflowClient(tracking_uri=uri)
    if is_model_uri(source):
        path = source[len("models:/") :]
        if "@" in path:
            name, _, alias = path.partition("@")
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, _, number = path.partition("/")
            version = client.get_model_version(name, number)
        return {"model_uri": source, "registered_model": version.name, "model_version": str(version.version),
                "training_run_id": str(version.run_id)}
    versions = model_versions_of_run(source, uri)
    if not versions:
        return {}
    latest = max(versions, key=lambda v: int(v.version))
    return {"model_uri": f"models:/{latest.name}/{latest.version}", "registered_model": latest.name,
            "model_version": str(latest.version)}
