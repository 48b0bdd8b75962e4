"""Intervals and tests that hold at small counts (docs/explanation/detection-and-statistics.md "Confidence intervals and comparisons").

The percentile bootstrap collapses at the boundary: 0 of 11 tumors found gives [0, 0], and a few
discordant scans can look significant. These closed-form methods do not:

- :func:`wilson_interval`: the Wilson score interval of a proportion (statsmodels), 0 of 11 gives
  [0, 0.26];
- :func:`newcombe_paired_interval` (:func:`newcombe_paired_intervals` for many tables at once):
  the interval of a difference of paired proportions, method 10 of Newcombe (Statistics in
  Medicine 17:2635-2650, 1998), built from the two Wilson intervals and the continuity-corrected
  correlation of the paired 2x2 table;
- :func:`mcnemar_exact_p`: the exact (binomial) McNemar p of paired sensitivities or specificities
  (statsmodels);
- :func:`delong_test`: DeLong's test of two correlated ROC AUCs (DeLong, DeLong & Clarke-Pearson,
  Biometrics 44:837-845, 1988), computed by the midrank algorithm of Sun & Xu (IEEE Signal
  Processing Letters 21:1389-1393, 2014).

They count scans as independent units; the bootstrap beside them resamples patients.

Example::

    wilson_interval(0, 11)                            # (0.0, 0.259)
    newcombe_paired_interval(59, 6, 16, 80)           # (-0.1186, -0.0046)
    mcnemar_exact_p(0, 5)                             # 0.0625
    delong_test(truth, scores_a, scores_b).p_value
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.stats
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.proportion import proportion_confint


def wilson_interval(successes, n, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval of successes/n (arrays broadcast); NaN where n = 0."""
    successes, n = np.broadcast_arrays(np.asarray(successes, dtype=float), np.asarray(n, dtype=float))
    low, high = np.full(n.shape, np.nan), np.full(n.shape, np.nan)
    counted = n > 0
    if counted.any():
        low[counted], high[counted] = proportion_confint(successes[counted], n[counted], alpha=1.0 - confidence, method="wilson")
    return low, high


def newcombe_paired_interval(a: int, b: int, c: int, d: int, confidence: float = 0.95) -> tuple[float, float]:
    """Newcombe's method 10 interval for p1 - p2 of a paired 2x2 table (NaN, NaN when it is empty).

    The table follows the paper: ``a`` pairs where both succeed, ``b`` where only the first does,
    ``c`` only the second, ``d`` neither; p1 = (a + b)/n, p2 = (a + c)/n. With (l1, u1) and (l2, u2)
    the Wilson limits of p1 and p2 and phi the continuity-corrected correlation (ad - bc, less n/2
    when above n/2, 0 between 0 and n/2, over the root of the product of the margins; 0 when a
    margin is 0)::

        L = (p1 - p2) - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)
        U = (p1 - p2) + sqrt((p2 - l2)^2 - 2 phi (p2 - l2)(u1 - p1) + (u1 - p1)^2)
    """
    (low,), (high,) = newcombe_paired_intervals([a], [b], [c], [d], confidence)
    return float(low), float(high)


def newcombe_paired_intervals(a, b, c, d, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """:func:`newcombe_paired_interval` of many paired 2x2 tables at once (arrays broadcast)."""
    a, b, c, d = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (a, b, c, d)))
    n = a + b + c + d
    with np.errstate(invalid="ignore", divide="ignore"):
        p1, p2 = (a + b) / n, (a + c) / n
        l1, u1 = wilson_interval(a + b, n, confidence)
        l2, u2 = wilson_interval(a + c, n, confidence)
        margins = (a + b) * (c + d) * (a + c) * (b + d)
        cross = a * d - b * c
        corrected = np.where(cross > n / 2, cross - n / 2, np.where(cross < 0, cross, 0.0))
        phi = np.where(margins > 0, corrected / np.sqrt(np.where(margins > 0, margins, 1.0)), 0.0)
        lower_spread = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
        upper_spread = (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2
        low = p1 - p2 - np.sqrt(np.maximum(lower_spread, 0.0))
        high = p1 - p2 + np.sqrt(np.maximum(upper_spread, 0.0))
    empty = n == 0
    return np.where(empty, np.nan, low), np.where(empty, np.nan, high)


def mcnemar_exact_p(only_first: int, only_second: int) -> float:
    """Exact two-sided McNemar p from the discordant pairs (binomial, statsmodels); 1 without any."""
    if only_first + only_second == 0:
        return 1.0
    return float(mcnemar([[0, only_first], [only_second, 0]], exact=True).pvalue)


@dataclass(frozen=True)
class DeLongResult:
    """Two correlated ROC AUCs on the same cases and DeLong's test of their difference (b - a)."""

    auc_a: float
    auc_b: float
    variance_a: float
    variance_b: float
    covariance: float
    z: float
    p_value: float


def _midrank(values: np.ndarray) -> np.ndarray:
    return scipy.stats.rankdata(values, method="average", axis=-1)


def delong_covariance(truth, *score_sets) -> tuple[np.ndarray, np.ndarray]:
    """AUCs of several score sets on the same cases and their DeLong covariance matrix.

    Sun & Xu's algorithm: with midranks T_Z of the combined scores, T_X within the positives and
    T_Y within the negatives (m positives, n negatives), the placement values are
    V10 = (T_Z - T_X)/n on the positives and V01 = 1 - (T_Z - T_Y)/m on the negatives; the AUC is
    the mean of V10, and Cov = S10/m + S01/n with S10, S01 the sample covariances of the placement
    values across models.

    Returns:
        (aucs, covariance); NaN without positives or negatives.
    """
    truth = np.asarray(truth, dtype=bool)
    scores = np.atleast_2d(np.asarray(score_sets, dtype=float))
    k = scores.shape[0]
    positives, negatives = scores[:, truth], scores[:, ~truth]
    m, n = positives.shape[1], negatives.shape[1]
    if m == 0 or n == 0:
        return np.full(k, np.nan), np.full((k, k), np.nan)
    combined = np.concatenate([positives, negatives], axis=1)
    ranks = _midrank(combined)
    v10 = (ranks[:, :m] - _midrank(positives)) / n
    v01 = 1.0 - (ranks[:, m:] - _midrank(negatives)) / m
    aucs = v10.mean(axis=1)
    s10 = np.atleast_2d(np.cov(v10)) if m > 1 else np.zeros((k, k))
    s01 = np.atleast_2d(np.cov(v01)) if n > 1 else np.zeros((k, k))
    return aucs, s10 / m + s01 / n


def delong_test(truth, scores_a, scores_b) -> DeLongResult:
    """DeLong's test of AUC(b) - AUC(a) for two score sets on the same cases (two-sided normal p).

    p is NaN without positives or negatives; with a zero variance of the difference it is 1 when
    the AUCs are equal and 0 otherwise.
    """
    aucs, covariance = delong_covariance(truth, scores_a, scores_b)
    delta = aucs[1] - aucs[0]
    variance = covariance[0, 0] + covariance[1, 1] - 2 * covariance[0, 1]
    if np.isnan(delta):
        z = p = math.nan
    elif variance <= 1e-15:
        z, p = (0.0, 1.0) if abs(delta) < 1e-12 else (math.copysign(math.inf, delta), 0.0)
    else:
        z = float(delta / math.sqrt(variance))
        p = float(2.0 * scipy.stats.norm.sf(abs(z)))
    return DeLongResult(float(aucs[0]), float(aucs[1]), float(covariance[0, 0]), float(covariance[1, 1]),
                        float(covariance[0, 1]), float(z), float(p))
