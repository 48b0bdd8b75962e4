"""``benchx sweep``: parse the arguments and run one sweep worker (:func:`synthx.workflows.sweep.sweep`).

Every argument (ratio range, objective, targeting rules, storage URL) and the recipe are checked
before Optuna, Lightning or MLflow is imported and before any study or run exists: a bad one ends in
a short message with exit code 2.

Example::

    benchx sweep --recipe recipes/unet.yaml --trials 8 --objective both profile=cpu trainer.val_every_n_steps=1000 synthx.cohort=data/synthetic
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from lightning_modules.commands.common import CommandParser, add_overrides_argument, bounded, parse_command_line

# synthx.workflows.sweep's DEFAULT_STORAGE, DEFAULT_HEARTBEAT_S and OBJECTIVES' names, named here so
# that --help and a refused command line answer without importing Optuna and the trainer.
DEFAULT_STORAGE = "sqlite:///optuna.db"
DEFAULT_HEARTBEAT_S = 60
OBJECTIVE_NAMES = ("both", "f1", "worst_sensitivity")

DESCRIPTION = (
    "An Optuna study over the synthesis ratio, each trial an augmented training run scored on the "
    "validation split. Every trial is scored on validation: a recipe that validates nothing during training "
    "(trainer.val_every_n_steps 0, as in unet's cpu profile) is refused with exit 2; one that validates only at "
    "its last step runs without pruning. The sweep's MLflow run ends FINISHED or FAILED with its worker."
)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="benchx sweep", description=DESCRIPTION)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--study-name", default="synthx-ratio")
    parser.add_argument("--storage", default=DEFAULT_STORAGE,
                        help="sqlite:///file.db (one worker), postgresql://... (many workers), or journal:<file>")
    parser.add_argument("--objective", choices=OBJECTIVE_NAMES, default="f1")
    parser.add_argument("--trials", type=bounded(int, 1), default=8, help="finished trials the study should hold (across workers)")
    parser.add_argument("--ratio-min", type=bounded(float, 0), default=0.0,
                        help="lowest synthx.ratio sampled, >= 0 (at most 10, or 1 when synthx.mode is displace)")
    parser.add_argument("--ratio-max", type=bounded(float, 0), default=0.8, help="highest synthx.ratio sampled, above --ratio-min")
    parser.add_argument("--enqueue", type=bounded(float, 0), action="append", default=None, metavar="RATIO",
                        help="a ratio tried first (repeatable; default 0 = the baseline as reference)")
    parser.add_argument("--no-enqueue", action="store_true", help="let the sampler choose every ratio")
    parser.add_argument("--attributes", nargs="+", default=["age", "sex", "phase"], help="for the worst-group objective")
    parser.add_argument("--targeting", nargs="*", default=[], metavar="RULE=COHORT",
                        help="optional targeting rules to sweep, each with its synthetic cohort folder")
    parser.add_argument("--heartbeat-interval", type=bounded(int, 1), default=DEFAULT_HEARTBEAT_S, metavar="SECONDS",
                        help="RDB storage: a running trial's heartbeat period; a trial silent for 3 periods is "
                        "failed and retried (default %(default)s)")
    parser.add_argument("--create-only", action="store_true", help="create the study and its MLflow run, then exit")
    add_overrides_argument(parser)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    return parse_command_line(build_parser(), argv)


def targeting_cohorts(parser: argparse.ArgumentParser, items: Sequence[str]) -> dict[str, str]:
    """``RULE=COHORT`` arguments as {rule: cohort folder}; a malformed one or a missing folder is a usage error."""
    cohorts: dict[str, str] = {}
    for item in items:
        rule, _, cohort = item.partition("=")
        if not rule.strip() or not cohort.strip():
            parser.error(f"--targeting {item!r}: expected RULE=COHORT, e.g. need:40=data/synthetic-need40")
        if not Path(cohort).is_dir():
            parser.error(f"--targeting {item!r}: the synthetic cohort folder {cohort} does not exist")
        cohorts[rule.strip()] = cohort.strip()
    return cohorts


def check_storage(parser: argparse.ArgumentParser, url: str) -> None:
    """A storage URL Optuna can open: ``journal:<file>`` or a database URL of a known SQLAlchemy dialect."""
    if url.startswith("journal:"):
        if not url[len("journal:"):].strip():
            parser.error("--storage journal: needs a file, e.g. journal:sweep.log")
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url).get_dialect()
    except ArgumentError:
        parser.error(f"--storage {url!r} is not a storage URL: give sqlite:///file.db, postgresql://... or journal:<file>")


def check_ratios(parser: argparse.ArgumentParser, args: argparse.Namespace, recipe) -> list[float]:
    """The ratios to enqueue, after checking that the range is a range and that the recipe takes
    every ratio the sweep can try (its synthx.mode bounds synthx.ratio)."""
    from lightning_modules.config.loader import RecipeError, with_values
    from lightning_modules.config.recipe import check_values

    if args.ratio_min >= args.ratio_max:
        parser.error(f"--ratio-min ({args.ratio_min:g}) must be below --ratio-max ({args.ratio_max:g})")
    enqueue = [] if args.no_enqueue else (args.enqueue if args.enqueue is not None else [0.0])
    for ratio in sorted({args.ratio_min, args.ratio_max, *enqueue}):
        try:
            with_values(recipe, {"synthx": {"ratio": float(ratio)}}, checker=check_values,
                        source=f"{args.recipe} (sweep ratio {ratio:g})")
        except RecipeError as error:
            parser.error(str(error))
    return enqueue


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, sys.argv[1:] if argv is None else argv)
    from lightning_modules.config.recipe import check_values
    from lightning_modules.recipe import check_recipe, load_recipe

    # The values first (a mistyped key, a value out of range, a ratio the recipe refuses): no torch yet.
    recipe = load_recipe(args.recipe, args.overrides, checker=check_values)
    enqueue = check_ratios(parser, args, recipe)
    targeting = targeting_cohorts(parser, args.targeting)
    check_storage(parser, args.storage)
    check_recipe(recipe, args.recipe)  # the model section: imports torch

    from synthx.workflows.sweep import PARENT_ATTR, SweepError, SweepSettings, safe_url, sweep

    settings = SweepSettings(
        recipe=recipe,
        study_name=args.study_name,
        storage=args.storage,
        objective=args.objective,
        trials=args.trials,
        ratio_range=(args.ratio_min, args.ratio_max),
        enqueue=enqueue,
        attributes=args.attributes,
        targeting=targeting,
        heartbeat_interval=args.heartbeat_interval,
        create_only=args.create_only,
    )
    try:
        study = sweep(settings)
    except SweepError as error:
        print(f"benchx sweep: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(f"benchx sweep: {error}", file=sys.stderr)
        return 1
    if args.create_only:
        print(f"study {args.study_name} ready in {safe_url(args.storage)}; MLflow parent run {study.user_attrs[PARENT_ATTR]}")
        return 0
    for trial in study.best_trials:
        print(f"trial {trial.number}: ratio={trial.params.get('ratio'):.3f} values={trial.values} run={trial.user_attrs.get('mlflow_run_id')}")
    return 0
