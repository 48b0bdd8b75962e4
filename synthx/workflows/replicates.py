"""Replicated studies side by side: does a subgroup difference hold across seeds, hosts or ratios?

A study's paired bootstrap interval resamples the test patients with both trained models held
fixed, so it does not see how much a second training of the same recipe would differ
(docs/explanation/detection-and-statistics.md "Confidence intervals and comparisons"). This module reads the test comparison
table of several finished studies (one parent run each, e.g. one per seed) and lines up, per
subgroup and metric at one operating point, each study's difference with its CI and mark, the
mean, the range, and how many studies found it significantly up or down.

The studies must have been evaluated on the same test set: every group's patients, positives and
negatives must agree, or the studies are refused with the first group that differs.

The second half runs a study as K paired replicates (``benchx study --seeds K``: one seed per
replicate, every arm in each) and pools them from MLflow with
:mod:`lightning_modules.evaluation.seed_pooling` (docs/explanation/detection-and-statistics.md "Seeds as the unit of inference");
the pooled run's page is :mod:`synthx.workflows.pooled_page`.

Example::

    benchx replicates <parent seed 0> <parent seed 1> <parent seed 2> --metric auc --attribute phase
    benchx study --seeds 5 --workers 2 --out outputs/study-seeds
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Sequence

import pandas as pd
from mlflow.tracking import MlflowClient

from lightning_modules.evaluation.seed_pooling import ArmRecords, format_pooled, pool_seeds
from lightning_modules.infrastructure.process import exit_on_signal, git_commit, rerun_command, start_worker, stop_workers
from lightning_modules.infrastructure.run_folder import content_key
from lightning_modules.tracking import experiment_id, tracking_uri
from lightning_modules.tracking.recorder import download_records
from lightning_modules.workflows.evaluate import is_flagged, OPERATING_POINT_METRIC, significance_mark
from synthx.painters import SYNTHX_PAINTER
from synthx.workflows.pooled_decomposition import POOLED_ARTIFACT, pooled_decomposition_table
from synthx.workflows.report.runs import COMPARISON_ARTIFACT, load_study
from synthx.workflows.study.run import run_study
from synthx.workflows.study.settings import segmentation_recipe


OPERATING_POINTS = ("fixed", "val_chosen", "matched_specificity", "subgroup_matched_specificity")
COUNT_COLUMNS = ("n_patients", "positives", "negatives")
KEY = ["attribute", "group", "metric"]


class ReplicateError(ValueError):
    """Studies that cannot be lined up (not finished, not a study, or evaluated on different sets)."""


def study_comparison(run_id: str, uri: str) -> pd.DataFrame:
    """The test comparison table of one finished study, with its ``study`` run id, ``seed`` and ``ratio``."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            study = load_study(run_id, uri, Path(folder))
        except ValueError as error:  # ReportError: not a study's parent run
            raise ReplicateError(str(error)) from error
        missing = [step for step in ("augmented", "compare") if step not in study.steps]
        if missing:
            raise ReplicateError(f"study {run_id} has no {' or '.join(missing)} step: it did not finish; "
                                 f"resume it with the same `benchx study` command")
        table = study.csv("compare", "comparison/test_comparison.csv")
        augmented = study.run("augmented")
    # The study's comparison also holds baseline minus sham (the schedule alone): replicates line up SynthX's.
    table = table[table["run"] == "synthx"].reset_index(drop=True) if "run" in table.columns else table
    table.insert(0, "study", run_id)
    table.insert(1, "seed", augmented.data.params.get("seed", ""))
    table.insert(2, "ratio", augmented.data.tags.get("synthx_ratio", ""))
    return table


def _labels(tables: Sequence[pd.DataFrame]) -> list[str]:
    """A column label per study: its seed and ratio, made unique with the run id when two agree."""
    labels = [f"seed {t['seed'].iloc[0]} r {t['ratio'].iloc[0]}" for t in tables]
    return [label if labels.count(label) == 1 else f"{label} ({t['study'].iloc[0][:8]})"
            for label, t in zip(labels, tables)]


