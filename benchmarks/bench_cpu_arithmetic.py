"""Benchmark: what the pinned CPU arithmetic costs, per training step, against the machine's own paths.

Importing ``lightning_modules`` pins torch's CPU arithmetic (``lightning_modules.config.numerics``):
ATen on its AVX2 kernels, MKL's conditional reproducibility, oneDNN's convolutions off, so that a
seed trains the same weights on any Intel x86-64 machine. ``BENCHX_NATIVE_CPU=1`` keeps the machine's
fastest paths. This script times the two networks the main job trains, each in a fresh process
per setting (the settings are read once per process):

- the segmentation U-Net of ``recipes/unet.yaml`` (CPU profile): a Lightning-free step of the
  SegmentationModule on one batch of its patch size;
- the SynthX generator of ``recipes/generator/synthx.yaml`` (CPU profile): one denoising training
  step (forward, tumor-weighted loss, backward, AdamW), after the training module's own
  ``on_fit_start`` (on CPU it puts the denoiser in channels-last memory, as ``synthx-train`` does).

It prints milliseconds per step for each setting and the ratio pinned / native. No target: the
figures say what reproducibility costs on this machine.

Run::

    .venv/bin/python benchmarks/bench_cpu_arithmetic.py
    .venv/bin/python benchmarks/bench_cpu_arithmetic.py --steps 30 --threads 2

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.record import Row, add_record_argument, record  # noqa: E402

WORKER = r"""
import sys, time
sys.path.insert(0, {root!r})
import lightning_modules  # pins the environment unless BENCHX_NATIVE_CPU
import lightning_modules.models  # turns oneDNN off unless BENCHX_NATIVE_CPU
import torch

torch.set_num_threads({threads})
torch.manual_seed(0)
network, steps = {network!r}, {steps}
if network == "unet":
    from lightning_modules.recipe import load_recipe
    from lightning_modules.models.checkpoints import build_module

    recipe = load_recipe({root!r} + "/recipes/unet.yaml", ["profile=cpu"])
    module = build_module(recipe)
    module.train()
    optimizer = module.configure_optimizers()["optimizer"]
    patch = tuple(int(v) for v in recipe.data.patch_size)
    batch = int(recipe.data.batch_size)
    image = torch.rand((batch, 1, *patch))
    label = torch.randint(0, 2, (batch, 1, *patch))

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = module.compute_loss(module.network(image), label)
        loss.backward()
        optimizer.step()
else:
    from synthx.config import load_synthx_recipe
    from synthx.generator.model import CONDITION_NAMES
    from synthx.training.modules import SynthXTrainingModule

    recipe = load_synthx_recipe({root!r} + "/recipes/generator/synthx.yaml", ["profile=cpu"])
    module = SynthXTrainingModule.from_recipe(recipe)
    module.on_fit_start()  # as in training: on CPU the denoiser runs channels-last
    optimizer = torch.optim.AdamW(module.denoiser.parameters(), lr=1e-3)
    size, batch = [int(v) for v in recipe.data.patch_size], int(recipe.data.batch_size)
    data = {{"image": torch.rand((batch, 1, *size)) * 2 - 1,
             "region": (torch.rand((batch, 1, *size)) > 0.8).float()}}
    conditions = {{name: torch.zeros(batch, dtype=torch.long) for name in CONDITION_NAMES}}

    def step():
        timesteps = torch.randint(0, 1000, (batch,))
        loss = module.loss(data, timesteps, conditions)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

for _ in range(3):
    step()
start = time.perf_counter()
for _ in range(steps):
    step()
print((time.perf_counter() - start) / steps * 1000.0)
"""


def time_step(network: str, native: bool, steps: int, threads: int) -> float:
    """Milliseconds per training step of ``network`` in a fresh process, pinned or native."""
    environment = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    environment["BENCHX_NATIVE_CPU"] = "1" if native else "0"
    code = WORKER.format(root=str(ROOT), network=network, steps=steps, threads=threads)
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{network} ({'native' if native else 'pinned'}) failed:\n{result.stderr[-2000:]}")
    return float(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per setting (after 3 warm-up steps)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    print(f"{'network':<10} {'pinned ms/step':>15} {'native ms/step':>15} {'pinned / native':>16}")
    rows = []
    for network in ("unet", "generator"):
        pinned = time_step(network, False, args.steps, args.threads)
        native = time_step(network, True, args.steps, args.threads)
        print(f"{network:<10} {pinned:>15.1f} {native:>15.1f} {pinned / native:>16.2f}")
        rows.append(Row(
            label=f"pinned CPU arithmetic, {network} training step, {args.threads} threads",
            script="bench_cpu_arithmetic.py",
            figures={"pinned": (pinned, ".1f"), "native": (native, ".1f"), "ratio": (pinned / native, ".2f")},
            text="pinned {pinned} ms/step, `BENCHX_NATIVE_CPU=1` {native} ms/step", ratio="pinned / native {ratio}"))
    record(args.record, *rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
