"""``benchx synthx-quality``: how SynthX tumors compare with the real training tumors (see :mod:`synthx.quality`).

Run::

    benchx synthx-quality --root data/phantom --split splits/phantom.csv --synthetic data/synthetic \
        [--tracking-uri sqlite:///mlflow.db --run-id <generation run id> --out reports/synthx_quality]
"""

from __future__ import annotations

import argparse
import sys

from lightning_modules.commands.common import CommandParser


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="benchx synthx-quality",
        description="Synthetic vs real tumors: HU statistics, contrast, phase faithfulness and diversity, logged to MLflow.",
    )
    parser.add_argument("--root", required=True, help="the real cohort")
    parser.add_argument("--split", required=True, help="the real cohort's split CSV (train cases are the reference)")
    parser.add_argument("--synthetic", required=True, help="the SynthX output cohort")
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--run-id", default=None, help="log into this existing run (e.g. the generation run)")
    parser.add_argument("--experiment", default="synthx", help="experiment of a new run when --run-id is not given")
    parser.add_argument("--out", default=None, help="also write the tables (CSV) and the figure (PNG) to this folder")
    parser.add_argument("--lesion-class", default="pancreatic_lesion")
    parser.add_argument("--organ-class", default="pancreas")
    parser.add_argument("--rim-mm", type=float, default=5.0, help="rim thickness for the tumor-organ contrast")
    parser.add_argument("--seed", type=int, default=0, help="seed of the phase classifier's cross-validation folds")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import pandas as pd

    from synthx.quality import assess_synthetic_cohort

    report, run_id = assess_synthetic_cohort(
        args.root, args.split, args.synthetic, tracking_uri=args.tracking_uri, run_id=args.run_id,
        experiment=args.experiment, out=args.out, lesion_class=args.lesion_class, organ_class=args.organ_class,
        rim_mm=args.rim_mm, seed=args.seed,
    )
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        overview = report.intensity[report.intensity["attribute"].isin(["overall", "phase"])]
        columns = ["attribute", "group", "n_real", "n_synthetic", "contrast_real", "contrast_synthetic",
                   "tumor_sd_real", "tumor_sd_synthetic", "wasserstein_hu"]
        print(overview[columns].to_string(index=False))
        print(report.faithfulness.to_string(index=False))
    print(f"logged to MLflow run {run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
