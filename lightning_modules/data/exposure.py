"""Exposure-matched training schedules: every arm of a study sees the same real draws (docs/explanation/synthx.md
"Arms with equal real exposure").

A schedule is set by the real steps S (``synthx.real_steps``) and the synthesis ratio r
(``synthx.ratio``, synthetic per real draw): it is a stream of draws for the whole training,
:func:`matched_total_steps` ``(S, r) = S + round(r x S)`` steps of ``batch`` draws long (the
recipe's ``trainer.max_steps`` must equal it: :func:`check_schedule`). Its real draws are the first
``S x batch`` draws of one real stream: epoch after epoch a seeded permutation of the real training
cases (cut to whole batches, as the loader's ``drop_last`` would). The real stream depends on the
seed and the number of real cases only, so the baseline (r = 0), the sham arm and the SynthX arm
draw the same real cases, in the same order, the same number of times. The extra draws fill
synthetic slots at seeded positions; slot after slot cycles through the synthetic cases in random
order. In the sham arm each slot is filled instead by a real training positive of the same
(sex, age band, phase) cell as the synthetic case of that slot, drawn again with fresh augmentation.

The sampler hands the stream to Lightning in chunks of whole batches (one chunk per epoch), and counts
what a training of ``steps`` optimizer steps drew (:meth:`ExposureMatchedSampler.exposures`), so the
training run can log its per-case exposures.

Example::

    benchx train --recipe recipes/unet.yaml profile=cpu synthx.real_steps=2400                 # baseline
    benchx train --recipe recipes/unet.yaml profile=cpu synthx.real_steps=2400 trainer.max_steps=3120 \\
        synthx.ratio=0.3 synthx.cohort=data/synthetic [synthx.sham=true]
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
from torch.utils.data import Sampler

from lightning_modules.config.recipe import RecipeError, SynthXMixConfig, TrainerConfig

EXPOSURE_ARTIFACT = "exposure/cases.csv"


def matched_total_steps(real_steps: int, ratio: float) -> int:
    """The optimizer steps of an arm with synthetic share ``ratio`` (synthetic per real draw) and equal real draws."""
    return real_steps + round(ratio * real_steps)


def check_schedule(mixing: SynthXMixConfig, trainer: TrainerConfig, source: str = "recipe") -> None:
    """An exposure-matched recipe (``synthx.real_steps`` set) trains ``real_steps x (1 + ratio)`` steps.

    Raises:
        RecipeError: naming ``source``, the settings and the ``trainer.max_steps`` they need.
    """
    if mixing.real_steps is None:
        return
    expected = matched_total_steps(mixing.real_steps, mixing.ratio)
    if mixing.real_steps < 1 or trainer.max_steps != expected:
        raise RecipeError(f"{source}: synthx.real_steps={mixing.real_steps} at synthx.ratio={mixing.ratio} "
                          f"needs trainer.max_steps={expected} (real steps x (1 + ratio)), got {trainer.max_steps}")


class ExposureMatchedSampler(Sampler[int]):
    """Indices into [real..., synthetic...] following the exposure-matched schedule (module docstring).

    Args:
        n_real: real training cases (indices 0..n_real-1).
        batch_size: draws per optimizer step.
        real_steps: steps whose draws are real (the baseline's steps, ``synthx.real_steps``).
        ratio: the synthesis ratio r (``synthx.ratio``, >= 0): the arm trains
            ``total_steps = matched_total_steps(real_steps, ratio)`` steps, the extra draws being
            synthetic slots; 0 is the baseline.
        seed: the recipe's seed.
        n_synthetic: synthetic cases (indices n_real..); needed when the schedule has slots.
        substitutes: sham arm: for each synthetic case, the real indices that may stand in for it
            (the real training positives of its cell); a slot then yields one of them.
    """

    def __init__(self, n_real: int, batch_size: int, real_steps: int, ratio: float, seed: int = 0,
                 n_synthetic: int = 0, substitutes: Sequence[Sequence[int]] | None = None):
        if n_real < 1 or batch_size < 1 or real_steps < 1:
            raise ValueError("an exposure-matched schedule needs real cases, a batch and real steps")
        if not ratio >= 0:
            raise ValueError(f"synthx.ratio must be >= 0, got {ratio}")
        total_steps = matched_total_steps(real_steps, ratio)
        if total_steps > real_steps and n_synthetic < 1:
            raise ValueError("synthetic slots in the schedule but the synthetic cohort has no cases")
        if substitutes is not None:
            if len(substitutes) != n_synthetic:
                raise ValueError("one list of substitutes per synthetic case is needed")
            empty = [j for j, options in enumerate(substitutes) if not len(options)]
            if empty:
                raise ValueError(f"synthetic case(s) {empty} have no real training positive to stand in for them")
        self.n_real, self.n_synthetic, self.batch_size = int(n_real), int(n_synthetic), int(batch_size)
        self.real_steps, self.ratio, self.total_steps, self.seed = real_steps, ratio, total_steps, int(seed)
        self.substitutes = [np.asarray(s, dtype=np.int64) for s in substitutes] if substitutes is not None else None
        self.epoch = 0
        self._stream: tuple[np.ndarray, np.ndarray] | None = None
        # One epoch: about one pass over the real cases plus its share of synthetic slots, whole batches.
        per_pass = max(self.n_real - self.n_real % self.batch_size, 1)
        length = per_pass * self.total_steps / self.real_steps
        self.epoch_length = self.batch_size * max(1, int(round(length / self.batch_size)))

    def real_stream(self, draws: int) -> np.ndarray:
        """The first ``draws`` real draws: a seeded permutation per pass, cut to whole batches."""
        per_pass = self.n_real - self.n_real % self.batch_size if self.n_real >= self.batch_size else self.n_real
        passes = -(-draws // per_pass)
        orders = [np.random.default_rng([self.seed, 0, e]).permutation(self.n_real)[:per_pass] for e in range(passes)]
        return np.concatenate(orders)[:draws] if orders else np.zeros(0, dtype=np.int64)

    def stream(self) -> tuple[np.ndarray, np.ndarray]:
        """(dataset index of each draw, synthetic case of each draw or -1 for a real draw), whole training."""
        if self._stream is None:
            total = self.total_steps * self.batch_size
            real_draws = self.real_steps * self.batch_size
            slots = total - real_draws
            is_slot = np.zeros(total, dtype=bool)
            if slots:
                is_slot[np.random.default_rng([self.seed, 1]).choice(total, size=slots, replace=False)] = True
            case = np.full(total, -1, dtype=np.int64)
            if slots:
                rng = np.random.default_rng([self.seed, 2])
                rounds = -(-slots // self.n_synthetic)
                case[is_slot] = np.concatenate([rng.permutation(self.n_synthetic) for _ in range(rounds)])[:slots]
            index = np.empty(total, dtype=np.int64)
            index[~is_slot] = self.real_stream(real_draws)
            if self.substitutes is None:
                index[is_slot] = self.n_real + case[is_slot]
            else:
                rng = np.random.default_rng([self.seed, 3])
                index[is_slot] = [self.substitutes[j][rng.integers(len(self.substitutes[j]))] for j in case[is_slot]]
            self._stream = (index, case)
        return self._stream

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.epoch_length

    def __iter__(self):
        index, _ = self.stream()
        start = self.epoch * self.epoch_length
        return iter(index[start:start + self.epoch_length].tolist())

    def exposures(self, steps: int) -> pd.DataFrame:
        """Draws per dataset index in the first ``steps`` optimizer steps.

        Columns: ``index``, ``real_draws`` (draws in real slots), ``slot_draws`` (draws in synthetic
        slots: a synthetic case's own, or a real case's as a sham stand-in). One row per index of
        [real..., synthetic...] (real only in the sham arm).
        """
        index, case = self.stream()
        drawn = slice(0, min(int(steps), self.total_steps) * self.batch_size)
        size = self.n_real + (self.n_synthetic if self.substitutes is None else 0)  # sham: no synthetic case loaded
        real = np.bincount(index[drawn][case[drawn] < 0], minlength=size)
        slot = np.bincount(index[drawn][case[drawn] >= 0], minlength=size)
        return pd.DataFrame({"index": np.arange(size), "real_draws": real, "slot_draws": slot})


def sham_substitutes(synthetic: pd.DataFrame, real: pd.DataFrame) -> tuple[list[list[int]], pd.Series]:
    """For each synthetic case, the real training positives of its (sex, age band, phase) cell.

    Args:
        synthetic: the synthetic cases' metadata (their canvases' sex, age, phase), in dataset order.
        real: the real training cases' metadata, in dataset order (``tumor`` 1 for a positive).

    Returns:
        The positions in ``real`` that may stand in for each synthetic case, and per synthetic case
        the match it got: ``cell``, else ``phase`` (a positive of the same phase), else ``any``.
    """
    from lightning_modules.data.metadata import age_bands

    def cells(table: pd.DataFrame) -> pd.DataFrame:
        return pd.DataFrame({"sex": table["sex"].astype(str).to_numpy(),
                             "age_band": age_bands(pd.to_numeric(table["age"], errors="coerce").to_numpy()),
                             "phase": table["phase"].astype(str).to_numpy()})

    real_cells, synthetic_cells = cells(real), cells(synthetic)
    positive = pd.to_numeric(real["tumor"], errors="coerce").fillna(0).to_numpy() == 1
    if not positive.any():
        raise ValueError("the sham arm needs real training positives, and the training split has none")
    options, matches = [], []
    for row in synthetic_cells.itertuples(index=False):
        same_phase = positive & (real_cells["phase"].to_numpy() == row.phase)
        same_cell = same_phase & (real_cells["sex"].to_numpy() == row.sex) & (real_cells["age_band"].to_numpy() == row.age_band)
        for match, mask in (("cell", same_cell), ("phase", same_phase), ("any", positive)):
            if mask.any():
                options.append(list(np.flatnonzero(mask)))
                matches.append(match)
                break
    return options, pd.Series(matches, index=synthetic.index, name="sham_match")
