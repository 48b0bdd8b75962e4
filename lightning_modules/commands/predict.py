"""``benchx predict``: segment CT scans with a trained model and write the masks on each scan's own grid.

For each scan: ``<out>/<case_id>/prediction.nii.gz`` (labels in recipe class order) and
``<out>/<case_id>/segmentations/<class>.nii.gz``, and the predicted tumor volume in mm^3 (the
scan-level score) is printed. The model is a training run, a registered model or a checkpoint.

Example::

    benchx predict --model-uri models:/benchx-unet@baseline --input data/example_ct --out predictions/
    benchx predict --run-id <training run> --input scan.nii.gz --out predictions/
    benchx predict --checkpoint best.ckpt --recipe recipes/unet.yaml --input scan.nii.gz --out predictions/
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from lightning_modules.commands.common import add_model_source_arguments, add_overrides_argument, split_overrides


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchx predict", description=__doc__.split("\n\n")[0])
    add_model_source_arguments(parser)
    parser.add_argument("--input", required=True, help="a CT .nii.gz, a cohort folder, or a folder of CTs")
    parser.add_argument("--out", required=True, help="output folder (one subfolder per scan)")
    add_overrides_argument(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    # Heavy imports after parsing, so --help is quick. Errors (no such run or model, no CT) go to the
    # dispatcher, which prints them without a traceback.
    from tqdm import tqdm

    from lightning_modules.inference import predict_inputs
    from lightning_modules.models.checkpoints import load_module_from_checkpoint, resolve_model_source

    with tempfile.TemporaryDirectory() as folder:
        recipe, checkpoint = resolve_model_source(
            Path(folder), args.run_id, args.checkpoint, args.recipe, split_overrides(args.overrides)
        )
        module = load_module_from_checkpoint(recipe, checkpoint)
    for case_id, volume, folder in predict_inputs(module, recipe, Path(args.input), Path(args.out)):
        tqdm.write(f"{case_id}: predicted {recipe.data.tumor_class} volume {volume:.1f} mm^3 -> {folder}")
    return 0
