"""``benchx evaluate``: subgroup evaluation of a trained model into a new MLflow run.

Parses the model source (``--run-id`` or ``--checkpoint --recipe``), the stages and recipe overrides,
and calls :func:`lightning_modules.workflows.evaluate.evaluate`.

Example::

    benchx evaluate --run-id <training run> --stages val,test
    benchx evaluate --run-id <training run> data.root=data/external data.split=splits/external.csv
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from lightning_modules.commands.common import CommandParser, add_model_source_arguments, add_overrides_argument, parse_command_line

DESCRIPTION = (
    "Evaluate a trained model on a cohort + split into a new MLflow run linked to its training run: "
    "subgroup detection metrics with bootstrap CIs at the fixed m, at the m chosen on validation and at the "
    "recipe's rule (docs/explanation/detection-and-statistics.md \"Scan-level detection\"). Refuses val/test cases that are training cases "
    "of the model or share a patient with them."
)


def _stages(text: str) -> list[str]:
    stages = [part for part in text.replace(" ", ",").split(",") if part]
    if not stages or any(stage not in ("val", "test") for stage in stages):
        raise argparse.ArgumentTypeError(f"stages must be val and/or test, comma-separated; got {text!r}")
    return stages


def parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="benchx evaluate", description=DESCRIPTION)
    add_model_source_arguments(parser)
    parser.add_argument("--stages", default="val,test", type=_stages,
                        help="comma-separated, from val and test (one value, so key=value overrides may follow)")
    parser.add_argument("--allow-training-overlap", action="store_true",
                        help="evaluate even when val/test cases are training cases of the model (tagged in the run)")
    add_overrides_argument(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_command_line(parser(), sys.argv[1:] if argv is None else argv)
    # Heavy imports after parsing, so --help answers at once.
    from lightning_modules.workflows.evaluate import evaluate
    from lightning_modules.tracking.artifacts import resolve_model_source

    # A refusal the user can fix (training cases in the evaluation set, a run that is no segmentation
    # model, a broken cohort or split) is a short message with exit 2 from the benchx dispatcher.
    with tempfile.TemporaryDirectory() as folder:
        recipe, checkpoint = resolve_model_source(
            Path(folder), args.run_id, args.checkpoint, args.recipe, args.overrides
        )
        run_id, results = evaluate(recipe, checkpoint, args.stages, training_run_id=args.run_id,
                                   allow_training_overlap=args.allow_training_overlap)
    from lightning_modules.trainer import global_rank

    if global_rank() > 0:  # under DDP only rank 0 reports
        return 0
    print(f"evaluation run {run_id}")
    for stage, table in results.items():
        overall = table[table["attribute"] == "overall"].iloc[0]
        threshold = float(table.attrs.get("threshold", float("nan")))
        print(
            f"  {stage}: n={int(overall['n'])} m={threshold:g} sensitivity={_percent(overall['sensitivity'])} "
            f"specificity={_percent(overall['specificity'])} f1={_percent(overall['f1'])} auc={_percent(overall['auc'])}"
        )
    return 0


def _percent(value) -> str:
    value = float(value)
    return "-" if value != value else f"{100 * value:.1f}"
