"""``benchx study``: the baseline-versus-SynthX study, the project's main job (MLproject ``main``).

Parses the command line into :class:`synthx.workflows.study.settings.StudySettings` and runs :func:`synthx.workflows.study.run.run_study`
(the steps and their resumability are described there).

Example::

    benchx study --recipe recipes/unet.yaml --profile cpu
    benchx study --recipe recipes/unet.yaml --profile cpu --target need:40 trainer.max_steps=4000
    benchx study --painter phantom --out outputs/study-phantom-painter   # the positive control
    benchx study --seeds 5 --workers 2 --out outputs/study-seeds        # 5 paired replicates, pooled

``--seeds K`` runs K replicates (seeds 0..K-1, each a whole study in ``<out>/seed-<S>``, ``--workers``
processes at a time; finished ones are kept, killed ones resume) and pools them per subgroup;
``--seed S`` runs one replicate (a Slurm array task: scripts/slurm-study.sbatch); ``--pool-only``
only pools the finished replicates (docs/explanation/detection-and-statistics.md "Seeds as the unit of inference").
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from lightning_modules.commands.common import CommandParser, add_overrides_argument, bounded, parse_command_line
from synthx.painters import COPY_PASTE_PAINTER, PAINTERS, SYNTHX_PAINTER

# The defaults of synthx.workflows.study.settings.StudySettings, named here so that --help and a refused
# command line answer without importing the workflow (and with it torch, Lightning and MLflow).
DEFAULTS = {
    "recipe": "recipes/unet.yaml", "profile": "cpu", "synthx_recipe": "recipes/generator/synthx.yaml", "ratio": 0.3,
    "target": "need:20", "experiment": "benchx-study", "output_dir": "outputs/study", "painter": SYNTHX_PAINTER,
    "locked_cases": 307,
}


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="benchx study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=DEFAULTS["recipe"], help="backbone recipe (default: %(default)s)")
    parser.add_argument("--synthx-recipe", default=DEFAULTS["synthx_recipe"], help="SynthX recipe (default: %(default)s)")
    parser.add_argument("--synthx-override", action="append", default=[], help="key=value for the SynthX recipe (repeatable)")
    parser.add_argument("--cases", type=bounded(int, 1), default=None,
                        help="phantom cases when the cohort is generated (default: the phantom's own, matching splits/phantom.csv)")
    parser.add_argument("--ratio", type=bounded(float, 0, above=True), default=DEFAULTS["ratio"],
                        help="synthesis ratio r of the augmented run, > 0 (at most 10, or 1 when synthx.mode is displace)")
    parser.add_argument("--target", default=DEFAULTS["target"],
                        help="targeting rule: need:B (default %(default)s: B cases where the baseline's validation "
                             "sensitivity falls short), min_positives:k, match:val, match:uniform, counts:<table>")
    parser.add_argument("--target-phases", default=None,
                        help="comma-separated contrast phases the targeting may fill (default: all), e.g. arterial "
                             "to spend the budget on a scarcity gap only")
    parser.add_argument("--budget", type=bounded(int, 1), default=None, help="total synthetic cases for match:* rules")
    parser.add_argument("--synthesis-steps", type=bounded(int, 1), default=None,
                        help="denoising steps per synthetic case (default: the SynthX recipe's sampling.num_inference_steps)")
    parser.add_argument("--painter", choices=PAINTERS, default=DEFAULTS["painter"],
                        help="who paints the targeted tumors: synthx (default: the SynthX generator, trained in the "
                             "study) or phantom (the positive control: the embedded phantom's own renderer paints "
                             "real-appearance tumors into the same canvases; phantom cohorts only; no copy-paste "
                             "arm). copy_paste is refused: a SynthX study trains the copy-paste arm beside SynthX")
    parser.add_argument("--locked-cases", type=bounded(int, 0), default=DEFAULTS["locked_cases"],
                        help="scans of the locked test cohort, a phantom of another seed (default: %(default)s, sized "
                             "by `python -m synthx.analysis.power`; 0: test on the split's test set)")
    parser.add_argument("--locked-seed", type=bounded(int, 0), default=None,
                        help="the locked phantom's seed (default: the development phantom's seed + 1000)")
    parser.add_argument("--experiment", default=DEFAULTS["experiment"], help="MLflow experiment (default: %(default)s)")
    parser.add_argument("--out", default=DEFAULTS["output_dir"], help="output folder (default: %(default)s)")
    replicates = parser.add_argument_group("seeds as the unit of inference")
    replicates.add_argument("--seeds", type=bounded(int, 2), default=None, metavar="K",
                            help="run K paired replicates (seeds 0..K-1) and pool them per subgroup")
    replicates.add_argument("--workers", type=bounded(int, 1), default=1,
                            help="replicates run at once as separate processes (default: %(default)s)")
    replicates.add_argument("--seed", type=bounded(int, 0), default=None, metavar="S",
                            help="run replicate S only (one task of a Slurm array); pool later with --seeds K --pool-only")
    replicates.add_argument("--pool-only", action="store_true",
                            help="with --seeds: run nothing, pool the K finished replicates")
    replicates.add_argument("--operating-point", default="subgroup_matched_specificity",
                            choices=("subgroup_matched_specificity", "matched_specificity", "val_chosen", "fixed"),
                            help="each arm's m in the pooled analysis (default: %(default)s, the primary endpoint's)")
    add_overrides_argument(parser)
    return parser


REPLICATE_OPTIONS = {"--seeds": True, "--workers": True, "--seed": True, "--pool-only": False, "--operating-point": True}


def replicate_command(argv: Sequence[str]) -> list[str]:
    """The command of one replicate: this command line without its replicate options (``--seed S`` is added)."""
    command, skip = [], False
    for argument in argv:
        if skip:
            skip = False
            continue
        name = argument.split("=", 1)[0]
        if name in REPLICATE_OPTIONS:
            skip = REPLICATE_OPTIONS[name] and "=" not in argument
            continue
        command.append(argument)
    return [sys.executable, "-m", "lightning_modules.cli", "study", *command]


def study_overrides(args: argparse.Namespace) -> list[str]:
    """The recipe overrides of the study: the profile, given as --profile NAME or profile=NAME, is the
    study's own setting (default cpu), not an override."""
    return [item for item in args.overrides if item.split("=", 1)[0].strip() != "profile"]


