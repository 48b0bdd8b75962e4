"""``benchx report``: rebuild a study's HTML report from what its runs logged in MLflow.

The report is written to ``--out`` and logged to the study's parent run as
``report/study_report.html`` (the MLflow UI previews it there). With ``--markdown PATH`` the
results page is written instead: the verdict and a short table in Markdown, naming the run and the
commit that produced them (docs/results.md is written this way). Given the pooled run of a
replicated study (``benchx study --seeds K`` prints it), ``--markdown`` writes the pooled page
(docs/seeds.md is written this way).

Example::

    benchx report --run-id <study parent run> --out outputs/study/study_report.html
    benchx report --run-id <study parent run> --markdown docs/results.md
    benchx report --run-id <pooled run> --markdown docs/seeds.md
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="benchx report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-id", required=True,
                        help="the study's parent run (its name is study-<backbone>), or a pooled run for --markdown")
    parser.add_argument("--out", default=None, help="HTML file to write (default: study_report_<run>.html here)")
    parser.add_argument("--markdown", default=None, metavar="PATH",
                        help="write the results page (verdict and short table, Markdown) to PATH instead of the HTML report")
    parser.add_argument("--no-log", action="store_true", help="do not log the report to the parent run")
    parser.add_argument("--tracking-uri", default=None, help="MLflow store (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    from mlflow.tracking import MlflowClient

    from lightning_modules.tracking import tracking_uri
    from synthx.workflows.pooled_page import write_pooled_markdown
    from synthx.workflows.replicates import POOLED_STAGE
    from synthx.workflows.report.html_page import build_report
    from synthx.workflows.report.markdown_page import write_results_markdown

    uri = tracking_uri(args.tracking_uri)
    if args.markdown:
        pooled = MlflowClient(tracking_uri=uri).get_run(args.run_id).data.tags.get("stage") == POOLED_STAGE
        path = (write_pooled_markdown if pooled else write_results_markdown)(args.run_id, uri, args.markdown)
        print(f"results page written to {path}")
        return 0
    path = build_report(args.run_id, uri, args.out, log=not args.no_log)
    print(f"report written to {path}" + ("" if args.no_log else f" and logged to run {args.run_id}"))
    return 0
