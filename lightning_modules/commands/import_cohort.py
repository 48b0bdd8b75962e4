"""``benchx import``: import TotalSegmentator / nnU-Net / MSD / DICOM data into a cohort in layout A.

Run::

    benchx import msd Task07_Pancreas --out data/msd_pancreas
    benchx import nnunet Dataset007_Pancreas --out data/pancreas --class-map classes.json
    benchx import totalseg TotalSegmentator_v2 --out data/totalseg --cohort TotalSegmentator
    benchx import dicom exports/ct --out data/site_a --cohort site-a --salt "$SECRET" --metadata ids.csv

The exit status is 0 when every case is in the cohort, 1 when some are quarantined, 2 when the
source is refused (nothing is written then). See :mod:`lightning_modules.cohorts.importers`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from lightning_modules.commands.common import CommandParser

# lightning_modules.cohorts.importers.SOURCE_KINDS, named here so that --help answers without
# importing the image readers.
SOURCE_KINDS = ("totalseg", "nnunet", "msd", "dicom")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="benchx import",
        description="Import a dataset into a cohort in AbdomenAtlas layout A (resumable; failures go to quarantine.csv).",
    )
    parser.add_argument("kind", choices=SOURCE_KINDS, help="source format")
    parser.add_argument("src", help="source folder")
    parser.add_argument("--out", required=True, help="cohort root to write (existing metadata.csv rows are kept)")
    parser.add_argument("--cohort", help="cohort name for metadata.csv (default: dataset name or folder; required for dicom)")
    parser.add_argument("--class-map", help="JSON/YAML/CSV label -> AbdomenAtlas class, or totalseg-v2 / totalseg-v1")
    parser.add_argument("--metadata", help="CSV keyed by case_id with known metadata (patient_id, age, sex, phase, ...)")
    parser.add_argument("--salt", help="dicom: secret for pseudonymous patient ids (default: $BENCHX_PSEUDONYM_SALT)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every case")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from lightning_modules.cohorts.importers import ImportSourceError, import_source

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        report = import_source(args.kind, args.src, args.out, args.cohort, args.class_map, args.metadata, args.salt)
    except ImportSourceError as error:
        print(f"benchx import: {error}", file=sys.stderr)
        return 2
    print(report.summary())
    return 1 if report.quarantined else 0


if __name__ == "__main__":
    sys.exit(main())
