"""Benchmark: the training step of the SegmentationModule through Lightning against a plain PyTorch loop.

Same network (a recipe's backbone, the CPU profile by default), same optimizer settings, same batch
of in-memory patches, same number of steps, in one process: the ratio
``Lightning seconds per step / plain loop seconds per step`` is the framework's overhead (target <= 1.05).
The plain loop is what a user would write: forward, the module's own loss, backward, step, schedule.

Run::

    .venv/bin/python benchmarks/bench_training_step.py
    .venv/bin/python benchmarks/bench_training_step.py --recipe recipes/stunet_b.yaml --steps 30

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from benchmarks.record import Row, add_record_argument, record  # noqa: E402
from lightning_modules.recipe import load_recipe  # noqa: E402
from lightning_modules.models.checkpoints import build_module  # noqa: E402


class InMemoryPatches(Dataset):
    """The same ``batches`` of (image, label) patches, one batch per item."""

    def __init__(self, batches: list[dict]):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict:
        return self.batches[index]


def make_batches(n: int, batch_size: int, patch: tuple[int, ...], n_classes: int, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "image": torch.rand((batch_size, 1, *patch), generator=generator),
            "label": torch.randint(0, n_classes + 1, (batch_size, 1, *patch), generator=generator),
        }
        for _ in range(n)
    ]


def plain_loop(module, batches: list[dict]) -> float:
    """Seconds for the steps of a hand-written loop over ``batches`` (after one warm-up step)."""
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    module.train()

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        loss = module.compute_loss(module.network(batch["image"]), batch["label"].long())
        loss.backward()
        optimizer.step()
        scheduler.step()

    step(batches[0])
    started = time.perf_counter()
    for batch in batches[1:]:
        step(batch)
    return time.perf_counter() - started


class StepTimer(pl.Callback):
    """Wall time from the start of the second training batch to the end of the last."""

    def __init__(self):
        self.started = None
        self.ended = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ended = time.perf_counter()


def lightning_loop(module, batches: list[dict]) -> float:
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=len(batches), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer],
        log_every_n_steps=10,
    )
    loader = DataLoader(InMemoryPatches(batches), batch_size=None, shuffle=False)
    trainer.fit(module, train_dataloaders=loader)
    return timer.ended - timer.started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/unet.yaml")
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2, help="alternate plain/Lightning this many times")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    recipe = load_recipe(args.recipe, [f"profile={args.profile}"])
    patch = tuple(int(p) for p in recipe.data.patch_size)
    per_step = int(recipe.data.batch_size) * int(recipe.data.samples_per_volume)
    batches = make_batches(args.steps + 1, per_step, patch, len(recipe.data.classes))
    print(f"{recipe.name} ({args.profile}): {per_step} patches of {patch} per step, {args.steps} timed steps, "
          f"torch threads {torch.get_num_threads()}")
    plain_times, lightning_times = [], []
    for _ in range(args.repeats):  # alternate, so that machine load hits both alike
        torch.manual_seed(0)
        plain_times.append(plain_loop(build_module(recipe), batches) / args.steps)
        torch.manual_seed(0)
        lightning_times.append(lightning_loop(build_module(recipe), batches) / args.steps)
    plain, lightning = min(plain_times), min(lightning_times)
    print(f"plain PyTorch loop: {plain * 1000:.1f} ms/step (best of {args.repeats}: "
          f"{', '.join(f'{t * 1000:.1f}' for t in plain_times)})")
    print(f"SegmentationModule via Lightning: {lightning * 1000:.1f} ms/step (best of {args.repeats}: "
          f"{', '.join(f'{t * 1000:.1f}' for t in lightning_times)})")
    ratio = lightning / plain
    print(f"ratio Lightning / plain: {ratio:.3f} (target <= 1.05)")
    record(args.record, Row(
        label=f"training step, {recipe.name} {args.profile} profile, {per_step} patches of {'x'.join(map(str, patch))}",
        script="bench_training_step.py",
        figures={"plain": (plain * 1000, ".1f"), "lightning": (lightning * 1000, ".1f"), "ratio": (ratio, ".2f")},
        text="plain loop {plain} ms/step, Lightning {lightning} ms/step", ratio="Lightning / plain {ratio}",
        target="<= 1.05", met=ratio <= 1.05))
    return 0 if ratio <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
