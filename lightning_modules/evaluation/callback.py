"""``SubgroupEvaluation``: a Lightning callback that turns per-case records into BenchX subgroup metrics in MLflow.

At the end of validation and test it takes the module's per-case records (one per case, gathered
from every process and de-duplicated by case id: DistributedSampler pads with repeated cases),
computes scan-level detection metrics overall and per subgroup (DESIGN.md sections 3-5) and logs:

- metrics under ``<stage>/<metric>/<attribute>/<group>`` (e.g. ``test/f1/phase/venous``), the
  overall values, and per attribute the worst group and the gap;
- on test (and on validation when ``tables_on_val``): the per-case table and the subgroup table
  with bootstrap CIs (CSV artifacts and ``mlflow.log_table``), and a figure of per-subgroup
  sensitivity and F1 with CI bars.

The detection threshold m is the recipe's (``detection.threshold_mm3``) or, with
``detection.threshold_rule`` = ``f1`` / ``youden``, chosen on the validation records and then
applied unchanged to test.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import pandas as pd
from lightning.pytorch.callbacks import Callback

from lightning_modules.evaluation.bootstrap import bootstrap_subgroup_metrics, evaluation_set_hash
from lightning_modules.evaluation.detection import choose_threshold, mlflow_metric_keys, subgroup_metrics

RECORDS_ARTIFACT = "evaluation/{stage}_records.csv"
SUBGROUP_ARTIFACT = "evaluation/{stage}_subgroups.csv"
FIGURE_ARTIFACT = "evaluation/{stage}_subgroups.png"


class SubgroupEvaluation(Callback):
    """Subgroup detection metrics at validation and test end, logged to the trainer's MLflow run.

    Args:
        threshold_mm3: the fixed detection threshold m (mm^3), or the score threshold for ``max_prob``.
        threshold_rule: ``fixed``, ``f1`` or ``youden`` (chosen on validation, applied to test).
        score: ``volume`` (predicted tumor volume) or ``max_prob``.
        n_resamples: bootstrap resamples for the test CIs (DESIGN.md section 5).
        confidence: CI level.
        val_resamples: resamples on validation (0: point estimates only, keeps training fast).
        tables_on_val: also log tables and the figure at every validation.
    """

    def __init__(
        self,
        threshold_mm3: float = 50.0,
        threshold_rule: str = "fixed",
        score: str = "volume",
        n_resamples: int = 2000,
        confidence: float = 0.95,
        val_resamples: int = 0,
        tables_on_val: bool = False,
    ):
        self.threshold = float(threshold_mm3)
        self.threshold_rule = threshold_rule
        self.score = score
        self.n_resamples = int(n_resamples)
        self.confidence = float(confidence)
        self.val_resamples = int(val_resamples)
        self.tables_on_val = tables_on_val
        self.results: dict[str, pd.DataFrame] = {}
        self.records: dict[str, pd.DataFrame] = {}

    @classmethod
    def from_recipe(cls, recipe, **kwargs) -> "SubgroupEvaluation":
        detection = recipe.detection
        return cls(
            threshold_mm3=float(detection.threshold_mm3),
            threshold_rule=str(detection.threshold_rule),
            score=str(detection.score),
            n_resamples=int(detection.bootstrap_resamples),
            confidence=float(detection.confidence),
            **kwargs,
        )

    def state_dict(self) -> dict:
        return {"threshold": self.threshold}

    def load_state_dict(self, state_dict: dict) -> None:
        self.threshold = float(state_dict.get("threshold", self.threshold))

    # ------------------------------------------------------------------------------------------

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        records = pl_module.collect_records("val")
        if not len(records):
            return
        if self.threshold_rule != "fixed":
            self.threshold = float(choose_threshold(records, rule=self.threshold_rule, score=self.score))
        self._evaluate(trainer, pl_module, "val", records, self.val_resamples, self.tables_on_val)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module) -> None:
        records = pl_module.collect_records("test")
        if len(records):
            self._evaluate(trainer, pl_module, "test", records, self.n_resamples, True)

    # ------------------------------------------------------------------------------------------

    def _evaluate(self, trainer, pl_module, stage: str, records: pd.DataFrame, resamples: int, tables: bool) -> None:
        if resamples > 0:
            table = bootstrap_subgroup_metrics(
                records, self.threshold, n_resamples=resamples, confidence=self.confidence, score=self.score
            )
        else:
            table = subgroup_metrics(records, self.threshold, score=self.score)
        self.results[stage], self.records[stage] = table, records
        metrics = mlflow_metric_keys(table, stage, ci=resamples > 0)
        metrics[f"{stage}/threshold"] = self.threshold
        # The headline values go through Lightning, so checkpointing and pruning callbacks see them.
        for key in (f"{stage}/f1/overall", f"{stage}/sensitivity/overall", f"{stage}/specificity/overall"):
            if key in metrics:
                pl_module.log(key, metrics[key], rank_zero_only=True)
        if not trainer.is_global_zero or trainer.logger is None:
            return
        trainer.logger.log_metrics({k: v for k, v in metrics.items() if not math.isnan(v)}, step=trainer.global_step)
        run_id = getattr(trainer.logger, "run_id", None)
        if tables and run_id:
            log_evaluation_artifacts(trainer.logger.experiment, run_id, stage, records, table)


def log_evaluation_artifacts(client, run_id: str, stage: str, records: pd.DataFrame, table: pd.DataFrame) -> None:
    """Per-case records, the subgroup table (CSV + MLflow table) and the subgroup figure."""
    client.set_tag(run_id, f"{stage}_set_sha256", evaluation_set_hash(records["case_id"]))
    client.set_tag(run_id, f"{stage}_n_cases", str(len(records)))
    with tempfile.TemporaryDirectory() as folder:
        for template, frame in ((RECORDS_ARTIFACT, records), (SUBGROUP_ARTIFACT, table)):
            path = Path(folder) / Path(template.format(stage=stage)).name
            frame.to_csv(path, index=False)
            client.log_artifact(run_id, str(path), "evaluation")
    client.log_table(run_id, data=table, artifact_file=f"evaluation/{stage}_subgroups.json")
    figure = subgroup_figure(table, title=f"{stage}: sensitivity and F1 by subgroup")
    client.log_figure(run_id, figure, FIGURE_ARTIFACT.format(stage=stage))
    import matplotlib.pyplot as plt

    plt.close(figure)


def subgroup_figure(table: pd.DataFrame, title: str = "", metrics=("sensitivity", "f1")):
    """Per-subgroup point estimates with CI bars (where the table has them), one panel per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table[table["attribute"] != "overall"].reset_index(drop=True)
    labels = [f"{a}: {g} (n={int(n)})" for a, g, n in zip(rows["attribute"], rows["group"], rows["n"])]
    figure, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 0.32 * max(len(rows), 4) + 1.5), sharey=True)
    axes = list(axes) if len(metrics) > 1 else [axes]
    positions = list(range(len(rows)))
    for axis, metric in zip(axes, metrics):
        values = rows[metric].astype(float)
        if f"{metric}_ci_low" in rows:
            low = (values - rows[f"{metric}_ci_low"].astype(float)).clip(lower=0)
            high = (rows[f"{metric}_ci_high"].astype(float) - values).clip(lower=0)
            axis.errorbar(values, positions, xerr=[low.fillna(0), high.fillna(0)], fmt="o", capsize=3)
        else:
            axis.plot(values, positions, "o")
        overall = table.loc[table["attribute"] == "overall", metric]
        if len(overall) and not math.isnan(float(overall.iloc[0])):
            axis.axvline(float(overall.iloc[0]), color="grey", linestyle="--", linewidth=1, label="overall")
            axis.legend(loc="lower left")
        axis.set_xlim(-0.02, 1.02)
        axis.set_xlabel(metric)
        axis.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(positions)
    axes[0].set_yticklabels(labels, fontsize=8)
    axes[0].invert_yaxis()
    figure.suptitle(title)
    figure.tight_layout()
    return figure
