"""GPU benchmark: training iterations per second and peak memory of every backbone at its Touchstone patch and batch.

For each of the 12 backbones, at the full-size recipe's patch and patches per step (BenchX table 8;
nnU-Net and ResEnc planned for a typical abdominal CT at 1.5 mm, as ``benchx train`` would), a
training step is the SegmentationModule's loss (Dice + CE, deep supervision as the recipe says)
with its optimizer, under bf16 autocast (what Lightning's ``precision="bf16-mixed"`` runs). Variants:

- ``eager``: as trained by default;
- ``channels_last``: network and inputs in ``torch.channels_last_3d`` (convolutional backbones only:
  the transformer backbones keep tokens channels-last themselves);
- ``compile``: ``torch.compile`` of the network (default mode).

Printed beside each: the rate implied by BenchX table 7 (iterations / hours on the GPUs it lists,
e.g. U-Net 250K iterations in 7.5 h on one A6000 = 9.3 it/s; the multi-GPU rows are the rate of all
their GPUs together). One command, one GPU, under 8 minutes: each variant runs ``--warmup`` then
``--steps`` timed steps, and variants still waiting when ``--budget-s`` is spent are reported as
skipped rather than run.

Run::

    .venv/bin/python benchmarks/gpu_backbones.py                 # on a GPU
    .venv/bin/python benchmarks/gpu_backbones.py --only unet mednext --variants eager compile
    .venv/bin/python benchmarks/gpu_backbones.py --dry-run       # tiny widths on CPU: checks the script runs

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peak_memory import PeakMemory  # noqa: E402
from benchmarks.record import Row, add_record_argument, record  # noqa: E402
from lightning_modules.recipe import load_recipe  # noqa: E402
from lightning_modules.models.backbones import BACKBONES  # noqa: E402
from lightning_modules.models.backbones.nnunet import is_planned  # noqa: E402
from lightning_modules.models.planning import plan_nnunet  # noqa: E402
from lightning_modules.models.checkpoints import build_module  # noqa: E402

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
# BenchX table 7: (iterations, hours, GPUs).
TABLE_7 = {
    "unet": (250_000, 7.5, "1xA6000"),
    "unetr": (250_000, 24, "8xV100"),
    "swin_unetr_tiny": (250_000, 24, "8xV100"),
    "swin_unetr_small": (250_000, 28, "4xA6000"),
    "swin_unetr_base": (250_000, 30, "4xA6000"),
    "universal_model_a": (200_000, 18, "1xA6000"),
    "universal_model_b": (200_000, 18, "1xA6000"),
    "nnunet": (250_000, 28, "1xA6000"),
    "resenc": (250_000, 28, "1xA6000"),
    "stunet_b": (500_000, 30, "1xA6000"),
    "mednext": (250_000, 67, "4xA6000"),
    "vsmtrans": (300_000, 48, "4xA6000"),
}
CONVOLUTIONAL = {"unet", "nnunet", "resenc", "stunet_b", "mednext", "universal_model_a"}
TYPICAL_CT_SPACING, TYPICAL_CT_SHAPE = (1.5, 1.5, 1.5), (266, 266, 300)
VARIANTS = ("eager", "channels_last", "compile")


def table_7_rate(name: str) -> float:
    iterations, hours, _ = TABLE_7[name]
    return iterations / (hours * 3600)


def benchmark_recipe(name: str, dry_run: bool):
    """The recipe as benchmarked: full size (planned where 'auto'), or the CPU profile for a dry run."""
    overrides = ["profile=cpu", "data.patch_size=[32,32,32]", "data.batch_size=1", "data.samples_per_volume=1"] if dry_run else []
    recipe = load_recipe(RECIPES / f"{name}.yaml", overrides)
    options = OmegaConf.to_container(recipe.model.options, resolve=True)
    if name in ("nnunet", "resenc") and is_planned(options):
        architecture = "plain" if name == "nnunet" else "resenc"
        plan = plan_nnunet(TYPICAL_CT_SPACING, TYPICAL_CT_SHAPE, architecture=architecture,
                           gpu_memory_gb=float(options["gpu_memory_gb"]))
        for key in ("n_stages", "strides", "kernel_sizes", "features_per_stage"):
            recipe.model.options[key] = plan[key]
        recipe.data.patch_size = list(plan["patch_size"])
    return recipe


def run_variant(recipe, variant: str, device: torch.device, warmup: int, steps: int) -> tuple[float, float]:
    """(iterations per second, peak MiB) of ``steps`` training steps after ``warmup``."""
    torch.manual_seed(0)
    module = build_module(recipe).to(device)
    module.train()
    network = module.network
    memory_format = torch.channels_last_3d if variant == "channels_last" else torch.contiguous_format
    if variant == "channels_last":
        network = network.to(memory_format=memory_format)
    forward = torch.compile(network) if variant == "compile" else network
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    patch = tuple(int(p) for p in recipe.data.patch_size)
    batch = int(recipe.data.batch_size) * int(recipe.data.samples_per_volume)
    image = torch.rand((batch, 1, *patch), device=device).contiguous(memory_format=memory_format)
    label = torch.randint(0, len(recipe.data.classes) + 1, (batch, 1, *patch), device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss = module.compute_loss(forward(image), label)
        loss.backward()
        optimizer.step()
        scheduler.step()

    for _ in range(warmup):
        step()
    with PeakMemory(device) as peak:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
    del module, network, forward, optimizer
    return steps / elapsed, peak.mib


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny widths, 32^3 patches, batch 1, on CPU")
    parser.add_argument("--only", nargs="*", default=list(BACKBONES), choices=list(BACKBONES))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop starting new runs after this (7.5 min)")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.dry_run:
        print("no CUDA device: use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    if args.dry_run:
        args.warmup, args.steps, args.budget_s = 1, 1, float("inf")  # the dry run checks every path
    name_of_device = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run: tiny widths)"
    print(f"device: {name_of_device}; torch {torch.__version__}; bf16 autocast; {args.warmup} warm-up + {args.steps} timed steps")
    print(f"{'backbone':<18} {'patch':<15} {'batch':>5} {'variant':<13} {'it/s':>7} {'peak MiB':>9} "
          f"{'table 7 it/s':>12}  GPUs (table 7)")
    started = time.perf_counter()
    failures, ran, rows = 0, 0, []
    for name in args.only:
        recipe = benchmark_recipe(name, args.dry_run)
        patch = "x".join(str(int(p)) for p in recipe.data.patch_size)
        batch = int(recipe.data.batch_size) * int(recipe.data.samples_per_volume)
        for variant in args.variants:
            if variant == "channels_last" and name not in CONVOLUTIONAL:
                continue
            if variant == "compile" and args.dry_run and name != "unet":
                continue  # compiling every backbone on CPU takes long; the dry run checks the path once
            prefix = f"{name:<18} {patch:<15} {batch:>5} {variant:<13}"
            if time.perf_counter() - started > args.budget_s:
                print(f"{prefix} {'skipped (time budget spent)':>17}")
                continue
            try:
                rate, peak = run_variant(recipe, variant, device, args.warmup, args.steps)
                ran += 1
                print(f"{prefix} {rate:7.2f} {peak:9.0f} {table_7_rate(name):12.2f}  {TABLE_7[name][2]}", flush=True)
                rows.append(Row(
                    label=f"{name}, patch {patch}, batch {batch}, {variant}, {name_of_device}", script="gpu_backbones.py",
                    figures={"rate": (rate, ".2f"), "peak": (peak, ",.0f"), "table_7": (table_7_rate(name), ".2f")},
                    text=f"{{rate}} it/s, peak {{peak}} MiB; BenchX table 7 {{table_7}} it/s on {TABLE_7[name][2]}"))
            except Exception as error:  # one failing variant (e.g. out of memory) must not hide the rest
                failures += 1
                print(f"{prefix} failed: {type(error).__name__}: {str(error).splitlines()[0][:80]}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.dry_run:  # tiny widths on CPU say nothing of GPU speed: the row says what was checked
        rows = [Row(label="GPU backbones: it/s and peak memory per backbone", script="gpu_backbones.py",
                    figures={"ran": (ran, ".0f"), "failed": (failures, ".0f")},
                    text=("not measured: no GPU; the dry run (tiny widths, on CPU) stepped {ran} backbone variants, "
                          "{failed} failed"))]
    record(args.record, *rows)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
