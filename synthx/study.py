"""``benchx study``: the baseline-versus-SynthX study, the project's main job (MLproject ``main``).

Steps, each an MLflow run under one parent run (``mlflow.parentRunId``):

1. ``data``: the cohort (the embedded phantom is generated when absent) and its split (the
   committed ``splits/phantom.csv`` for the phantom; made once otherwise), validated;
2. ``baseline``: the backbone trained on real data (``synthx.ratio=0``);
3. ``synthx_train``: the SynthX generator trained on the training split's tumors;
4. ``synthesize``: targeted generation on healthy training canvases (default rule
   ``min_positives:k``: bring every (sex, age band, phase) cell to at least k tumor cases);
5. ``augmented``: the same backbone, seed and iterations with the synthetic cohort mixed in at ratio r;
6. ``evaluate_baseline`` / ``evaluate_augmented``: subgroup evaluation on the test split (threshold
   chosen on validation when the recipe says so);
7. ``compare``: the BenchX table-6 comparison with paired bootstrap differences.

Resumable: a step is skipped when an identical finished run exists (same step, parameters and code
version: the key is a hash of the three, stored as the tag ``study_step_key``), so rerunning the
same command after a failure only does what is missing; an interrupted training resumes from its
``last.ckpt`` into its MLflow run.

Example::

    benchx study --recipe recipes/unet.yaml --profile cpu
    mlflow run . --env-manager local                       # the same, as MLproject `main`
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd
from mlflow.tracking import MlflowClient

from lightning_modules.commands.common import split_overrides
from lightning_modules.config.recipe import load_recipe
from lightning_modules.tracking import experiment_id, git_commit, tracking_uri

STEP_KEY_TAG = "study_step_key"
STEP_NAME_TAG = "study_step"
PARENT_TAG = "mlflow.parentRunId"


@dataclass
class StudySettings:
    """Everything that defines a study; the steps' parameters are derived from it."""

    recipe: str = "recipes/unet.yaml"
    profile: str = "cpu"
    overrides: list[str] = field(default_factory=list)
    synthx_recipe: str = "recipes/generator/synthx.yaml"
    synthx_overrides: list[str] = field(default_factory=list)
    cases: int = 200
    phantom_seed: int = 0
    ratio: float = 0.3
    target: str = "min_positives:1"
    budget: int | None = None
    synthesis_steps: int = 20
    scheduler: str = "ddim"
    experiment: str = "benchx-study"
    output_dir: str = "outputs/study"


class StudyRunner:
    """Runs named steps as child runs of one parent, skipping those already finished identically."""

    def __init__(
        self, uri: str, experiment: str, code_version: str, parent_name: str = "study", parent_run_id: str | None = None
    ):
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.experiment = experiment
        self.experiment_id = experiment_id(experiment, uri)
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
        started = time.time()
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
        self.client.log_metric(self.parent_id, f"study/seconds/{name}", time.time() - started)
        print(f"[study] {name}: done in {time.time() - started:.0f} s (run {run_id})")
        self.outputs[name] = outputs
        return outputs

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.parent_id, status)


def _segmentation_recipe(settings: StudySettings, extra: Sequence[str] = ()):
    return load_recipe(
        settings.recipe,
        [f"profile={settings.profile}", f"tracking.experiment={settings.experiment}", *settings.overrides, *extra],
    )