def study_settings(args: argparse.Namespace):
    """The study's :class:`~synthx.workflows.study.settings.StudySettings` from its parsed command line (every
    replicate parses the same ones)."""
    from synthx.workflows.study.settings import StudySettings

    return StudySettings(
        recipe=args.recipe, profile=args.profile or DEFAULTS["profile"], overrides=study_overrides(args),
        synthx_recipe=args.synthx_recipe, synthx_overrides=args.synthx_override, cases=args.cases,
        ratio=args.ratio, target=args.target, budget=args.budget, synthesis_steps=args.synthesis_steps,
        experiment=args.experiment, output_dir=args.out, painter=args.painter,
        locked_cases=args.locked_cases, locked_seed=args.locked_seed,
        target_phases=[p.strip() for p in args.target_phases.split(",") if p.strip()] if args.target_phases else None,
    )


def check_recipe(args: argparse.Namespace) -> None:
    """Load the backbone recipe as the study will (profile, experiment, overrides) and check its values
    the augmented arm's ratio and the generator's recipe with its overrides, so a mistyped key or a wrong value is refused at once, before torch
    and the workflow are imported (the workflow checks the model section when it loads the recipe,
    before it opens a run). Raises :class:`~lightning_modules.config.loader.RecipeError`."""
    from lightning_modules.config.loader import with_values
    from lightning_modules.config.recipe import check_values
    from lightning_modules.recipe import load_recipe

    recipe = load_recipe(args.recipe, [f"profile={args.profile or DEFAULTS['profile']}",
                                       f"tracking.experiment={args.experiment}", *study_overrides(args)],
                         checker=check_values)
    with_values(recipe, {"synthx": {"ratio": args.ratio}}, checker=check_values, source=f"--ratio {args.ratio:g} with {args.recipe}")
    from synthx.config import load_synthx_recipe

    # The generator's recipe as the study loads it (its cohort and store are the study's, set later).
    load_synthx_recipe(args.synthx_recipe, [f"profile={args.profile or DEFAULTS['profile']}", *args.synthx_override])


def run_study(settings) -> None:
    """:func:`synthx.workflows.study.run.run_study`, imported only when the command line has been checked."""
    from synthx.workflows.study.run import run_study as run

    run(settings)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments and run the study; returns 0 when it finished."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parse_command_line(parser, argv)
    if args.seed is not None and args.seeds is not None:
        parser.error("give --seeds K (all replicates) or --seed S (one), not both")
    if args.painter == COPY_PASTE_PAINTER:
        from synthx.workflows.study.settings import COPY_PASTE_REFUSAL

        parser.error(COPY_PASTE_REFUSAL)
    if args.pool_only and args.seeds is None:
        parser.error("--pool-only needs --seeds K")
    check_recipe(args)
    settings = study_settings(args)
    try:
        settings.check()
    except ValueError as error:
        parser.error(str(error))
    if args.seed is not None:
        from synthx.workflows.replicates import run_replicate

        run_replicate(settings, args.seed)
        return 0
    if args.seeds is not None:
        from lightning_modules.evaluation.seed_pooling import format_pooled
        from synthx.workflows.replicates import pool_replicates, run_replicates

        seeds = list(range(args.seeds))
        if not args.pool_only:
            run_replicates(settings, seeds, args.workers, replicate_command(argv))
        table, run_id = pool_replicates(settings, seeds, args.operating_point)
        print(f"== {len(seeds)} seeds pooled at the {args.operating_point} operating point (test) ==")
        print(format_pooled(table))
        print(f"[replicates] pooled analysis logged to run {run_id} (experiment '{settings.experiment}'); "
              f"its page: benchx report --run-id {run_id} --markdown docs/seeds.md")
        return 0
    run_study(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
