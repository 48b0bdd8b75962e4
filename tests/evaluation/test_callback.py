"""Tests for lightning_modules.evaluation.callback: the SubgroupEvaluation callback in a real Trainer
loop, logging into a real MLflow run: metrics, threshold chosen on validation and applied to test,
artifacts on test, and the fallback to the fixed m (tag + log line) on constant validation scores."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pandas as pd
import torch
from lightning.pytorch.loggers import MLFlowLogger
from mlflow.tracking import MlflowClient
from test_detection_metrics import random_records

from lightning_modules.evaluation.callback import FALLBACK_TAG, SubgroupEvaluation
from lightning_modules.evaluation.thresholds import bagged_threshold, choose_threshold
from lightning_modules.tracking.recorder import logger_recorder


class RecordsModule(pl.LightningModule):
    """A LightningModule whose evaluation epochs yield the given per-case records, as
    SegmentationModule.collect_records does after inference."""

    def __init__(self, records: dict[str, pd.DataFrame]):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.records = records

    def collect_records(self, stage: str) -> pd.DataFrame:
        return self.records[stage]

    def validation_step(self, batch, batch_idx):
        return None

    def test_step(self, batch, batch_idx):
        return None

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(2, 1))

    def test_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(2, 1))


def _run(mlflow_uri, records, callback):
    logger = MLFlowLogger(experiment_name="callback", tracking_uri=mlflow_uri)
    trainer = pl.Trainer(accelerator="cpu", logger=logger, callbacks=[callback], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    module = RecordsModule(records)
    trainer.validate(module)
    trainer.test(module)
    return MlflowClient(mlflow_uri), logger.run_id


def test_threshold_chosen_on_validation_is_applied_to_test_and_logged(mlflow_uri):
    records = {"val": random_records(90, seed=1), "test": random_records(60, seed=2)}
    callback = SubgroupEvaluation(threshold_mm3=50.0, threshold_rule="youden", n_resamples=20, recorder=logger_recorder)
    client, run_id = _run(mlflow_uri, records, callback)
    chosen = choose_threshold(records["val"], "youden")
    run = client.get_run(run_id)
    assert run.data.metrics["val/threshold"] == chosen and run.data.metrics["test/threshold"] == chosen
    assert callback.results["test"].attrs["threshold"] == chosen
    assert "test/f1_ci_low/overall" in run.data.metrics and "test/n_patients/overall" in run.data.metrics
    assert run.data.metrics["test/n/overall"] == 60
    assert FALLBACK_TAG not in run.data.tags
    artifacts = {a.path for a in client.list_artifacts(run_id, "evaluation")}
    assert {"evaluation/test_records.csv", "evaluation/test_subgroups.csv", "evaluation/test_subgroups.png"} <= artifacts


def test_a_bagged_threshold_is_chosen_on_validation_and_applied_to_test(mlflow_uri):
    records = {"val": random_records(90, seed=1), "test": random_records(60, seed=2)}
    callback = SubgroupEvaluation(threshold_mm3=50.0, threshold_rule="youden", threshold_bootstrap=50, n_resamples=20,
                                  recorder=logger_recorder)
    client, run_id = _run(mlflow_uri, records, callback)
    bagged = bagged_threshold(records["val"], "youden", n_resamples=50)
    run = client.get_run(run_id)
    assert run.data.metrics["val/threshold"] == bagged.threshold == run.data.metrics["test/threshold"]
    assert bagged.threshold != choose_threshold(records["val"], "youden")
    assert callback.operating_point.interval == (bagged.low, bagged.high)


def test_constant_validation_scores_fall_back_to_the_fixed_m_without_aborting(mlflow_uri, caplog):
    records = {"val": random_records(90, seed=1).assign(volume_mm3=0.0), "test": random_records(60, seed=2)}
    callback = SubgroupEvaluation(threshold_mm3=50.0, threshold_rule="f1", n_resamples=10, recorder=logger_recorder)
    with caplog.at_level(logging.WARNING, logger="lightning_modules.evaluation.callback"):
        client, run_id = _run(mlflow_uri, records, callback)
    run = client.get_run(run_id)
    assert run.data.metrics["test/threshold"] == 50.0
    assert "all 90 scores equal" in run.data.tags[FALLBACK_TAG]
    assert any("using the fixed m = 50" in message for message in caplog.messages)
    assert callback.operating_point.fallback


class ListRecorder:
    """A recorder that keeps what it is given (the recording interface without MLflow)."""

    def __init__(self):
        self.tags, self.tables, self.figures = {}, {}, []

    def set_tags(self, tags):
        self.tags.update(tags)

    def log_metrics(self, metrics, step=0):
        raise AssertionError("the callback logs metrics through the trainer's logger")

    def log_table(self, table, path, ui=False):
        self.tables[path] = (table, ui)

    def log_text(self, text, path):
        raise AssertionError("not used by the callback")

    def log_dict(self, data, path):
        raise AssertionError("not used by the callback")

    def log_figure(self, figure, path):
        self.figures.append(path)


def test_tables_figures_and_tags_go_to_the_recorder_the_workflow_hands_in(mlflow_uri):
    records = {"val": random_records(90, seed=1).assign(volume_mm3=0.0), "test": random_records(60, seed=2)}
    kept = ListRecorder()
    callback = SubgroupEvaluation(threshold_mm3=50.0, threshold_rule="f1", n_resamples=10, recorder=lambda trainer: kept)
    client, run_id = _run(mlflow_uri, records, callback)
    assert set(kept.tables) == {"evaluation/test_records.csv", "evaluation/test_subgroups.csv"}
    assert kept.tables["evaluation/test_subgroups.csv"][1] and not kept.tables["evaluation/test_records.csv"][1]
    pd.testing.assert_frame_equal(kept.tables["evaluation/test_records.csv"][0], records["test"])
    assert kept.figures == ["evaluation/test_subgroups.png"]
    assert kept.tags["test_n_cases"] == "60" and "all 90 scores equal" in kept.tags[FALLBACK_TAG]
    # Nothing reached the MLflow run but the metrics, which go through the trainer's logger.
    run = client.get_run(run_id)
    assert run.data.metrics["test/n/overall"] == 60
    assert not client.list_artifacts(run_id, "evaluation") and FALLBACK_TAG not in run.data.tags


def test_without_a_recorder_only_metrics_are_logged(mlflow_uri):
    records = {"val": random_records(90, seed=1), "test": random_records(60, seed=2)}
    client, run_id = _run(mlflow_uri, records, SubgroupEvaluation(threshold_mm3=50.0, n_resamples=10))
    assert client.get_run(run_id).data.metrics["test/n/overall"] == 60
    assert not client.list_artifacts(run_id, "evaluation")
