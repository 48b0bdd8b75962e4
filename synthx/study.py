"""The baseline-versus-SynthX study, the project's main job (``benchx study``, MLproject ``main``).

Steps, each an MLflow child run of one parent run (``mlflow.parentRunId``):

1. ``data``: the cohort (the embedded phantom is generated when absent) and its split (the
   committed ``splits/phantom.csv`` for the phantom; made once otherwise), validated;
2. ``baseline``: the backbone trained on real data (``synthx.ratio=0``);
3. ``evaluate_baseline``: subgroup evaluation on validation and test (operating point chosen on
   validation when the recipe says so, ``docs/design.md "Scan-level detection"``);
4. ``targeting``: how many synthetic tumors per (sex, age band, phase) cell. The default rule
   ``need:B`` spends a budget of B cases where the baseline's VALIDATION sensitivity falls short
   (``synthx.targeting``); it reads the baseline's validation records only, never test labels;
5. ``synthx_train``: the SynthX generator trained on the training split's tumors;
6. ``synthesize``: the targeted cases painted into matching healthy training scans;
7. ``augmented``: the same backbone, seed and iterations with the synthetic cohort mixed in at ratio r;
8. ``evaluate_synthx``: the augmented model evaluated as the baseline was;
9. ``compare``: the BenchX table-6 comparison with paired bootstrap differences.

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

import hashlib
import json
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd
from mlflow.tracking import MlflowClient

from lightning_modules.config.recipe import load_recipe
from lightning_modules.run_folder import RunFolderLock, content_key
from lightning_modules.tracking import experiment_id, git_commit, tracking_uri
from synthx.painters import PAINTERS, PHANTOM_PAINTER, SYNTHX_PAINTER

STEP_KEY_TAG = "study_step_key"
STEP_NAME_TAG = "study_step"
PARENT_TAG = "mlflow.parentRunId"
STEPS = ("data", "baseline", "evaluate_baseline", "targeting", "synthx_train", "synthesize", "augmented",
         "evaluate_synthx", "compare")
TARGETS_ARTIFACT = "synthx/targets.csv"
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


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

    def check(self) -> None:
        """Refuse settings that would be silently ignored."""
        if self.target_phases is not None:
            from lightning_modules.data.metadata import PHASES, normalize_phase

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
        self, uri: str, experiment: str, code_version: str, parent_name: str = "study", parent_run_id: str | None = None
    ):
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.experiment = experiment
        self.experiment_id = experiment_id(experiment, uri)
        # A model-training experiment, so the MLflow UI opens it on its runs rather than on GenAI pages.
        self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        self.code_version = code_version
        self.parent_id = parent_run_id or self.client.create_run(
            self.experiment_id, run_name=parent_name, tags={"stage": "study", "git_commit": code_version}
        ).info.run_id
        if parent_run_id:
            self.client.set_tag(parent_run_id, "stage", "study")
            self.client.set_tag(parent_run_id, "git_commit", code_version)
            self.client.set_tag(parent_run_id, "mlflow.runName", parent_name)
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


def segmentation_recipe(settings: StudySettings, extra: Sequence[str] = ()):
    """The backbone recipe of the study: recipe, profile, the study's experiment, overrides, then ``extra``.

    The trainings do not validate the real cohort again (``data.validate=false``): the ``data`` step
    has just validated it, and reading every scan twice more costs minutes on a CPU. The split's
    leakage audit still runs before each training.
    """
    return load_recipe(
        settings.recipe,
        [f"profile={settings.profile}", f"tracking.experiment={settings.experiment}", "data.validate=false",
         *settings.overrides, *extra],
    )


def _generator_recipe(settings: StudySettings, root: Path, split: Path, uri: str):
    from synthx.config import load_synthx_recipe

    return load_synthx_recipe(
        settings.synthx_recipe,
        [f"profile={settings.profile}", f"data.root={root}", f"data.split={split}",
         f"tracking.experiment={settings.experiment}", f"tracking.uri={uri}", *settings.synthx_overrides],
    )


def _recipe_params(recipe) -> dict:
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(recipe, resolve=True)
    container.pop("tracking", None)
    container.pop("profiles", None)
    return container


# ----------------------------------------------------------------------------------------------
# Steps: each returns the outputs of its MLflow run (at least ``run_id``).


def data_step(client: MlflowClient, experiment: str, tags: dict, root: Path, split: Path, settings: StudySettings) -> dict:
    """Generate the phantom cohort when absent, make the split when absent, validate both."""
    from lightning_modules.data.cohort import load_cohort
    from lightning_modules.data.splits import load_split, make_splits, split_sha256, write_split
    from lightning_modules.data.validation import validate_cohort

    run_id = client.create_run(experiment, run_name="data", tags=tags).info.run_id
    if not (root / "metadata.csv").exists():
        from lightning_modules.data.phantom import DEFAULT_CASES, generate_phantom_cohort

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


def train_action(recipe, variant: str, output_dir: Path) -> Callable[[dict], dict]:
    """The action of a training step: train ``recipe`` into ``output_dir/<variant>/<fingerprint>``."""

    def action(tags: dict) -> dict:
        from lightning_modules.training import recipe_fingerprint, train

        folder = output_dir / variant / recipe_fingerprint(recipe)
        result = train(recipe, output_dir=folder, variant=variant, extra_tags=tags)
        return {"run_id": result.run_id, "checkpoint": str(result.best_checkpoint or result.last_checkpoint)}

    return action


def evaluate_action(recipe, trained: dict, variant: str) -> Callable[[dict], dict]:
    """The action of an evaluation step: the trained model on validation and test, into a linked run."""

    def action(tags: dict) -> dict:
        from lightning_modules.evaluation.runs import evaluate

        run_id, _ = evaluate(recipe, trained["checkpoint"], ("val", "test"), training_run_id=trained["run_id"],
                             run_name=f"{variant}-evaluate-{recipe.name}", extra_tags={**tags, "variant": variant})
        return {"run_id": run_id}

    return action


def validation_records(client: MlflowClient, evaluation_run_id: str) -> tuple[pd.DataFrame, float | None]:
    """The per-case VALIDATION records an evaluation run logged, and its validation-chosen operating point.

    Only ``evaluation/val_records.csv`` is read: targeting never sees test labels. The threshold is
    the run's ``operating_point/val_chosen`` (None when the run has none: the targeting rule then
    uses the fixed m).
    """
    from lightning_modules.evaluation.artifacts import download_records
    from lightning_modules.evaluation.runs import OPERATING_POINT_METRIC

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
        from synthx.targeting import resolve_targets

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
        from synthx.training import recipe_key, train_synthx

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
        from synthx.generation import SynthesisSettings, synthesize

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
            from synthx.generation.canvases import GenerationError

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


def compare_action(evaluations: dict[str, dict], uri: str, experiment: str, resamples: int) -> Callable[[dict], dict]:
    """The action of the comparison step: paired bootstrap differences, baseline vs SynthX, on test."""

    def action(tags: dict) -> dict:
        from lightning_modules.evaluation.runs import compare

        _, run_id = compare([evaluations["baseline"]["run_id"], evaluations["synthx"]["run_id"]], "test", uri=uri,
                            experiment=experiment, n_resamples=resamples)
        return {"run_id": run_id}

    return action


# ----------------------------------------------------------------------------------------------
# The study


def _open_runner(settings: StudySettings) -> StudyRunner:
    """The runner; under ``mlflow run`` the run it opened is the study's parent, and its experiment the study's."""
    uri = tracking_uri(segmentation_recipe(settings).tracking.uri)
    parent_run_id = os.environ.get("MLFLOW_RUN_ID")
    if parent_run_id:
        client = MlflowClient(tracking_uri=uri)
        settings.experiment = client.get_experiment(client.get_run(parent_run_id).info.experiment_id).name
    return StudyRunner(uri, settings.experiment, git_commit(), parent_name=f"study-{segmentation_recipe(settings).name}",
                       parent_run_id=parent_run_id)


def _baseline_steps(runner: StudyRunner, settings: StudySettings, root: Path, split: Path) -> tuple:
    """data, baseline, evaluate_baseline; returns (baseline recipe, baseline outputs, evaluation outputs)."""
    output_dir = Path(settings.output_dir)
    runner.step("data", {"root": str(root), "split": str(split), "cases": settings.cases, "seed": settings.phantom_seed},
                lambda tags: data_step(runner.client, runner.experiment_id, tags, root, split, settings))
    recipe = segmentation_recipe(settings, ["synthx.ratio=0"])
    baseline = runner.step("baseline", _recipe_params(recipe), train_action(recipe, "baseline", output_dir))
    evaluation = runner.step("evaluate_baseline", {"training_run": baseline["run_id"], "recipe": _recipe_params(recipe),
                                                   "checkpoint": Path(baseline["checkpoint"]).name},
                             evaluate_action(recipe, baseline, "baseline"))
    return recipe, baseline, evaluation


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


def _publish_comparison(runner: StudyRunner, comparison: dict) -> pd.DataFrame:
    """Copy the comparison's text table onto the parent run, print it, and return the comparison table."""
    client = runner.client
    with tempfile.TemporaryDirectory() as folder:
        table = pd.read_csv(client.download_artifacts(comparison["run_id"], "comparison/test_comparison.csv", folder))
        text = Path(client.download_artifacts(comparison["run_id"], "comparison/test_comparison.txt", folder)).read_text()
    client.log_text(runner.parent_id, text, "comparison/test_comparison.txt")
    client.set_tag(runner.parent_id, "comparison_run_id", comparison["run_id"])
    print(text)
    return table


