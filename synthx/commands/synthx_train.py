"""``benchx synthx-train``: train the SynthX tumor generator (or its latent-mode autoencoder) from a recipe.

Run::

    benchx synthx-train --recipe recipes/generator/synthx.yaml profile=cpu
    benchx synthx-train --recipe recipes/generator/synthx.yaml --root data/phantom --split splits/phantom.csv trainer.max_steps=300
    benchx synthx-train --recipe recipes/generator/synthx.yaml trainer.devices=2 trainer.strategy=ddp   # DDP

Latent mode (full-size runs): train the autoencoder first, then the generator on its latents::

    benchx synthx-train --recipe recipes/generator/synthx.yaml --stage autoencoder --out outputs/synthx-ae
    benchx synthx-train --recipe recipes/generator/synthx.yaml model.latent=true model.vae_path=outputs/synthx-ae/autoencoder

Dry run: build the recipe's full-size models, run one optimisation step on the CPU on a synthetic
batch, print parameter counts, step time, peak memory, FLOPs per step and a GPU time estimate;
no cohort, no MLflow run, nothing written (:func:`dry_run`)::

    benchx synthx-train --recipe recipes/generator/synthx.yaml profile=gpu --dry-run
    benchx synthx-train --recipe recipes/generator/synthx.yaml profile=gpu --stage autoencoder --dry-run
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
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="build the full-size models and run one optimisation step on the CPU on a synthetic batch (no cohort); "
        "print parameter counts, step time, peak memory, FLOPs and a GPU time estimate; no MLflow run, nothing written",
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
    if args.dry_run:
        print(dry_run(recipe, args.stage, source=args.recipe))
        return 0
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


# The dry run's limits on this CPU: above either, projected from a batch-1 step, the timed step
# runs at batch 1 (the models are still built at full size).
DRY_RUN_MAX_SECONDS = 120.0
DRY_RUN_MAX_BYTES = 10 * 2**30
# An ASSUMPTION, not a measurement: the effective bf16 throughput of one H100 on these 3D U-Nets,
# used only to turn the counted FLOPs into hours.
ASSUMED_GPU_FLOPS = 400e12


def _synthetic_batch(size: int, patch, generator):
    """Random patches in [-1, 1], a central ball (a third of the patch across) as the inpainting
    region, and random non-null conditions: the shapes a training batch of the recipe has."""
    import torch

    from synthx.generator.model import AGE_BAND_VOCAB, CONDITION_NAMES, ORGAN_VOCAB, PHASE_VOCAB, SEX_VOCAB

    axes = [torch.arange(p, dtype=torch.float32) - (p - 1) / 2 for p in patch]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"))
    radii = torch.tensor([p / 6 for p in patch]).view(3, 1, 1, 1)
    ball = ((grid / radii).pow(2).sum(0) <= 1).float()
    batch = {
        "image": torch.rand((size, 1, *patch), generator=generator) * 2 - 1,
        "region": ball.expand(size, 1, *patch).clone(),
    }
    for name, vocab in zip(CONDITION_NAMES, (SEX_VOCAB, AGE_BAND_VOCAB, PHASE_VOCAB, ORGAN_VOCAB)):
        batch[name] = torch.randint(1, len(vocab), (size,), generator=generator)
    return batch


def _build_dry_run_module(recipe, stage: str):
    """(module, trained network, description of the networks) at the recipe's full size."""
    from pathlib import Path

    from synthx.training import SynthXAutoencoderModule, SynthXTrainingModule

    def count(network) -> int:
        return sum(p.numel() for p in network.parameters())

    if stage == "autoencoder":
        module = SynthXAutoencoderModule.from_recipe(recipe)
        network = module.autoencoder
        return module, network, f"autoencoder {count(network):,} parameters (trained)"
    vae, source = None, ""
    if recipe.model.latent and not Path(recipe.model.vae_path).is_dir():
        # No trained autoencoder yet: an untrained one of the recipe's autoencoder section has the
        # same shapes and cost, which is all one timed step needs.
        vae = SynthXAutoencoderModule.from_recipe(recipe).autoencoder.requires_grad_(False).eval()
        source = f", built from the recipe's autoencoder section: {recipe.model.vae_path} does not exist yet"
    module = SynthXTrainingModule.from_recipe(recipe, vae=vae)
    described = f"denoiser {count(module.denoiser):,} parameters (trained)"
    if module.vae is not None:
        factor = module.vae.downsampling_factor * 2 ** (len(recipe.model.channels) - 1)
        if any(int(p) % factor for p in recipe.data.patch_size):
            raise ValueError(f"latent mode: every data.patch_size value must be divisible by {factor}; got {list(recipe.data.patch_size)}")
        described += f"; autoencoder {count(module.vae):,} parameters (frozen{source})"
    return module, module.denoiser, described


