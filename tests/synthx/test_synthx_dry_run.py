"""`benchx synthx-train --dry-run` and the DiffTumor-scale `gpu` profile of the generator recipe: the
profile resolves to the full-size latent setting and its models build at their full parameter counts;
the dry run builds the models, runs one optimisation step on a synthetic batch, prints parameter
counts, step time, peak memory, counted FLOPs and the GPU estimate with its assumption, opens no
MLflow run and writes nothing. The steps here run on small overrides of the profile (the full-size
step takes about a minute on 2 cores; docs/scaling.md "The generator at full size" has its output).

Run: .venv/bin/pytest tests/synthx/test_synthx_dry_run.py -x -q
"""

from __future__ import annotations

import re
from pathlib import Path

import mlflow
import pytest

from synthx.commands import synthx_train
from synthx.config import load_synthx_recipe
from synthx.training import SynthXAutoencoderModule, build_denoiser

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "generator" / "synthx.yaml"
# Small enough for a step in seconds on 2 cores; the profile's latent mode and 4x autoencoder stay.
SMALL = [
    "data.patch_size=[32,32,64]", "data.batch_size=2", "model.channels=[32,32,32,32]",
    "autoencoder.channels=[16,16,16]",
]


def count(network) -> int:
    return sum(p.numel() for p in network.parameters())


def test_gpu_profile_is_difftumor_scale_latent_mode_and_builds_at_full_size():
    recipe = load_synthx_recipe(RECIPE, ["profile=gpu"])
    assert recipe.data.patch_size == [96, 96, 96] and recipe.data.batch_size == 4
    assert recipe.model.latent and recipe.model.vae_path == "outputs/synthx-ae/autoencoder"
    assert recipe.scheduler.prediction_type == "sample" and recipe.ema.decay == 0.995
    assert (recipe.optim.lr, recipe.trainer.max_steps) == (1.0e-4, 60_000)
    assert (recipe.autoencoder.latent_channels, recipe.autoencoder.lr) == (8, 3.0e-4)
    autoencoder = SynthXAutoencoderModule.from_recipe(recipe).autoencoder
    assert autoencoder.downsampling_factor == 4  # 96^3 patches -> 24^3 latents, as in DiffTumor
    denoiser = build_denoiser(recipe.model, recipe.data, in_channels=autoencoder.config.latent_channels)
    # This configuration's own counts (stated in the recipe's comment), not published figures.
    assert count(denoiser) == 166_635_976 and count(autoencoder) == 754_577
    assert denoiser.unet.conv_in.conv.in_channels == 2 * 8 + 1  # noisy latent, masked latent, region


def dry_run(argv, tmp_path, monkeypatch, capsys) -> str:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert synthx_train.main(["--recipe", str(RECIPE), "profile=gpu", "--dry-run", *SMALL, *argv]) == 0
    assert list(tmp_path.iterdir()) == [], "the dry run wrote files"
    assert mlflow.active_run() is None
    return capsys.readouterr().out


def numbers(pattern: str, text: str) -> tuple[float, ...]:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text}"
    return tuple(float(g.replace(",", "")) for g in found.groups())


def test_generator_dry_run_reports_counts_time_memory_flops_and_writes_nothing(tmp_path, monkeypatch, capsys):
    out = dry_run([], tmp_path, monkeypatch, capsys)
    recipe = load_synthx_recipe(RECIPE, ["profile=gpu", *SMALL])
    autoencoder = SynthXAutoencoderModule.from_recipe(recipe).autoencoder
    denoiser = build_denoiser(recipe.model, recipe.data, in_channels=8)
    assert numbers(r"denoiser ([\d,]+) parameters", out) == (count(denoiser),)
    assert numbers(r"autoencoder ([\d,]+) parameters \(frozen, built from the recipe's autoencoder section", out) == (count(autoencoder),)
    assert "the denoiser sees 8 x 8x8x16 latents" in out
    seconds, batch, memory = numbers(r"([\d.]+) s at batch (\d+) \(wall clock; [\d.]+ s of CPU time\); peak memory ([\d.]+) GB", out)
    assert seconds > 0 and batch == 2 and memory > 0 and "reduced batch" not in out
    per_patch, per_step, total = numbers(r"([\d.e+]+) per patch, ([\d.e+]+) at batch 2; ([\d.e+]+) for 60,000 steps", out)
    assert per_patch > 0 and per_step == pytest.approx(2 * per_patch, rel=1e-3) and total == pytest.approx(60_000 * per_step, rel=1e-3)
    (hours,) = numbers(r"GPU time estimate \(compute only, a lower bound\): ([\d.]+) h", out)
    assert hours == pytest.approx(total / 400e12 / 3600, abs=0.01) and "ASSUMING 400 TFLOP/s" in out


def test_autoencoder_dry_run_and_the_reduced_batch(tmp_path, monkeypatch, capsys):
    # A full batch projected over the time limit: the step runs at batch 1 and the output says so.
    monkeypatch.setattr(synthx_train, "DRY_RUN_MAX_SECONDS", 0.0)
    out = dry_run(["--stage", "autoencoder"], tmp_path, monkeypatch, capsys)
    recipe = load_synthx_recipe(RECIPE, ["profile=gpu", *SMALL])
    assert numbers(r"autoencoder ([\d,]+) parameters \(trained\)", out) == (count(SynthXAutoencoderModule.from_recipe(recipe).autoencoder),)
    assert "denoiser" not in out and re.search(r"[\d.]+ s at batch 1 \(wall clock", out)
    assert "reduced batch: the timed step ran at batch 1, not 2" in out
    assert re.search(r"[\d.e+]+ at batch 2; [\d.e+]+ for 20,000 steps", out)


def test_a_patch_the_latent_u_net_cannot_divide_is_refused_naming_the_recipe(tmp_path, monkeypatch, capsys):
    from lightning_modules import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["synthx-train", "--recipe", str(RECIPE), "profile=gpu", "data.patch_size=[48,48,48]", "--dry-run"]) == 2
    error = capsys.readouterr().err
    assert f"{RECIPE}: latent mode: every data.patch_size value must be divisible by 32" in error
    assert "Traceback" not in error and list(tmp_path.iterdir()) == []
