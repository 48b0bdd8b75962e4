"""Evaluation runs and comparisons: the library behind ``benchx evaluate`` and ``benchx compare``.

``evaluate`` takes a trained model (checkpoint + recipe, and its training run when known), a cohort
and a split (including an external cohort never trained on), and writes a new MLflow run linked to
the training run (tag ``training_run_id``) with the subgroup metrics, the per-case records, the
subgroup tables with CIs and the figures, at three operating points
(docs/explanation/detection-and-statistics.md "Scan-level detection"): the recipe's (``val/...``, ``test/...``), BenchX's fixed m (``test_fixed/...``) and the
one chosen on validation (``test_val_chosen/...``; metrics ``operating_point/<name>`` hold the
thresholds, ``operating_point/val_chosen_low`` and ``_high`` the spread of a bagged choice). It
refuses an evaluation set holding a training case or patient of the model, a case its synthetic
data's generator learned from, or one of its training scans under another case id, unless
``allow_training_overlap`` is set (then tagged ``training_overlap_override``); what the model
learned from comes from its training run, else from the checkpoint's own provenance
(:mod:`lightning_modules.workflows.training_overlap`).

``compare`` takes two or more evaluation runs on the same evaluation set (same case-id hash),
refuses any of them evaluated with ``allow_training_overlap`` (its numbers are contaminated) or
without the training-overlap check (tag ``training_overlap_check: unavailable``: nothing shows they
are not), and writes the table of BenchX table 6 at each operating point (fixed m, validation-chosen, matched
specificity, and with ``subgroup`` specificity matched within that subgroup): for each subgroup its patients, positives and negatives, baseline and augmented
with their Wilson intervals, the difference with its paired bootstrap CI (at the chosen points
including the threshold's uncertainty) and Newcombe's interval, the exact McNemar p (sensitivity,
specificity) or DeLong's p (AUC), the share of resamples where it was defined, and whether it is
significant (the metric's deciding test rejects and the subgroup supports it:
docs/explanation/detection-and-statistics.md "Confidence intervals and comparisons"). The fixed m reads the raw predicted tumor
volume (BenchX's rule); ``score="localized_volume"`` compares the localization-aware score.

Example::

    run_id, tables = evaluate(recipe, "best.ckpt", ("val", "test"), training_run_id=run)
    table, compare_run = compare([baseline_eval_run, synthx_eval_run], "test", experiment="benchx")
"""

from __future__ import annotations

import logging
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from lightning_modules.cohorts.audit.signatures import ScanSignatures, scan_signatures
from lightning_modules.data.datamodule import CohortDataModule, default_cache_dir
from lightning_modules.data.splits import split_sha256
from lightning_modules.evaluation.bootstrap import evaluation_set_hash
from lightning_modules.evaluation.callback import FALLBACK_TAG, SubgroupEvaluation
from lightning_modules.evaluation.figures import close, comparison_figure
from lightning_modules.evaluation.paired_comparison import paired_differences
from lightning_modules.evaluation.records import fixed_rule_score, score_column
from lightning_modules.evaluation.thresholds import choose_operating_point, RULES
from lightning_modules.infrastructure.run_folder import RunRecord
from lightning_modules.models.checkpoints import load_module_from_checkpoint, ModelSourceError
from lightning_modules.tracking import (
    check_run_id,
    ended_run,
    experiment_id,
    log_evaluation_inputs,
    run_tags,
    start_run,
    tracking_uri,
)
from lightning_modules.tracking.pyfunc import is_model_uri, model_version_tags, record_operating_point
from lightning_modules.tracking.recorder import download_records, logger_recorder
from lightning_modules.trainer import (
    build_trainer,
    FailWithLaunchedProcesses,
    global_rank,
    RunLogger,
    share_from_rank_zero,
)
# The comparison table's cells and the operating points' metric, read by the study, its report and
# the replicates through this module.
from lightning_modules.workflows.comparison_table import format_comparison, is_flagged, percent, significance_mark  # noqa: F401
from lightning_modules.workflows.matched_points import matched_point, nested_thresholds, parse_subgroup, SUBGROUP_POINT
from lightning_modules.workflows.operating_points import (
    log_operating_points,
    OPERATING_POINT_METRIC,
    operating_points,
    point_score,
)
from lightning_modules.workflows.training_overlap import (
    overlap_problems,
    partial_check_note,
    signature_cache,
    training_record,
)


