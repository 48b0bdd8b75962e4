"""``benchx audit``: the leakage audit of a cohort and its split (duplicates, patients, header cues).

Run::

    benchx audit --root data/phantom --split splits/phantom.csv --out outputs/audit
    benchx audit --root data/phantom --split splits/phantom.csv --out outputs/audit \\
        --tracking-uri sqlite:///mlflow.db --experiment benchx-audit

Exit status 0 when no leak was found, 1 on leakage, 2 when the cohort or split cannot be read.
"""

from __future__ import annotations

import argparse
import sys

from lightning_modules.commands.common import CommandParser

# The near-duplicate threshold's default (lightning_modules.cohorts.audit.DEFAULT_THRESHOLD), named
# here so that --help answers without importing the audit's image libraries.
DEFAULT_THRESHOLD = 0.98


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="benchx audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="cohort folder")
    parser.add_argument("--split", required=True, help="split CSV (case_id,patient_id,split)")
    parser.add_argument("--out", required=True, help="folder for the findings CSV and the summary")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="near-duplicate NCC threshold")
    parser.add_argument("--synthetic-root", action="append", default=[], help="a SynthX cohort to check (repeatable)")
    parser.add_argument("--lesion-class", default="pancreatic_lesion")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="reader threads (default: up to 4)")
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument("--experiment", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from lightning_modules.cohorts.audit import AuditSettings, audit
    from lightning_modules.data.cohort import CohortError
    from lightning_modules.data.splits import SplitError
    from lightning_modules.tracking.audit import log_audit

    settings = AuditSettings(
        threshold=args.threshold, lesion_class=args.lesion_class, seed=args.seed, workers=args.workers
    )
    try:
        report = audit(args.root, args.split, args.out, settings, synthetic_cohorts=args.synthetic_root)
    except (CohortError, SplitError, ValueError) as error:
        print(f"benchx audit: {error}", file=sys.stderr)
        return 2
    log_audit(report, args.tracking_uri, args.experiment)
    for finding in report.findings:
        print(finding)
    warnings = sum(f.severity == "warning" for f in report.findings)
    print(f"audit written to {report.files['summary'].parent}: {len(report.leaks)} leak(s), {warnings} warning(s)")
    return 1 if report.leakage_found else 0


if __name__ == "__main__":
    sys.exit(main())
