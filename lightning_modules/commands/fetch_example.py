"""``benchx fetch-example``: fetch TotalSegmentator's real example CT and import it as case ``TS_EXAMPLE``.

Run::

    benchx fetch-example --out data/example_ct
    benchx fetch-example --out data/example_ct --dicom --cache /tmp/benchx-cache

See :mod:`lightning_modules.cohorts.example_ct` for what is fetched and how it is checked.
"""

from __future__ import annotations

import argparse
import logging
import sys

from lightning_modules.commands.common import CommandParser

# lightning_modules.cohorts.example_ct's DEFAULT_OUT and CACHE_ENVIRONMENT_VARIABLE, named here so
# that --help answers without importing the readers.
DEFAULT_OUT = "data/example_ct"
CACHE_ENVIRONMENT_VARIABLE = "BENCHX_CACHE"


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="benchx fetch-example", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="cohort root to import TS_EXAMPLE into")
    parser.add_argument(
        "--cache", default=None, help=f"download cache (default ${CACHE_ENVIRONMENT_VARIABLE} or ~/.cache/benchx)"
    )
    parser.add_argument("--dicom", action="store_true", help="also extract the real DICOM series and print its folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from lightning_modules.cohorts.example_ct import EXAMPLE_CASE_ID, ExampleFetchError, fetch_example, fetch_example_dicom

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        case_dir = fetch_example(args.out, args.cache)
        print(f"{EXAMPLE_CASE_ID}: {case_dir}")
        if args.dicom:
            print(f"DICOM series: {fetch_example_dicom(args.cache)}")
    except ExampleFetchError as error:
        print(f"benchx fetch-example: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
