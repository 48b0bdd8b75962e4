"""``SubgroupEvaluation``: the thin Lightning adapter that turns per-case records into subgroup
detection metrics in the trainer's run (metrics through the trainer's logger; tables, figures and
tags through the recorder the workflow hands in).

At the end of validation and test it takes the module's per-case records (one per case, gathered
from every process and de-duplicated by case id: DistributedSampler pads with repeated cases) and
hands them to the pure metrics (``detection``, ``bootstrap``); it logs

- metrics under ``<stage>/<metric>/<attribute>/<group>`` (``metric_keys``), the overall values, and
  per attribute the worst group and the gap;
- on test (and on validation when ``tables_on_val``), with a recorder: the per-case table, the
  subgroup table with bootstrap CIs and the figure (``artifacts``).

The detection threshold m is the recipe's (``detection.threshold_mm3``) or, with
``detection.threshold_rule`` = ``f1`` / ``youden``, chosen on the validation records and then
applied unchanged to test (``thresholds.choose_operating_point``). When validation gives nothing to
choose from, the fixed m is used: a warning is logged and (with a recorder) the run gets the tag
``threshold_fallback`` with the reason; training goes on.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import lightning.pytorch as pl
import pandas as pd
from lightning.pytorch.callbacks import Callback

from lightning_modules.config.recipe import DetectionConfig
from lightning_modules.evaluation.artifacts import log_evaluation_artifacts
from lightning_modules.evaluation.subgroup_intervals import bootstrap_subgroup_metrics
from lightning_modules.evaluation.detection import subgroup_metrics
from lightning_modules.evaluation.metric_keys import headline_metric_keys, mlflow_metric_keys
from lightning_modules.evaluation.records import fixed_rule_score
from lightning_modules.evaluation.thresholds import OperatingPoint, choose_operating_point
from lightning_modules.infrastructure.recording import RunRecorder

log = logging.getLogger(__name__)
FALLBACK_TAG = "threshold_fallback"
HEADLINE_METRICS = ("f1", "sensitivity", "specificity")


class SubgroupEvaluation(Callback):
    """Subgroup detection metrics at validation and test end, logged to the trainer's MLflow run.

    Args:
        threshold_mm3: the fixed detection threshold m (mm^3), or the score threshold for ``max_prob``.
        threshold_rule: ``fixed``, ``f1`` or ``youden`` (chosen on validation, applied to test).
        threshold_bootstrap: patient resamples a chosen threshold is averaged over (0: chosen once).
        score: ``volume`` (predicted tumor volume) or ``max_prob``.
        n_resamples: bootstrap resamples for the test CIs (docs/explanation/detection-and-statistics.md "Confidence intervals and comparisons").
        confidence: CI level.
        val_resamples: resamples on validation (0: point estimates only, keeps training fast).
        tables_on_val: also log tables and the figure at every validation.
        headline_only: log the overall headline keys only (``metric_keys.headline_metric_keys``):
            an evaluation run logs its per-group keys at the validation-chosen point itself.
        recorder: where tables, figures and the fallback tag go: given the trainer, the recorder
            of its run (:class:`~lightning_modules.infrastructure.recording.RunRecorder`; e.g.
            :func:`lightning_modules.tracking.recorder.logger_recorder`), or None off the logging
            rank; without it only metrics are logged, through the trainer's logger.
    """

    def __init__(
        self,
        threshold_mm3: float = 50.0,
        threshold_rule: str = "fixed",
        threshold_bootstrap: int = 0,
        score: str = "volume",
        n_resamples: int = 2000,
        confidence: float = 0.95,
        val_resamples: int = 0,
        tables_on_val: bool = False,
        headline_only: bool = False,
        recorder: Callable[[pl.Trainer], RunRecorder | None] | None = None,
    ):
        self.fixed_threshold = float(threshold_mm3)
        self.threshold = float(threshold_mm3)
        self.threshold_rule = threshold_rule
        self.threshold_bootstrap = int(threshold_bootstrap)
        self.score = score
        self.n_resamples = int(n_resamples)
        self.confidence = float(confidence)
        self.val_resamples = int(val_resamples)
        self.tables_on_val = tables_on_val
        self.headline_only = headline_only
        self.recorder = recorder
        self.operating_point = OperatingPoint("fixed", self.threshold, "fixed")
        self.results: dict[str, pd.DataFrame] = {}
        self.records: dict[str, pd.DataFrame] = {}

    @classmethod
    def from_detection(cls, detection: DetectionConfig, **kwargs) -> "SubgroupEvaluation":
        """The evaluation of the recipe's ``detection`` section (operating point, score, intervals)."""
        return cls(
            threshold_mm3=float(detection.threshold_mm3),
            threshold_rule=str(detection.threshold_rule),
            threshold_bootstrap=int(detection.threshold_bootstrap),
            score=str(detection.score),
            n_resamples=int(detection.bootstrap_resamples),
            confidence=float(detection.confidence),
            **kwargs,
        )

    def state_dict(self) -> dict:
        return {"threshold": self.threshold}

    def load_state_dict(self, state_dict: dict) -> None:
        self.threshold = float(state_dict.get("threshold", self.threshold))

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        records = pl_module.collect_records("val")
        if not len(records):
            return
        if self.threshold_rule != "fixed":
            self.operating_point = choose_operating_point(
                records, self.threshold_rule, self.fixed_threshold, self.score,
                self.threshold_bootstrap, self.confidence,
            )
            self.threshold = self.operating_point.threshold
            if self.operating_point.fallback:
                self._report_fallback(trainer)
        self._evaluate(trainer, pl_module, "val", records, self.val_resamples, self.tables_on_val)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module) -> None:
        records = pl_module.collect_records("test")
        if len(records):
            self._evaluate(trainer, pl_module, "test", records, self.n_resamples, True)

    def _report_fallback(self, trainer: pl.Trainer) -> None:
        message = f"threshold rule {self.threshold_rule}: {self.operating_point.fallback}; using the fixed m = {self.fixed_threshold:g}"
        log.warning(message)
        recorder = self.recorder(trainer) if self.recorder else None
        if recorder is not None:
            recorder.set_tags({FALLBACK_TAG: message[:5000]})

    def _evaluate(self, trainer, pl_module, stage: str, records: pd.DataFrame, resamples: int, tables: bool) -> None:
        # BenchX's fixed m counts the raw predicted tumor voxels (docs/explanation/detection-and-statistics.md "Scan-level detection").
        score = fixed_rule_score(self.score, records) if self.threshold_rule == "fixed" else self.score
        if resamples > 0:
            table = bootstrap_subgroup_metrics(
                records, self.threshold, n_resamples=resamples, confidence=self.confidence, score=score
            )
        else:
            table = subgroup_metrics(records, self.threshold, score=score)
        self.results[stage], self.records[stage] = table, records
        metrics = (headline_metric_keys(table, stage, groups=False) if self.headline_only
                   else mlflow_metric_keys(table, stage, ci=resamples > 0))
        metrics[f"{stage}/threshold"] = self.threshold
        # The headline values go through Lightning, so checkpointing and pruning callbacks see them.
        for key in (f"{stage}/{metric}/overall" for metric in HEADLINE_METRICS):
            if key in metrics:
                pl_module.log(key, metrics[key], rank_zero_only=True)
        if not trainer.is_global_zero or trainer.logger is None:
            return
        trainer.logger.log_metrics({k: v for k, v in metrics.items() if not math.isnan(v)}, step=trainer.global_step)
        recorder = self.recorder(trainer) if tables and self.recorder else None
        if recorder is not None:
            log_evaluation_artifacts(recorder, stage, records, table)
