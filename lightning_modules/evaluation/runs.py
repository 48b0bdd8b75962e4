"""``benchx evaluate`` and ``benchx compare``: subgroup evaluation runs and BenchX table-6 comparisons.

``evaluate`` takes a trained model (an MLflow training run id, or a checkpoint + recipe), a cohort
and a split (including an external cohort never trained on), and writes a new MLflow run linked
to the training run (tag ``training_run_id``) with the subgroup metrics, the per-case records, the
subgroup table with CIs and the figure. The detection threshold is chosen on the split's validation
cases when the recipe says so, then applied unchanged to its test cases.

``compare`` takes two or more evaluation runs on the same evaluation set (same case-id hash) and
writes the table of BenchX table 6: for each subgroup, baseline, augmented, the difference with its
paired bootstrap CI (the same resamples for both runs) and whether it is significant.

Example::

    benchx evaluate --run-id <training run> --stages val,test
    benchx evaluate --run-id <training run> data.root=data/external data.split=splits/external.csv
    benchx compare <baseline evaluation run> <augmented evaluation run>
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import lightning.pytorch as pl
import pandas as pd
from lightning.pytorch.loggers import MLFlowLogger
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from lightning_modules.evaluation.bootstrap import evaluation_set_hash, paired_difference
from lightning_modules.data.datamodule import CohortDataModule
from lightning_modules.evaluation.callback import RECORDS_ARTIFACT, SubgroupEvaluation, subgroup_figure
from lightning_modules.config.recipe import load_recipe
from lightning_modules.models.pyfunc import model_version_tags
from lightning_modules.tracking import experiment_id, log_evaluation_inputs, run_tags, tracking_uri
from lightning_modules.models.checkpoints import load_module_from_checkpoint


class EvaluationError(ValueError):
    """An evaluation or comparison that cannot be done as asked."""



def evaluate(
    recipe: DictConfig,
    checkpoint: str | Path,
    stages: Sequence[str] = ("val", "test"),
    training_run_id: str | None = None,
    run_name: str | None = None,
    extra_tags: dict[str, str] | None = None,
) -> tuple[str, dict[str, pd.DataFrame]]:
    """Evaluate a checkpoint on the recipe's cohort + split into a new MLflow run.

    Returns the evaluation run id and the subgroup table per stage.
    """
    from lightning_modules.data.splits import split_sha256

    uri = tracking_uri(recipe.tracking.uri)
    experiment_id(str(recipe.tracking.experiment), uri)
    module = load_module_from_checkpoint(recipe, checkpoint)
    tags = run_tags(recipe, split_sha256(recipe.data.split))
    tags.update({"stage": "evaluation", "eval_cohort": str(recipe.data.root), "checkpoint": Path(checkpoint).name})
    if training_run_id:
        tags["training_run_id"] = training_run_id
    tags.update(extra_tags or {})
    tags.update(model_version_tags(training_run_id, uri))
    logger = MLFlowLogger(
        experiment_name=str(recipe.tracking.experiment),
        tracking_uri=uri,
        run_name=run_name or f"evaluate-{recipe.name}",
        tags=tags,
    )
    callback = SubgroupEvaluation.from_recipe(recipe, tables_on_val=True)
    trainer = pl.Trainer(
        accelerator=recipe.trainer.accelerator,
        devices=1,
        logger=logger,
        callbacks=[callback],
        enable_model_summary=False,
        enable_progress_bar=sys.stderr.isatty(),
        enable_checkpointing=False,
    )
    datamodule = CohortDataModule(recipe)
    stages = list(stages)
    if "val" in stages or recipe.detection.threshold_rule != "fixed":
        trainer.validate(module, datamodule=datamodule)
    if "test" in stages:
        trainer.test(module, datamodule=datamodule)
    log_evaluation_inputs(logger.experiment, logger.run_id, datamodule, stages)
    logger.experiment.set_terminated(logger.run_id, "FINISHED")
    return logger.run_id, dict(callback.results)


def compare(
    run_ids: Sequence[str],
    stage: str = "test",
    uri: str | None = None,
    experiment: str | None = None,
    n_resamples: int = 2000,
    confidence: float = 0.95,
) -> tuple[pd.DataFrame, str | None]:
    """Paired comparison of evaluation runs against the first (the baseline), BenchX table 6 shape.

    Returns the comparison table and the MLflow run id it was logged to (None without an experiment).
    """
    if len(run_ids) < 2:
        raise EvaluationError("compare needs at least two evaluation runs (baseline first)")
    uri = tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    records, thresholds, names = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for run_id in run_ids:
            run = client.get_run(run_id)
            try:
                path = client.download_artifacts(run_id, RECORDS_ARTIFACT.format(stage=stage), folder + f"/{run_id}")
            except Exception as error:
                raise EvaluationError(f"run {run_id} has no {stage} records: evaluate it first ({error})") from error
            records.append(pd.read_csv(path, keep_default_na=False, na_values=[""]))
            threshold = run.data.metrics.get(f"{stage}/threshold")
            if threshold is None:
                raise EvaluationError(f"run {run_id} has no {stage}/threshold metric")
            thresholds.append(float(threshold))
            names.append(run.data.tags.get("variant") or run.info.run_name or run_id[:8])
    hashes = [evaluation_set_hash(r["case_id"]) for r in records]
    if len(set(hashes)) != 1:
        listing = ", ".join(f"{run_id}: {h[:12]} ({len(r)} cases)" for run_id, h, r in zip(run_ids, hashes, records))
        raise EvaluationError(f"runs were evaluated on different sets (case-id sha256 differs): {listing}")
    tables = []
    for run_id, name, frame, threshold in zip(run_ids[1:], names[1:], records[1:], thresholds[1:]):
        table = paired_difference(
            records[0], frame, thresholds[0], threshold, n_resamples=n_resamples, confidence=confidence
        )
        table.insert(0, "run", name)
        table.insert(1, "run_id", run_id)
        tables.append(table)
    comparison = pd.concat(tables, ignore_index=True)
    comparison.attrs["baseline"] = names[0]
    logged_run = None
    if experiment:
        # The client, not mlflow.start_run: under `mlflow run`, start_run would resume the run in
        # MLFLOW_RUN_ID (the caller's) instead of creating the comparison's own run.
        run_id = client.create_run(
            experiment_id(experiment, uri),
            run_name="compare",
            tags={"stage": "compare", "compared_runs": ",".join(run_ids), f"{stage}_set_sha256": hashes[0]},
        ).info.run_id
        client.log_table(run_id, data=comparison, artifact_file=f"comparison/{stage}_comparison.json")
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / f"{stage}_comparison.csv"
            comparison.to_csv(path, index=False)
            client.log_artifact(run_id, str(path), "comparison")
            (Path(folder) / f"{stage}_comparison.txt").write_text(format_comparison(comparison))
            client.log_artifact(run_id, str(Path(folder) / f"{stage}_comparison.txt"), "comparison")
        figure = comparison_figure(comparison)
        client.log_figure(run_id, figure, f"comparison/{stage}_comparison.png")
        import matplotlib.pyplot as plt

        plt.close(figure)
        client.set_terminated(run_id, "FINISHED")
        logged_run = run_id
    return comparison, logged_run


def format_comparison(comparison: pd.DataFrame, metrics: Sequence[str] = ("sensitivity", "specificity", "f1")) -> str:
    """The comparison as a terminal table (BenchX table 6 shape): one line per subgroup, per metric
    baseline, other, difference with its paired 95% CI, and '*' when significant."""
    lines = []
    for run, table in comparison.groupby("run", sort=False):
        lines.append(f"== {comparison.attrs.get('baseline', 'baseline')} (base) vs {run} (new), in % ==")
        lines.append(f"{'subgroup':<26}{'n':>6}" + "".join(f"  {metric:<34}" for metric in metrics))
        lines.append(f"{'':<32}" + "".join(f"  {'base':>6}{'new':>6} {'delta [95% CI]':<21}" for _ in metrics))
        wide = table.pivot_table(
            index=["attribute", "group"], columns="metric", values=["a", "b", "delta", "ci_low", "ci_high", "significant", "n"],
            aggfunc="first", sort=False,
        )
        for (attribute, group), row in wide.iterrows():
            n = row[("n", metrics[0])]
            cells = [f"{(str(attribute) + ':' + str(group))[:25]:<26}{int(n):>6}"]
            for metric in metrics:
                star = "*" if bool(row[("significant", metric)]) else " "
                interval = f"{_fmt(row[('delta', metric)], True)} [{_fmt(row[('ci_low', metric)], True)}, {_fmt(row[('ci_high', metric)], True)}]{star}"
                cells.append(f"  {_fmt(row[('a', metric)]):>6}{_fmt(row[('b', metric)]):>6} {interval:<21}")
            lines.append("".join(cells))
    lines.append("* significant: the paired 95% bootstrap CI of the difference excludes 0;  - undefined (no positives or negatives)")
    return "\n".join(lines)


def _fmt(value, sign: bool = False) -> str:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return "-"
    if math.isnan(value):
        return "-"
    return f"{value * 100:+.1f}" if sign else f"{value * 100:.1f}"


def comparison_figure(comparison: pd.DataFrame, metric: str = "f1"):
    """Per-subgroup difference (other minus baseline) of one metric with its paired CI."""
    rows = comparison[comparison["metric"] == metric]
    table = pd.DataFrame(
        {
            "attribute": rows["attribute"],
            "group": rows["group"].astype(str) + " [" + rows["run"].astype(str) + "]",
            "n": rows["n"],
            metric: rows["delta"],
            f"{metric}_ci_low": rows["ci_low"],
            f"{metric}_ci_high": rows["ci_high"],
        }
    )
    figure = subgroup_figure(table, metrics=(metric,))
    axis = figure.axes[0]
    axis.set_xlim(-1.02, 1.02)
    axis.axvline(0.0, color="black", linewidth=1)
    axis.set_xlabel(f"{metric}: augmented minus baseline (paired 95% CI)")
    return figure


def _stages(text: str) -> list[str]:
    stages = [part for part in text.replace(" ", ",").split(",") if part]
    if not stages or any(stage not in ("val", "test") for stage in stages):
        raise argparse.ArgumentTypeError(f"stages must be val and/or test, comma-separated; got {text!r}")
    return stages


def evaluate_main(argv: Sequence[str] | None = None) -> int:
    from lightning_modules.commands.common import add_model_source_arguments, add_overrides_argument, split_overrides
    from lightning_modules.models.checkpoints import resolve_model_source

    parser = argparse.ArgumentParser(prog="benchx evaluate", description=__doc__.split("\n\n")[1])
    add_model_source_arguments(parser)
    parser.add_argument("--stages", default="val,test", type=_stages,
                        help="comma-separated, from val and test (one value, so key=value overrides may follow)")
    add_overrides_argument(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    # Expected errors go to the dispatcher (lightning_modules.cli): a short message, exit 2.
    with tempfile.TemporaryDirectory() as folder:
        recipe, checkpoint = resolve_model_source(
            Path(folder), args.run_id, args.checkpoint, args.recipe, split_overrides(args.overrides)
        )
        run_id, results = evaluate(recipe, checkpoint, args.stages, training_run_id=args.run_id)
    print(f"evaluation run {run_id}")
    for stage, table in results.items():
        overall = table[table["attribute"] == "overall"].iloc[0]
        print(
            f"  {stage}: n={int(overall['n'])} sensitivity={_fmt(overall['sensitivity'])} "
            f"specificity={_fmt(overall['specificity'])} f1={_fmt(overall['f1'])} auc={_fmt(overall['auc'])}"
        )
    return 0


def compare_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchx compare", description=__doc__.split("\n\n")[2])
    parser.add_argument("run_ids", nargs="+", help="evaluation runs; the first is the baseline")
    parser.add_argument("--stage", default="test", choices=["val", "test"])
    parser.add_argument("--experiment", default="benchx", help="experiment to log the comparison run in ('' to skip)")
    parser.add_argument("--resamples", type=int, default=2000)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    table, run_id = compare(args.run_ids, args.stage, experiment=args.experiment or None, n_resamples=args.resamples)
    print(format_comparison(table))
    if run_id:
        print(f"comparison logged to run {run_id}")
    return 0
