"""``benchx predict``: segment CT scans with a trained model; masks on each scan's own grid and affine.

Parses the model source, the input and the output folder and calls
:func:`lightning_modules.inference.predict_cases`. Exit status: 0 when every scan was predicted,
2 on a bad model source or input (through the dispatcher), 3 when some files could not be read (they are listed at the end;
the others were predicted).

Example::

    benchx predict --model-uri models:/benchx-unet@benchx-study-baseline --input data/example_ct --out predictions/
    benchx predict --run-id <training run> --input data/example_ct --out predictions/
    benchx predict --checkpoint best.ckpt --recipe recipes/unet.yaml --input scan.nii.gz --out predictions/
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from lightning_modules.commands.common import add_model_source_arguments, add_overrides_argument, split_overrides

EXIT_SKIPPED = 3


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchx predict",
        description="Segment CT scans with a trained model and write the masks on each scan's own grid and affine; "
        f"unreadable files are skipped, listed at the end, and make the exit status {EXIT_SKIPPED}.",
    )
    add_model_source_arguments(parser)
    parser.add_argument("--input", required=True, help="a CT .nii.gz, a cohort folder, or a folder of CTs")
    parser.add_argument("--out", required=True)
    add_overrides_argument(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    # Heavy imports after parsing, so --help answers at once.
    from lightning_modules.inference import input_cases, predict_cases
    from lightning_modules.models.checkpoints import load_module_from_checkpoint, resolve_model_source

    # A bad model source or input goes to the dispatcher (lightning_modules.cli): a short message, exit 2.
    with tempfile.TemporaryDirectory() as folder:
        recipe, checkpoint = resolve_model_source(
            Path(folder), args.run_id, args.checkpoint, args.recipe, split_overrides(args.overrides)
        )
        module = load_module_from_checkpoint(recipe, checkpoint)
    summary = predict_cases(module, recipe, input_cases(Path(args.input)), Path(args.out), report=print)
    if summary.skipped:
        print(f"benchx predict: {len(summary.skipped)} file(s) skipped, they could not be read:", file=sys.stderr)
        for path, reason in summary.skipped:
            print(f"  {path}: {reason}", file=sys.stderr)
        return EXIT_SKIPPED
    return 0
