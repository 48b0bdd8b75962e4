"""The baseline / sham / SynthX study, the project's main job (``benchx study``, MLproject ``main``).

Before any step, the pre-specified primary endpoint is logged on the parent run
(:mod:`synthx.endpoint`, ``docs/design.md "The primary endpoint"``). Steps, each an MLflow child
run of one parent run (``mlflow.parentRunId``):

1. ``data``: the cohort (the embedded phantom is generated when absent) and its split (the
   committed ``splits/phantom.csv`` for the phantom; made once otherwise), validated;
2. ``locked_cohort`` (phantom cohorts): the locked test cohort, a phantom of another seed that no
   design decision has seen, viewed together with the development validation split
   (``docs/design.md "The locked test cohort"``);
3. ``baseline``: the backbone trained on real data, on the exposure-matched schedule's real draws
   (``synthx.real_steps``, ``docs/design.md "Arms with equal real exposure"``);
4. ``evaluate_baseline``: subgroup evaluation on validation and the development test split
   (operating point chosen on validation when the recipe says so, ``docs/design.md "Scan-level detection"``);
5. ``targeting``: how many synthetic tumors per (sex, age band, phase) cell. The default rule
   ``need:B`` spends a budget of B cases where the baseline's VALIDATION sensitivity falls short
   (``synthx.targeting``); it reads the baseline's validation records only, never test labels;
6. ``synthx_train``: the SynthX generator trained on the training split's tumors;
7. ``synthesize``: the targeted cases painted into matching healthy training scans;
8. ``sham``: the augmented schedule (real_steps x (1 + r) steps, the baseline's real draws) with each
   synthetic slot filled by a real training positive of the synthetic case's cell;
9. ``augmented``: the same schedule with the synthetic cases;
10. ``evaluate_locked_baseline``, ``evaluate_sham``, ``evaluate_synthx``: the three arms on the
    study's test set (the locked cohort; the split's test set for other cohorts), operating points
    chosen on the development validation split;
11. ``compare``: the BenchX table-6 comparison with paired bootstrap differences against the sham
    arm: SynthX minus sham (the primary endpoint and the secondary family) and baseline minus sham
    (what the schedule alone does).

The positive control (``painter="phantom"``, ``benchx study --painter phantom``): on the embedded
phantom, the phantom's own renderer paints the targeted tumors instead of SynthX (no
``synthx_train`` step), with the same targeting, canvases, ratio and training; it shows what the
study can detect when the added tumors are as real as the phantom's
(:mod:`synthx.generation.phantom_painter`).

Resumable: a step is skipped when an identical finished run exists (same step, parameters and code
version: the key is a hash of the three, stored as the tag ``study_step_key``), so rerunning the
same command after a failure only does what is missing; an interrupted training resumes from its
``last.ckpt`` into its MLflow run.

Example::

    benchx study --recipe recipes/unet.yaml --profile cpu
    mlflow run . --env-manager local                       # the same, as MLproject `main`
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import hashlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import pandas as pd
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from lightning_modules.cohorts.phantom import DEFAULT_CASES, generate_phantom_cohort, PARAMS_FILE
from lightning_modules.recipe import load_recipe, recipe_variant
from lightning_modules.data.cohort import load_cohort, write_metadata
from lightning_modules.data.exposure import matched_total_steps
from lightning_modules.data.metadata import normalize_phase, PHASES
from lightning_modules.data.splits import load_split, make_splits, split_sha256, write_split
from lightning_modules.data.validation import validate_cohort
from lightning_modules.evaluation.artifacts import download_records
from lightning_modules.process import git_commit
from lightning_modules.run_folder import content_key, RunFolderLock
from lightning_modules.tracking import experiment_id, mark_model_experiment, tracking_uri
from lightning_modules.workflows.evaluate import compare, evaluate, OPERATING_POINT_METRIC
from lightning_modules.workflows.train import recipe_fingerprint, train
from synthx.config import load_synthx_recipe
from synthx.endpoint import endpoint_summary, label_results, log_endpoint, PrimaryEndpoint
from synthx.generation import SynthesisSettings, synthesize
from synthx.generation.canvases import GenerationError
from synthx.painters import PAINTERS, PHANTOM_PAINTER, SYNTHX_PAINTER
from synthx.targeting import resolve_targets
from synthx.training import recipe_key, train_synthx
from synthx.verdict import study_verdict
from synthx.workflows.report import publish_study

STEP_KEY_TAG = "study_step_key"
STEP_NAME_TAG = "study_step"
PARENT_TAG = "mlflow.parentRunId"
STEPS = ("data", "locked_cohort", "baseline", "evaluate_baseline", "targeting", "synthx_train", "synthesize", "sham",
         "augmented", "evaluate_locked_baseline", "evaluate_sham", "evaluate_synthx", "compare")
TARGETS_ARTIFACT = "synthx/targets.csv"
# The locked cohort's size: the positive control's effect on arterial sensitivity detectable with 80%
# power (``python -m synthx.power``, docs/design.md "The locked test cohort").
LOCKED_CASES = 307
LOCKED_SEED_OFFSET = 1000  # the locked phantom's seed: the development phantom's seed + this
LOCKED_PREFIX = "L"  # the locked cases' and patients' ids in the evaluation view


@dataclass
class StudySettings:
    """Everything that defines a study; the steps' parameters are derived from it."""

    recipe: str = "recipes/unet.yaml"
    profile: str = "cpu"
    overrides: list[str] = field(default_factory=list)
    synthx_recipe: str = "recipes/generator/synthx.yaml"
    synthx_overrides: list[str] = field(default_factory=list)
    cases: int | None = None  # phantom cases when the cohort is generated (None: the phantom's default)
    phantom_seed: int = 0
    ratio: float = 0.3
    target: str = "need:20"
    budget: int | None = None
    synthesis_steps: int | None = None  # None: the SynthX recipe's sampling.num_inference_steps
    scheduler: str | None = None  # None: the SynthX recipe's sampling.scheduler
    experiment: str = "benchx-study"
    output_dir: str = "outputs/study"
    # "synthx": the diffusion generator is trained and paints; "phantom": the phantom's own renderer
    # paints real-appearance tumors (the positive control, synthx.generation.phantom_painter).
    painter: str = SYNTHX_PAINTER
    # Restrict the targeted cells to these contrast phases (None: every phase), e.g. ["arterial"].
    target_phases: list[str] | None = None
    # The locked test cohort (phantom cohorts only): scans, and the phantom seed (None: the
    # development phantom's seed + LOCKED_SEED_OFFSET). 0 cases: test on the split's test set.
    locked_cases: int = LOCKED_CASES
    locked_seed: int | None = None
    endpoint: PrimaryEndpoint = field(default_factory=PrimaryEndpoint)

    @property
    def locked_phantom_seed(self) -> int:
        return self.phantom_seed + LOCKED_SEED_OFFSET if self.locked_seed is None else int(self.locked_seed)

    def check(self) -> None:
        """Refuse settings that would be silently ignored."""
        if self.locked_cases and self.locked_phantom_seed == self.phantom_seed:
            raise ValueError(f"the locked test cohort needs a phantom seed other than the development cohort's "
                             f"({self.phantom_seed}); choose another --locked-seed")
        if self.locked_cases < 0:
            raise ValueError("--locked-cases must be 0 (test on the split's test set) or a number of scans")
        if self.target_phases is not None:

            phases = [normalize_phase(p) for p in self.target_phases]
            unknown = [p for p, n in zip(self.target_phases, phases) if n not in PHASES]
            if unknown or not phases:
                raise ValueError(f"target phases must be among {', '.join(PHASES)}; got {list(self.target_phases)!r}")
            self.target_phases = sorted(set(phases), key=PHASES.index)
        if self.painter not in PAINTERS:
            raise ValueError(f"unknown painter {self.painter!r} (expected one of {', '.join(PAINTERS)})")
        if self.painter == PHANTOM_PAINTER:
            unused = [name for name, value in (
                ("--synthx-override", self.synthx_overrides), ("--synthesis-steps", self.synthesis_steps),
                ("scheduler", self.scheduler),
                ("--synthx-recipe", self.synthx_recipe if self.synthx_recipe != StudySettings.synthx_recipe else None),
            ) if value]
            if unused:
                raise ValueError(f"--painter phantom trains and samples no generator, so {', '.join(unused)} would be "
                                 "ignored; drop it or use --painter synthx")


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished child processes (the phantom's render workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class StudyRunner:
    """Runs named steps as child runs of one parent, skipping those already finished identically."""

    def __init__(
        self, uri: str, experiment: str, code_version: str, parent_name: str = "study", parent_run_id: str | None = None,
        parent_tags: dict[str, str] | None = None,
    ):
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.experiment = experiment
        self.experiment_id = experiment_id(experiment, uri)
        mark_model_experiment(self.client, self.experiment_id)
        self.code_version = code_version
        self.parent_id = parent_run_id or self.client.create_run(
            self.experiment_id, run_name=parent_name, tags={"stage": "study", "git_commit": code_version, **(parent_tags or {})}
        ).info.run_id
        if parent_run_id:
            for tag, value in {"stage": "study", "git_commit": code_version, "mlflow.runName": parent_name,
                               **(parent_tags or {})}.items():
                self.client.set_tag(parent_run_id, tag, value)
        self.outputs: dict[str, dict] = {}

    def key(self, name: str, params: dict) -> str:
        payload = json.dumps({"step": name, "params": params, "code": self.code_version}, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:20]

    def finished(self, key: str) -> dict | None:
        """Outputs of a finished run with this step key, if any (the most recent)."""
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.{STEP_KEY_TAG} = '{key}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if not runs:
            return None
        outputs = runs[0].data.tags.get("study_outputs")
        return json.loads(outputs) if outputs else None

    def step(self, name: str, params: dict, action: Callable[[dict], dict]) -> dict:
        """Run ``action(tags) -> outputs`` unless an identical finished step exists.

        ``tags`` must be put on the MLflow run the action creates; ``outputs`` must hold its
        ``run_id``. Outputs are stored on that run, so a later study can reuse them.
        """
        key = self.key(name, params)
        previous = self.finished(key)
        if previous is not None:
            print(f"[study] {name}: identical finished run {previous['run_id']} reused")
            self.client.set_tag(self.parent_id, f"step.{name}", previous["run_id"])
            self.outputs[name] = previous
            return previous
        print(f"[study] {name}: running")
        started, cpu_started = time.time(), _cpu_seconds()
        tags = {PARENT_TAG: self.parent_id, STEP_NAME_TAG: name}
        outputs = action(tags)
        run_id = outputs["run_id"]
        outputs = {k: (str(v) if isinstance(v, Path) else v) for k, v in outputs.items()}
        for tag, value in tags.items():
            self.client.set_tag(run_id, tag, value)
        self.client.set_tag(run_id, "study_outputs", json.dumps(outputs, default=str))
        run = self.client.get_run(run_id)
        if run.info.status != "FINISHED":
            self.client.set_terminated(run_id, "FINISHED")
        # The key goes on last: a run carries it only once its outputs are complete.
        self.client.set_tag(run_id, STEP_KEY_TAG, key)
        self.client.set_tag(self.parent_id, f"step.{name}", run_id)
        wall, cpu = time.time() - started, _cpu_seconds() - cpu_started
        self.client.log_metric(self.parent_id, f"study/seconds/{name}", wall)
        self.client.log_metric(self.parent_id, f"study/cpu_seconds/{name}", cpu)
        print(f"[study] {name}: done in {wall:.0f} s wall, {cpu:.0f} s CPU (run {run_id})")
        self.outputs[name] = outputs
        return outputs

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.parent_id, status)


