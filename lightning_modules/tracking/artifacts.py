"""Where a trained segmentation model comes from: an MLflow training run (its resolved
``recipe.yaml`` and best, else last, checkpoint artifacts), a registered model, or a checkpoint
file plus the recipe it was trained with. Every command that loads a model (evaluate, predict, the
study) resolves it here, so the rules are the same everywhere.

Example::

    recipe, checkpoint = resolve_model_source(run_id="3f2a...", folder=tmp)
    module = load_module_from_checkpoint(recipe, checkpoint)
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import mlflow
from mlflow.models import Model
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from lightning_modules.recipe import load_recipe
from lightning_modules.models.checkpoints import CHECKPOINT_ARTIFACT, RECIPE_ARTIFACT, ModelSourceError
from lightning_modules.tracking import tracking_uri as resolve_uri


def training_run_artifacts(run_id: str, uri: str, folder: Path) -> tuple[Path, Path]:
    """Download a training run's resolved recipe and its best (else last) checkpoint into ``folder``."""
    client = MlflowClient(tracking_uri=uri)
    try:
        recipe_path = Path(client.download_artifacts(run_id, "recipe.yaml", str(folder)))
    except Exception as error:  # MLflow raises several types for a missing artifact
        raise ModelSourceError(f"run {run_id} has no recipe.yaml artifact: is it a training run? ({error})") from error
    names = {Path(item.path).name for item in client.list_artifacts(run_id, "checkpoints")}
    for name in ("best.ckpt", "last.ckpt"):
        if name in names:
            return recipe_path, Path(client.download_artifacts(run_id, f"checkpoints/{name}", str(folder)))
    raise ModelSourceError(f"run {run_id} has no checkpoints/best.ckpt or last.ckpt artifact")


def registered_model_artifacts(model_uri: str, uri: str, folder: Path) -> tuple[Path, Path]:
    """Download a registered model (``models:/benchx-unet@benchx-study-baseline``); its recipe and checkpoint artifacts."""
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(folder), tracking_uri=uri))
    except mlflow.exceptions.MlflowException as error:
        raise ModelSourceError(f"{model_uri}: no such registered model in {uri} ({str(error).splitlines()[0]})") from error
    artifacts = Model.load(str(local)).flavors.get("python_function", {}).get("artifacts", {})
    if CHECKPOINT_ARTIFACT not in artifacts or RECIPE_ARTIFACT not in artifacts:
        raise ModelSourceError(f"{model_uri} is not a benchx segmentation model (no checkpoint and recipe artifacts)")
    return local / artifacts[RECIPE_ARTIFACT]["path"], local / artifacts[CHECKPOINT_ARTIFACT]["path"]


def existing_store(uri: str, source: str) -> str:
    """The tracking URI, refused when it is a SQLite file that does not exist: opening it would create an
    empty store (a stray ``./mlflow.db``) and then report the model as missing."""
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///") :])
        if not path.is_file():
            raise ModelSourceError(
                f"{source} needs the tracking store that holds it, and {uri} does not exist ({path.resolve()}): "
                "set MLFLOW_TRACKING_URI to that store, e.g. sqlite:////path/to/mlflow.db or http://host:5000"
            )
    return uri


def resolve_model_source(
    folder: Path,
    run_id: str | None = None,
    checkpoint: str | Path | None = None,
    recipe: str | Path | None = None,
    overrides: Sequence[str] = (),
    tracking_uri: str | None = None,
) -> tuple[DictConfig, Path]:
    """The recipe and checkpoint of a model named by a training run or by a checkpoint file.

    Args:
        folder: where a run's artifacts are downloaded (the caller keeps it alive while it loads).
        run_id: an MLflow training run, or a registered model URI (``models:/benchx-unet@benchx-study-baseline``);
            its resolved recipe is used unless ``recipe`` replaces it.
        checkpoint: a checkpoint file (then ``recipe`` is required).
        recipe: the recipe YAML for ``checkpoint``, or one that replaces the run's recipe.
        overrides: ``key=value`` recipe overrides, applied last.
        tracking_uri: the MLflow store of ``run_id`` (default: the environment's).
    """
    if (run_id is None) == (checkpoint is None):
        raise ModelSourceError("name exactly one model source: --run-id RUN or --checkpoint FILE --recipe YAML")
    if run_id is not None and str(run_id).startswith("models:/"):
        uri = existing_store(resolve_uri(tracking_uri), run_id)
        recipe_path, checkpoint_path = registered_model_artifacts(run_id, uri, Path(folder))
    elif run_id is not None:
        uri = existing_store(resolve_uri(tracking_uri), f"run {run_id}")
        recipe_path, checkpoint_path = training_run_artifacts(run_id, uri, Path(folder))
    if run_id is not None:
        if recipe is not None:
            return load_recipe(recipe, list(overrides)), checkpoint_path
        return load_recipe(recipe_path, list(overrides), resolved=True), checkpoint_path
    if recipe is None:
        raise ModelSourceError("--checkpoint needs --recipe (the recipe the checkpoint was trained with)")
    if not Path(checkpoint).is_file():
        raise ModelSourceError(f"checkpoint {checkpoint}: no such file")
    return load_recipe(recipe, list(overrides)), Path(checkpoint)
