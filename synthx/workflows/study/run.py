"""The study from start to end: the steps in order (:mod:`synthx.workflows.study`), under the output
folder's lock, then the comparison published and the verdict printed.

Example::

    table = run_study(StudySettings(recipe="recipes/unet.yaml", profile="cpu"))
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from lightning_modules.cohorts.phantom import PARAMS_FILE
from lightning_modules.infrastructure.process import exit_on_signal, held_signals, raise_if_signalled, rerun_command, stop_code
from lightning_modules.infrastructure.run_folder import RunFolderLock
from synthx.analysis.endpoint import log_endpoint
from synthx.painters import COPY_PASTE_PAINTER, SYNTHX_PAINTER
from synthx.workflows.report import publish_study
from synthx.workflows.study.publish import (baseline_test_sets, publish_comparison, publish_decomposition,
                                            ui_command, verdict_text)
from synthx.workflows.study.runner import open_runner, StudyRunner
from synthx.workflows.study.settings import (arm_values, copy_paste_skipped, generator_recipe_of, recipe_params,
                                             segmentation_recipe, StudySettings)
from synthx.workflows.study.steps import (COMPARED_ARMS, compare_action, copy_paste_action, data_step, evaluate_action,
                                          generator_action, locked_cohort_step, synthesize_action, synthetic_folder,
                                          targeting_action, train_action)


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
    baseline = runner.step("baseline", recipe_params(recipe), train_action(recipe, "baseline", output_dir))
    evaluation = runner.step("evaluate_baseline", {"training_run": baseline["run_id"], "recipe": recipe_params(recipe),
                                                   "checkpoint": Path(baseline["checkpoint"]).name},
                             evaluate_action(recipe, baseline, "baseline"))
    return recipe, baseline, evaluation, locked


def _synthx_steps(runner: StudyRunner, settings: StudySettings, root: Path, split: Path, evaluation: dict,
                  score: str, seed: int) -> tuple[dict, dict | None]:
    """targeting, synthesize_copy_paste, synthx_train, synthesize; returns the synthesis outputs
    (``cohort`` is the synthetic folder) and the copy-paste synthesis' (None without a copy-paste arm).

    With the phantom painter there is no generator to train and no copy-paste arm
    (:func:`copy_paste_skipped`): targeting, then synthesize.
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
        synthesis = runner.step("synthesize", params,
                                synthesize_action(runner.client, root, split, settings, None, None, targeting,
                                                  synthetic_folder(output_dir, params), seed, runner.uri))
        print(f"[study] no copy-paste arm: {copy_paste_skipped(settings)}")
        return synthesis, None
    generator_recipe = generator_recipe_of(settings, root, split, runner.uri)
    # SynthX's targets, seed and mask prior: its canvases and sites, painted with real tumors. No
    # generator, so it runs before synthx_train and a new generator reuses it.
    pasted = {"painter": COPY_PASTE_PAINTER, "targeting": targeting["run_id"], "seed": seed,
              "mask_prior": recipe_params(generator_recipe)["mask_prior"]}
    copy_paste = runner.step(
        "synthesize_copy_paste", pasted,
        copy_paste_action(runner.client, root, split, settings, generator_recipe, targeting,
                          synthetic_folder(output_dir, pasted), seed, runner.uri),
    )
    generator = runner.step("synthx_train", recipe_params(generator_recipe), generator_action(generator_recipe, output_dir))
    params = {"generator": generator["run_id"], "targeting": targeting["run_id"], "steps": settings.synthesis_steps,
              "scheduler": settings.scheduler, "seed": seed}
    synthesis = runner.step(
        "synthesize", {**params, "realism_against": copy_paste["run_id"]},
        synthesize_action(runner.client, root, split, settings, generator_recipe, generator, targeting,
                          synthetic_folder(output_dir, params), seed, runner.uri, copy_paste),
    )
    return synthesis, copy_paste


def run_study(settings: StudySettings, parent_tags: dict[str, str] | None = None) -> pd.DataFrame:
    """Run (or resume) the study, step by step (see the package docstring); returns the comparison table.

    One study per output folder at a time: a second process is refused, naming the holder. Runs a
    study left RUNNING when its process died are ended (KILLED) first (:meth:`StudyRunner.end_stale`).
    ``parent_tags`` go on the study's parent run (a replicate's set and seed, :mod:`synthx.workflows.replicates`).

    Every run the study opened ends: on SIGTERM, SIGINT or Ctrl+C the step run in flight and the
    parent run end KILLED and the process exits 143 or 130 (``SystemExit``) after one line naming the
    step and the command that resumes it; on an error both end FAILED, a line names the step, and
    the error is raised again (the ``benchx`` dispatcher prints a user-facing one in two lines).
    """
    settings.check()
    stop = {"note": "no study run was opened; " + _resume_advice()}
    with exit_on_signal("benchx study", lambda: stop["note"]):
        with RunFolderLock(settings.output_dir, "benchx study") as lock:
            if lock.takeover_note:
                print(f"[study] {lock.takeover_note}")
            return _run_study(settings, parent_tags, stop)


