"""``benchx synthesize``: paint conditioned synthetic tumors into healthy training scans (see :mod:`synthx.generation`).

Sampling (``sampling.scheduler``, ``sampling.num_inference_steps``, ``sampling.guidance_scale``)
and the mask prior (``mask_prior.*``) come from the SynthX recipe and its ``key=value`` overrides,
as do the seed and the MLflow tracking settings.

Run::

    benchx synthesize --root data/phantom --split splits/phantom.csv --pipeline runs:/<run id>/pipeline \
        --out data/synthetic --target min_positives:4 [--recipe recipes/generator/synthx.yaml] profile=cpu \
        sampling.guidance_scale=3 tracking.uri=sqlite:///mlflow.db
    benchx synthesize ... --target need:40 --baseline-records val_records.csv --need-threshold 50
"""

from __future__ import annotations

import argparse
import sys

from lightning_modules.commands.common import CommandParser, add_overrides_argument, parse_command_line


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="benchx synthesize",
        description="Paint conditioned synthetic tumors into healthy training scans of the requested cells and "
        "write a synthetic cohort (resumable). Trailing key=value pairs override the SynthX recipe.",
    )
    parser.add_argument("--root", required=True, help="the real cohort (canvases: its healthy training cases)")
    parser.add_argument("--split", required=True, help="its split CSV")
    parser.add_argument("--pipeline", required=True, help="saved pipeline folder, runs:/<run id>/pipeline, or a run id")
    parser.add_argument("--out", required=True, help="the synthetic cohort folder (resumed when it exists)")
    parser.add_argument(
        "--target",
        required=True,
        help="need:B (with --baseline-records) | min_positives:k | match:val|uniform|<table> (with --budget) | counts:<csv/yaml>",
    )
    parser.add_argument("--recipe", default="recipes/generator/synthx.yaml", help="SynthX recipe (sampling, mask_prior, seed, tracking)")
    parser.add_argument("--budget", type=int, default=None, help="total synthetic cases for match rules")
    parser.add_argument("--baseline-records", default=None, help="the baseline's validation records CSV (need rule)")
    parser.add_argument("--need-threshold", type=float, default=None, help="the baseline's operating point for those records")
    parser.add_argument("--phases", nargs="+", default=None, help="restrict the targeted cells to these phases")
    parser.add_argument("--seed", type=int, default=None, help="generation seed (default: the recipe's seed)")
    parser.add_argument("--max-cases", type=int, default=None, help="make at most this many new cases now")
    parser.add_argument("--generator-run-id", default=None, help="the generator's training run (default: from its provenance)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    add_overrides_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(build_parser(), sys.argv[1:] if argv is None else argv)
    # Heavy imports after parsing, so --help answers at once.
    import torch

    from synthx.config import load_synthx_recipe
    from synthx.generation import SynthesisSettings, synthesize

    recipe = load_synthx_recipe(args.recipe, args.overrides)
    values = dict(
        budget=args.budget, phases=args.phases, max_cases=args.max_cases, generator_run_id=args.generator_run_id,
        need_threshold=args.need_threshold, device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        progress=sys.stderr.isatty(),
    )
    if args.seed is not None:
        values["seed"] = args.seed
    if args.baseline_records:
        import pandas as pd

        values["baseline_records"] = pd.read_csv(args.baseline_records, keep_default_na=False, na_values=[""])
    settings = SynthesisSettings.from_recipe(recipe, args.root, args.split, args.pipeline, args.out, **values)
    summary = synthesize(settings, args.target)
    print(
        f"{len(summary.generated)} generated, {len(summary.skipped)} already complete, {len(summary.failed)} failed, "
        f"{summary.not_reached} left for a rerun, of {summary.requested} fillable requested "
        f"({summary.seconds_per_case:.1f} s per case) -> {summary.out_root}"
    )
    for cell in summary.unfillable.to_dict("records"):
        print(f"  UNFILLABLE {cell['sex']}/{cell['age_band']}/{cell['phase']}: {cell['requested']} requested, "
              "no healthy training scan of that cell", file=sys.stderr)
    for case_id, error in summary.failed.items():
        print(f"  FAILED {case_id}: {error} (details in {summary.out_root / '.quarantine' / (case_id + '.json')})", file=sys.stderr)
    if summary.synthesis_run_id:
        print(f"MLflow run {summary.synthesis_run_id}")
    return 0 if summary.complete else 1


if __name__ == "__main__":
    sys.exit(main())
