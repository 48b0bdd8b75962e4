"""Evaluation runs and comparisons: the library behind ``benchx evaluate`` and ``benchx compare``.

``evaluate`` takes a trained model (checkpoint + recipe, and its training run when known), a cohort
and a split (including an external cohort never trained on), and writes a new MLflow run linked to
the training run (tag ``training_run_id``) with the subgroup metrics, the per-case records, the
subgroup tables with CIs and the figures, at three operating points
(docs/design.md "Scan-level detection"): the recipe's (``val/...``, ``test/...``), BenchX's fixed m (``test_fixed/...``) and the
one chosen on validation (``test_val_chosen/...``; metrics ``operating_point/<name>`` hold the
thresholds, ``operating_point/val_chosen_low`` and ``_high`` the spread of a bagged choice). It
refuses an evaluation set holding a training case or patient of the model unless
``allow_training_overlap`` is set (then tagged ``training_overlap_override``).

``compare`` takes two or more evaluation runs on the same evaluation set (same case-id hash) and
writes the table of BenchX table 6 at each operating point (fixed m, validation-chosen, matched
specificity): for each subgroup its patients, positives and negatives, baseline, augmented, the
difference with its paired bootstrap CI, the share of resamples where it was defined, and whether
it is significant (CI excludes 0 and the subgroup supports it:
docs/design.md "Confidence intervals and comparisons").

Example::

    run_id, tables = evaluate(recipe, "best.ckpt", ("val", "test"), training_run_id=run)
    table, compare_run = compare([baseline_eval_run, synthx_eval_run], "test", experiment="benchx")
"""

from __future__ import annotations

import logging
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pandas as pd
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from lightning_modules.evaluation.artifacts import download_records, log_evaluation_artifacts
from lightning_modules.evaluation.bootstrap import bootstrap_subgroup_metrics, evaluation_set_hash, paired_differences
from lightning_modules.evaluation.callback import FALLBACK_TAG, SubgroupEvaluation
from lightning_modules.evaluation.figures import close, comparison_figure
from lightning_modules.evaluation.metric_keys import headline_metric_keys
from lightning_modules.evaluation.provenance import training_cases, training_overlap
from lightning_modules.evaluation.subgroups import support_rule_text
from lightning_modules.evaluation.thresholds import (
    OperatingPoint,
    choose_operating_point,
    matched_specificity_point,
    specificity_at,
)
from lightning_modules.trainer import FailWithLaunchedProcesses, RunLogger, build_trainer, global_rank, share_from_rank_zero
from lightning_modules.tracking import (
    check_run_id,
    ended_run,
    experiment_id,
    log_evaluation_inputs,
    log_metrics,
    run_tags,
    start_run,
    tracking_uri,
)

log = logging.getLogger(__name__)
OVERLAP_OVERRIDE_TAG = "training_overlap_override"
OVERLAP_CHECK_TAG = "training_overlap_check"
OPERATING_POINT_METRIC = "operating_point/{name}"


class EvaluationError(ValueError):
    """An evaluation or comparison that cannot be done as asked."""


# ------------------------------------------------------------------------------------------------
# evaluate


def validation_rule(recipe: DictConfig) -> str:
    """The rule of the validation-chosen operating point: the recipe's ``detection.threshold_rule``
    when it is ``f1`` or ``youden``, else Youden's J."""
    rule = str(recipe.detection.threshold_rule)
    return rule if rule in ("f1", "youden") else "youden"


def training_run_of_checkpoint(checkpoint: str | Path) -> str | None:
    """The MLflow run of a checkpoint written by ``benchx train`` (``<run folder>/checkpoints/*.ckpt``),
    from the run folder's record (``run.json``)."""
    from lightning_modules.run_folder import RunRecord

    record = RunRecord.read(Path(checkpoint).resolve().parent.parent)
    return record.run_id if record is not None else None


