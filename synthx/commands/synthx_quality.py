"""``benchx synthx-quality``: how SynthX tumors compare with the real training tumors (see :mod:`synthx.analysis.quality`
and :mod:`synthx.analysis.realism`), logged to MLflow.

Run::

    benchx synthx-quality --root data/phantom --split splits/phantom.csv --synthetic data/synthetic \
        [--tracking-uri sqlite:///mlflow.db --run-id <generation run id> --out reports/synthx_quality] \
        [--copy-paste data/copy_paste] [--recipe recipes/generator/synthx.yaml quality_filter.enabled=true] \
        [--detector <training run id> | --detector-checkpoint best.ckpt --detector-recipe recipe.yaml]

With a detector, the realism table adds the Frechet distance of its encoder's bottleneck features
(:mod:`synthx.analysis.realism_encoder`).

With the SynthX recipe's ``quality_filter.enabled``, the synthetic cases a cross-fitted real-vs-synthetic
discriminator spots are listed as dropped (:func:`synthx.analysis.realism.quality_filter`), in
``synthx_quality/quality_filter.csv`` and ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from lightning_modules.commands.common import CommandParser, add_overrides_argument, parse_command_line

# The report's tables, logged as artifacts and written to --out.
TABLES = ("per_tumor", "intensity", "faithfulness", "diversity", "realism")


def quality_metrics(report, prefix: str = "synthx_quality") -> dict[str, float]:
    """The report's metrics: ``<prefix>/<statistic>/<attribute>/<group>`` of the intensity table, phase
    accuracy, synthetic diversity, and ``<prefix>/realism/<comparison>/<metric>[_ci_low|_ci_high]/<phase>``.

    An undefined comparison (no tumor on one side) is left out, never logged as 0.
    """
    from synthx.analysis.quality import LOGGED_STATISTICS

    metrics = {}
    for row in report.intensity.to_dict("records"):
        for statistic in LOGGED_STATISTICS:
            if np.isfinite(row[statistic]):
                metrics[f"{prefix}/{statistic}/{row['attribute']}/{row['group']}"] = float(row[statistic])
    for row in report.faithfulness.to_dict("records"):
        if np.isfinite(row["accuracy"]):
            metrics[f"{prefix}/phase_accuracy/phase/{row['phase']}"] = float(row["accuracy"])
    for row in report.diversity.to_dict("records"):
        if np.isfinite(row["mean_ncc_synthetic"]):
            key = f"{prefix}/mean_ncc_synthetic/phase:sex:age_band/{row['phase']}:{row['sex']}:{row['age_band']}"
            metrics[key] = float(row["mean_ncc_synthetic"])
    for row in report.realism.to_dict("records"):
        for column, suffix in (("value", ""), ("ci_low", "_ci_low"), ("ci_high", "_ci_high")):
            if np.isfinite(row[column]):
                metrics[f"{prefix}/realism/{row['comparison']}/{row['metric']}{suffix}/{row['phase']}"] = float(row[column])
    return metrics


def log_quality(report, run_id: str, prefix: str = "synthx_quality", client=None, filtered: pd.DataFrame | None = None) -> None:
    """Log a :class:`synthx.analysis.quality.QualityReport` to an MLflow run: tables (JSON and CSV), figure, metrics.

    Args:
        report: from :func:`synthx.analysis.quality.quality_report`.
        run_id: the run to log into (e.g. the generation run, so the report sits beside its cases).
        prefix: the artifact folder and metric key prefix.
        client: an MlflowClient (default: one on the current tracking URI).
        filtered: the quality filter's decisions (:func:`synthx.analysis.realism.quality_filter`), logged as
            ``<prefix>/quality_filter.csv`` with ``<prefix>/quality_filter/dropped/<phase>`` counts.
    """
    import mlflow

    from lightning_modules.tracking.recorder import MlflowRunRecorder

    recorder = MlflowRunRecorder(client or mlflow.MlflowClient(), run_id)
    for name in TABLES:
        recorder.log_table(getattr(report, name), f"{prefix}/{name}.csv", ui=True)
    recorder.log_figure(report.figure, f"{prefix}/examples.png")
    metrics = quality_metrics(report, prefix)
    if filtered is not None:
        recorder.log_table(filtered, f"{prefix}/quality_filter.csv")
        for phase, group in filtered.groupby("phase"):
            metrics[f"{prefix}/quality_filter/dropped/{phase}"] = float((~group["kept"]).sum())
    if metrics:
        recorder.log_metrics(metrics)


def filter_cases(report, real_quantile: float, folds: int, seed: int = 0) -> pd.DataFrame:
    """:func:`synthx.analysis.realism.quality_filter` over the report's real training tumors and synthetic tumors."""
    from synthx.analysis.quality import realism_frame
    from synthx.analysis.realism import quality_filter

    return quality_filter(realism_frame(report.records), real_quantile=real_quantile, folds=folds, seed=seed)


