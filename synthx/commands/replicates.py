"""``benchx replicates``: several finished studies (e.g. one per seed) side by side, subgroup by subgroup.

Each study's paired CI covers its test sample only; the spread between studies shows the training
variance those intervals leave out (docs/explanation/detection-and-statistics.md "Confidence intervals and comparisons"). Prints,
per subgroup and metric at one operating point, each study's difference [CI] with its marks, the
mean, and how many studies found it significantly up or down; ``--out`` writes the table as CSV.
Under ``mlflow run -e replicates`` the text and CSV are also logged to the run it opened.

Example::

    benchx replicates <parent seed 0> <parent seed 1> <parent seed 2> --metric auc --attribute phase
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from lightning_modules.commands.common import CommandParser

# synthx.workflows.replicates.OPERATING_POINTS, named here so that --help answers without importing
# the workflow (and with it MLflow and the study).
OPERATING_POINTS = ("fixed", "val_chosen", "matched_specificity", "subgroup_matched_specificity")


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(prog="benchx replicates", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_ids", nargs="+", metavar="RUN",
                        help="the studies' parent runs (two or more; one argument may hold several, space- or comma-separated)")
    parser.add_argument("--operating-point", default="fixed", choices=OPERATING_POINTS,
                        help="which comparison block to line up (default: fixed, where AUC is reported)")
    parser.add_argument("--metric", action="append", dest="metrics",
                        help="metric to show (repeatable; default: auc, sensitivity, specificity)")
    parser.add_argument("--attribute", action="append", dest="attributes",
                        help="subgroup attribute to show, e.g. phase (repeatable; default: all)")
    parser.add_argument("--out", default=None, help="also write the table as CSV here")
    parser.add_argument("--tracking-uri", default=None, help="MLflow store (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    from lightning_modules.tracking import tracking_uri
    from synthx.workflows.replicates import format_replicates, replicate_table, study_comparison

    uri = tracking_uri(args.tracking_uri)
    run_ids = [run_id for argument in args.run_ids for run_id in argument.replace(",", " ").split()]
    tables = [study_comparison(run_id, uri) for run_id in run_ids]
    table = replicate_table(tables, args.operating_point, args.metrics or ("auc", "sensitivity", "specificity"),
                            args.attributes)
    text = (f"== {len(tables)} studies at the {args.operating_point} operating point (SynthX minus baseline, test) ==\n"
            + format_replicates(table))
    print(text)
    if args.out:
        table.to_csv(args.out, index=False)
        print(f"table written to {args.out}")
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if run_id:  # under `mlflow run -e replicates`: the table goes on the run it opened
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        client.log_text(run_id, text, "replicates/replicates.txt")
        client.log_text(run_id, table.to_csv(index=False), "replicates/replicates.csv")
        client.set_tag(run_id, "replicated_studies", " ".join(run_ids))
        print(f"logged to run {run_id} (replicates/)")
    return 0