def check_training_overlap(
    client: MlflowClient, training_run_id: str | None, evaluated: pd.DataFrame, allow: bool
) -> dict[str, str]:
    """Refuse (EvaluationError) an evaluation set sharing a case or patient with the model's training
    cases, unless ``allow``; returns the tags that record what was checked."""
    if training_run_id is None:
        log.warning("evaluate: no training run known for this checkpoint, so its training cases are not checked")
        return {OVERLAP_CHECK_TAG: "unavailable: no training run"}
    try:
        client.get_run(training_run_id)
    except Exception as error:  # MLflow raises its own exception for an unknown run
        raise EvaluationError(f"training run {training_run_id}: not found in the tracking store ({error})") from error
    with tempfile.TemporaryDirectory() as folder:
        training = training_cases(client, training_run_id, folder)
    if training is None:
        log.warning("evaluate: training run %s records no training cases; overlap not checked", training_run_id)
        return {OVERLAP_CHECK_TAG: "unavailable: the training run records no training_cases.csv"}
    problems = training_overlap(evaluated, training)
    if not problems:
        return {OVERLAP_CHECK_TAG: "passed"}
    listing = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
    if not allow:
        raise EvaluationError(
            f"{len(problems)} evaluated case(s) overlap the training cases of run {training_run_id}:\n  {listing}\n"
            "evaluation refused: use a split whose val/test cases the model never saw, or pass "
            "--allow-training-overlap to evaluate anyway (recorded in the run)"
        )
    log.warning("evaluate: %d evaluated case(s) overlap the training cases (override given):\n  %s", len(problems), listing)
    return {OVERLAP_CHECK_TAG: f"failed: {len(problems)} case(s)", OVERLAP_OVERRIDE_TAG: "true"}


def _operating_points(recipe: DictConfig, callback: SubgroupEvaluation) -> list[OperatingPoint]:
    detection = recipe.detection
    fixed = float(detection.threshold_mm3)
    chosen = callback.operating_point
    if chosen.name != "val_chosen":
        # The callback chose on validation only when the recipe's rule is f1 or youden (the same
        # rule, records and bagging as here); otherwise the validation point is chosen by Youden.
        chosen = choose_operating_point(
            callback.records.get("val"), validation_rule(recipe), fixed, str(detection.score),
            int(detection.threshold_bootstrap), float(detection.confidence),
        )
    if chosen.fallback:
        log.warning("evaluate: validation operating point (%s): %s; using the fixed m = %g", chosen.rule, chosen.fallback, fixed)
    elif chosen.interval is not None:
        log.info("evaluate: validation operating point m = %g by %s; the resamples chose %g to %g (%g%% interval)",
                 chosen.threshold, chosen.rule, chosen.interval[0], chosen.interval[1], 100 * float(detection.confidence))
    return [OperatingPoint("fixed", fixed, "fixed"), chosen]


def _log_operating_points(client, run_id: str, recipe: DictConfig, callback, stages, points) -> dict[str, pd.DataFrame]:
    """Tables, metrics and artifacts of every evaluated stage at the fixed and the validation-chosen m."""
    detection = recipe.detection
    tables = {}
    for point in points:
        client.log_metric(run_id, OPERATING_POINT_METRIC.format(name=point.name), point.threshold)
        client.set_tag(run_id, f"operating_point.{point.name}.rule", point.rule)
        if point.interval is not None:
            # How far the choice moves between patient resamples of validation: its uncertainty.
            low_key, high_key = (OPERATING_POINT_METRIC.format(name=f"{point.name}_{end}") for end in ("low", "high"))
            client.log_metric(run_id, low_key, point.interval[0])
            client.log_metric(run_id, high_key, point.interval[1])
        if point.fallback:
            client.set_tag(run_id, f"{FALLBACK_TAG}.{point.name}", f"{point.fallback}; the fixed m is used"[:5000])
        for stage in stages:
            records = callback.records.get(stage)
            if records is None:
                continue
            name = f"{stage}_{point.name}"
            table = bootstrap_subgroup_metrics(records, point.threshold, n_resamples=int(detection.bootstrap_resamples),
                                               confidence=float(detection.confidence), score=str(detection.score))
            # A few hundred keys a person can plot: per group only at the validation-chosen point
            # (its full table, CIs included, is logged as an MLflow table below).
            metrics = headline_metric_keys(table, name, groups=point.name == "val_chosen")
            metrics[f"{name}/threshold"] = point.threshold
            log_metrics(client, run_id, metrics)
            log_evaluation_artifacts(client, run_id, name, None, table)
            tables[name] = table
    return tables