def _resume_advice() -> str:
    command = rerun_command()
    return f"resume with: {command}" if command else "run the same command again to resume"


def _evaluate_arm(runner: StudyRunner, settings: StudySettings, name: str, arm: str, trained: dict,
                  extra: dict, locked: dict | None) -> dict:
    """Evaluate one arm on the study's test set: the locked cohort's view when there is one."""
    view = {"data": {"root": str(locked["root"]), "split": str(locked["split"])}} if locked else {}
    recipe = segmentation_recipe(settings, extra, view)
    return runner.step(name, {"training_run": trained["run_id"], "recipe": recipe_params(recipe),
                              "checkpoint": Path(trained["checkpoint"]).name},
                       evaluate_action(recipe, trained, arm, "locked" if locked else "test"))


def _run_study(settings: StudySettings, parent_tags: dict[str, str] | None, stop: dict[str, str]) -> pd.DataFrame:
    with held_signals():  # a signal here is raised once the runner can end the parent run
        runner = open_runner(settings, parent_tags)
    try:
        raise_if_signalled()
        stale = runner.end_stale(settings.output_dir)
        if stale:
            print(f"[study] ended {len(stale)} run(s) that a study whose process is gone left RUNNING (KILLED): "
                  f"{', '.join(stale)}")
        base = segmentation_recipe(settings)
        root, split = Path(base.data.root), Path(base.data.split)
        # The primary endpoint is fixed before anything is trained or evaluated.
        log_endpoint(runner.client, runner.parent_id, settings.endpoint)
        output_dir = Path(settings.output_dir)
        _, baseline, baseline_evaluation, locked = _baseline_steps(runner, settings, root, split)
        synthesis, copy_paste = _synthx_steps(runner, settings, root, split, baseline_evaluation,
                                              str(base.detection.score), int(base.seed))
        trained, extras = {"baseline": baseline}, {"baseline": arm_values(settings, "baseline")}
        # The copy-paste arm: SynthX's recipe variant with the copy-paste cohort (same ratio, steps, schedule).
        arms = [("sham", "sham", synthesis), ("synthx", "augmented", synthesis)]
        arms += [("copy_paste", "copy_paste", copy_paste)] if copy_paste else []
        for arm, step, cohort in arms:
            extras[arm] = arm_values(settings, arm, cohort["cohort"])
            recipe = segmentation_recipe(settings, extras[arm])
            trained[arm] = runner.step(step, {**recipe_params(recipe), "synthesis_run": cohort["run_id"]},
                                       train_action(recipe, arm, output_dir))
        evaluations = {"baseline": baseline_evaluation}
        if locked:
            evaluations["baseline"] = _evaluate_arm(runner, settings, "evaluate_locked_baseline", "baseline",
                                                    baseline, extras["baseline"], locked)
        for arm, _, _ in arms:
            evaluations[arm] = _evaluate_arm(runner, settings, f"evaluate_{arm}", arm, trained[arm], extras[arm], locked)
        comparison = runner.step(
            "compare", {"runs": [evaluations[arm]["run_id"] for arm in COMPARED_ARMS if arm in evaluations],
                        "subgroup": settings.endpoint.subgroup},
            compare_action(evaluations, runner.uri, settings.experiment, int(base.detection.bootstrap_resamples),
                           subgroup=settings.endpoint.subgroup),
        )
        table = publish_comparison(runner, comparison, settings.endpoint)
        decomposition = publish_decomposition(runner, evaluations, table, settings.endpoint)
        if locked:
            side_by_side = baseline_test_sets(runner.client, baseline_evaluation["run_id"], evaluations["baseline"]["run_id"])
            runner.client.log_text(runner.parent_id, side_by_side.to_csv(index=False), "study/baseline_test_sets.csv")
            overall = side_by_side[side_by_side["attribute"] == "overall"]
            print("[study] the baseline on the development test split and on the locked cohort (all scans; every "
                  "subgroup: artifact study/baseline_test_sets.csv):")
            print(overall.drop(columns=["attribute"]).to_string(index=False))

        print(f"[study] report: {publish_study(runner.uri, runner.parent_id, settings.output_dir)}")
        runner.finish()
    except BaseException as error:
        step = runner.current
        status = runner.abort(error)
        where = f"step {step}: its run and" if step else "between steps:"
        note = f"{where} the study run {runner.parent_id} ended {status}; finished steps are kept, "
        if stop_code(error) is not None:
            stop["note"] = note + _resume_advice()
        else:
            print(f"[study] {step or 'the study'} failed ({type(error).__name__}); {note}fix the cause, then "
                  f"{_resume_advice()}", file=sys.stderr, flush=True)
        raise
    print(f"[study] parent run {runner.parent_id} in experiment '{settings.experiment}' ({runner.uri})")
    print(f"[study] MLflow UI: {ui_command(runner.uri, runner.experiment_id)}")
    print(verdict_text(table, settings.endpoint, decomposition, settings.painter))
    return table