def _optimisation_step(module, network, stage: str, batch: dict, clip) -> tuple[float, float]:
    """One training step as the trainer runs it (loss, backward, clipping, AdamW/Adam, EMA):
    (wall-clock seconds, CPU seconds of the process, all threads)."""
    import time

    import torch

    from synthx.generator.model import CONDITION_NAMES
    from synthx.training import drop_conditions

    optimizers = module.configure_optimizers()
    optimizer = optimizers["optimizer"] if isinstance(optimizers, dict) else optimizers
    started, cpu_started = time.perf_counter(), time.process_time()
    if stage == "autoencoder":
        loss = module.loss(batch)[0]
    else:
        conditions = drop_conditions({n: batch[n] for n in CONDITION_NAMES}, module.dropout_each, module.dropout_all)
        steps = torch.randint(0, module.noise_scheduler.config.num_train_timesteps, (batch["image"].shape[0],))
        loss = module.loss(batch, steps, conditions)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(network.parameters(), float(clip))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if getattr(module, "ema", None) is not None:
        module.ema.step(network.parameters())
    return time.perf_counter() - started, time.process_time() - cpu_started


def _peak_bytes() -> int:
    """The process's peak resident memory so far (Linux reports kilobytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def dry_run(recipe, stage: str = "generator", source: str = "recipe") -> str:
    """Build the recipe's models at full size and run one optimisation step on the CPU; the report.

    A first step at batch 1 counts the FLOPs (``torch.utils.flop_counter``, forward and backward) and
    warms up; the timed step then runs at ``data.batch_size``, or at batch 1 when a full batch,
    projected from the first step, would take over :data:`DRY_RUN_MAX_SECONDS` or
    :data:`DRY_RUN_MAX_BYTES`. Nothing is written and no MLflow run is opened.

    Raises:
        RecipeError: naming ``source``, when the recipe's shapes do not fit its networks.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(int(recipe.seed))
    from synthx.config import RecipeError

    try:
        module, network, described = _build_dry_run_module(recipe, stage)
    except ValueError as error:  # a patch the latent and U-Net downsampling do not divide
        raise RecipeError(f"{source}: {error}") from None
    module.on_fit_start()
    module.train()
    patch, batch_size = [int(p) for p in recipe.data.patch_size], int(recipe.data.batch_size)
    generator = torch.Generator().manual_seed(int(recipe.seed))
    clip = recipe.trainer.gradient_clip_val
    before = _peak_bytes()
    counter = FlopCounterMode(display=False)
    with counter:
        first_seconds, _ = _optimisation_step(module, network, stage, _synthetic_batch(1, patch, generator), clip)
    flops_per_sample = counter.get_total_flops()
    per_sample_bytes = max(_peak_bytes() - before, 0)
    fits = first_seconds * batch_size <= DRY_RUN_MAX_SECONDS and before + per_sample_bytes * batch_size <= DRY_RUN_MAX_BYTES
    timed_batch = batch_size if fits else 1
    seconds, cpu_seconds = _optimisation_step(module, network, stage, _synthetic_batch(timed_batch, patch, generator), clip)
    max_steps = int(recipe.autoencoder.max_steps if stage == "autoencoder" else recipe.trainer.max_steps)
    flops_per_step = flops_per_sample * batch_size
    total = flops_per_step * max_steps
    per_step_cpu = seconds * batch_size / timed_batch
    shape = "x".join(str(p) for p in patch)
    lines = [
        f"SynthX dry run ({stage}, recipe {recipe.name}, profile {recipe.profile}): one step on synthetic data; "
        "nothing trained or written, no MLflow run",
        f"  models: {described}",
        f"  batch: {batch_size} patches of {shape} voxels (data.batch_size)"
        + (" with conditions sex, age band, phase, organ" if stage == "generator" else ""),
    ]
    if stage == "generator" and module.vae is not None:
        latent = "x".join(str(p // module.vae.downsampling_factor) for p in patch)
        lines.append(f"  latent mode: the denoiser sees {module.vae.config.latent_channels} x {latent} latents")
    lines.append(
        f"  step time on the CPU ({torch.get_num_threads()} threads, float32): {seconds:.2f} s at batch {timed_batch} "
        f"(wall clock; {cpu_seconds:.2f} s of CPU time); "
        f"peak memory {_peak_bytes() / 2**30:.2f} GB (process maximum RSS)"
    )
    if not fits:
        lines.append(
            f"  reduced batch: the timed step ran at batch 1, not {batch_size}: a full batch, projected from the "
            f"first step ({first_seconds:.1f} s, {per_sample_bytes / 2**30:.2f} GB at batch 1), would exceed "
            f"{DRY_RUN_MAX_SECONDS:.0f} s or {DRY_RUN_MAX_BYTES / 2**30:.0f} GB on this machine"
        )
    lines += [
        f"  FLOPs per step (counted, forward + backward): {flops_per_sample:.3e} per patch, {flops_per_step:.3e} "
        f"at batch {batch_size}; {total:.3e} for {max_steps:,} steps",
        f"  on this CPU, {max_steps:,} steps at this wall-clock step time"
        + ("" if fits else f" (x {batch_size} for the full batch)")
        + f": {per_step_cpu * max_steps / 3600:.1f} h",
        f"  GPU time estimate (compute only, a lower bound): {total / ASSUMED_GPU_FLOPS / 3600:.2f} h for {max_steps:,} steps, "
        f"ASSUMING {ASSUMED_GPU_FLOPS / 1e12:.0f} TFLOP/s effective bf16 throughput (an H100 assumption, not measured; "
        "the FLOPs are counted); data loading and memory-bound layers add to it",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