# ----------------------------------------------------------------------------------------------
# Recipes


def segmentation_recipe(settings: StudySettings, *variants: Mapping):
    """The backbone recipe of the study: recipe, profile, the study's experiment and overrides, loaded
    from YAML once per study; each of ``variants`` (nested typed values, e.g. an arm's
    :func:`arm_values`) is then merged in memory and checked again (:func:`recipe_variant`).

    The trainings do not validate the real cohort again (``data.validate=false``): the ``data`` step
    has just validated it, and reading every scan twice more costs minutes on a CPU. The split's
    leakage audit still runs before each training.
    """
    path = Path(settings.recipe)
    stamp = path.stat() if path.is_file() else None
    recipe = copy.deepcopy(_loaded_recipe(str(path), settings.profile, settings.experiment, tuple(settings.overrides),
                                          (stamp.st_mtime_ns, stamp.st_size) if stamp else None))
    for values in variants:
        recipe = recipe_variant(recipe, values, source=f"{settings.recipe} (study variant)")
    return recipe


@functools.lru_cache(maxsize=16)
def _loaded_recipe(path: str, profile: str, experiment: str, overrides: tuple[str, ...], stamp) -> DictConfig:
    """The study's recipe as loaded from its file (``stamp``: the file's mtime and size, so an edited
    file is read again)."""
    return load_recipe(path, [f"profile={profile}", f"tracking.experiment={experiment}", "data.validate=false",
                              *overrides])