def evaluate(
    recipe: DictConfig,
    checkpoint: str | Path,
    stages: Sequence[str] = ("val", "test"),
    training_run_id: str | None = None,
    run_name: str | None = None,
    extra_tags: dict[str, str] | None = None,
    allow_training_overlap: bool = False,
) -> tuple[str, dict[str, pd.DataFrame]]:
    """Evaluate a checkpoint on the recipe's cohort + split into a new MLflow run.

    Validation always runs (it chooses the validation operating point); ``stages`` says which
    stages get tables at every operating point.

    Args:
        recipe: the model's recipe, with the cohort and split to evaluate on.
        checkpoint: the checkpoint file.
        stages: ``val`` and/or ``test``.
        training_run_id: the model's training run (default: the run recorded beside the checkpoint).
        run_name: the evaluation run's name.
        extra_tags: more tags for the evaluation run.
        allow_training_overlap: evaluate even when evaluated cases overlap the training cases
            (recorded as a tag and warned about).

    Returns:
        The evaluation run id and the subgroup tables: ``val``/``test`` at the recipe's operating
        point and ``<stage>_fixed``, ``<stage>_val_chosen``.

    Raises:
        EvaluationError: a malformed run id, or an evaluation set that overlaps the training cases.
    """
    from lightning_modules.data.datamodule import CohortDataModule
    from lightning_modules.data.splits import split_sha256
    from lightning_modules.models.checkpoints import load_module_from_checkpoint

    from lightning_modules.models.pyfunc import is_model_uri, model_version_tags

    # A registered model (models:/NAME@ALIAS) stands for its version's training run.
    version_tags = model_version_tags(training_run_id, tracking_uri(recipe.tracking.uri)) if is_model_uri(training_run_id) else {}
    training_run_id = version_tags.get("training_run_id", training_run_id)
    training_run_id = training_run_id or training_run_of_checkpoint(checkpoint)
    try:
        training_run_id = check_run_id(training_run_id) if training_run_id else None
    except ValueError as error:
        raise EvaluationError(str(error)) from error
    uri = tracking_uri(recipe.tracking.uri)
    datamodule = CohortDataModule(recipe)
    datamodule._load()
    evaluated = datamodule.split[datamodule.split["split"].isin({"val", *stages})]

    def start_evaluation_run() -> str:
        """On rank 0: check the evaluation set against the model's training cases and open the run."""
        experiment_id(str(recipe.tracking.experiment), uri)
        tags = run_tags(recipe, split_sha256(recipe.data.split))
        tags.update(check_training_overlap(MlflowClient(tracking_uri=uri), training_run_id, evaluated, allow_training_overlap))
        tags.update({"stage": "evaluation", "eval_cohort": str(recipe.data.root), "checkpoint": Path(checkpoint).name})
        if training_run_id:
            tags["training_run_id"] = training_run_id
        tags.update(extra_tags or {})
        tags.update(version_tags or model_version_tags(training_run_id, uri))
        return start_run(uri, str(recipe.tracking.experiment), run_name or f"evaluate-{recipe.name}", tags)

    # Under DDP (trainer.devices/strategy/num_nodes, torchrun, srun) rank 0 opens the run and every
    # process gets its id; each rank evaluates its share of the cases, the records are gathered
    # (padding de-duplicated) and only rank 0 writes. A failure on any rank ends the run FAILED.
    run_id = share_from_rank_zero(start_evaluation_run, str(recipe.trainer.get("accelerator", "auto")))
    writer = global_rank() == 0
    tables: dict[str, pd.DataFrame] = {}
    with ended_run(uri, run_id, writer=writer):
        module = load_module_from_checkpoint(recipe, checkpoint)
        logger = RunLogger(experiment_name=str(recipe.tracking.experiment), tracking_uri=uri, run_id=run_id)
        callback = SubgroupEvaluation.from_recipe(recipe, tables_on_val=True, headline_only=True)
        trainer = build_trainer(recipe.trainer, None, logger=logger, callbacks=[callback, FailWithLaunchedProcesses(uri, run_id)],
                                enable_model_summary=False, enable_progress_bar=sys.stderr.isatty())
        if datamodule.case_ids("val"):
            trainer.validate(module, datamodule=datamodule)
        if "test" in stages:
            trainer.test(module, datamodule=datamodule)
        tables = dict(callback.results)
        if trainer.is_global_zero:
            points = _operating_points(recipe, callback)
            tables.update(_log_operating_points(logger.experiment, run_id, recipe, callback, list(stages), points))
            log_evaluation_inputs(logger.experiment, run_id, datamodule, list(dict.fromkeys(["val", *stages])))
    return run_id, tables


