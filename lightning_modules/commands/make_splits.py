"""``benchx make-splits``: write a patient-grouped, stratified split CSV of a cohort, once.

Run::

    benchx make-splits --root data/phantom --out splits/phantom.csv --seed 0 --val 0.1 --test 0.2
    benchx make-splits --root data/external --out splits/external.csv --val 0.1 --test 0.9   # no training share

Exit status 0 when the split was written; a refused cohort, split or setting (an existing file,
fractions out of range) is a short message with exit status 2 from the ``benchx`` dispatcher.
"""

from __future__ import annotations

import argparse
import sys

from lightning_modules.commands.common import CommandParser


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="benchx make-splits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="cohort folder with metadata.csv")
    parser.add_argument("--out", required=True, help="split CSV to write (e.g. splits/phantom.csv)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val", type=float, default=0.1, help="share of cases in val")
    parser.add_argument(
        "--test", type=float, default=0.2, help="share of cases in test (val + test = 1 leaves no training share)"
    )
    parser.add_argument(
        "--tumor-class", default="pancreatic_lesion", help="lesion mask that defines an unrecorded tumor label"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing split file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from lightning_modules.data.splits import write_cohort_split

    written = write_cohort_split(args.root, args.out, args.seed, args.val, args.test, args.tumor_class, args.force)
    print(f"wrote {args.out} (sha256 {written.sha256[:12]}, seed {args.seed})")
    print(written.summary.to_string(index=False))
    if written.synthetic_left_out:
        print(f"{written.synthetic_left_out} synthetic case(s) left out: synthetic cases are training data only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
