"""``benchx train``: parse the recipe, the overrides and the run folder, and call :func:`lightning_modules.workflows.train.train`.

Example::

    benchx train --recipe recipes/unet.yaml profile=cpu trainer.max_steps=200
    benchx train --recipe recipes/unet.yaml profile=cpu trainer.devices=2 trainer.strategy=ddp
    torchrun --standalone --nproc_per_node=2 -m lightning_modules.cli train --recipe recipes/unet.yaml profile=cpu trainer.devices=2 trainer.strategy=ddp
    mlflow run . -e train -P recipe=recipes/unet.yaml -P overrides="profile=cpu" --env-manager local

Exit codes: see :data:`EXIT_CODES`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from lightning_modules.commands.common import CommandParser, add_overrides_argument, parse_command_line


EXIT_CODES = (
    "Exit status: 0 trained (or already finished); 2 refused, with a short message (bad arguments or recipe, "
    "broken cohort, leaking split, folder in use, another recipe in the folder, damaged checkpoints); "
    "128 + signal when stopped by SIGTERM (143) or Ctrl+C (130)."
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = CommandParser(
        prog="benchx train",
        description="Train a backbone from a recipe. Trailing key=value pairs override the recipe "
        "(e.g. profile=cpu trainer.max_steps=100 data.root=/data/AbdomenAtlas). Rerunning the same "
        "command resumes the run; another recipe in the same folder is refused. " + EXIT_CODES,
    )
    parser.add_argument("--recipe", required=True, help="recipe YAML, e.g. recipes/unet.yaml")
    parser.add_argument("--out", default=None, help="run folder (default: <tracking.output_dir>/<recipe>-<hash>)")
    parser.add_argument("--fresh", action="store_true", help="start a new run in the folder, replacing its checkpoints")
    add_overrides_argument(parser)
    return parse_command_line(parser, argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from lightning_modules.recipe import load_recipe

    # Recipe, cohort and run-folder errors go to the dispatcher (lightning_modules.cli): two lines, exit 2.
    # The recipe is read before torch, Lightning and MLflow are imported, so a mistyped key is
    # reported at once.
    recipe = load_recipe(args.recipe, args.overrides)
    from lightning_modules.infrastructure.process import Terminated
    from lightning_modules.trainer import global_rank
    from lightning_modules.workflows.train import TrainSettings, train

    try:
        # Under `mlflow run`, log into the run it opened (Lightning would otherwise start another).
        settings = TrainSettings(output_dir=args.out, resume=not args.fresh, run_id=os.environ.get("MLFLOW_RUN_ID"))
        result = train(recipe, settings)
    except Terminated as stopped:
        print(f"benchx train: {stopped}; rerun the same command to resume", file=sys.stderr)
        return stopped.exit_code
    if global_rank() > 0:
        return 0
    print(f"run {result.run_id}: {result.global_step} steps, best checkpoint {result.best_checkpoint}")
    for key in sorted(result.metrics):
        if key.startswith("val/"):
            print(f"  {key} = {result.metrics[key]:.4f}")
    return 0
