"""The training data as MLflow sees it: dataset inputs, exposures, and the synthetic cohort a
generator run wrote (the tracking side of :mod:`lightning_modules.data.mixing`).

- :func:`resolve_synthetic_cohort`: ``synthx.cohort``, or the folder tagged on ``synthx.generator_run``;
- :func:`log_dataset_inputs`: the real training split and the synthetic cohort as dataset inputs of
  the training run (lineage back to the generator run through ``generator_run_id``), and the cases
  the generator learned from (``generator_training_cases.csv``, which evaluation checks);
- :func:`log_exposures`: an exposure-matched training's per-case draws and their totals.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
import pandas as pd
from mlflow.entities import DatasetInput, InputTag
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from lightning_modules.data.cohort import CohortError
from lightning_modules.data.datamodule import CohortDataModule
from lightning_modules.data.exposure import EXPOSURE_ARTIFACT
from lightning_modules.data.mixing import MatchedTrainingSet
from lightning_modules.data.synthetic_provenance import generator_training_cases
from lightning_modules.tracking import log_inputs, tracking_client, tracking_uri
from lightning_modules.tracking.provenance import log_generator_training_cases

SYNTHETIC_COHORT_TAG = "synthetic_cohort"


def resolve_synthetic_cohort(recipe: DictConfig) -> Path | None:
    """The synthetic cohort folder from ``synthx.cohort`` or from a generator run's ``synthetic_cohort`` tag."""
    if recipe.synthx.cohort:
        return Path(recipe.synthx.cohort)
    if recipe.synthx.generator_run:
        run = tracking_client(tracking_uri(recipe.tracking.uri)).get_run(str(recipe.synthx.generator_run))
        path = run.data.tags.get(SYNTHETIC_COHORT_TAG) or run.data.params.get("out")
        if not path:
            raise CohortError([f"MLflow run {recipe.synthx.generator_run} has no '{SYNTHETIC_COHORT_TAG}' tag"])
        return Path(path)
    return None


def log_exposures(client: MlflowClient, run_id: str, datamodule: CohortDataModule, steps: int) -> pd.DataFrame | None:
    """Log an exposure-matched training's per-case draws (artifact) and their totals (metrics).

    Returns the per-case table, or None for a training without an exposure-matched schedule.
    """
    dataset = datamodule.datasets.get("train")
    if not isinstance(dataset, MatchedTrainingSet):
        return None
    table = dataset.exposure_table(steps)
    client.log_text(run_id, table.to_csv(index=False), EXPOSURE_ARTIFACT)
    real_cases = table["synthetic"] == 0
    sham = dataset.sham_match is not None
    totals = {
        "exposure/real_draws": table.loc[real_cases, "real_draws"].sum(),
        "exposure/synthetic_draws": table.loc[~real_cases, "slot_draws"].sum(),
        "exposure/sham_draws": table.loc[real_cases, "slot_draws"].sum(),
        "exposure/steps": steps,
    }
    if sham:
        for match, count in dataset.sham_match.value_counts().items():
            totals[f"exposure/sham_match_{match}"] = count
    for key, value in totals.items():
        client.log_metric(run_id, key, float(value))
    client.set_tag(run_id, "exposure_schedule", "sham" if sham else ("synthetic" if (~real_cases).any() else "real"))
    return table


def log_dataset_inputs(client: MlflowClient, run_id: str, datamodule: CohortDataModule, split_path: str) -> None:
    """Log the real training split and (when mixing) the synthetic cohort as MLflow dataset inputs."""
    datamodule.load()
    inputs = []
    train_ids = datamodule.case_ids("train")
    real = mlflow.data.from_pandas(
        datamodule.cohort.subset(train_ids).astype(str), source=str(Path(datamodule.cohort.root).resolve()), name=f"train:{Path(split_path).name}"
    )
    inputs.append(DatasetInput(real._to_mlflow_entity(), [InputTag("mlflow.data.context", "training")]))
    synthetic = getattr(datamodule, "synthetic_cohort", None)
    if synthetic is not None:
        dataset = mlflow.data.from_pandas(
            synthetic.metadata.astype(str), source=str(Path(synthetic.root).resolve()), name=f"synthetic:{Path(synthetic.root).name}"
        )
        inputs.append(DatasetInput(dataset._to_mlflow_entity(), [InputTag("mlflow.data.context", "training-synthetic")]))
        generators = sorted(set(synthetic.metadata["generator_run_id"]) - {""})
        if generators:
            client.set_tag(run_id, "generator_run_ids", ",".join(generators))
        client.set_tag(run_id, SYNTHETIC_COHORT_TAG, str(synthetic.root))
        log_generator_training_cases(client, run_id, generator_training_cases(synthetic.root, datamodule.cohort.metadata))
    log_inputs(client, run_id, inputs)  # concurrent workers may log the same dataset
