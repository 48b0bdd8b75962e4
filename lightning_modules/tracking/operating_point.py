"""The operating point m a registered segmentation model applies, and where it comes from.

An evaluation records its validation-chosen m on the registered version it evaluated
(:func:`record_operating_point`, version tags ``operating_point_mm3``, ``operating_point_rule``,
``operating_point_run``) when its validation cases are the model's own validation split; the
loaded pyfunc, ``benchx predict`` (:func:`applied_operating_point`) and a version's description
(:func:`operating_point_description`) all read that one value, or the recipe's
``detection.threshold_mm3`` where none is recorded.

Example::

    threshold, source = applied_operating_point("models:/benchx-unet@study-synthx", uri, 50.0)
    text = operating_point_description("benchx-unet", "3", uri)
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd

OPERATING_POINT_TAG = "operating_point_mm3"
OPERATING_POINT_RULE_TAG = "operating_point_rule"
OPERATING_POINT_RUN_TAG = "operating_point_run"


def version_operating_point(version) -> tuple[float, str] | None:
    """The operating point recorded on a registered model version (its ``operating_point_mm3`` tag)."""
    if OPERATING_POINT_TAG not in (version.tags or {}):
        return None
    return float(version.tags[OPERATING_POINT_TAG]), f"registered model {version.name} version {version.version}"


def applied_operating_point(source: str | None, uri: str | None, recipe_threshold: float) -> tuple[float, str]:
    """The m a model named by ``source`` applies, and where it comes from: the point recorded on its
    registered version (a ``models:/`` URI, or a training run that registered one), else the recipe's
    ``detection.threshold_mm3`` (``recipe``), as its pyfunc does when loaded."""
    from mlflow.tracking import MlflowClient

    fallback = float(recipe_threshold), "recipe"
    if not source or not uri:
        return fallback
    client = MlflowClient(tracking_uri=uri)
    try:
        if is_model_uri(source):
            path = source[len("models:/") :]
            if "@" in path:
                name, _, alias = path.partition("@")
                versions = [client.get_model_version_by_alias(name, alias)]
            else:
                name, _, number = path.partition("/")
                versions = [client.get_model_version(name, number)]
        else:
            versions = sorted(model_versions_of_run(source, uri), key=lambda v: int(v.version), reverse=True)
    except Exception as error:  # no registry in this store: the recipe's point, as the pyfunc falls back
        warnings.warn(f"the registered operating point of {source} could not be looked up ({error}); "
                      "the recipe's detection.threshold_mm3 is used", stacklevel=2)
        return fallback
    for version in versions:
        point = version_operating_point(version)
        if point is not None:
            return point
    return fallback


def record_operating_point(evaluation_run_id: str, uri: str) -> dict[str, str] | None:
    """Record an evaluation's validation-chosen operating point on the registered version it evaluated.

    Only an evaluation whose validation cases are the model's own validation split records, without
    the training-overlap override and without a fallback to the fixed point: one on the split the
    model was trained with (same ``split_sha256``), or on another split with the same validation
    cases (:func:`same_validation_cases`; a study's locked-cohort view keeps the development
    validation cases and swaps the test set). Returns the tags set, or None.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(evaluation_run_id)
    tags, metrics = run.data.tags, run.data.metrics
    name, number, training = tags.get("registered_model"), tags.get("model_version"), tags.get("training_run_id")
    threshold = metrics.get("operating_point/val_chosen")
    if not (name and number and training) or threshold is None:
        return None
    if tags.get("training_overlap_override") or tags.get("threshold_fallback.val_chosen"):
        return None
    try:
        training_run = client.get_run(training)
    except Exception:  # the training run is gone from this store: nothing to compare the split with
        return None
    if training_run.data.tags.get("split_sha256") != tags.get("split_sha256") and not same_validation_cases(training_run, tags):
        return None
    point = {
        OPERATING_POINT_TAG: repr(float(threshold)),
        OPERATING_POINT_RULE_TAG: tags.get("operating_point.val_chosen.rule", ""),
        OPERATING_POINT_RUN_TAG: evaluation_run_id,
    }
    for key, value in point.items():
        client.set_model_version_tag(name, str(number), key, value)
    return point


def same_validation_cases(training_run, evaluation_tags: dict) -> bool:
    """Whether an evaluation's validation cases (its ``val_set_sha256``) are the validation cases of
    the split a training run was trained with (its ``data.split``, unchanged since: same sha256)."""
    from lightning_modules.infrastructure.files import file_sha256
    from lightning_modules.evaluation.bootstrap import evaluation_set_hash

    split = training_run.data.params.get("data.split")
    evaluated = evaluation_tags.get("val_set_sha256")
    if not split or not evaluated or not Path(split).is_file():
        return False
    if file_sha256(split) != training_run.data.tags.get("split_sha256"):
        return False  # the split file changed since training: its validation cases are not known
    table = pd.read_csv(split, dtype=str, keep_default_na=False)
    if not {"case_id", "split"} <= set(table.columns):
        return False
    return evaluation_set_hash(table.loc[table["split"] == "val", "case_id"]) == evaluated


def operating_point_description(name: str, version: str | int, uri: str, recipe_threshold: float | None = None) -> str:
    """The operating point a registered version applies, in words, from the value it applies (for its
    description): the recorded ``operating_point_mm3`` with its rule and run, else the recipe's m."""
    from mlflow.tracking import MlflowClient

    model_version = MlflowClient(tracking_uri=uri).get_model_version(name, str(version))
    point = version_operating_point(model_version)
    if point is not None:
        tags = model_version.tags
        rule = tags.get(OPERATING_POINT_RULE_TAG, "")
        run = tags.get(OPERATING_POINT_RUN_TAG, "")
        return (f"m = {point[0]:,.0f} mm³ chosen on validation{f' by {rule}' if rule else ''}"
                f"{f' (evaluation run {run})' if run else ''}, applied by this version")
    fixed = "the recipe's detection.threshold_mm3" if recipe_threshold is None else f"m = {float(recipe_threshold):,.0f} mm³"
    return f"{fixed} (fixed; no validation-chosen point recorded on this version), applied by this version"


def model_versions_of_run(run_id: str, uri: str) -> list:
    """Registered versions whose source is the given training run."""
    from mlflow.tracking import MlflowClient

    return list(MlflowClient(tracking_uri=uri).search_model_versions(f"run_id = '{run_id}'"))


def is_model_uri(source: str | None) -> bool:
    return bool(source) and str(source).startswith("models:/")
