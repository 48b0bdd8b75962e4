"""How often the pooled seed interval excludes 0 when the arms do not differ
(docs/explanation/detection-and-statistics.md "Seeds as the unit of inference"): simulated null studies of K paired replicates,
pooled by Student's t over the seeds (the headline,
:func:`~lightning_modules.evaluation.seed_pooling.seed_t_interval`) and by the two-level
bootstrap (the secondary interval of :func:`~lightning_modules.evaluation.seed_pooling.pool_deltas`).

A null study: T tumors (one per patient) with a difficulty z shared by every seed and arm (the
same test patients); each seed k trains both arms, each arm with its own quality q ~ N(0, tau^2);
a tumor is found when ``mu + z + q + e > 0`` (e ~ N(0, 1) per scan), mu setting the mean
sensitivity. The arms are exchangeable, so every interval that excludes 0 is a false positive.
A regime is named by its per-seed spread: the standard deviation of the K per-seed paired
sensitivity differences within a study (0.31 in the arterial row of docs/seeds.md), which
:func:`training_sd_for_spread` turns into tau.

Run::

    python -m lightning_modules.evaluation.pooling_level      # the table of docs/design.md
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd
import scipy.optimize
import scipy.stats

from lightning_modules.evaluation.bootstrap import patient_weight_blocks
from lightning_modules.evaluation.seed_pooling import pool_deltas, seed_counts, seed_t_interval

SENSITIVITY = 0.5  # the arms' mean arterial sensitivity on the locked cohort (sham about 0.75, SynthX 0.30)
TUMORS = (18, 40)
SPREADS = (0.2, 0.3, 0.4, 0.5)
SEEDS = 5


def _detections(tumors: int, seeds: int, training_sd: float, n_nulls: int, rng: np.random.Generator,
                sensitivity: float = SENSITIVITY) -> np.ndarray:
    """(nulls x seeds x 2 arms x tumors) detections of simulated null studies."""
    mu = scipy.stats.norm.ppf(sensitivity) * np.sqrt(2.0 + training_sd**2)
    difficulty = rng.normal(0.0, 1.0, (n_nulls, 1, 1, tumors))
    quality = rng.normal(0.0, training_sd, (n_nulls, seeds, 2, 1))
    return mu + difficulty + quality + rng.normal(0.0, 1.0, (n_nulls, seeds, 2, tumors)) > 0


def per_seed_differences(tumors: int, seeds: int, training_sd: float, n_nulls: int, seed: int = 0,
                         sensitivity: float = SENSITIVITY) -> np.ndarray:
    """(seeds x nulls) each seed's sensitivity difference (second arm minus first) in each null study."""
    found = _detections(tumors, seeds, training_sd, n_nulls, np.random.default_rng(seed), sensitivity).mean(axis=3)
    return (found[:, :, 1] - found[:, :, 0]).T


def mean_spread(tumors: int, seeds: int, training_sd: float, n_nulls: int = 4000, seed: int = 1,
                sensitivity: float = SENSITIVITY) -> float:
    """The root mean within-study variance of the per-seed differences (the regime's per-seed spread)."""
    differences = per_seed_differences(tumors, seeds, training_sd, n_nulls, seed, sensitivity)
    return float(np.sqrt(differences.var(axis=0, ddof=1).mean()))


def training_sd_for_spread(spread: float, tumors: int, seeds: int = SEEDS, sensitivity: float = SENSITIVITY) -> float:
    """tau, the arms' training spread in latent units, whose null studies have that per-seed spread.

    Raises:
        ValueError: a spread below the patients' noise alone (tau = 0) or beyond what tau reaches.
    """
    def gap(training_sd: float) -> float:
        return mean_spread(tumors, seeds, training_sd, sensitivity=sensitivity) - spread

    low, high = gap(0.0), gap(8.0)
    if low > 0 or high < 0:
        raise ValueError(f"a per-seed spread of {spread} is out of reach at {tumors} tumors "
                         f"({spread + low:.3f} to {spread + high:.3f})")
    return float(scipy.optimize.brentq(gap, 0.0, 8.0, xtol=1e-3))


