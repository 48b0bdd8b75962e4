"""``benchx compare``: paired comparison of evaluation runs (BenchX table 6) at three operating points.

Parses the runs and settings and calls :func:`lightning_modules.workflows.evaluate.compare`; prints the
table (and any operating-point fallback) and the comparison run.

Example::

    benchx compare <baseline evaluation run> <augmented evaluation run>
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from lightning_modules.commands.common import CommandParser

DESCRIPTION = (
    "Compare evaluation runs on the same evaluation set with the first (the baseline): per subgroup the "
    "difference with its paired bootstrap CI at the fixed m, at the m chosen on validation and at matched "
    "specificity (docs/explanation/detection-and-statistics.md \"Confidence intervals and comparisons\"). An evaluation run made with "
    "--allow-training-overlap (tag training_overlap_override) is refused: its evaluation set holds cases the "
    "model learned from; so is one evaluated without that check (training_overlap_check unavailable: a checkpoint "
    "that records no training cases, evaluated without its training run), with no override: evaluate the model "
    "with --run-id. Errors a user can fix exit with status 2."
)


def parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="benchx compare", description=DESCRIPTION)
    parser.add_argument("run_ids", nargs="+", help="evaluation runs; the first is the baseline")
    parser.add_argument("--stage", default="test", choices=["val", "test"])
    parser.add_argument("--experiment", default="benchx", help="experiment to log the comparison run in ('' to skip)")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--score", default="volume", choices=["volume", "localized_volume", "max_prob"],
                        help="scan score: predicted tumor volume, or only the components that overlap the "
                             "lesion (docs/explanation/detection-and-statistics.md \"Scan-level detection\")")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    # Heavy imports after parsing, so --help answers at once.
    from lightning_modules.workflows.evaluate import compare, format_comparison

    # A refused comparison (EvaluationError) is a short message with exit 2 from the benchx dispatcher.
    table, run_id = compare(args.run_ids, args.stage, experiment=args.experiment or None, n_resamples=args.resamples,
                            score=args.score)
    print(format_comparison(table))
    if run_id:
        print(f"comparison logged to run {run_id}")
    return 0