def run_study(settings: StudySettings) -> pd.DataFrame:
    """Run (or resume) the study, step by step (see the module docstring); returns the comparison table.

    One study per output folder at a time: a second process is refused, naming the holder.
    """
    settings.check()
    with RunFolderLock(settings.output_dir, "benchx study") as lock:
        if lock.takeover_note:
            print(f"[study] {lock.takeover_note}")
        return _run_study(settings)


def _run_study(settings: StudySettings) -> pd.DataFrame:
    runner = _open_runner(settings)
    base = segmentation_recipe(settings)
    root, split = Path(base.data.root), Path(base.data.split)
    try:
        baseline_recipe, _, baseline_evaluation = _baseline_steps(runner, settings, root, split)
        synthesis = _synthx_steps(runner, settings, root, split, baseline_evaluation, str(base.detection.score),
                                  int(base.seed))
        augmented_recipe = segmentation_recipe(
            settings, [f"synthx.ratio={settings.ratio}", f"synthx.cohort={synthesis['cohort']}"]
        )
        augmented = runner.step("augmented", {**_recipe_params(augmented_recipe), "synthesis_run": synthesis["run_id"]},
                                train_action(augmented_recipe, "synthx", Path(settings.output_dir)))
        synthx_evaluation = runner.step(
            "evaluate_synthx", {"training_run": augmented["run_id"], "recipe": _recipe_params(augmented_recipe),
                                "checkpoint": Path(augmented["checkpoint"]).name},
            evaluate_action(augmented_recipe, augmented, "synthx"),
        )
        evaluations = {"baseline": baseline_evaluation, "synthx": synthx_evaluation}
        comparison = runner.step(
            "compare", {"runs": [baseline_evaluation["run_id"], synthx_evaluation["run_id"]]},
            compare_action(evaluations, runner.uri, settings.experiment, int(base.detection.bootstrap_resamples)),
        )
        table = _publish_comparison(runner, comparison)
        from synthx.report import publish_study

        print(f"[study] report: {publish_study(runner.uri, runner.parent_id, settings.output_dir)}")
    except BaseException:
        runner.finish("FAILED")
        raise
    runner.finish()
    print(f"[study] parent run {runner.parent_id} in experiment '{settings.experiment}' ({runner.uri})")
    print(f"[study] MLflow UI: {ui_command(runner.uri, runner.experiment_id)}")
    print(verdict_text(table))
    return table


def ui_command(uri: str, experiment_id: str, port: int = 5000) -> str:
    """The command that opens the study's runs in the MLflow UI, and the page to open (the runs
    view of the experiment, not MLflow 3's GenAI overview)."""
    return (f"mlflow ui --backend-store-uri {uri} --port {port}, then open "
            f"http://127.0.0.1:{port}/#/experiments/{experiment_id}/runs")


def verdict_text(comparison: pd.DataFrame) -> str:
    """The verdict sentences the study ends on (:func:`synthx.verdict.study_verdict`)."""
    from synthx.verdict import study_verdict

    lines = study_verdict(comparison)
    return "Verdict (test):\n" + "\n".join(f"  {line}" for line in lines) if lines else "Verdict: no designed subgroup in the comparison"