def assess_synthetic_cohort(real_root, split_path, synthetic_root, tracking_uri: str | None = None, run_id: str | None = None,
                            experiment: str = "synthx", out=None, lesion_class: str = "pancreatic_lesion",
                            organ_class: str = "pancreas", rim_mm: float = 5.0, seed: int = 0, copy_paste_root=None,
                            quality_filter: dict | None = None, embed=None):
    """:func:`synthx.analysis.quality.quality_report`, logged to MLflow (a new ``synthx-quality`` run unless ``run_id``)
    and optionally written to ``out``; with ``quality_filter`` (``real_quantile`` and ``folds`` of an enabled
    recipe section), the filter's decisions too; ``embed``: see :func:`synthx.analysis.quality.quality_report`.

    A new run ends FINISHED, or FAILED/KILLED when logging fails or is interrupted; an existing run is left as it was.

    Returns:
        (the report, the MLflow run id it was logged to, the filter's decisions or None).
    """
    from synthx.analysis.quality import quality_report
    from lightning_modules.tracking import ended_run, start_run, tracking_client, tracking_uri as resolve_uri

    report = quality_report(real_root, split_path, synthetic_root, lesion_class, organ_class, rim_mm, seed=seed,
                            copy_paste_root=copy_paste_root, embed=embed)
    filtered = None
    if quality_filter is not None:
        filtered = filter_cases(report, float(quality_filter["real_quantile"]), int(quality_filter["folds"]), seed)
    uri = resolve_uri(tracking_uri)
    client = tracking_client(uri)
    if run_id:
        log_quality(report, run_id, client=client, filtered=filtered)
        logged_to = run_id
    else:
        logged_to = start_run(uri, experiment, "synthx-quality", {"synthetic_cohort": str(Path(synthetic_root).resolve())})
        with ended_run(uri, logged_to):
            log_quality(report, logged_to, client=client, filtered=filtered)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        for name in TABLES:
            getattr(report, name).to_csv(folder / f"{name}.csv", index=False)
        if filtered is not None:
            filtered.to_csv(folder / "quality_filter.csv", index=False)
        report.figure.savefig(folder / "examples.png", dpi=120)
    return report, logged_to, filtered


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="benchx synthx-quality",
        description="Synthetic vs real tumors: HU statistics, contrast, phase faithfulness, diversity and realism "
        "(texture, boundary, shape, classifier two-sample test, Frechet distance), logged to MLflow. Trailing "
        "key=value pairs override the SynthX recipe (quality_filter.*).",
    )
    parser.add_argument("--root", required=True, help="the real cohort")
    parser.add_argument("--split", required=True, help="the real cohort's split CSV (train cases are the reference)")
    parser.add_argument("--synthetic", required=True, help="the SynthX output cohort")
    parser.add_argument("--copy-paste", default=None, help="a cohort of copy-pasted tumors, compared with the real ones beside SynthX's")
    parser.add_argument("--recipe", default=None, help="SynthX recipe whose quality_filter section applies (default: filter off)")
    parser.add_argument("--detector", default=None, help="a trained detector (training run id or models:/NAME@ALIAS) whose "
                        "encoder features give the realism table's frechet_encoder")
    parser.add_argument("--detector-checkpoint", default=None, help="a detector checkpoint file, with --detector-recipe")
    parser.add_argument("--detector-recipe", default=None, help="the recipe YAML of --detector-checkpoint")
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--run-id", default=None, help="log into this existing run (e.g. the generation run)")
    parser.add_argument("--experiment", default="synthx", help="experiment of a new run when --run-id is not given")
    parser.add_argument("--out", default=None, help="also write the tables (CSV) and the figure (PNG) to this folder")
    parser.add_argument("--lesion-class", default="pancreatic_lesion")
    parser.add_argument("--organ-class", default="pancreas")
    parser.add_argument("--rim-mm", type=float, default=5.0, help="rim thickness for the tumor-organ contrast")
    parser.add_argument("--seed", type=int, default=0, help="seed of the classifiers' cross-validation folds and the bootstrap")
    add_overrides_argument(parser)
    return parser