log = logging.getLogger(__name__)
OVERLAP_OVERRIDE_TAG = "training_overlap_override"
OVERLAP_CHECK_TAG = "training_overlap_check"
OVERLAP_SOURCE_TAG = "training_overlap_source"


class EvaluationError(ValueError):
    """An evaluation or comparison that cannot be done as asked."""


# ------------------------------------------------------------------------------------------------
# evaluate


def training_run_of_checkpoint(checkpoint: str | Path) -> str | None:
    """The MLflow run of a checkpoint written by ``benchx train`` (``<run folder>/checkpoints/*.ckpt``),
    from the run folder's record (``run.json``)."""
    record = RunRecord.read(Path(checkpoint).resolve().parent.parent)
    return record.run_id if record is not None else None


def check_training_overlap(
    client: MlflowClient, training_run_id: str | None, evaluated: pd.DataFrame, allow: bool,
    checkpoint: str | Path | None = None, signatures_of: Callable[[Sequence[str]], ScanSignatures] | None = None,
) -> dict[str, str]:
    """Refuse (EvaluationError) an evaluation set holding a case the model learned from -- a training
    case or patient, a case its synthetic data's generator learned from, or a training scan under
    another case id (``signatures_of`` computes the evaluated scans' signatures) -- unless ``allow``.

    What the model learned from is read from its training run, else from the checkpoint's own
    provenance. Returns the tags that record what was checked.
    """
    if training_run_id is not None:
        try:
            client.get_run(training_run_id)
        except Exception as error:  # MLflow raises its own exception for an unknown run
            raise EvaluationError(f"training run {training_run_id}: not found in the tracking store ({error})") from error
    with tempfile.TemporaryDirectory() as folder:
        try:
            record = training_record(client, training_run_id, checkpoint, folder)
        except ModelSourceError as error:
            raise EvaluationError(str(error)) from error
    if record is None:
        why = (f"training run {training_run_id} records no training_cases.csv" if training_run_id else
               "no training run known and the checkpoint records no training cases")
        log.warning("evaluate: %s; the evaluated cases are not checked against the model's training cases", why)
        return {OVERLAP_CHECK_TAG: f"unavailable: {why}"}
    problems = overlap_problems(record, evaluated, signatures_of)
    if not problems:
        note = partial_check_note(record)
        if note:
            log.warning("evaluate: the training-overlap check against %s is partial: %s", record.source, note)
            return {OVERLAP_CHECK_TAG: f"passed for the training cases; {note}", OVERLAP_SOURCE_TAG: record.source}
        return {OVERLAP_CHECK_TAG: "passed", OVERLAP_SOURCE_TAG: record.source}
    listing = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
    if not allow:
        raise EvaluationError(
            f"{len(problems)} evaluated case(s) overlap the training cases of {record.source}:\n  {listing}\n"
            "evaluation refused: use a split whose val/test cases the model never saw, or pass "
            "--allow-training-overlap to evaluate anyway (recorded in the run)"
        )
    log.warning("evaluate: %d evaluated case(s) overlap the training cases (override given):\n  %s", len(problems), listing)
    return {OVERLAP_CHECK_TAG: f"failed: {len(problems)} case(s)", OVERLAP_OVERRIDE_TAG: "true",
            OVERLAP_SOURCE_TAG: record.source}


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
    # A registered model (models:/NAME@ALIAS) stands for its version's training run.
    version_tags = model_version_tags(training_run_id, tracking_uri(recipe.tracking.uri)) if is_model_uri(training_run_id) else {}
    training_run_id = version_tags.get("training_run_id", training_run_id)
    training_run_id = training_run_id or training_run_of_checkpoint(checkpoint)
    try:
        training_run_id = check_run_id(training_run_id) if training_run_id else None
    except ValueError as error:
        raise EvaluationError(str(error)) from error
    uri = tracking_uri(recipe.tracking.uri)
    datamodule = CohortDataModule(recipe.data, int(recipe.seed), cache_dir=default_cache_dir(recipe.tracking.output_dir))
    datamodule.load()
    evaluated = datamodule.split[datamodule.split["split"].isin({"val", *stages})]

    def start_evaluation_run() -> str:
        """On rank 0: check the evaluation set against the model's training cases and open the run."""
        experiment_id(str(recipe.tracking.experiment), uri)
        tags = run_tags(recipe, split_sha256(recipe.data.split))
        cache = signature_cache(recipe.tracking.output_dir)
        tags.update(check_training_overlap(
            MlflowClient(tracking_uri=uri), training_run_id, evaluated, allow_training_overlap, checkpoint,
            lambda ids: scan_signatures(datamodule.cohort, ids, cache),
        ))
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
        callback = SubgroupEvaluation.from_detection(recipe.detection, tables_on_val=True, headline_only=True,
                                                     recorder=logger_recorder)
        trainer = build_trainer(recipe.trainer, None, logger=logger, callbacks=[callback, FailWithLaunchedProcesses(uri, run_id)],
                                enable_model_summary=False, enable_progress_bar=sys.stderr.isatty())
        if datamodule.case_ids("val"):
            trainer.validate(module, datamodule=datamodule)
        if "test" in stages:
            trainer.test(module, datamodule=datamodule)
        tables = dict(callback.results)
        if trainer.is_global_zero:
            points = operating_points(recipe, callback)
            tables.update(log_operating_points(logger.experiment, run_id, recipe, callback, list(stages), points))
            log_evaluation_inputs(logger.experiment, run_id, datamodule, list(dict.fromkeys(["val", *stages])))
            record_operating_point(run_id, uri)  # on the registered version, for its pyfunc's tumor_detected
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
    rule: str = "youden"


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
    if run.data.tags.get(OVERLAP_OVERRIDE_TAG) == "true":
        check = run.data.tags.get(OVERLAP_CHECK_TAG, "failed")
        raise EvaluationError(
            f"run {run_id} was evaluated with --allow-training-overlap ({OVERLAP_CHECK_TAG}: {check}): its evaluation "
            "set holds cases the model learned from, so a difference to it says nothing; evaluate the model on a "
            "split whose val/test cases it never saw"
        )
    check = run.data.tags.get(OVERLAP_CHECK_TAG)
    if check is None or check.startswith("unavailable"):
        raise EvaluationError(
            f"run {run_id} was evaluated without the training-overlap check ({OVERLAP_CHECK_TAG}: {check or 'not recorded'}): "
            "nothing shows its evaluation set is free of cases the model learned from, so it is not compared (there "
            "is no override); evaluate the model again with --run-id <its training run>, or with a checkpoint written "
            "by benchx train (it records its training cases)"
        )
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
    # The tag reads e.g. "youden (mean of 1998 of 2000 resamples)".
    rule = (run.data.tags.get("operating_point.val_chosen.rule", "youden").split() or ["youden"])[0]
    return EvaluatedRun(run_id, name, records, download_records(client, run_id, "val", folder), thresholds, fallback,
                        rule if rule in RULES else "youden")