# ------------------------------------------------------------------------------------------------
# compare


@dataclass
class EvaluatedRun:
    """What compare needs of one evaluation run."""

    run_id: str
    name: str
    records: pd.DataFrame
    val_records: pd.DataFrame | None
    thresholds: dict[str, float] = field(default_factory=dict)
    fallback: str = ""


def _check_run_ids(run_ids: Sequence[str]) -> list[str]:
    if len(run_ids) < 2:
        raise EvaluationError("compare needs at least two evaluation runs (baseline first)")
    try:
        ids = [check_run_id(run_id) for run_id in run_ids]
    except ValueError as error:
        raise EvaluationError(str(error)) from error
    repeated = sorted({run_id for run_id in ids if ids.count(run_id) > 1})
    if repeated:
        raise EvaluationError(f"run {repeated[0]} is named more than once: compare needs different runs")
    return ids


def _load_run(client: MlflowClient, run_id: str, stage: str, folder: str) -> EvaluatedRun:
    try:
        run = client.get_run(run_id)
    except Exception as error:  # MLflow raises its own exception for an unknown run
        raise EvaluationError(f"run {run_id}: not found in the tracking store ({error})") from error
    records = download_records(client, run_id, stage, folder)
    if records is None:
        raise EvaluationError(f"run {run_id} has no {stage} records: evaluate it first")
    thresholds = {}
    for name in ("fixed", "val_chosen"):
        value = run.data.metrics.get(OPERATING_POINT_METRIC.format(name=name))
        if value is None:
            raise EvaluationError(
                f"run {run_id} has no {OPERATING_POINT_METRIC.format(name=name)} metric: it was evaluated before "
                "operating points were recorded; evaluate the model again"
            )
        thresholds[name] = float(value)
    name = run.data.tags.get("variant") or run.info.run_name or run_id[:8]
    fallback = run.data.tags.get(f"{FALLBACK_TAG}.val_chosen", "")
    return EvaluatedRun(run_id, name, records, download_records(client, run_id, "val", folder), thresholds, fallback)


def _matched_point(baseline: EvaluatedRun, other: EvaluatedRun, score: str) -> OperatingPoint:
    target = math.nan
    if baseline.val_records is not None:
        target = specificity_at(baseline.val_records, baseline.thresholds["val_chosen"], score)
    return matched_specificity_point(other.val_records, target, other.thresholds["fixed"], score)


