"""Benchmark: the training data pipeline, cached against decode-every-time, and how long a CPU step waits for data.

On a phantom cohort written to a temporary folder, in one process:

1. Throughput of training samples (random lesion-weighted crops of the preprocessed volume): the
   datamodule's ``CacheDataset`` (NIfTI decoding, orientation, resampling, HU windowing and
   foreground cropping done once per case) against a plain ``Dataset`` with the same transforms
   that decodes and resamples every time. Target: cached >= 10x.
2. The share of a CPU-profile training step (the SegmentationModule through Lightning with the
   datamodule's loader, ``num_workers`` as the profile says) spent waiting for the next batch:
   the time inside the loader's ``next()`` (the data wait proper; target <= 5%), and the whole gap
   between one batch's end and the next one's start, which adds Lightning's loop between steps.
   Beside it, the loader's floor: the same training fed items drawn beforehand (the same
   DataLoader, batch size and collation, no transforms left to run), so the printout separates
   what the loader itself costs from what the random crops and augmentation cost.
3. Memory per cached case at Touchstone's 1.5 mm spacing: the bytes per voxel of the cached image
   and label (measured on the cached tensors), times the voxels of a typical abdominal CT at 1.5 mm
   (512 x 512 x 300 voxels of 0.78 x 0.78 x 1.5 mm -> 266 x 266 x 300), and the phantom's own cases
   resampled to 1.5 mm (measured).

Run::

    .venv/bin/python benchmarks/bench_data_pipeline.py
    .venv/bin/python benchmarks/bench_data_pipeline.py --cases 12 --samples 60

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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
from monai.data import DataLoader, Dataset  # noqa: E402

from benchmarks.record import Row, add_record_argument, record  # noqa: E402
from lightning_modules.recipe import load_recipe  # noqa: E402
from lightning_modules.data.cohort import load_cohort  # noqa: E402
from lightning_modules.data.datamodule import (  # noqa: E402
    CohortDataModule,
    case_items,
    preprocessing,
    seeded_compose,
    training_transforms,
)
from lightning_modules.cohorts.phantom import generate_phantom_cohort  # noqa: E402
from lightning_modules.data.splits import make_splits, write_split  # noqa: E402
from lightning_modules.models.checkpoints import build_module  # noqa: E402

TYPICAL_CT_VOXELS_AT_1_5_MM = 266 * 266 * 300


def samples_per_second(dataset, n_samples: int) -> float:
    """Training samples (one item = samples_per_volume crops) drawn per second, cycling over the cases."""
    started = time.perf_counter()
    drawn = 0
    while drawn < n_samples:
        for index in range(len(dataset)):
            crops = dataset[index]
            drawn += len(crops) if isinstance(crops, list) else 1
            if drawn >= n_samples:
                break
    return drawn / (time.perf_counter() - started)


class TimedLoader:
    """A loader whose iterator records how long each ``next()`` took (the wait for the batch itself)."""

    def __init__(self, loader):
        self.loader, self.fetches = loader, []

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        iterator = iter(self.loader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.fetches.append(time.perf_counter() - start)
            yield batch


class DataWait(pl.Callback):
    """Time between the end of one training batch and the start of the next (the loader's share)."""

    def __init__(self):
        self.waits, self.steps, self._ended = [], [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self._ended is not None:
            self.waits.append(now - self._ended)
        self._started = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._ended = time.perf_counter()
        self.steps.append(self._ended - self._started)


def training_wait(recipe, loader, steps: int) -> tuple[float, float, float, float, float]:
    """Train ``steps`` CPU-profile steps from ``loader``.

    Returns the mean seconds of a step's compute, of the loader's ``next()`` and of the whole gap
    between steps, and the shares of ``next()`` and of the gap in compute plus wait.
    """
    timer = DataWait()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[timer],
    )
    timed = TimedLoader(loader)
    trainer.fit(build_module(recipe), train_dataloaders=timed)
    # From the third step on: the first two steps (and the fetches and gap before them) are warm-up.
    waits, computes, fetches = np.array(timer.waits[1:]), np.array(timer.steps[2:]), np.array(timed.fetches[2:])
    share = fetches.sum() / (fetches.sum() + computes.sum())
    gap_share = waits.sum() / (waits.sum() + computes.sum())
    return computes.mean(), fetches.mean(), waits.mean(), share, gap_share


def cached_bytes_per_voxel(item: dict) -> tuple[float, int]:
    image, label = item["image"], item["label"]
    voxels = int(np.prod(image.shape[1:]))
    return (image.element_size() * image.numel() + label.element_size() * label.numel()) / voxels, voxels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/unet.yaml")
    parser.add_argument("--cases", type=int, default=12, help="phantom cases to write")
    parser.add_argument("--samples", type=int, default=60, help="training samples drawn per pipeline")
    parser.add_argument("--steps", type=int, default=25, help="CPU-profile training steps for the data-wait share")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    with tempfile.TemporaryDirectory() as folder:
        root, split = Path(folder) / "phantom", Path(folder) / "split.csv"
        generate_phantom_cohort(root, n_cases=args.cases, seed=0)
        cohort = load_cohort(root)
        write_split(make_splits(cohort.metadata, seed=0, val_fraction=0.15, test_fraction=0.15), split)
        overrides = [f"data.root={root}", f"data.split={split}", "data.num_workers=0"]
        recipe = load_recipe(args.recipe, ["profile=cpu", *overrides])
        print(f"phantom: {args.cases} cases of {tuple(cohort.metadata.shape)[0]} rows; recipe {recipe.name}, cpu profile, "
              f"torch threads {torch.get_num_threads()}")

        module = CohortDataModule(recipe.data, recipe.seed)
        module.setup("fit")
        cached = module.datasets["train"]
        items = case_items(cohort, module.case_ids("train"), list(recipe.data.classes))
        transforms = preprocessing(recipe.data) + training_transforms(recipe.data)
        uncached = Dataset(items, seeded_compose(transforms, int(recipe.seed)))
        fast = samples_per_second(cached, args.samples)
        slow = samples_per_second(uncached, max(args.samples // 4, 8))
        print(f"cached: {fast:.1f} samples/s; decode every time: {slow:.2f} samples/s; ratio {fast / slow:.1f}x (target >= 10x)")

        compute, fetch, gap, share, gap_share = training_wait(recipe, module.train_dataloader(), args.steps)
        print(f"CPU-profile step: {compute * 1000:.0f} ms compute, {fetch * 1000:.1f} ms in the loader's "
              f"next(): share waiting for data {share * 100:.2f}% (target <= 5%); the whole gap between steps "
              f"{gap * 1000:.1f} ms ({gap_share * 100:.2f}%, with Lightning's loop)")
        # Items drawn beforehand, in a MONAI Dataset without transforms: the loader only fetches and collates.
        loader = module.train_dataloader()
        drawn = Dataset([cached[i % len(cached)] for i in range((args.steps + 2) * loader.batch_size)])
        floor_loader = DataLoader(drawn, batch_size=loader.batch_size, shuffle=True, num_workers=0,
                                  collate_fn=loader.collate_fn, drop_last=True)
        floor_compute, floor_fetch, _, floor_share, _ = training_wait(recipe, floor_loader, args.steps)
        print(f"loader floor (the same training on items drawn beforehand: fetch and collation only): "
              f"{floor_compute * 1000:.0f} ms compute, {floor_fetch * 1000:.1f} ms in next() ({floor_share * 100:.2f}%); "
              f"so the random crops and augmentation cost about {(fetch - floor_fetch) * 1000:.1f} ms per batch")

        full = load_recipe(args.recipe, overrides)  # full profile: 1.5 mm spacing
        cached_full = CohortDataModule(full.data, full.seed, cohort=cohort)
        cached_full.load()
        dataset = cached_full._dataset("train", preprocessing(full.data), cache=True)
        per_voxel, voxels = cached_bytes_per_voxel(dataset[0])
        sizes = [cached_bytes_per_voxel(dataset[i])[1] for i in range(len(dataset))]
        print(f"cached case at 1.5 mm: {per_voxel:.1f} bytes/voxel (image + label, measured); phantom cases "
              f"{np.mean(sizes) * per_voxel / 2**20:.1f} MiB each (measured, {np.mean(sizes):,.0f} voxels); a typical "
              f"CT (266 x 266 x 300 voxels at 1.5 mm) {TYPICAL_CT_VOXELS_AT_1_5_MM * per_voxel / 2**20:.0f} MiB (computed)")
    typical_mib = TYPICAL_CT_VOXELS_AT_1_5_MM * per_voxel / 2**20
    record(
        args.record,
        Row(label=f"data pipeline, {args.cases}-case phantom", script="bench_data_pipeline.py",
            figures={"fast": (fast, ",.0f"), "slow": (slow, ".0f"), "ratio": (fast / slow, ".0f")},
            text="cached {fast} samples/s, decode every time {slow} samples/s", ratio="cached / decode {ratio}x",
            target=">= 10x", met=fast / slow >= 10),
        Row(label="share of a CPU-profile step waiting for data, main process", script="bench_data_pipeline.py",
            figures={"share": (share * 100, ".1f"), "gap": (gap_share * 100, ".1f"),
                     "floor": (floor_share * 100, ".1f"), "augment": ((fetch - floor_fetch) * 1000, ".1f")},
            text=(f"{{share}} % in the loader ({args.steps} steps), {{gap}} % with Lightning's loop between steps; "
                  "loader floor {floor} %; crops and augmentation {augment} ms per batch"),
            target="<= 5 %", met=share <= 0.05),
        Row(label="memory per cached case at 1.5 mm", script="bench_data_pipeline.py",
            figures={"per_voxel": (per_voxel, ".1f"), "typical": (typical_mib, ",.0f")},
            text="{per_voxel} bytes/voxel (image and label, measured); a typical CT, 266 x 266 x 300 voxels, "
                 "{typical} MiB (computed)"),
    )
    return 0 if fast / slow >= 10 and share <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
