"""``benchx sweep``: parse the arguments and run one sweep worker (:func:`synthx.workflows.sweep.sweep`).

Example::

    benchx sweep --recipe recipes/unet.yaml --trials 8 --objective both profile=cpu trainer.val_every_n_steps=1000 synthx.cohort=data/synthetic
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from lightning_modules.commands.common import add_overrides_argument, parse_command_line, split_overrides
from lightning_modules.recipe import load_recipe
from synthx.workflows.sweep import DEFAULT_HEARTBEAT_S, DEFAULT_STORAGE, OBJECTIVES, PARENT_ATTR, SweepError, SweepSettings, safe_url, sweep


VALIDATION_NOTE = (
    "Every trial is scored on validation: a recipe that validates nothing during training "
    "(trainer.val_every_n_steps 0, as in unet's cpu profile) is refused with exit 2; one that validates only at "
    "its last step runs without pruning. The sweep's MLflow run ends FINISHED or FAILED with its worker."
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from synthx.workflows import sweep as library

    parser = argparse.ArgumentParser(prog="benchx sweep", description=library.__doc__.split("\n\n")[0] + " " + VALIDATION_NOTE)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--study-name", default="synthx-ratio")
    parser.add_argument("--storage", default=DEFAULT_STORAGE,
                        help="sqlite:///file.db (one worker), postgresql://... (many workers), or journal:<file>")
    parser.add_argument("--objective", choices=sorted(OBJECTIVES), default="f1")
    parser.add_argument("--trials", type=int, default=8, help="finished trials the study should hold (across workers)")
    parser.add_argument("--ratio-min", type=float, default=0.0)
    parser.add_argument("--ratio-max", type=float, default=0.8)
    parser.add_argument("--enqueue", type=float, action="append", default=None, metavar="RATIO",
                        help="a ratio tried first (repeatable; default 0 = the baseline as reference)")
    parser.add_argument("--no-enqueue", action="store_true", help="let the sampler choose every ratio")
    parser.add_argument("--attributes", nargs="+", default=["age", "sex", "phase"], help="for the worst-group objective")
    parser.add_argument("--targeting", nargs="*", default=[], metavar="RULE=COHORT",
                        help="optional targeting rules to sweep, each with its synthetic cohort folder")
    parser.add_argument("--heartbeat-interval", type=int, default=DEFAULT_HEARTBEAT_S, metavar="SECONDS",
                        help="RDB storage: a running trial's heartbeat period; a trial silent for 3 periods is "
                        "failed and retried (default %(default)s)")
    parser.add_argument("--create-only", action="store_true", help="create the study and its MLflow run, then exit")
    add_overrides_argument(parser)
    return parse_command_line(parser, argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    settings = SweepSettings(
        recipe=load_recipe(args.recipe, split_overrides(args.overrides)),
        study_name=args.study_name,
        storage=args.storage,
        objective=args.objective,
        trials=args.trials,
        ratio_range=(args.ratio_min, args.ratio_max),
        enqueue=[] if args.no_enqueue else (args.enqueue if args.enqueue is not None else [0.0]),
        attributes=args.attributes,
        targeting=dict(item.split("=", 1) for item in args.targeting),
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