def _generator_recipe(settings: StudySettings, root: Path, split: Path, uri: str):
    return load_synthx_recipe(
        settings.synthx_recipe,
        [f"profile={settings.profile}", f"data.root={root}", f"data.split={split}",
         f"tracking.experiment={settings.experiment}", f"tracking.uri={uri}", *settings.synthx_overrides],
    )


def _recipe_params(recipe) -> dict:
    container = OmegaConf.to_container(recipe, resolve=True, enum_to_str=True)
    container.pop("tracking", None)
    container.pop("profiles", None)
    return container


# ----------------------------------------------------------------------------------------------
# Steps: each returns the outputs of its MLflow run (at least ``run_id``).


@contextlib.contextmanager
def cohort_lock(root: Path):
    """An exclusive ``flock`` on ``<root>.lock`` while a process makes the cohort or its split, so
    that processes started together wait for the first instead of writing the same files."""
    lock = Path(root).parent / f".{Path(root).name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


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
        raise RuntimeError("cohort problems:\n" + "\n".join(str(p) for p in problems))
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
        targets = resolve_targets(root, split, settings.target, budget=settings.budget, baseline_records=records,
                                  threshold=threshold, score=score, **phases)
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
                      generator: dict | None, targeting: dict, synthetic_root: Path, seed: int, uri: str) -> Callable[[dict], dict]:
    """The action of the synthesis step: paint the targeted cases into matching healthy training scans.

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
        return {"run_id": summary.synthesis_run_id, "cohort": str(synthetic_root),
                "cases": len(summary.generated) + len(summary.skipped)}

    return action


COMPARED_ARMS = ("sham", "synthx", "baseline")  # the sham arm first: the reference of both comparisons


def compare_action(evaluations: dict[str, dict], uri: str, experiment: str, resamples: int) -> Callable[[dict], dict]:
    """The action of the comparison step: paired bootstrap differences against the sham arm, on test.

    One table: rows of run ``synthx`` are SynthX minus sham, rows of run ``baseline`` baseline minus
    sham (:data:`COMPARED_ARMS`).
    """

    def action(tags: dict) -> dict:
        _, run_id = compare([evaluations[arm]["run_id"] for arm in COMPARED_ARMS], "test", uri=uri,
                            experiment=experiment, n_resamples=resamples)
        return {"run_id": run_id}

    return action


# ----------------------------------------------------------------------------------------------
# The study


def _open_runner(settings: StudySettings, parent_tags: dict[str, str] | None = None) -> StudyRunner:
    """The runner; under ``mlflow run`` the run it opened is the study's parent, and its experiment the study's."""
    uri = tracking_uri(segmentation_recipe(settings).tracking.uri)
    parent_run_id = os.environ.get("MLFLOW_RUN_ID")
    if parent_run_id:
        client = MlflowClient(tracking_uri=uri)
        settings.experiment = client.get_experiment(client.get_run(parent_run_id).info.experiment_id).name
    return StudyRunner(uri, settings.experiment, git_commit(), parent_name=f"study-{segmentation_recipe(settings).name}",
                       parent_run_id=parent_run_id, parent_tags=parent_tags)


def arm_values(settings: StudySettings, arm: str, cohort: str | None = None) -> dict:
    """The recipe values of an arm on the exposure-matched schedule (``docs/design.md "Arms with equal real exposure"``).

    The recipe's ``trainer.max_steps`` (with the study's overrides) are the real steps S of every
    arm; the sham and SynthX arms train S x (1 + r) steps, their extra draws being synthetic slots.
    """
    real_steps = int(segmentation_recipe(settings).trainer.max_steps)
    if arm == "baseline":
        return {"synthx": {"ratio": 0.0, "real_steps": real_steps}}
    mixing = {"ratio": float(settings.ratio), "cohort": str(cohort), "real_steps": real_steps}
    if arm == "sham":
        mixing["sham"] = True
    return {"synthx": mixing, "trainer": {"max_steps": matched_total_steps(real_steps, settings.ratio)}}


def _baseline_steps(runner: StudyRunner, settings: StudySettings, root: Path, split: Path) -> tuple:
    """data, locked_cohort, baseline, evaluate_baseline; returns (baseline recipe, baseline outputs,
    evaluation outputs, locked cohort outputs or None)."""
    output_dir = Path(settings.output_dir)
    runner.step("data", {"root": str(root), "split": str(split), "cases": settings.cases, "seed": settings.phantom_seed},
                lambda tags: data_step(runner.client, runner.experiment_id, tags, root, split, settings))
    locked = None

    if settings.locked_cases and (root / PARAMS_FILE).is_file():
        locked = runner.step(
            "locked_cohort", {"root": str(root), "split": str(split), "cases": settings.locked_cases,
                              "seed": settings.locked_phantom_seed, "output_dir": str(output_dir)},
            lambda tags: locked_cohort_step(runner.client, runner.experiment_id, tags, root, split, settings),
        )
    recipe = segmentation_recipe(settings, arm_values(settings, "baseline"))
    baseline = runner.step("baseline", _recipe_params(recipe), train_action(recipe, "baseline", output_dir))
    evaluation = runner.step("evaluate_baseline", {"training_run": baseline["run_id"], "recipe": _recipe_params(recipe),
                                                   "checkpoint": Path(baseline["checkpoint"]).name},
                             evaluate_action(recipe, baseline, "baseline"))
    return recipe, baseline, evaluation, locked


def _synthx_steps(runner: StudyRunner, settings: StudySettings, root: Path, split: Path, evaluation: dict,
                  score: str, seed: int) -> dict:
    """targeting, synthx_train, synthesize; returns the synthesis outputs (``cohort`` is the synthetic folder).

    With the phantom painter there is no generator to train: targeting, then synthesize.
    """
    output_dir = Path(settings.output_dir)
    targeting_params = {"rule": settings.target, "budget": settings.budget, "baseline_evaluation": evaluation["run_id"]}
    if settings.target_phases:  # only when set, so the keys of earlier studies stay valid
        targeting_params["phases"] = list(settings.target_phases)
    targeting = runner.step(
        "targeting", targeting_params,
        targeting_action(runner.client, runner.experiment_id, root, split, settings, evaluation["run_id"], score),
    )
    if settings.painter != SYNTHX_PAINTER:
        params = {"painter": settings.painter, "targeting": targeting["run_id"], "seed": seed}
        return runner.step("synthesize", params,
                           synthesize_action(runner.client, root, split, settings, None, None, targeting,
                                             synthetic_folder(output_dir, params), seed, runner.uri))
    generator_recipe = _generator_recipe(settings, root, split, runner.uri)
    generator = runner.step("synthx_train", _recipe_params(generator_recipe), generator_action(generator_recipe, output_dir))
    params = {"generator": generator["run_id"], "targeting": targeting["run_id"], "steps": settings.synthesis_steps,
              "scheduler": settings.scheduler, "seed": seed}
    return runner.step(
        "synthesize", params,
        synthesize_action(runner.client, root, split, settings, generator_recipe, generator, targeting,
                          synthetic_folder(output_dir, params), seed, runner.uri),
    )


def synthetic_folder(output_dir: Path, params: dict) -> Path:
    """``<output_dir>/synthetic/<key>``: one folder per synthesis (generator, targeting, sampling, seed).

    A resumed study finds its own folder again; a study with another target (or generator, steps,
    seed) in the same output folder writes a cohort of its own, so it gets its own synthesis run
    and augmented model instead of extending, under the same run, the cohort an earlier study's
    augmented model was trained on.
    """
    return Path(output_dir) / "synthetic" / content_key(params)


def _publish_comparison(runner: StudyRunner, comparison: dict, endpoint: PrimaryEndpoint) -> pd.DataFrame:
    """Copy the comparison's text table onto the parent run with each row's role (primary, secondary,
    schedule) and the primary result; print them and return the labelled comparison table."""
    client = runner.client
    with tempfile.TemporaryDirectory() as folder:
        table = pd.read_csv(client.download_artifacts(comparison["run_id"], "comparison/test_comparison.csv", folder))
        text = Path(client.download_artifacts(comparison["run_id"], "comparison/test_comparison.txt", folder)).read_text()
    table = label_results(table, endpoint)
    summary = endpoint_summary(table, endpoint)
    client.log_text(runner.parent_id, text, "comparison/test_comparison.txt")
    client.log_text(runner.parent_id, table.to_csv(index=False), "comparison/test_roles.csv")
    client.log_text(runner.parent_id, summary + "\n", "comparison/primary_endpoint.txt")
    primary = table[table["role"] == "primary"]
    if not primary.empty:
        for column in ("delta", "ci_low", "ci_high", "p_family"):
            value = float(primary[column].iloc[0])
            if value == value:  # NaN is not logged
                client.log_metric(runner.parent_id, f"endpoint/{column}", value)
    client.set_tag(runner.parent_id, "comparison_run_id", comparison["run_id"])
    print(text)
    print(summary)
    return table


def baseline_test_sets(client: MlflowClient, development_run: str, locked_run: str) -> pd.DataFrame:
    """The baseline's test subgroup table on the development split beside the locked cohort's."""
    columns = ["n_patients", "positives", "negatives", "sensitivity", "specificity", "f1", "auc"]
    with tempfile.TemporaryDirectory() as folder:
        tables = [pd.read_csv(client.download_artifacts(run, "evaluation/test_subgroups.csv", f"{folder}/{i}"))
                  for i, run in enumerate((development_run, locked_run))]
    kept = [c for c in columns if c in tables[0].columns and c in tables[1].columns]
    parts = [t[["attribute", "group", *kept]].astype({"group": str}) for t in tables]
    return parts[0].merge(parts[1], on=["attribute", "group"], how="outer", suffixes=("_development", "_locked"))


def run_study(settings: StudySettings, parent_tags: dict[str, str] | None = None) -> pd.DataFrame:
    """Run (or resume) the study, step by step (see the module docstring); returns the comparison table.

    One study per output folder at a time: a second process is refused, naming the holder.
    ``parent_tags`` go on the study's parent run (a replicate's set and seed, :mod:`synthx.workflows.replicates`).
    """
    settings.check()
    with RunFolderLock(settings.output_dir, "benchx study") as lock:
        if lock.takeover_note:
            print(f"[study] {lock.takeover_note}")
        return _run_study(settings, parent_tags)


def _evaluate_arm(runner: StudyRunner, settings: StudySettings, name: str, arm: str, trained: dict,
                  extra: dict, locked: dict | None) -> dict:
    """Evaluate one arm on the study's test set: the locked cohort's view when there is one."""
    view = {"data": {"root": str(locked["root"]), "split": str(locked["split"])}} if locked else {}
    recipe = segmentation_recipe(settings, extra, view)
    return runner.step(name, {"training_run": trained["run_id"], "recipe": _recipe_params(recipe),
                              "checkpoint": Path(trained["checkpoint"]).name},
                       evaluate_action(recipe, trained, arm, "locked" if locked else "test"))


def _run_study(settings: StudySettings, parent_tags: dict[str, str] | None = None) -> pd.DataFrame:
    runner = _open_runner(settings, parent_tags)
    base = segmentation_recipe(settings)
    root, split = Path(base.data.root), Path(base.data.split)
    # The primary endpoint is fixed before anything is trained or evaluated.
    log_endpoint(runner.client, runner.parent_id, settings.endpoint)
    output_dir = Path(settings.output_dir)
    try:
        _, baseline, baseline_evaluation, locked = _baseline_steps(runner, settings, root, split)
        synthesis = _synthx_steps(runner, settings, root, split, baseline_evaluation, str(base.detection.score),
                                  int(base.seed))
        trained, extras = {"baseline": baseline}, {"baseline": arm_values(settings, "baseline")}
        for arm, step in (("sham", "sham"), ("synthx", "augmented")):
            extras[arm] = arm_values(settings, arm, synthesis["cohort"])
            recipe = segmentation_recipe(settings, extras[arm])
            trained[arm] = runner.step(step, {**_recipe_params(recipe), "synthesis_run": synthesis["run_id"]},
                                       train_action(recipe, arm, output_dir))
        evaluations = {"baseline": baseline_evaluation}
        if locked:
            evaluations["baseline"] = _evaluate_arm(runner, settings, "evaluate_locked_baseline", "baseline",
                                                    baseline, extras["baseline"], locked)
        for arm in ("sham", "synthx"):
            evaluations[arm] = _evaluate_arm(runner, settings, f"evaluate_{arm}", arm, trained[arm], extras[arm], locked)
        comparison = runner.step(
            "compare", {"runs": [evaluations[arm]["run_id"] for arm in COMPARED_ARMS]},
            compare_action(evaluations, runner.uri, settings.experiment, int(base.detection.bootstrap_resamples)),
        )
        table = _publish_comparison(runner, comparison, settings.endpoint)
        if locked:
            side_by_side = baseline_test_sets(runner.client, baseline_evaluation["run_id"], evaluations["baseline"]["run_id"])
            runner.client.log_text(runner.parent_id, side_by_side.to_csv(index=False), "study/baseline_test_sets.csv")
            print("[study] the baseline on the development test split and on the locked cohort:")
            print(side_by_side.to_string(index=False))

        print(f"[study] report: {publish_study(runner.uri, runner.parent_id, settings.output_dir)}")
    except BaseException:
        runner.finish("FAILED")
        raise
    runner.finish()
    print(f"[study] parent run {runner.parent_id} in experiment '{settings.experiment}' ({runner.uri})")
    print(f"[study] MLflow UI: {ui_command(runner.uri, runner.experiment_id)}")
    print(verdict_text(table, settings.endpoint))
    return table


def ui_command(uri: str, experiment_id: str, port: int = 5000) -> str:
    """The command that opens the study's runs in the MLflow UI, and the page to open (the runs
    view of the experiment, not MLflow 3's GenAI overview)."""
    return (f"mlflow ui --backend-store-uri {uri} --port {port}, then open "
            f"http://127.0.0.1:{port}/#/experiments/{experiment_id}/runs")


def verdict_text(comparison: pd.DataFrame, endpoint: PrimaryEndpoint | None = None) -> str:
    """The verdict sentences the study ends on (:func:`synthx.verdict.study_verdict`)."""
    lines = study_verdict(comparison, endpoint=endpoint)
    return "Verdict (test):\n" + "\n".join(f"  {line}" for line in lines) if lines else "Verdict: no designed subgroup in the comparison"
