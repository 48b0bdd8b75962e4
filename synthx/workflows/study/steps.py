"""The study's steps: each action makes one MLflow run and returns its outputs (at least ``run_id``).

The data and the locked test cohort, the trainings and evaluations of the arms, the targeting of the
synthetic budget, the generator, the synthesis and the comparison (the order is
:mod:`synthx.workflows.study.run`'s).

Example::

    runner.step("targeting", params, targeting_action(client, experiment, root, split, settings, run_id, "volume"))
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import pandas as pd
from mlflow.tracking import MlflowClient

from lightning_modules.cohorts.phantom import DEFAULT_CASES, generate_phantom_cohort, PARAMS_FILE
from lightning_modules.data.cohort import CohortError, load_cohort, write_metadata
from lightning_modules.data.splits import load_split, make_splits, split_sha256, write_split
from lightning_modules.data.validation import validate_cohort
from lightning_modules.infrastructure.process import held_signals
from lightning_modules.infrastructure.run_folder import content_key
from lightning_modules.tracking import end_run, experiment_id, final_status
from lightning_modules.tracking.recorder import download_records
from lightning_modules.workflows.evaluate import compare, evaluate, OPERATING_POINT_METRIC
from lightning_modules.workflows.train import recipe_fingerprint, train
from synthx.generation import SynthesisSettings, synthesize
from synthx.generation.canvases import GenerationError
from synthx.generation.targeting import resolve_targets
from synthx.painters import COPY_PASTE_PAINTER
from synthx.training import recipe_key, train_synthx
from synthx.workflows.study.runner import cohort_lock
from synthx.workflows.study.settings import LOCKED_PREFIX, segmentation_recipe, StudySettings, TARGETS_ARTIFACT


def data_step(client: MlflowClient, experiment: str, tags: dict, root: Path, split: Path, settings: StudySettings) -> dict:
    """Generate the phantom cohort when absent, make the split when absent, validate both."""
    run_id = client.create_run(experiment, run_name="data", tags=tags).info.run_id
    with cohort_lock(root):  # replicates started together (benchx study --seeds) make the cohort once
        if not (root / "metadata.csv").exists():

            generate_phantom_cohort(root, n_cases=settings.cases or DEFAULT_CASES, seed=settings.phantom_seed)
            client.set_tag(run_id, "phantom_generated", "true")
        cohort = load_cohort(root)
        if not split.exists():
            write_split(make_splits(cohort.metadata, seed=settings.phantom_seed), split)
    table = load_split(split, cohort)
    problems = validate_cohort(cohort)
    if problems:
        raise CohortError(problems, root)
    for name, count in table["split"].value_counts().to_dict().items():
        client.log_metric(run_id, f"data/cases/{name}", count)
    client.log_param(run_id, "split_sha256", split_sha256(split))
    client.log_artifact(run_id, str(split), "split")
    client.set_terminated(run_id, "FINISHED")
    return {"run_id": run_id, "split_sha256": split_sha256(split)}


def locked_view(development_root: Path, development_split: Path, locked_root: Path, out: Path) -> tuple[Path, Path]:
    """The evaluation view of the locked cohort: the development validation cases (``val``) and the
    locked phantom's cases (``test``), each locked case and patient renamed with ``LOCKED_PREFIX``.

    The case folders are links, so nothing is copied. Returns (view root, view split).

    Raises:
        ValueError: a locked case or patient id that is also a development one.
    """
    development = load_cohort(development_root)
    split = load_split(development_split, development)
    val = split.loc[split["split"] == "val", "case_id"].tolist()
    locked = load_cohort(locked_root).metadata.copy()
    folders = {LOCKED_PREFIX + case_id: Path(locked_root).resolve() / case_id for case_id in locked["case_id"]}
    locked["case_id"] = LOCKED_PREFIX + locked["case_id"].astype(str)
    locked["patient_id"] = LOCKED_PREFIX + locked["patient_id"].astype(str)
    shared_cases = set(locked["case_id"]) & set(development.metadata["case_id"])
    shared_patients = set(locked["patient_id"]) & set(development.metadata["patient_id"].astype(str))
    if shared_cases or shared_patients:
        raise ValueError(f"locked cohort shares ids with the development cohort: {sorted(shared_cases | shared_patients)[:5]}")
    folders.update({case_id: Path(development_root).resolve() / case_id for case_id in val})
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for case_id, target in folders.items():
        (staging / case_id).symlink_to(target, target_is_directory=True)
    rows = pd.concat([development.subset(val), locked], ignore_index=True)
    write_metadata(staging, rows)
    table = pd.DataFrame({"case_id": rows["case_id"], "patient_id": rows["patient_id"].astype(str),
                          "split": ["val"] * len(val) + ["test"] * len(locked)})
    write_split(table, staging / "split.csv")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out, out / "split.csv"


def locked_cohort_step(client: MlflowClient, experiment: str, tags: dict, root: Path, split: Path,
                       settings: StudySettings) -> dict:
    """Generate the locked phantom (another seed, the development phantom's shape and spacing) and its view."""
    run_id = client.create_run(experiment, run_name="locked_cohort", tags=tags).info.run_id
    development = json.loads((root / PARAMS_FILE).read_text())
    seed = settings.locked_phantom_seed
    if seed == int(development["seed"]):
        raise ValueError(f"the locked cohort's seed {seed} is the development phantom's")
    folder = Path(settings.output_dir) / "locked_cohort"
    phantom = folder / f"phantom-seed{seed}-{settings.locked_cases}"
    generate_phantom_cohort(phantom, n_cases=settings.locked_cases, seed=seed, shape=development["shape"],
                            spacing=development["spacing"])
    view, view_split = locked_view(root, split, phantom, folder / f"view-seed{seed}-{settings.locked_cases}")
    table = pd.read_csv(view_split)
    for key, value in {"locked_seed": seed, "development_seed": development["seed"], "locked_cases": settings.locked_cases,
                       "view_split_sha256": split_sha256(view_split)}.items():
        client.log_param(run_id, key, value)
    client.log_metric(run_id, "data/cases/test", float((table["split"] == "test").sum()))
    client.log_metric(run_id, "data/cases/val", float((table["split"] == "val").sum()))
    client.log_artifact(run_id, str(view_split), "split")
    client.set_terminated(run_id, "FINISHED")
    return {"run_id": run_id, "root": str(view), "split": str(view_split), "seed": seed}


def train_action(recipe, variant: str, output_dir: Path) -> Callable[[dict], dict]:
    """The action of a training step: train ``recipe`` into ``output_dir/<variant>/<fingerprint>``."""

    def action(tags: dict) -> dict:
        folder = output_dir / variant / recipe_fingerprint(recipe)
        result = train(recipe, output_dir=folder, variant=variant, extra_tags=tags)
        return {"run_id": result.run_id, "checkpoint": str(result.best_checkpoint or result.last_checkpoint)}

    return action


def evaluate_action(recipe, trained: dict, variant: str, test_set: str = "test") -> Callable[[dict], dict]:
    """The action of an evaluation step: the trained model on validation and test, into a linked run.

    ``test_set`` names the test set in the run's name and its ``test_set`` tag (``test``: the
    split's; ``locked``: the locked cohort's view).
    """

    def action(tags: dict) -> dict:
        run_id, _ = evaluate(recipe, trained["checkpoint"], ("val", "test"), training_run_id=trained["run_id"],
                             run_name=f"{variant}-evaluate-{recipe.name}-{test_set}",
                             extra_tags={**tags, "variant": variant, "test_set": test_set})
        return {"run_id": run_id}

    return action


def validation_records(client: MlflowClient, evaluation_run_id: str) -> tuple[pd.DataFrame, float | None]:
    """The per-case VALIDATION records an evaluation run logged, and its validation-chosen operating point.

    Only ``evaluation/val_records.csv`` is read: targeting never sees test labels. The threshold is
    the run's ``operating_point/val_chosen`` (None when the run has none: the targeting rule then
    uses the fixed m).
    """
    with tempfile.TemporaryDirectory() as folder:
        records = download_records(client, evaluation_run_id, "val", folder)
    if records is None:
        raise RuntimeError(f"evaluation run {evaluation_run_id} logged no validation records; targeting needs them")
    history = client.get_metric_history(evaluation_run_id, OPERATING_POINT_METRIC.format(name="val_chosen"))
    threshold = float(history[-1].value) if history else None
    return records, threshold


def targeting_action(client: MlflowClient, experiment: str, root: Path, split: Path, settings: StudySettings,
                     evaluation_run_id: str, score: str) -> Callable[[dict], dict]:
    """The action of the targeting step: the synthetic budget per cell, from the baseline's validation records."""

    def action(tags: dict) -> dict:
        run_id = client.create_run(experiment, run_name="targeting", tags=tags).info.run_id
        records, threshold = validation_records(client, evaluation_run_id)
        phases = {"phases": settings.target_phases} if settings.target_phases else {}
        # Without a recorded validation-chosen m, the recipe's own detection threshold (not the schema's default).
        detection = segmentation_recipe(settings).detection
        targets = resolve_targets(root, split, settings.target, budget=settings.budget, baseline_records=records,
                                  threshold=threshold, score=score, detection=detection, **phases)
        client.log_param(run_id, "rule", settings.target)
        if settings.target_phases:
            client.log_param(run_id, "target_phases", ",".join(settings.target_phases))
        client.log_param(run_id, "baseline_evaluation_run", evaluation_run_id)
        client.log_text(run_id, targets.to_csv(index=False), TARGETS_ARTIFACT)
        client.log_metric(run_id, "synthx/requested_total", float(targets["requested"].sum()))
        client.set_terminated(run_id, "FINISHED")
        print(f"[study] targeting {settings.target}: {int(targets['requested'].sum())} case(s) requested")
        return {"run_id": run_id, "targets": TARGETS_ARTIFACT}

    return action


def read_targets(client: MlflowClient, targeting_run_id: str) -> pd.DataFrame:
    """The targeting table a targeting step logged."""
    with tempfile.TemporaryDirectory() as folder:
        return pd.read_csv(client.download_artifacts(targeting_run_id, TARGETS_ARTIFACT, folder), keep_default_na=False)


def generator_action(generator_recipe, output_dir: Path) -> Callable[[dict], dict]:
    """The action of the SynthX training step: train into ``output_dir/generator/<recipe key>``.

    One folder per generator recipe, as the backbones have one per fingerprint: a study rerun with
    another generator recipe (say, more steps of another patch size) trains a new generator beside
    the old one instead of refusing the old folder, and a rerun of the same recipe resumes its own.
    """

    def action(tags: dict) -> dict:
        generator_recipe.tracking.tags.update(tags)
        result = train_synthx(generator_recipe, output_dir=output_dir / "generator" / recipe_key(generator_recipe))
        return {"run_id": result.run_id, "pipeline": str(result.pipeline_dir)}

    return action


def synthesize_action(client: MlflowClient, root: Path, split: Path, settings: StudySettings, generator_recipe,
                      generator: dict | None, targeting: dict, synthetic_root: Path, seed: int, uri: str,
                      copy_paste: dict | None = None) -> Callable[[dict], dict]:
    """The action of the synthesis step: paint the targeted cases into matching healthy training scans,
    then log their realism against the real training tumors (:func:`log_realism`), beside the
    copy-paste cohort's when ``copy_paste`` (the copy-paste step's outputs) is given.

    With SynthX, sampling (scheduler, steps, guidance) and the mask prior come from the SynthX recipe;
    the study's ``synthesis_steps`` and ``scheduler`` replace the recipe's only when set. With the
    phantom painter (the positive control) there is no generator: ``generator_recipe`` and
    ``generator`` are None.
    """

    def action(tags: dict) -> dict:
        common = dict(seed=seed, tracking_uri=uri, experiment=settings.experiment, progress=sys.stderr.isatty())
        if generator is None:
            synthesis = SynthesisSettings(root, split, None, synthetic_root, painter=settings.painter, **common)
        else:
            chosen = {key: value for key, value in (("num_inference_steps", settings.synthesis_steps),
                                                    ("scheduler", settings.scheduler)) if value is not None}
            synthesis = SynthesisSettings.from_recipe(generator_recipe, root, split, generator["pipeline"], synthetic_root,
                                                      generator_run_id=generator["run_id"], **common, **chosen)
        summary = synthesize(synthesis, read_targets(client, targeting["run_id"]))
        if not summary.complete:
            raise RuntimeError(f"synthesis incomplete: {len(summary.failed)} failed: {summary.failed}")
        if not summary.generated and not summary.skipped:

            cells = summary.unfillable.to_dict("records") if summary.unfillable is not None else []
            shown = ", ".join(f"{c['sex']}/{c['age_band']}/{c['phase']}" for c in cells[:6]) or "none requested"
            raise GenerationError(
                f"no synthetic case was made, so there is nothing to add to training: every targeted cell is "
                f"unfillable (no healthy training scan of that sex, age band and phase: {shown}); "
                "choose another rule with --target (e.g. need:B with a larger B, or counts:<table>)"
            )
        log_realism(client, summary.synthesis_run_id, root, split, synthetic_root,
                    copy_paste["cohort"] if copy_paste else None, seed)
        return {"run_id": summary.synthesis_run_id, "cohort": str(synthetic_root),
                "cases": len(summary.generated) + len(summary.skipped)}

    return action


def log_realism(client: MlflowClient, run_id: str, root: Path, split: Path, synthetic_root: Path,
                copy_paste_root: str | None, seed: int) -> None:
    """The painted tumors against the real training tumors (:func:`synthx.analysis.quality.quality_report`,
    radiomic realism only, no detector features), logged on ``run_id`` under ``synthx_quality/``
    (``synthx_quality/realism.csv``: per phase, real against ``synthetic`` and ``copy_paste``)."""
    from synthx.commands.synthx_quality import log_quality
    from synthx.analysis.quality import quality_report

    report = quality_report(root, split, synthetic_root, seed=seed, copy_paste_root=copy_paste_root)
    log_quality(report, run_id, client=client)


def copy_paste_action(client: MlflowClient, root: Path, split: Path, settings: StudySettings, generator_recipe,
                      targeting: dict, synthetic_root: Path, seed: int, uri: str) -> Callable[[dict], dict]:
    """The action of the copy-paste synthesis step: real training tumors pasted at SynthX's sites.

    The same targets, seed and mask prior (the SynthX recipe's ``mask_prior``) as the ``synthesize``
    step give the same canvases, sites and sizes (:mod:`synthx.generation.copy_paste`); no generator
    is trained or loaded, so the step needs neither ``synthx_train`` nor ``synthesize``.
    """

    def action(tags: dict) -> dict:
        common = dict(seed=seed, tracking_uri=uri, experiment=settings.experiment, progress=sys.stderr.isatty())
        synthesis = SynthesisSettings.from_recipe(generator_recipe, root, split, None, synthetic_root,
                                                  painter=COPY_PASTE_PAINTER, **common)
        summary = synthesize(synthesis, read_targets(client, targeting["run_id"]))
        if not summary.complete:
            raise RuntimeError(f"copy-paste synthesis incomplete: {len(summary.failed)} failed: {summary.failed}")
        cases = len(summary.generated) + len(summary.skipped)
        if not cases:
            raise GenerationError("the copy-paste painter made no case: every targeted cell is unfillable")
        return {"run_id": summary.synthesis_run_id, "cohort": str(synthetic_root), "cases": cases}

    return action


# The sham arm first: the reference of every comparison (SynthX, copy-paste and the baseline minus sham).
COMPARED_ARMS = ("sham", "synthx", "copy_paste", "baseline")


def compare_action(evaluations: dict[str, dict], uri: str, experiment: str, resamples: int,
                   subgroup: str | None = None) -> Callable[[dict], dict]:
    """The action of the comparison step: paired bootstrap differences against the sham arm, on test.

    One table: rows of run ``synthx`` are SynthX minus sham, rows of run ``copy_paste`` copy-paste
    minus sham, rows of run ``baseline`` baseline minus sham (:data:`COMPARED_ARMS`; an arm the study
    did not train, the copy-paste arm of the positive control, is left out). With ``subgroup`` (the
    primary endpoint's, e.g. ``phase:arterial``) the table also holds the subgroup-matched point.
    """

    def action(tags: dict) -> dict:
        runs = [evaluations[arm]["run_id"] for arm in COMPARED_ARMS if arm in evaluations]
        try:
            _, run_id = compare(runs, "test", uri=uri, experiment=experiment, n_resamples=resamples, subgroup=subgroup)
        except BaseException as error:
            _end_open_comparisons(uri, experiment, runs, final_status(error))
            raise
        return {"run_id": run_id}

    return action


def _end_open_comparisons(uri: str, experiment: str, runs: list[str], status: str) -> None:
    """End the comparison run of these evaluation runs that a stopped or failed comparison left
    RUNNING (it carries the study's tags only once it is complete)."""
    client = MlflowClient(tracking_uri=uri)
    with held_signals():
        for run in client.search_runs([experiment_id(experiment, uri)],
                                      filter_string=f"tags.compared_runs = '{','.join(runs)}' and attributes.status = 'RUNNING'"):
            end_run(uri, run.info.run_id, status)


def synthetic_folder(output_dir: Path, params: dict) -> Path:
    """``<output_dir>/synthetic/<key>``: one folder per synthesis (generator, targeting, sampling, seed).

    A resumed study finds its own folder again; a study with another target (or generator, steps,
    seed) in the same output folder writes a cohort of its own, so it gets its own synthesis run
    and augmented model instead of extending, under the same run, the cohort an earlier study's
    augmented model was trained on.
    """
    return Path(output_dir) / "synthetic" / content_key(params)