def detector_embedder(args: argparse.Namespace, folder: Path):
    """The detector's encoder features (:func:`synthx.analysis.realism_encoder.encoder_embedder`), or None without a detector."""
    if args.detector is None and args.detector_checkpoint is None:
        return None
    import torch

    from lightning_modules.models.checkpoints import load_module_from_checkpoint
    from lightning_modules.tracking.artifacts import resolve_model_source
    from synthx.analysis.realism_encoder import encoder_embedder

    recipe, checkpoint = resolve_model_source(folder, run_id=args.detector, checkpoint=args.detector_checkpoint,
                                              recipe=args.detector_recipe, tracking_uri=args.tracking_uri)
    module = load_module_from_checkpoint(recipe, checkpoint)
    return encoder_embedder(module.network, recipe.data, device="cuda" if torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(build_parser(), sys.argv[1:] if argv is None else argv)
    filter_settings = None
    if args.recipe is not None or args.overrides:
        from synthx.config import RecipeError, load_synthx_recipe

        if args.recipe is None:
            raise RecipeError(f"recipe overrides {args.overrides} need --recipe (the SynthX recipe they change)")
        recipe = load_synthx_recipe(args.recipe, args.overrides)
        if recipe.quality_filter.enabled:
            filter_settings = {"real_quantile": recipe.quality_filter.real_quantile, "folds": recipe.quality_filter.folds}
    with tempfile.TemporaryDirectory() as folder:
        embed = detector_embedder(args, Path(folder))
        report, run_id, filtered = assess_synthetic_cohort(
            args.root, args.split, args.synthetic, tracking_uri=args.tracking_uri, run_id=args.run_id,
            experiment=args.experiment, out=args.out, lesion_class=args.lesion_class, organ_class=args.organ_class,
            rim_mm=args.rim_mm, seed=args.seed, copy_paste_root=args.copy_paste, quality_filter=filter_settings, embed=embed,
        )
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        overview = report.intensity[report.intensity["attribute"].isin(["overall", "phase"])]
        columns = ["attribute", "group", "n_real", "n_synthetic", "contrast_real", "contrast_synthetic",
                   "tumor_sd_real", "tumor_sd_synthetic", "wasserstein_hu"]
        print(overview[columns].to_string(index=False))
        print(report.faithfulness.to_string(index=False))
        summary = report.realism[report.realism["metric"].isin(["classifier_auc", "frechet_radiomic", "edge_gradient"])]
        print(summary[["phase", "comparison", "metric", "n_real", "n_other", "value", "ci_low", "ci_high"]].to_string(index=False))
    if filtered is not None:
        dropped = filtered.loc[~filtered["kept"], "case_id"].tolist()
        print(f"quality filter: {len(filtered) - len(dropped)} kept, {len(dropped)} dropped {dropped}")
    print(f"logged to MLflow run {run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