def _compare_pair(baseline: EvaluatedRun, other: EvaluatedRun, settings: dict, notes: list[str]) -> pd.DataFrame:
    """The paired comparison of one run with the baseline at the three operating points."""
    matched = _matched_point(baseline, other, settings["score"])
    if matched.fallback:
        notes.append(f"{other.name} ({other.run_id}): matched specificity: {matched.fallback}; the fixed m is used")
    pairs = {
        "fixed": (baseline.thresholds["fixed"], other.thresholds["fixed"]),
        "val_chosen": (baseline.thresholds["val_chosen"], other.thresholds["val_chosen"]),
        "matched_specificity": (baseline.thresholds["val_chosen"], matched.threshold),
    }
    # One pass over the resamples for the three points (the baseline evaluated once per threshold).
    tables = paired_differences(baseline.records, [(other.records, a, b) for a, b in pairs.values()], **settings)
    frames = []
    for (point, (threshold_a, threshold_b)), table in zip(pairs.items(), tables):
        table.insert(0, "run", other.name)
        table.insert(1, "run_id", other.run_id)
        table.insert(2, "operating_point", point)
        table.insert(3, "threshold_a", threshold_a)
        table.insert(4, "threshold_b", threshold_b)
        frames.append(table)
    return pd.concat(frames, ignore_index=True)


def _log_comparison(client: MlflowClient, experiment: str, uri: str, stage: str, comparison: pd.DataFrame,
                    run_ids: Sequence[str], set_hash: str) -> str:
    # The client, not mlflow.start_run: under `mlflow run`, start_run would resume the run in
    # MLFLOW_RUN_ID (the caller's) instead of creating the comparison's own run.
    run_id = client.create_run(
        experiment_id(experiment, uri),
        run_name="compare",
        tags={"stage": "compare", "compared_runs": ",".join(run_ids), f"{stage}_set_sha256": set_hash},
    ).info.run_id
    for i, note in enumerate(comparison.attrs.get("notes", [])):
        client.set_tag(run_id, f"{FALLBACK_TAG}.{i}", note[:5000])
    client.log_table(run_id, data=comparison, artifact_file=f"comparison/{stage}_comparison.json")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{stage}_comparison.csv"
        comparison.to_csv(path, index=False)
        client.log_artifact(run_id, str(path), "comparison")
        (Path(folder) / f"{stage}_comparison.txt").write_text(format_comparison(comparison))
        client.log_artifact(run_id, str(Path(folder) / f"{stage}_comparison.txt"), "comparison")
    for point in dict.fromkeys(comparison["operating_point"]):
        figure = comparison_figure(comparison, operating_point=point)
        client.log_figure(run_id, figure, f"comparison/{stage}_comparison_{point}.png")
        close(figure)
    client.set_terminated(run_id, "FINISHED")
    return run_id


def compare(
    run_ids: Sequence[str],
    stage: str = "test",
    uri: str | None = None,
    experiment: str | None = None,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    score: str = "volume",
) -> tuple[pd.DataFrame, str | None]:
    """Paired comparison of evaluation runs against the first (the baseline), BenchX table 6 shape,
    at the fixed m, the validation-chosen m and matched specificity.

    Returns the comparison table (``attrs["notes"]`` lists operating-point fallbacks, each also
    logged) and the MLflow run id it was logged to (None without an experiment).

    Raises:
        EvaluationError: fewer than two runs, a malformed or repeated run id, a run without
            records, or runs evaluated on different sets.
    """
    run_ids = _check_run_ids(run_ids)
    uri = tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    with tempfile.TemporaryDirectory() as folder:
        runs = [_load_run(client, run_id, stage, folder) for run_id in run_ids]
    hashes = [evaluation_set_hash(run.records["case_id"]) for run in runs]
    if len(set(hashes)) != 1:
        listing = ", ".join(f"{run.run_id}: {h[:12]} ({len(run.records)} cases)" for run, h in zip(runs, hashes))
        raise EvaluationError(f"runs were evaluated on different sets (case-id sha256 differs): {listing}")
    notes = [f"{run.name} ({run.run_id}): validation operating point: {run.fallback}" for run in runs if run.fallback]
    settings = {"n_resamples": n_resamples, "confidence": confidence, "score": score}
    comparison = pd.concat([_compare_pair(runs[0], other, settings, notes) for other in runs[1:]], ignore_index=True)
    for note in notes:
        log.warning("compare: %s", note)
    comparison.attrs.update({"baseline": runs[0].name, "notes": notes})
    logged_run = _log_comparison(client, experiment, uri, stage, comparison, run_ids, hashes[0]) if experiment else None
    return comparison, logged_run