def t_false_positive_rate(per_seed: np.ndarray, confidence: float = 0.95) -> float:
    """The share of null studies (columns) whose t-interval over seeds excludes 0."""
    pooled = seed_t_interval(per_seed, confidence)
    return float(np.mean((pooled["ci_low"] > 0) | (pooled["ci_high"] < 0)))


def bootstrap_false_positive_rate(tumors: int, seeds: int, training_sd: float, n_nulls: int,
                                  n_resamples: int = 1000, seed: int = 0, sensitivity: float = SENSITIVITY) -> float:
    """The share of null studies whose two-level bootstrap interval excludes 0 (as ``pool_seeds`` draws it)."""
    rng = np.random.default_rng(seed)
    weights = np.concatenate([block for _, block in patient_weight_blocks(tumors, n_resamples, seed, n_resamples)],
                             axis=1).T.astype(float)  # resamples x tumors
    totals = weights.sum(axis=1)
    flagged = 0
    for null in range(n_nulls):
        detected = _detections(tumors, seeds, training_sd, 1, rng, sensitivity)[0].astype(float)  # seeds x arms x tumors
        resampled = np.einsum("rt,kat->rka", weights, detected) / totals[:, None, None]  # resamples x seeds x arms
        per_seed = detected[:, 1].mean(axis=1) - detected[:, 0].mean(axis=1)
        pooled = pool_deltas(per_seed[:, None], (resampled[:, :, 1] - resampled[:, :, 0])[:, :, None],
                             seed_counts(seeds, n_resamples, seed + null))
        flagged += bool(pooled["boot_ci_low"][0] > 0 or pooled["boot_ci_high"][0] < 0)
    return flagged / n_nulls


def level_table(tumors=TUMORS, spreads=SPREADS, seeds: int = SEEDS, n_nulls: int = 20_000,
                bootstrap_nulls: int = 0, n_resamples: int = 1000, seed: int = 2026,
                sensitivity: float = SENSITIVITY) -> pd.DataFrame:
    """Per regime: tau, the spread reached, and each interval's false-positive rate over simulated nulls."""
    rows = []
    for count in tumors:
        for spread in spreads:
            training_sd = training_sd_for_spread(spread, count, seeds, sensitivity)
            per_seed = per_seed_differences(count, seeds, training_sd, n_nulls, seed, sensitivity)
            row = {"tumors": count, "spread": spread, "training_sd": round(training_sd, 3),
                   "spread_reached": float(np.sqrt(per_seed.var(axis=0, ddof=1).mean())),
                   "t_interval": t_false_positive_rate(per_seed)}
            if bootstrap_nulls:
                row["two_level_bootstrap"] = bootstrap_false_positive_rate(count, seeds, training_sd, bootstrap_nulls,
                                                                           n_resamples, seed, sensitivity)
            rows.append(row)
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nulls", type=int, default=20_000, help="simulated null studies per regime (t-interval)")
    parser.add_argument("--bootstrap-nulls", type=int, default=2000,
                        help="simulated null studies per regime for the two-level bootstrap (0: leave it out)")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples per null study")
    parser.add_argument("--seeds", type=int, default=SEEDS, help="K, the seeds of a study")
    parser.add_argument("--sensitivity", type=float, default=SENSITIVITY, help="the arms' mean sensitivity")
    args = parser.parse_args(argv)
    if (args.nulls < 100 or args.bootstrap_nulls < 0 or args.resamples < 100 or args.seeds < 2
            or not 0 < args.sensitivity < 1):
        print("pooling_level: need --nulls >= 100, --bootstrap-nulls >= 0, --resamples >= 100, --seeds >= 2 "
              "and --sensitivity in (0, 1)",
              file=sys.stderr)
        return 2
    try:
        table = level_table(seeds=args.seeds, n_nulls=args.nulls, bootstrap_nulls=args.bootstrap_nulls,
                            n_resamples=args.resamples, sensitivity=args.sensitivity)
    except ValueError as error:
        print(f"pooling_level: {error}", file=sys.stderr)
        return 2
    print(f"false-positive rate of the pooled 95% interval, K = {args.seeds} seeds, mean sensitivity {args.sensitivity}, "
          f"{args.nulls} null studies per regime (t), {args.bootstrap_nulls} (bootstrap, {args.resamples} resamples)")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