def replicate_table(tables: Sequence[pd.DataFrame], operating_point: str = "fixed",
                    metrics: Sequence[str] = ("auc", "sensitivity", "specificity"),
                    attributes: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per (attribute, group, metric): each study's difference, and the summary across them.

    Columns: the key, the group's counts, ``studies``, ``mean_delta``, ``min_delta``, ``max_delta``,
    ``significant_up`` / ``significant_down`` (studies whose difference is significant, by CI and
    support, in that direction), ``same_sign`` (every study's difference on the same side of 0),
    then per study ``<label>`` (the difference) and ``<label> ci`` (its interval and mark, as text).
    """
    if len(tables) < 2:
        raise ReplicateError("give at least two studies to line up")
    if operating_point not in OPERATING_POINTS:
        raise ReplicateError(f"operating point must be one of {', '.join(OPERATING_POINTS)} (got {operating_point!r})")
    labels = _labels(tables)
    parts = []
    for label, table in zip(labels, tables):
        rows = table[(table["operating_point"] == operating_point) & table["metric"].isin(list(metrics))]
        if attributes:
            rows = rows[rows["attribute"].isin(list(attributes))]
        if rows.empty:
            raise ReplicateError(f"study {table['study'].iloc[0]} has no rows for {operating_point}, "
                                 f"metrics {', '.join(metrics)}")
        parts.append(rows.set_index(KEY))
    first = parts[0]
    for label, part, table in zip(labels[1:], parts[1:], tables[1:]):
        if set(part.index) != set(first.index):
            extra = sorted(set(part.index) ^ set(first.index))[0]
            raise ReplicateError(f"study {table['study'].iloc[0]} ({label}) and study {tables[0]['study'].iloc[0]} "
                                 f"do not have the same subgroups: {' / '.join(map(str, extra))} is in one only")
        counts = part.loc[first.index, list(COUNT_COLUMNS)]
        differ = (counts != first[list(COUNT_COLUMNS)]).any(axis=1)
        if differ.any():
            key = differ[differ].index[0]
            raise ReplicateError(
                f"study {table['study'].iloc[0]} ({label}) was evaluated on another set than study "
                f"{tables[0]['study'].iloc[0]}: {' / '.join(map(str, key))} has "
                f"{dict(counts.loc[key])} against {dict(first.loc[key, list(COUNT_COLUMNS)])}")

    out = first[list(COUNT_COLUMNS)].copy()
    deltas = pd.concat([part.loc[first.index, "delta"].rename(label) for label, part in zip(labels, parts)], axis=1)
    significant = pd.concat([part.loc[first.index, "significant"].map(is_flagged).rename(label)
                             for label, part in zip(labels, parts)], axis=1)
    out["studies"] = len(tables)
    out["mean_delta"] = deltas.mean(axis=1)
    out["min_delta"] = deltas.min(axis=1)
    out["max_delta"] = deltas.max(axis=1)
    out["significant_up"] = (significant & (deltas > 0)).sum(axis=1)
    out["significant_down"] = (significant & (deltas < 0)).sum(axis=1)
    out["same_sign"] = (deltas > 0).all(axis=1) | (deltas < 0).all(axis=1)
    for label, part in zip(labels, parts):
        rows = part.loc[first.index]
        out[label] = rows["delta"]
        out[f"{label} ci"] = [_interval(row) for _, row in rows.iterrows()]
    return out.reset_index()


def _interval(row: pd.Series) -> str:
    if pd.isna(row["ci_low"]) or pd.isna(row["ci_high"]):
        return "[-, -]"
    return f"[{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]{significance_mark(row)}".rstrip()


def format_replicates(table: pd.DataFrame) -> str:
    """A plain-text table: per subgroup and metric, each study's difference [CI] and the summary."""
    labels = [c for c in table.columns if f"{c} ci" in table.columns]
    header = ["subgroup", "metric", "pat", "pos", "neg", *labels, "mean", "sig. up/down", "same sign"]
    lines = []
    for row in table.to_dict("records"):
        cells = [f"{row['attribute']}:{row['group']}", row["metric"], str(row["n_patients"]), str(row["positives"]),
                 str(row["negatives"])]
        cells += ["-" if pd.isna(row[label]) else f"{row[label]:+.3f} {row[label + ' ci']}" for label in labels]
        cells += ["-" if pd.isna(row["mean_delta"]) else f"{row['mean_delta']:+.3f}",
                  f"{row['significant_up']}/{row['significant_down']}", "yes" if row["same_sign"] else "no"]
        lines.append(cells)
    widths = [max(len(str(c)) for c in column) for column in zip(header, *lines)]
    shown = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in [header, *lines])
    notes = ["* significant in that study (CI excludes 0 and the subgroup supports it); ** also after Holm;",
             "~ the CI excludes 0 but the subgroup is below the support rule.",
             "sig. up/down: studies with a significant difference above / below 0. The intervals are each",
             "study's paired test-set bootstrap; the spread between studies is the training variance they omit."]
    return "\n".join([shown, "", *notes])


# ----------------------------------------------------------------------------------------------
# Seeds as the unit of inference: K paired replicates of one study, run and pooled
# (docs/explanation/detection-and-statistics.md "Seeds as the unit of inference"; the pooling itself is
# lightning_modules.evaluation.seed_pooling).

REPLICATE_SET_TAG = "replicate_set"
REPLICATE_SEED_TAG = "replicate_seed"
POOLED_STAGE = "replicates_pooled"
# Arm pairs pooled when a replicate has both arms (arm minus reference), first the primary one.
# An arm is a study step ``evaluate_<arm>``.
ARM_PAIRS = (("synthx", "sham"), ("baseline", "sham"), ("control", "sham"), ("copy_paste", "sham"), ("synthx", "baseline"))
# matched_specificity: per arm pair, the reference at its validation-chosen m and the arm at the m
# that matches the reference's validation specificity, as each replicate's own comparison set them
# (the primary endpoint's point).
# subgroup_matched_specificity: the same, matched within the endpoint's subgroup (version 2).
MATCHED_POINTS = ("matched_specificity", "subgroup_matched_specificity")
POOLED_OPERATING_POINTS = ("val_chosen", "fixed", *MATCHED_POINTS)


def replicate_key(settings, code_version: str) -> str:
    """The identity of a set of replicates: the study's settings (not its output folder) and code version.

    Every replicate of ``benchx study --seeds K`` carries it (tag ``replicate_set``), whichever
    process or Slurm task ran it, and the pooled analysis reads the replicates that carry it.
    """
    payload = {k: v for k, v in asdict(settings).items() if k != "output_dir"}
    return content_key({"settings": payload, "code": code_version})


def seeded_settings(settings, seed: int):
    """The settings of replicate ``seed``: every training seeded with it, in ``<out>/seed-<seed>``."""
    generator = [*settings.synthx_overrides, f"seed={seed}"] if settings.painter == SYNTHX_PAINTER else settings.synthx_overrides
    return replace(settings, overrides=[*settings.overrides, f"seed={seed}"], synthx_overrides=generator,
                   output_dir=str(Path(settings.output_dir) / f"seed-{seed}"))


def _store(settings) -> tuple[str, str, str]:
    """(tracking uri, experiment id, replicate key) of a study's settings."""
    uri = tracking_uri(segmentation_recipe(settings).tracking.uri)
    return uri, experiment_id(settings.experiment, uri), replicate_key(settings, git_commit())


def finished_replicates(client, experiment_id: str, key: str) -> dict[int, object]:
    """The finished replicate studies of a set, by seed (the most recent of each seed)."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.{REPLICATE_SET_TAG} = '{key}' and tags.stage = 'study' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
    )
    found: dict[int, object] = {}
    for run in runs:
        found.setdefault(int(run.data.tags[REPLICATE_SEED_TAG]), run)
    return dict(sorted(found.items()))


def run_replicate(settings, seed: int) -> str:
    """Run replicate ``seed`` of a study unless it has finished; returns its parent run id.

    A killed replicate resumes: its finished steps are reused and an interrupted training resumes
    from its checkpoint (:mod:`synthx.workflows.study.run`). A finished one is never run again.
    """
    uri, experiment, key = _store(settings)
    client = MlflowClient(tracking_uri=uri)
    done = finished_replicates(client, experiment, key).get(int(seed))
    if done is not None:
        print(f"[replicates] seed {seed}: finished replicate {done.info.run_id} kept")
        return done.info.run_id
    run_study(seeded_settings(settings, seed), parent_tags={REPLICATE_SET_TAG: key, REPLICATE_SEED_TAG: str(int(seed))})
    return finished_replicates(client, experiment, key)[int(seed)].info.run_id


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def worker_threads(workers: int, cpus: int | None = None) -> int:
    """Threads per replicate process: the CPUs this process may use, shared among ``workers``."""

    available = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, available // max(1, workers))


def run_replicates(settings, seeds: Sequence[int], workers: int, command: Sequence[str]) -> None:
    """Run the unfinished replicates, ``workers`` processes at a time, each ``command + --seed S``.

    Each process writes its log to ``<out>/seed-<S>.log``. Finished replicates are not started.
    The processes die with this one (even by SIGKILL, on Linux); on SIGTERM, SIGINT or an error here
    they are stopped (each ends its runs KILLED), and on a signal this process exits 143 or 130 after
    one line naming the command that resumes them.

    Raises:
        ReplicateError: a replicate process failed (rerunning the same command resumes it).
    """
    if workers < 1:
        raise ReplicateError(f"--workers must be at least 1 (got {workers})")
    uri, experiment, key = _store(settings)  # creates the experiment before the workers start
    done = finished_replicates(MlflowClient(tracking_uri=uri), experiment, key)
    for seed in seeds:
        if seed in done:
            print(f"[replicates] seed {seed}: finished replicate {done[seed].info.run_id} kept")
    pending = [int(s) for s in seeds if int(s) not in done]
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Each replicate opens its own parent run: not the one `mlflow run` may have opened for this process.
    environment = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    # The CPUs are shared among the workers: each gets its share of threads (unless the user set them),
    # else every process starts one thread per CPU and they thrash (3x the CPU time at 2 workers on 2 CPUs).
    threads = worker_threads(workers)
    for variable in THREAD_VARIABLES:
        environment.setdefault(variable, str(threads))
    running: dict[int, tuple[subprocess.Popen, object]] = {}
    failed: list[int] = []
    advice = f"replicate(s) {', '.join(map(str, pending))} stopped; resume with: {rerun_command() or 'the same command'}"
    with exit_on_signal("benchx study", lambda: advice):
        try:
            while pending or running:
                while pending and len(running) < workers:
                    seed = pending.pop(0)
                    log = open(out / f"seed-{seed}.log", "a")
                    print(f"[replicates] seed {seed}: started with {environment['OMP_NUM_THREADS']} thread(s) "
                          f"(log {out / f'seed-{seed}.log'})")
                    running[seed] = (start_worker([*command, "--seed", str(seed)], stdout=log, stderr=subprocess.STDOUT,
                                                  env=environment), log)
                time.sleep(1)
                for seed, (process, log) in list(running.items()):
                    if process.poll() is None:
                        continue
                    log.close()
                    del running[seed]
                    print(f"[replicates] seed {seed}: {'done' if process.returncode == 0 else f'failed ({process.returncode})'}")
                    if process.returncode != 0:
                        failed.append(seed)
        except BaseException:
            stop_workers([process for process, _ in running.values()])
            raise
    if failed:
        raise ReplicateError(f"replicate(s) {', '.join(map(str, sorted(failed)))} failed (logs: {out}/seed-<seed>.log); "
                             "run the same command again to resume them")


def replicate_arms(client, parent, stage: str, operating_point: str, folder: str) -> dict:
    """A replicate's arms: ``evaluate_<arm>`` step -> :class:`ArmRecords` (its ``stage`` records, its m).

    With a locked test cohort the baseline's arm is its evaluation on that cohort
    (``evaluate_locked_baseline``), as in the study's own comparison, not the development split's.
    """
    steps = {tag[len("step.evaluate_"):]: run_id for tag, run_id in parent.data.tags.items()
             if tag.startswith("step.evaluate_")}
    if "locked_baseline" in steps:
        steps["baseline"] = steps.pop("locked_baseline")
    arms = {}
    for arm, run_id in steps.items():
        records = download_records(client, run_id, stage, str(Path(folder) / run_id))
        threshold = client.get_run(run_id).data.metrics.get(OPERATING_POINT_METRIC.format(name=operating_point))
        if records is None or threshold is None:
            raise ReplicateError(f"replicate {parent.info.run_id}: evaluation {run_id} ({arm}) has no {stage} records "
                                 f"or no {operating_point} operating point")
        arms[arm] = ArmRecords(records, float(threshold))
    return dict(sorted(arms.items()))


def matched_thresholds(client, parent, folder: str, point: str = "matched_specificity") -> dict[tuple[str, str], tuple[float, float]]:
    """(arm, reference) -> (reference's m, arm's m) at a matched ``point``, from a replicate's own comparison."""

    study = load_study(parent.info.run_id, client.tracking_uri, Path(folder) / f"compare-{parent.info.run_id}")
    try:
        table = study.csv("compare", COMPARISON_ARTIFACT)
    except LookupError as error:
        raise ReplicateError(f"replicate {parent.info.run_id} has no comparison to read its matched m from: {error}") from error
    rows = table[table["operating_point"] == point]
    return {(str(r.run), str(r.reference)): (float(r.threshold_a), float(r.threshold_b))
            for r in rows.drop_duplicates(["run", "reference"]).itertuples(index=False)}


def pooled_table(client, parents: dict, operating_point: str, stage: str = "test", **pooling) -> pd.DataFrame:
    """Pool replicates (seed label -> parent run) at one operating point (:func:`pool_seeds` keywords in ``pooling``).

    At ``val_chosen`` and ``fixed`` every arm keeps the m its evaluation logged; at
    ``matched_specificity`` and ``subgroup_matched_specificity`` each arm pair is pooled with the two m
    its replicate's comparison used.
    """

    with tempfile.TemporaryDirectory() as folder:
        point = "val_chosen" if operating_point in MATCHED_POINTS else operating_point
        replicates = {seed: replicate_arms(client, run, stage, point, folder) for seed, run in parents.items()}
        matched = ({seed: matched_thresholds(client, run, folder, operating_point) for seed, run in parents.items()}
                   if operating_point in MATCHED_POINTS else None)
    common = set.intersection(*(set(arms) for arms in replicates.values()))
    pairs = [pair for pair in ARM_PAIRS if set(pair) <= common]
    if matched is not None:
        pairs = [pair for pair in pairs if all(pair in thresholds for thresholds in matched.values())]
    if not pairs:
        raise ReplicateError(f"the replicates share no arm pair to compare at {operating_point} "
                             f"(arms: {', '.join(sorted(common))})")
    if matched is None:
        return pool_seeds(replicates, pairs, **pooling)
    frames = []
    for arm, reference in pairs:
        paired = {seed: {reference: ArmRecords(arms[reference].records, matched[seed][arm, reference][0]),
                         arm: ArmRecords(arms[arm].records, matched[seed][arm, reference][1])}
                  for seed, arms in replicates.items()}
        frames.append(pool_seeds(paired, [(arm, reference)], **pooling))
    table = pd.concat(frames, ignore_index=True)
    table.attrs.update(frames[0].attrs)
    return table


def pool_replicates(settings, seeds: Sequence[int] | None = None, operating_point: str = "val_chosen",
                    stage: str = "test") -> tuple[pd.DataFrame, str]:
    """The pooled analysis of a study's finished replicates, read from MLflow and logged to a new run.

    Args:
        settings: the study's settings (they name the replicate set, the store and the experiment).
        seeds: the seeds that must be there (None: every finished replicate of the set).
        operating_point: ``val_chosen``, ``fixed`` or ``matched_specificity`` (:func:`pooled_table`;
            AUC does not depend on it).
        stage: the evaluated split whose records are pooled.

    Returns:
        The pooled table (:func:`~lightning_modules.evaluation.seed_pooling.pool_seeds`) and the run it was
        logged to; when every replicate has the copy-paste arm, the pooled decomposition is logged there
        too (:func:`~synthx.workflows.pooled_decomposition.pooled_decomposition_table`).

    Raises:
        ReplicateError: fewer than two finished replicates, a named seed missing, or replicates
            without a common arm pair.
    """
    if operating_point not in POOLED_OPERATING_POINTS:
        raise ReplicateError(f"operating point must be one of {', '.join(POOLED_OPERATING_POINTS)} (got {operating_point!r})")
    uri, experiment, key = _store(settings)
    client = MlflowClient(tracking_uri=uri)
    parents = finished_replicates(client, experiment, key)
    if seeds is not None:
        missing = [s for s in seeds if s not in parents]
        if missing:
            raise ReplicateError(f"replicate(s) {', '.join(map(str, missing))} of this study have not finished in "
                                 f"experiment '{settings.experiment}'; run them first (benchx study --seeds, or one "
                                 "task per seed with --seed)")
        parents = {s: parents[s] for s in seeds}
    if len(parents) < 2:
        raise ReplicateError(f"{len(parents)} finished replicate(s) of this study in experiment '{settings.experiment}': "
                             "pooling needs at least two")
    recipe = segmentation_recipe(settings)
    pooling = dict(n_resamples=int(recipe.detection.bootstrap_resamples), confidence=float(recipe.detection.confidence),
                   score=str(recipe.detection.score))
    table = pooled_table(client, {str(seed): run for seed, run in parents.items()}, operating_point, stage, **pooling)
    text = (f"== {len(parents)} seeds pooled at the {operating_point} operating point ({stage}) ==\n"
            + format_pooled(table))
    run_id = client.create_run(experiment, run_name="pooled", tags={
        "stage": POOLED_STAGE, REPLICATE_SET_TAG: key, "operating_point": operating_point,
        "replicated_studies": " ".join(run.info.run_id for run in parents.values()),
    }).info.run_id
    client.log_param(run_id, "seeds", ",".join(map(str, parents)))
    client.log_text(run_id, text, f"pooled/{stage}_{operating_point}.txt")
    client.log_text(run_id, table.to_csv(index=False), f"pooled/{stage}_{operating_point}.csv")
    try:
        decomposition = pooled_decomposition_table(client, {str(seed): run for seed, run in parents.items()},
                                                   operating_point, replicate_arms, stage, **pooling)
    except LookupError as error:
        raise ReplicateError(str(error)) from error
    if decomposition is not None:
        client.log_text(run_id, decomposition.to_csv(index=False), POOLED_ARTIFACT.format(stage=stage, point=operating_point))
    client.set_terminated(run_id, "FINISHED")
    return table, run_id
