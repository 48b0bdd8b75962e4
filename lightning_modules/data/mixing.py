"""Mixing a synthetic cohort into training at a synthesis ratio r (docs/explanation/synthx.md "Synthetic data").

A synthetic cohort is just a cohort on disk whose rows have ``synthetic=1`` (written by
``benchx synthesize``); mixing it in needs nothing from the generator. Two modes (``synthx.mode``):

- ``add`` (default): synthetic draws come on top of the real ones. Each epoch sees every real
  training case exactly once, as the baseline does, plus ``round(r * n_real)`` synthetic draws
  (r = synthetic / real exposures; the synthetic cases are cycled through in random order so each
  is seen about equally often), all in one shuffled order.
- ``displace``: each of ``n_real`` draws per epoch is synthetic with probability r (0 <= r <= 1)
  and real otherwise, so real exposures are lost in proportion to r.

The real and synthetic exposures of each epoch are logged (``mixing/real_exposures``,
``mixing/synthetic_exposures``). With r = 0 the training data is exactly the baseline's: the mixing
dataset is not built at all.

Refusals, each naming the cases, before any run is opened: a synthetic case in the validation or
test split, a synthetic case whose canvas (``source_case_id``) is not a real training case of the
current split, a "synthetic" cohort with real rows, and a cohort whose generator learned from a
case that is not a real training case of the current split (its ``synthx_provenance.json``, naming
the first such case; a cohort without the file is refused too:
:mod:`lightning_modules.data.synthetic_provenance`). The training workflow logs the synthetic cohort
as an MLflow dataset input of its run and the cases its generator learned from
(:mod:`lightning_modules.tracking.datasets`), which evaluation checks against the cases it scores.

Example::

    benchx train --recipe recipes/unet.yaml profile=cpu synthx.ratio=0.3 synthx.cohort=data/synthetic
    benchx train --recipe recipes/unet.yaml profile=cpu synthx.ratio=0.3 synthx.mode=displace synthx.cohort=data/synthetic
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from monai.data import Dataset
from torch.utils.data import Sampler

from lightning_modules.config.recipe import DataConfig, MixingMode, SynthXMixConfig
from lightning_modules.data.cohort import Cohort, CohortError, load_cohort
from lightning_modules.data.splits import split_sha256
from lightning_modules.data.synthetic_provenance import (
    PROVENANCE_FILE,
    cohort_provenance_problem,
    read_provenance,
)
from lightning_modules.data.exposure import ExposureMatchedSampler, sham_substitutes
from lightning_modules.data.datamodule import CohortDataModule, case_items


class MixingSampler(Sampler[int]):
    """Indices into [real..., synthetic...] for one epoch, in ``add`` or ``displace`` mode (module docstring).

    Args:
        n_real: real cases (indices 0..n_real-1).
        n_synthetic: synthetic cases (indices n_real..n_real+n_synthetic-1).
        ratio: ``add``: synthetic draws per real case and epoch (>= 0); ``displace``: probability
            that a draw is synthetic (0..1). Its range is checked where the recipe is validated
            (:func:`lightning_modules.config.recipe.check_values`).
        seed: base seed; epoch e (``set_epoch``, called by Lightning) uses seed + e, so runs are
            reproducible and epochs differ.
        mode: ``add`` or ``displace``.
        report: called as ``report(epoch, real_exposures, synthetic_exposures)`` each time an epoch's
            order is drawn (e.g. to log them).
    """

    def __init__(self, n_real: int, n_synthetic: int, ratio: float, seed: int = 0,
                 mode: MixingMode = MixingMode.add, report=None):
        if mode not in set(MixingMode):
            raise ValueError(f"synthx.mode must be one of {', '.join(MixingMode)}, got {mode!r}")
        if n_synthetic == 0 and ratio > 0:
            raise ValueError("synthesis ratio > 0 but the synthetic cohort has no cases")
        self.n_real, self.n_synthetic, self.ratio, self.seed, self.mode = n_real, n_synthetic, ratio, seed, MixingMode(mode)
        self.report = report
        self.epoch = 0
        self.history: list[tuple[int, int, int]] = []  # (epoch, real, synthetic) exposures per drawn epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n_real + (round(self.ratio * self.n_real) if self.mode == MixingMode.add else 0)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = self._add(generator) if self.mode == MixingMode.add else self._displace(generator)
        synthetic = int((order >= self.n_real).sum())
        self.history.append((self.epoch, len(order) - synthetic, synthetic))
        if self.report is not None:
            self.report(self.epoch, len(order) - synthetic, synthetic)
        return iter(order.tolist())

    def _add(self, generator: torch.Generator) -> torch.Tensor:
        """Every real case once, plus round(r * n_real) synthetic draws cycling through the synthetic cases."""
        draws = round(self.ratio * self.n_real)
        rounds = -(-draws // max(self.n_synthetic, 1))
        cycled = [torch.randperm(self.n_synthetic, generator=generator) for _ in range(rounds)]
        synthetic = (torch.cat(cycled)[:draws] if cycled else torch.zeros(0, dtype=torch.long)) + self.n_real
        both = torch.cat([torch.arange(self.n_real), synthetic])
        return both[torch.randperm(len(both), generator=generator)]

    def _displace(self, generator: torch.Generator) -> torch.Tensor:
        """n_real draws, each synthetic with probability r."""
        synthetic = torch.rand(self.n_real, generator=generator) < self.ratio
        real_draws = torch.randperm(self.n_real, generator=generator)
        synth_draws = torch.randint(0, max(self.n_synthetic, 1), (self.n_real,), generator=generator) + self.n_real
        return torch.where(synthetic, synth_draws, real_draws)


def check_synthetic_cohort(synthetic: Cohort, split: pd.DataFrame, real: Cohort, split_sha256: str) -> None:
    """Refuse synthetic cases that would leak: canvases outside the training split, real rows, val/test
    use, and a generator that learned from a case outside the training split.

    Args:
        synthetic: the synthetic cohort.
        split: the current split table.
        real: the real cohort.
        split_sha256: the current split file's sha256.
    """
    problem = cohort_provenance_problem(synthetic.root, split, split_sha256)
    problems = ([problem] if problem else []) + generator_mismatches(synthetic)
    train_cases = set(split.loc[split["split"] == "train", "case_id"])
    held_out = set(split.loc[split["split"] != "train", "case_id"])
    for row in synthetic.metadata.itertuples():
        if int(row.synthetic) != 1:
            problems.append(f"{row.case_id}: {synthetic.root}/metadata.csv: row is not synthetic=1 (a synthetic cohort holds only SynthX output)")
        elif row.source_case_id in held_out:
            problems.append(f"{row.case_id}: canvas {row.source_case_id} is a validation/test case of the split: refused")
        elif row.source_case_id not in train_cases:
            problems.append(f"{row.case_id}: canvas {row.source_case_id} is not a real training case of the current split: refused")
    flagged = real.metadata.loc[real.metadata["synthetic"] == 1, "case_id"]
    for case_id in set(flagged) & held_out:
        problems.append(f"{case_id}: synthetic case in the validation/test split: synthetic data is training-only")
    if problems:
        raise CohortError(problems, synthetic.root)


def generator_mismatches(synthetic: Cohort) -> list[str]:
    """The first case made by another generator than the one the cohort's provenance describes (a cohort
    holds the output of one generator, so one provenance file speaks for every case)."""
    try:
        provenance = read_provenance(synthetic.root)
    except ValueError:  # reported by cohort_provenance_problem
        return []
    recorded = provenance.generator_run_id if provenance is not None else ""
    if not recorded or "generator_run_id" not in synthetic.metadata.columns:
        return []
    for case_id, run_id in zip(synthetic.metadata["case_id"], synthetic.metadata["generator_run_id"].astype(str)):
        if run_id and run_id != recorded:
            return [f"{case_id}: made by generator run {run_id}, but {synthetic.root}/{PROVENANCE_FILE} describes run "
                    f"{recorded}: keep each generator's cases in a cohort of their own"]
    return []


class MixedTrainingSet(Dataset):
    """Real training items followed by synthetic items, with a :class:`MixingSampler` as ``sampler``.

    ``inner``: the items as a (cached) dataset, e.g. :meth:`CohortDataModule.cached`.
    """

    def __init__(self, inner: Dataset, n_real: int, ratio: float, seed: int, mode: MixingMode = MixingMode.add, report=None):
        self.inner = inner
        self.n_real = n_real
        self.n_synthetic = len(inner) - n_real
        self.sampler = MixingSampler(n_real, self.n_synthetic, ratio, seed, mode, report)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        return self.inner[index]


def mixing_datamodule(
    data: DataConfig,
    mixing: SynthXMixConfig,
    *,
    seed: int,
    synthetic_root: Path | None = None,
    cache_dir: str | Path | None = None,
) -> CohortDataModule:
    """The recipe's datamodule; with ``synthx.ratio > 0`` its training set mixes in the synthetic cohort.

    The ratio r goes as it is to the sampler: :class:`MixingSampler`, or with ``synthx.real_steps``
    the :class:`~lightning_modules.data.exposure.ExposureMatchedSampler`, whose schedule is
    ``real_steps`` and r (the recipe's ``trainer.max_steps`` is checked to match it when it is loaded).

    Args:
        data: the recipe's data section.
        mixing: its ``synthx`` section (ratio, mode, cohort, exposure-matched schedule, sham).
        seed: the recipe's seed.
        synthetic_root: the synthetic cohort's folder (default: ``synthx.cohort``). A cohort named by
            its generator run (``synthx.generator_run``) is found in the tracking store by the training
            workflow (:func:`lightning_modules.tracking.datasets.resolve_synthetic_cohort`), not here.
        cache_dir: the disk cache's folder when ``data.cache_dir`` is empty.
    """
    if synthetic_root is None and mixing.cohort:
        synthetic_root = Path(mixing.cohort)
    ratio: float = mixing.ratio
    if synthetic_root is None and mixing.generator_run and ratio > 0:
        raise CohortError([f"synthx.generator_run={mixing.generator_run}: its cohort is found in the tracking "
                           "store; pass lightning_modules.tracking.datasets.resolve_synthetic_cohort(recipe) "
                           "(benchx train does)"])
    if mixing.real_steps is not None:
        return matched_datamodule(data, mixing, seed=seed,
                                  synthetic_root=synthetic_root if ratio > 0 else None, cache_dir=cache_dir)
    if ratio == 0.0 or synthetic_root is None:
        if ratio > 0:
            raise CohortError(["synthx.ratio > 0 needs synthx.cohort or synthx.generator_run"])
        return CohortDataModule(data, seed, cache_dir=cache_dir)
    synthetic = load_cohort(synthetic_root)

    def build(datamodule: CohortDataModule, transforms: list):
        classes = list(data.classes)
        real_items = case_items(datamodule.cohort, datamodule.case_ids("train"), classes)
        synth_items = case_items(synthetic, synthetic.case_ids, classes)
        return MixedTrainingSet(
            datamodule.cached(real_items + synth_items, transforms), len(real_items), ratio,
            seed, mixing.mode, exposure_logger(datamodule),
        )

    datamodule = CohortDataModule(data, seed, train_dataset_factory=build, cache_dir=cache_dir)
    # Checked here, before any run is opened (training refuses before it touches MLflow).
    datamodule.load()
    check_synthetic_cohort(synthetic, datamodule.split, datamodule.cohort, split_sha256(data.split))
    datamodule.synthetic_cohort = synthetic
    return datamodule


class MatchedTrainingSet(Dataset):
    """Real training items, then synthetic ones, drawn by an :class:`ExposureMatchedSampler` (``sampler``)."""

    def __init__(self, items: list[dict], inner: Dataset, sampler: ExposureMatchedSampler, sham_match: pd.Series | None = None):
        self.inner = inner
        self.case_ids = [item["case_id"] for item in items]
        self.synthetic = [int(i >= sampler.n_real) for i in range(len(items))]
        self.sampler = sampler
        self.sham_match = sham_match

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        return self.inner[index]

    def exposure_table(self, steps: int) -> pd.DataFrame:
        """Per case: ``case_id, synthetic, real_draws, slot_draws`` after ``steps`` optimizer steps."""
        table = self.sampler.exposures(steps)
        table.insert(0, "case_id", self.case_ids)
        table.insert(1, "synthetic", self.synthetic)
        return table.drop(columns="index")


def matched_datamodule(
    data: DataConfig,
    mixing: SynthXMixConfig,
    *,
    seed: int,
    synthetic_root: Path | None,
    cache_dir: str | Path | None = None,
) -> CohortDataModule:
    """The datamodule of an exposure-matched arm (:mod:`lightning_modules.data.exposure`); the
    arguments are :func:`mixing_datamodule`'s. Its sampler's schedule is ``synthx.real_steps`` and
    ``synthx.ratio``.

    ``synthetic_root`` None: the baseline (real draws only). With ``synthx.sham`` the synthetic cohort
    only says which cells the slots belong to; its cases are never loaded for training.
    """
    ratio: float = mixing.ratio
    if ratio > 0 and synthetic_root is None:
        raise CohortError(["synthx.ratio > 0 needs synthx.cohort or synthx.generator_run"])
    synthetic = load_cohort(synthetic_root) if synthetic_root is not None else None
    sham = bool(mixing.sham)

    def build(datamodule: CohortDataModule, transforms: list):
        classes = list(data.classes)
        train_ids = datamodule.case_ids("train")
        real_items = case_items(datamodule.cohort, train_ids, classes)
        synth_items, substitutes, match = [], None, None
        if synthetic is not None:
            if sham:
                real = datamodule.cohort.subset(train_ids)
                if (pd.to_numeric(real["tumor"], errors="coerce").fillna(-1) < 0).any():
                    real["tumor"] = datamodule.cohort.resolve_tumor_labels(str(data.tumor_class)).loc[train_ids].to_numpy()
                substitutes, match = sham_substitutes(synthetic.metadata, real)
                match.index = list(synthetic.metadata["case_id"])
            else:
                synth_items = case_items(synthetic, synthetic.case_ids, classes)
        sampler = ExposureMatchedSampler(
            len(real_items), data.batch_size, mixing.real_steps, ratio,
            seed, n_synthetic=len(synthetic.metadata) if synthetic is not None else 0, substitutes=substitutes,
        )
        items = real_items + synth_items
        return MatchedTrainingSet(items, datamodule.cached(items, transforms), sampler, match)

    datamodule = CohortDataModule(data, seed, train_dataset_factory=build, cache_dir=cache_dir)
    if synthetic is not None:
        # Checked before any run is opened, for the sham arm too: its slots follow the same cohort.
        datamodule.load()
        check_synthetic_cohort(synthetic, datamodule.split, datamodule.cohort, split_sha256(data.split))
    if synthetic is not None and not sham:
        datamodule.synthetic_cohort = synthetic
    return datamodule


def exposure_logger(datamodule: CohortDataModule):
    """``report(epoch, real, synthetic)`` that logs an epoch's exposures to the training run (rank 0)."""

    def report(epoch: int, real: int, synthetic: int) -> None:
        trainer = datamodule.trainer
        if trainer is None or not trainer.is_global_zero or trainer.logger is None:
            return
        metrics = {"mixing/real_exposures": float(real), "mixing/synthetic_exposures": float(synthetic), "mixing/epoch": float(epoch)}
        trainer.logger.log_metrics(metrics, step=trainer.global_step)

    return report
