"""``benchx phantom``: write the embedded phantom cohort (layout A + metadata.csv) and print a summary.

The cohort and its designed gaps are described in :mod:`lightning_modules.cohorts.phantom`.

Run::

    benchx phantom --out data/phantom --cases 440 --seed 0
    benchx phantom --out /tmp/tiny --cases 12 --shape 48 48 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lightning_modules.commands.common import CommandParser, bounded

# The phantom's default size (lightning_modules.cohorts.phantom.DEFAULT_CASES), named here so that
# --help answers without importing the renderer.
DEFAULT_CASES = 440


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, write the cohort, print a summary; exit code 2 on bad arguments."""
    parser = CommandParser(prog="benchx phantom", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/phantom", help="cohort folder (default: data/phantom)")
    parser.add_argument("--cases", type=bounded(int, 1), default=DEFAULT_CASES, help=f"number of scans (default: {DEFAULT_CASES})")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--shape", type=int, nargs=3, default=[96, 96, 64], metavar=("X", "Y", "Z"),
                        help="volume shape in voxels (default: 96 96 64)")
    parser.add_argument("--spacing", type=float, nargs=3, default=[2.5, 2.5, 3.0], metavar=("X", "Y", "Z"),
                        help="voxel spacing in mm (default: 2.5 2.5 3.0)")
    parser.add_argument("--overwrite", action="store_true",
                        help="rewrite every case and replace a phantom cohort made with other parameters")
    parser.add_argument("--workers", type=bounded(int, 1), default=None,
                        help="processes rendering cases (default: one per available CPU, at least 16 cases each); "
                             "the files are the same for any number")
    args = parser.parse_args(argv)
    from lightning_modules.cohorts.phantom import generate_phantom_cohort, summarize
    from lightning_modules.cohorts.phantom.writer import folder_size_bytes
    from lightning_modules.data.cohort import METADATA_FILE

    start = time.perf_counter()
    try:
        table = generate_phantom_cohort(args.out, args.cases, args.seed, args.shape, args.spacing, args.overwrite,
                                        workers=args.workers)
    except ValueError as error:
        print(f"benchx phantom: error: {error}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    out = Path(args.out)
    print(
        f"phantom cohort {out} (seed {args.seed}, shape {tuple(args.shape)}, spacing {tuple(args.spacing)} mm): "
        f"{table.attrs['written']} cases written, {table.attrs['kept']} kept, in {seconds:.1f} s, "
        f"{folder_size_bytes(out) / 1e6:.0f} MB on disk"
    )
    print(summarize(table))
    print(f"metadata: {out / METADATA_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