def _rechoose_on_score(run: EvaluatedRun, score: str, n_resamples: int, confidence: float) -> None:
    """Choose a run's validation point on another score than the one it was evaluated with (the
    localization-aware score): the run's rule, bagged over ``n_resamples`` validation resamples."""
    if run.val_records is None or score_column(score) not in run.val_records.columns:
        raise EvaluationError(f"run {run.run_id} has no validation records with {score_column(score)}: evaluate it again")
    point = choose_operating_point(run.val_records, run.rule, run.thresholds["fixed"], score, n_resamples, confidence)
    run.thresholds["val_chosen"], run.fallback = point.threshold, point.fallback


def _compare_pair(baseline: EvaluatedRun, other: EvaluatedRun, settings: dict, notes: list[str]) -> pd.DataFrame:
    """The paired comparison of one run with the baseline at the three operating points, and at
    ``subgroup_matched_specificity`` when ``settings["subgroup"]`` names a subgroup.

    The fixed m reads the raw predicted tumor volume (BenchX's rule); at the validation-chosen and
    matched-specificity points the test CIs include the threshold's uncertainty (each validation
    resample's choice applied to the paired test resample).
    """
    score, subgroup = settings["score"], settings.get("subgroup")
    matched = {"matched_specificity": matched_point(baseline, other, score)}
    if subgroup is not None:
        matched[SUBGROUP_POINT] = matched_point(baseline, other, score, subgroup)
    for name, point in matched.items():
        if point.fallback:
            notes.append(f"{other.name} ({other.run_id}): {name.replace('_', ' ')}: {point.fallback}; the fixed m is used")
    pairs = {
        "fixed": (baseline.thresholds["fixed"], other.thresholds["fixed"]),
        "val_chosen": (baseline.thresholds["val_chosen"], other.thresholds["val_chosen"]),
        **{name: (baseline.thresholds["val_chosen"], point.threshold) for name, point in matched.items()},
    }
    nested = nested_thresholds(baseline, other, matched, score, int(settings["n_resamples"]), subgroup)
    fixed_score = point_score("fixed", score, baseline.records)
    if fixed_score != point_score("fixed", score, other.records):
        fixed_score = score
    if fixed_score == score and fixed_rule_score(score) != score:
        notes.append(f"{other.name} ({other.run_id}): records without raw_volume_mm3; the fixed m reads {score_column(score)}")
    settings = {key: settings[key] for key in ("n_resamples", "confidence", "score")}
    fixed_settings = {**settings, "score": fixed_score}
    (fixed_table,) = paired_differences(baseline.records, [(other.records, *pairs["fixed"])], **fixed_settings)
    # One pass over the resamples for the chosen points (the baseline evaluated once per threshold).
    chosen = [point for point in pairs if point != "fixed"]
    tables = [fixed_table] + paired_differences(
        baseline.records, [(other.records, *pairs[point]) for point in chosen], **settings,
        resample_thresholds=[nested[point] for point in chosen],
    )
    frames = []
    for (point, (threshold_a, threshold_b)), table in zip(pairs.items(), tables):
        table.insert(0, "run", other.name)
        table.insert(1, "reference", baseline.name)  # the first run: every difference is run minus reference
        table.insert(2, "run_id", other.run_id)
        table.insert(3, "operating_point", point)
        table.insert(4, "threshold_a", threshold_a)
        table.insert(5, "threshold_b", threshold_b)
        table.insert(6, "score", fixed_score if point == "fixed" else score)
        table.insert(7, "nested_threshold", bool(table.attrs.get("nested_threshold", False)))
        # The subgroup whose healthy validation scans set the subgroup-matched thresholds ('' elsewhere).
        table["matched_subgroup"] = f"{subgroup[0]}:{subgroup[1]}" if point == SUBGROUP_POINT else ""
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
    subgroup: str | tuple[str, str] | None = None,
) -> tuple[pd.DataFrame, str | None]:
    """Paired comparison of evaluation runs against the first (the baseline), BenchX table 6 shape,
    at the fixed m, the validation-chosen m and matched specificity; with ``subgroup``
    (``"phase:arterial"``) also at ``subgroup_matched_specificity``: each run's m matched on
    validation to the baseline's specificity within that subgroup (column ``matched_subgroup``).

    Returns the comparison table (``attrs["notes"]`` lists operating-point fallbacks, each also
    logged) and the MLflow run id it was logged to (None without an experiment).

    Raises:
        EvaluationError: fewer than two runs, a malformed or repeated run id, a run without
            records, a run evaluated with the training overlap allowed (tag
            ``training_overlap_override``) or without the check (``training_overlap_check``
            unavailable or not recorded), runs evaluated on different sets, or a malformed subgroup.
    """
    run_ids = _check_run_ids(run_ids)
    try:
        subgroup = parse_subgroup(subgroup)
    except ValueError as error:
        raise EvaluationError(str(error)) from error
    uri = tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    with tempfile.TemporaryDirectory() as folder:
        runs = [_load_run(client, run_id, stage, folder) for run_id in run_ids]
    # A run is named by its variant tag (else its name); two runs of one variant (two ratios of a sweep,
    # arms evaluated with `benchx evaluate`) keep their rows apart by their ids.
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.name} ({run.run_id[:8]})"
    hashes = [evaluation_set_hash(run.records["case_id"]) for run in runs]
    if len(set(hashes)) != 1:
        listing = ", ".join(f"{run.run_id}: {h[:12]} ({len(run.records)} cases)" for run, h in zip(runs, hashes))
        raise EvaluationError(f"runs were evaluated on different sets (case-id sha256 differs): {listing}")
    if score not in ("volume", "max_prob"):
        for run in runs:
            _rechoose_on_score(run, score, n_resamples, confidence)
    notes = [f"{run.name} ({run.run_id}): validation operating point: {run.fallback}" for run in runs if run.fallback]
    settings = {"n_resamples": n_resamples, "confidence": confidence, "score": score, "subgroup": subgroup}
    comparison = pd.concat([_compare_pair(runs[0], other, settings, notes) for other in runs[1:]], ignore_index=True)
    for note in notes:
        log.warning("compare: %s", note)
    comparison.attrs.update({"baseline": runs[0].name, "notes": notes})
    logged_run = _log_comparison(client, experiment, uri, stage, comparison, run_ids, hashes[0]) if experiment else None
    return comparison, logged_run
