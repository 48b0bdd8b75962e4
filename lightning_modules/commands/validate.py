"""``benchx validate``: check a cohort (and optionally a split) and list every problem at once.

Run::

    benchx validate --root data/phantom
    benchx validate --root data/phantom --classes pancreas pancreatic_lesion --split splits/phantom.csv

Exit status 0 when there is no problem, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="benchx validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="cohort folder (layout A or B) with metadata.csv")
    parser.add_argument("--classes", nargs="+", default=None,
                        help="mask classes the recipe needs (default: pancreas and pancreatic_lesion, the BenchX task)")
    parser.add_argument("--tumor-class", default=None, help="lesion class checked against the tumor column")
    parser.add_argument("--split", default=None, help="also check a split CSV against the cohort")
    parser.add_argument("--headers-only", action="store_true", help="read NIfTI headers only (faster, fewer checks)")
    parser.add_argument("--workers", type=int, default=None, help="reader threads (default: up to 4)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imported after parsing, so that --help and argument errors answer at once.
    from lightning_modules.data.validation import DEFAULT_CLASSES, validate

    classes = args.classes if args.classes is not None else list(DEFAULT_CLASSES)
    report = validate(args.root, classes, not args.headers_only, args.tumor_class, args.workers, args.split)
    for problem in report.problems:
        print(problem)
    if report.problems:
        print(
            f"{len(report.problems)} problem(s) in {report.affected_cases} case(s) of {args.root} "
            f"({report.cases} case(s) read)"
        )
        return 1
    print(f"{args.root}: {report.cases} case(s), no problems")
    return 0


if __name__ == "__main__":
    sys.exit(main())
