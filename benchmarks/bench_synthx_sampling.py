"""Benchmark: SynthX sampling per tumor with DDIM / DPM-Solver at 20-50 steps against DDPM at 1,000 steps, with quality statistics.

Tiny settings so that it finishes in minutes on a CPU: a phantom cohort, the generator recipe's CPU
profile trained for ``--train-steps`` steps (its own MLflow run in a temporary SQLite store), then the
same requests (the same canvases, tumor masks and seed) painted with each sampler. For each: seconds
per tumor (measured), and the quality statistics of :func:`synthx.analysis.quality.quality_report` over all
tumors: mean tumor HU, tumor-to-rim contrast (HU) and the Wasserstein distances of the HU quantiles
and of the contrast to the real training tumors. The speed ratio is DDPM 1000 / the fast sampler;
the quality of the fast samplers should be close to DDPM's (a generator trained this briefly is far
from the real tumors for every sampler; the comparison is between samplers).

Run::

    .venv/bin/python benchmarks/bench_synthx_sampling.py
    .venv/bin/python benchmarks/bench_synthx_sampling.py --train-steps 300 --tumors 6

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import Row, add_record_argument, record  # noqa: E402
from lightning_modules.data.cohort import load_cohort  # noqa: E402
from lightning_modules.cohorts.phantom import generate_phantom_cohort  # noqa: E402
from lightning_modules.data.splits import make_splits, write_split  # noqa: E402
from synthx.config import load_synthx_recipe  # noqa: E402
from synthx.generation import SynthesisSettings, synthesize  # noqa: E402
from synthx.analysis.quality import quality_report  # noqa: E402
from synthx.training import train_synthx  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "generator" / "synthx.yaml"
# Fast samplers first, so their figures print even if DDPM 1000 is stopped.
SAMPLERS = (("dpm_solver", 20), ("ddim", 20), ("ddim", 50), ("ddpm", 1000))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=40, help="phantom cases")
    parser.add_argument("--train-steps", type=int, default=150, help="generator training steps (CPU profile)")
    parser.add_argument("--tumors", type=int, default=4, help="tumors painted per sampler")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        root, split = folder / "phantom", folder / "split.csv"
        generate_phantom_cohort(root, n_cases=args.cases, seed=0)
        write_split(make_splits(load_cohort(root).metadata, seed=0), split)
        recipe = load_synthx_recipe(RECIPE, [
            "profile=cpu", f"data.root={root}", f"data.split={split}", f"tracking.uri=sqlite:///{folder / 'mlflow.db'}",
            f"trainer.max_steps={args.train_steps}",
        ])
        started = time.perf_counter()
        trained = train_synthx(recipe, output_dir=folder / "generator", enable_progress_bar=False)
        print(f"generator: CPU profile, {args.train_steps} training steps in {time.perf_counter() - started:.0f} s; "
              f"torch threads {torch.get_num_threads()}")
        requests = {("F", "60-80", "venous"): args.tumors // 2, ("M", "60-80", "arterial"): args.tumors - args.tumors // 2}
        requests = {cell: count for cell, count in requests.items() if count}
        results = {}
        for scheduler, steps in SAMPLERS:
            out = folder / f"synthetic-{scheduler}-{steps}"
            started = time.perf_counter()
            # The recipe's sampling settings (guidance, mask prior) with this sampler and step count.
            settings = SynthesisSettings.from_recipe(recipe, root, split, trained.pipeline_dir, out, seed=0, scheduler=scheduler,
                                                     num_inference_steps=steps, log_to_mlflow=False, progress=False)
            summary = synthesize(settings, requests)
            seconds = (time.perf_counter() - started) / max(len(summary.generated), 1)
            overall = quality_report(root, split, out).intensity.query("attribute == 'overall'").iloc[0]
            results[(scheduler, steps)] = (seconds, overall)
            print(f"{scheduler} {steps:>4} steps: {seconds:6.2f} s/tumor ({len(summary.generated)} tumors); tumor mean "
                  f"{overall['tumor_mean_synthetic']:6.1f} HU (real {overall['tumor_mean_real']:.1f}), contrast "
                  f"{overall['contrast_synthetic']:6.1f} HU (real {overall['contrast_real']:.1f}), Wasserstein HU "
                  f"{overall['wasserstein_hu']:.1f}, contrast {overall['wasserstein_contrast']:.1f}")
        reference = results[("ddpm", 1000)][0]
        for (scheduler, steps), (seconds, _) in results.items():
            if scheduler != "ddpm":
                print(f"speed-up of {scheduler} {steps} over DDPM 1000: {reference / seconds:.1f}x per tumor")
    reference_mean = results[("ddpm", 1000)][1]["tumor_mean_synthetic"]
    figures = {f"{scheduler}_{steps}": (seconds, ".2f") for (scheduler, steps), (seconds, _) in results.items()}
    figures["ddpm_1000"] = (reference, ".1f")
    figures["within"] = (max(abs(overall["tumor_mean_synthetic"] - reference_mean)
                             for (scheduler, _), (_, overall) in results.items() if scheduler != "ddpm"), ".1f")
    figures["speedup"] = (reference / results[("ddim", 20)][0], ".1f")
    record(args.record, Row(
        label=(f"SynthX sampling per tumor, CPU-profile generator ({args.train_steps} training steps), "
               f"{args.tumors} tumor{'' if args.tumors == 1 else 's'} per sampler"),
        script="bench_synthx_sampling.py", figures=figures,
        text=("DPM-Solver 20 steps {dpm_solver_20} s, DDIM 20 {ddim_20} s, DDIM 50 {ddim_50} s, DDPM 1000 {ddpm_1000} s; "
              "tumor mean HU within {within} HU of DDPM's"),
        ratio="DDPM 1000 / DDIM 20: {speedup}x"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
