"""``benchx predict``: segment CT scans with a trained model; masks on each scan's own grid and affine.

Parses the model source, the input and the output folder and calls
:func:`lightning_modules.inference.predict_cases` at the operating point m the model applies (the
one recorded on its registered version, else its recipe's ``detection.threshold_mm3``, as the
pyfunc does): each case's decision is printed with m and written to ``<out>/predictions.csv``. Exit status: 0 when every scan was predicted,
2 on a bad model source or input (through the dispatcher: a missing tracking store, inputs whose
outputs would collide, an ``--out`` that is a file; nothing is written), 3 when some files could not
be read or hold NaN or infinite voxels (they are listed at the end; the others were predicted).

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

from lightning_modules.commands.common import add_model_source_arguments, add_overrides_argument, parse_command_line, split_overrides

EXIT_SKIPPED = 3


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, 
        prog="benchx predict",
        description="Segment CT scans with a trained model and write the masks on each scan's own grid and affine; "
        "unreadable files and scans with NaN or infinite voxels are skipped, listed at the end, and make "
        f"the exit status {EXIT_SKIPPED}.",
    )
    add_model_source_arguments(parser)
    parser.add_argument("--input", required=True, help="a CT .nii.gz, a cohort folder, or a folder of CTs")
    parser.add_argument("--out", required=True,
                        help="output folder: <out>/<case>/prediction.nii.gz and segmentations/<class>.nii.gz per case, "
                        "and <out>/predictions.csv (case, score, threshold, decision, error per case)")
    add_overrides_argument(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_command_line(parser(), sys.argv[1:] if argv is None else argv)
    # Heavy imports after parsing, so --help answers at once.
    from lightning_modules.inference import SUMMARY_FILE, check_output_folder, input_cases, predict_cases
    from lightning_modules.tracking import tracking_uri
    from lightning_modules.tracking.pyfunc import applied_operating_point
    from lightning_modules.models.checkpoints import load_module_from_checkpoint
    from lightning_modules.tracking.artifacts import resolve_model_source

    # A bad model source or input goes to the dispatcher (lightning_modules.cli): a short message, exit 2.
    # The input and output are checked first, so a mistake there costs no model download.
    check_output_folder(Path(args.out))
    cases = input_cases(Path(args.input))
    with tempfile.TemporaryDirectory() as folder:
        recipe, checkpoint = resolve_model_source(
            Path(folder), args.run_id, args.checkpoint, args.recipe, split_overrides(args.overrides)
        )
        module = load_module_from_checkpoint(recipe, checkpoint)
    threshold, source = applied_operating_point(args.run_id, tracking_uri(recipe.tracking.uri) if args.run_id else None,
                                                float(recipe.detection.threshold_mm3))
    print(f"operating point: m = {threshold:g} mm^3 ({source}); a case is 'tumor' when its predicted "
          f"{recipe.data.tumor_class} volume exceeds m")
    summary = predict_cases(module, recipe.data, cases, Path(args.out), report=print, threshold_mm3=threshold)
    print(f"per-case table: {Path(args.out) / SUMMARY_FILE}")
    if summary.skipped:
        print(f"benchx predict: {len(summary.skipped)} file(s) skipped, they could not be read or predicted:", file=sys.stderr)
        for path, reason in summary.skipped:
            print(f"  {path}: {reason}", file=sys.stderr)
        return EXIT_SKIPPED
    return 0
