"""``benchx synthx-train``: train the SynthX tumor generator (or its latent-mode autoencoder) from a recipe.

Run::

    benchx synthx-train --recipe recipes/generator/synthx.yaml profile=cpu
    benchx synthx-train --recipe recipes/generator/synthx.yaml --root data/phantom --split splits/phantom.csv trainer.max_steps=300
    benchx synthx-train --recipe recipes/generator/synthx.yaml trainer.devices=2 trainer.strategy=ddp   # DDP

Latent mode (full-size runs): train the autoencoder first, then the generator on its latents::

    benchx synthx-train --recipe recipes/generator/synthx.yaml --stage autoencoder --out outputs/synthx-ae
    benchx synthx-train --recipe recipes/generator/synthx.yaml model.latent=true model.vae_path=outputs/synthx-ae/autoencoder
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from lightning_modules.commands.common import CommandParser, add_overrides_argument, parse_command_line


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="benchx synthx-train",
        description="Train the SynthX tumor generator from a recipe. Trailing key=value pairs override the "
        "recipe (e.g. profile=cpu trainer.max_steps=300). A rerun with the same recipe and --out resumes "
        "from the last checkpoint into the same MLflow run.",
    )
    parser.add_argument("--recipe", default="recipes/generator/synthx.yaml", help="SynthX recipe YAML")
    parser.add_argument("--root", default=None, help="cohort folder (overrides data.root)")
    parser.add_argument("--split", default=None, help="split CSV (overrides data.split)")
    parser.add_argument("--out", default=None, help="run folder (default: <tracking.output_dir>/synthx-<stage>-<recipe key>)")
    parser.add_argument("--fresh", action="store_true", help="start over even when the run folder holds a checkpoint")
    parser.add_argument(
        "--stage",
        choices=("generator", "autoencoder"),
        default="generator",
        help="generator (default), or the latent-mode autoencoder (then set model.latent=true model.vae_path=<its folder>)",
    )
    add_overrides_argument(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_command_line(build_parser(), sys.argv[1:] if argv is None else argv)
    from synthx.config import load_synthx_recipe

    overrides = args.overrides
    overrides += [f"data.root={args.root}"] if args.root else []
    overrides += [f"data.split={args.split}"] if args.split else []
    recipe = load_synthx_recipe(args.recipe, overrides)  # refused before torch and diffusers load
    from synthx.training import train_autoencoder, train_synthx

    if args.stage == "autoencoder":
        trained = train_autoencoder(recipe, output_dir=args.out, resume=not args.fresh)
        print(
            f"SynthX autoencoder trained for {trained.steps} steps (latent scaling {trained.scaling_factor:.3f}); "
            f"MLflow run {trained.run_id}; saved to {trained.autoencoder_dir}; train the generator on it with "
            f"model.latent=true model.vae_path={trained.autoencoder_dir}"
        )
        return 0
    result = train_synthx(recipe, output_dir=args.out, resume=not args.fresh)
    print(
        f"SynthX generator trained for {result.steps} steps on {len(result.case_ids)} training cases "
        f"({result.mean_step_seconds:.3f} s/step); MLflow run {result.run_id}; pipeline saved to {result.pipeline_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