def format_comparison(comparison: pd.DataFrame, metrics: Sequence[str] = ("sensitivity", "specificity", "f1")) -> str:
    """The comparison as a terminal table (BenchX table 6 shape), one block per run and operating
    point: per subgroup its patients, positives and negatives, then per metric baseline, other, the
    difference with its paired CI and the share of resamples where it was defined."""
    lines = []
    for (run, point), table in comparison.groupby(["run", "operating_point"], sort=False):
        threshold = f"m {table['threshold_a'].iloc[0]:g} vs {table['threshold_b'].iloc[0]:g}"
        lines.append(f"== {comparison.attrs.get('baseline', 'baseline')} (base) vs {run} (new) at {point} ({threshold}), in % ==")
        lines.append(f"{'subgroup':<26}{'pat':>5}{'pos':>5}{'neg':>5}" + "".join(f"  {metric:<40}" for metric in metrics))
        lines.append(f"{'':<41}" + "".join(f"  {'base':>6}{'new':>6} {'delta [95% CI]':<21}{'def':>5}" for _ in metrics))
        for (attribute, group), rows in table.groupby(["attribute", "group"], sort=False):
            by_metric = rows.set_index("metric")
            first = rows.iloc[0]
            cells = [f"{(str(attribute) + ':' + str(group))[:25]:<26}{int(first['n_patients']):>5}"
                     f"{int(first['positives']):>5}{int(first['negatives']):>5}"]
            for metric in metrics:
                row = by_metric.loc[metric]
                interval = f"{_fmt(row['delta'], True)} [{_fmt(row['ci_low'], True)}, {_fmt(row['ci_high'], True)}]{significance_mark(row)}"
                defined = f"{100 * float(row['defined_fraction']):.0f}%"
                cells.append(f"  {_fmt(row['a']):>6}{_fmt(row['b']):>6} {interval:<21}{defined:>5}")
            lines.append("".join(cells))
    lines.append("* significant: the paired 95% bootstrap CI of the difference excludes 0 and the subgroup has "
                 f"{support_rule_text()};  ** also after Holm's correction over the groups of its attribute "
                 "(bootstrap p-values);  ~ the CI excludes 0 but the subgroup is below that rule;  "
                 "- undefined;  def: share of resamples where the difference was defined")
    lines += [f"note: {note}" for note in comparison.attrs.get("notes", [])]
    return "\n".join(lines)


def is_flagged(value) -> bool:
    """A significance cell, also as read back from CSV: True only when it says so (an empty cell is not)."""
    return False if pd.isna(value) else value is True or str(value).strip().lower() in {"true", "1"}


def significance_mark(row) -> str:
    """``**`` significant after Holm, ``*`` significant, ``~`` CI excludes 0 below the support rule, else a space."""
    if is_flagged(row.get("significant_holm", False)):
        return "**"
    if is_flagged(row["significant"]):
        return "*"
    low, high = float(row["ci_low"]), float(row["ci_high"])
    return "~" if (low > 0 or high < 0) else " "


def _fmt(value, sign: bool = False) -> str:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return "-"
    if math.isnan(value):
        return "-"
    return f"{value * 100:+.1f}" if sign else f"{value * 100:.1f}"