def run_study(settings: StudySettings) -> pd.DataFrame:
    """Run (or resume) the study; returns the comparison table."""
    from lightning_modules.evaluation.runs import compare, evaluate

    base = _segmentation_recipe(settings)
    uri = tracking_uri(base.tracking.uri)
    # Under `mlflow run`, the run it opened is the study's parent, and its experiment the study's.
    parent_run_id = os.environ.get("MLFLOW_RUN_ID")
    if parent_run_id:
        opened = MlflowClient(tracking_uri=uri).get_run(parent_run_id)
        settings.experiment = MlflowClient(tracking_uri=uri).get_experiment(opened.info.experiment_id).name
        base = _segmentation_recipe(settings)
    runner = StudyRunner(uri, settings.experiment, git_commit(), parent_name=f"study-{base.name}", parent_run_id=parent_run_id)
    client = runner.client
    root, split = Path(base.data.root), Path(base.data.split)
    output_dir = Path(settings.output_dir)
    try:
        runner.step("data", {"root": str(root), "split": str(split), "cases": settings.cases, "seed": settings.phantom_seed},
                    lambda tags: _data_step(client, runner.experiment_id, tags, root, split, settings))

        def train_step(recipe, variant: str):
            def action(tags):
                from lightning_modules.training import train

                from lightning_modules.training import recipe_fingerprint

                folder = output_dir / variant / recipe_fingerprint(recipe)
                result = train(recipe, output_dir=folder, variant=variant, extra_tags=tags)
                return {"run_id": result.run_id, "checkpoint": str(result.best_checkpoint or result.last_checkpoint)}

            return action

        baseline_recipe = _segmentation_recipe(settings, ["synthx.ratio=0"])
        baseline = runner.step("baseline", _recipe_params(baseline_recipe), train_step(baseline_recipe, "baseline"))

        from synthx.config import load_synthx_recipe

        generator_recipe = load_synthx_recipe(
            settings.synthx_recipe,
            [f"profile={settings.profile}", f"data.root={root}", f"data.split={split}",
             f"tracking.experiment={settings.experiment}", f"tracking.uri={uri}", *settings.synthx_overrides],
        )

        def generator_action(tags):
            from synthx.training import train_synthx

            generator_recipe.tracking.tags.update(tags)
            result = train_synthx(generator_recipe, output_dir=output_dir / "synthx")
            return {"run_id": result.run_id, "pipeline": str(result.pipeline_dir)}

        generator = runner.step("synthx_train", _recipe_params(generator_recipe), generator_action)

        synthetic_root = output_dir / "synthetic"

        def synthesize_action(tags):
            from synthx.generation import synthesize

            summary = synthesize(
                root, split, generator["pipeline"], synthetic_root, settings.target, seed=int(base.seed), budget=settings.budget,
                num_inference_steps=settings.synthesis_steps, scheduler=settings.scheduler,
                generator_run_id=generator["run_id"], tracking_uri=uri, experiment=settings.experiment,
                progress=sys.stderr.isatty(),
            )
            if not summary.complete:
                raise RuntimeError(f"synthesis incomplete: {len(summary.failed)} failed: {summary.failed}")
            return {"run_id": summary.synthesis_run_id, "cohort": str(synthetic_root), "cases": len(summary.generated) + len(summary.skipped)}

        synthesis = runner.step(
            "synthesize",
            {"generator": generator["run_id"], "target": settings.target, "budget": settings.budget, "steps": settings.synthesis_steps,
             "scheduler": settings.scheduler, "seed": int(base.seed)},
            synthesize_action,
        )
        augmented_recipe = _segmentation_recipe(
            settings, [f"synthx.ratio={settings.ratio}", f"synthx.cohort={synthesis['cohort']}"]
        )
        augmented = runner.step(
            "augmented", {**_recipe_params(augmented_recipe), "synthesis_run": synthesis["run_id"]},
            train_step(augmented_recipe, "synthx"),
        )

        def evaluate_action(recipe, trained: dict, variant: str):
            def action(tags):
                run_id, _ = evaluate(recipe, trained["checkpoint"], ("val", "test"), training_run_id=trained["run_id"],
                                     run_name=f"evaluate-{recipe.name}-{variant}-test", extra_tags={**tags, "variant": variant})
                return {"run_id": run_id}

            return action

        evaluations = {}
        for variant, recipe, trained in (("baseline", baseline_recipe, baseline), ("synthx", augmented_recipe, augmented)):
            evaluations[variant] = runner.step(
                f"evaluate_{variant}", {"training_run": trained["run_id"], "checkpoint": Path(trained["checkpoint"]).name},
                evaluate_action(recipe, trained, variant),
            )

        def compare_action(tags):
            table, run_id = compare(
                [evaluations["baseline"]["run_id"], evaluations["synthx"]["run_id"]], "test", uri=uri,
                experiment=settings.experiment, n_resamples=int(base.detection.bootstrap_resamples),
            )
            return {"run_id": run_id}

        comparison = runner.step(
            "compare", {"runs": [evaluations["baseline"]["run_id"], evaluations["synthx"]["run_id"]]}, compare_action
        )
        with tempfile.TemporaryDirectory() as folder:
            table = pd.read_csv(client.download_artifacts(comparison["run_id"], "comparison/test_comparison.csv", folder))
            text = Path(client.download_artifacts(comparison["run_id"], "comparison/test_comparison.txt", folder)).read_text()
        client.log_text(runner.parent_id, text, "comparison/test_comparison.txt")
        client.set_tag(runner.parent_id, "comparison_run_id", comparison["run_id"])
        print(text)
        from synthx.report import publish_study

        print(f"[study] report: {publish_study(uri, runner.parent_id, output_dir)}")
    except BaseException:
        runner.finish("FAILED")
        raise
    runner.finish()
    print(f"[study] parent run {runner.parent_id} in experiment '{settings.experiment}' ({uri})")
    return table


def _recipe_params(recipe) -> dict:
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(recipe, resolve=True)
    container.pop("tracking", None)
    container.pop("profiles", None)
    return container


def _data_step(client, experiment: str, tags: dict, root: Path, split: Path, settings: StudySettings) -> dict:
    """Generate the phantom cohort when absent, make the split when absent, validate both."""
    from lightning_modules.data.cohort import load_cohort
    from lightning_modules.data.splits import load_split, make_splits, split_sha256, write_split
    from lightning_modules.data.validation import validate_cohort

    run = client.create_run(experiment, run_name="data", tags=tags)
    run_id = run.info.run_id
    if not (root / "metadata.csv").exists():
        from lightning_modules.data.phantom import generate_phantom_cohort

        generate_phantom_cohort(root, n_cases=settings.cases, seed=settings.phantom_seed)
        client.set_tag(run_id, "phantom_generated", "true")
    cohort = load_cohort(root)
    if not split.exists():
        write_split(make_splits(cohort.metadata, seed=settings.phantom_seed), split)
    table = load_split(split, cohort)
    problems = validate_cohort(cohort)
    if problems:
        raise RuntimeError("cohort problems:\n" + "\n".join(str(p) for p in problems))
    counts = table["split"].value_counts().to_dict()
    for name, count in counts.items():
        client.log_metric(run_id, f"data/cases/{name}", count)
    client.log_param(run_id, "split_sha256", split_sha256(split))
    client.log_artifact(run_id, str(split), "split")
    client.set_terminated(run_id, "FINISHED")
    return {"run_id": run_id, "split_sha256": split_sha256(split)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchx study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=StudySettings.recipe)
    parser.add_argument("--profile", default=StudySettings.profile)
    parser.add_argument("--synthx-recipe", default=StudySettings.synthx_recipe)
    parser.add_argument("--synthx-override", action="append", default=[], help="key=value for the SynthX recipe")
    parser.add_argument("--cases", type=float, default=StudySettings.cases, help="phantom cases when the cohort is generated")
    parser.add_argument("--ratio", type=float, default=StudySettings.ratio, help="synthesis ratio of the augmented run")
    parser.add_argument("--target", default=StudySettings.target, help="targeting rule, e.g. min_positives:6 or match_test:40")
    parser.add_argument("--budget", type=int, default=None, help="total synthetic cases for match:* targeting rules")
    parser.add_argument("--synthesis-steps", type=int, default=StudySettings.synthesis_steps)
    parser.add_argument("--experiment", default=StudySettings.experiment)
    parser.add_argument("--out", default=StudySettings.output_dir)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the backbone recipe")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    settings = StudySettings(
        recipe=args.recipe, profile=args.profile, overrides=split_overrides(args.overrides),
        synthx_recipe=args.synthx_recipe, synthx_overrides=args.synthx_override, cases=int(args.cases),
        ratio=args.ratio, target=args.target, budget=args.budget, synthesis_steps=args.synthesis_steps, experiment=args.experiment,
        output_dir=args.out,
    )
    run_study(settings)
    return 0
