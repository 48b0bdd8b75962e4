"""Operating points: the detection threshold m a model is judged at (docs/design.md "Scan-level detection").

Three are reported:

- ``fixed``: BenchX's protocol, the recipe's ``detection.threshold_mm3``;
- ``val_chosen``: m chosen on the validation records by Youden's J or maximal F1, then applied
  unchanged to test;
- ``matched_specificity`` (comparisons only): the other model's m chosen on its validation records
  so that its specificity equals the baseline's there.

When validation gives nothing to choose from (every score equal, no positives, no negatives) the
choice falls back to the fixed m and says why (:attr:`OperatingPoint.fallback`); it never raises,
so a degenerate validation set cannot abort training, evaluation or a sweep trial.

Example::

    point = choose_operating_point(val_records, rule="youden", fixed=50.0)
    if point.fallback:
        print(point.fallback)
    table = subgroup_metrics(test_records, point.threshold)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from lightning_modules.evaluation.records import labels, scores, source_name

RULES = ("f1", "youden")
OPERATING_POINTS = ("fixed", "val_chosen", "matched_specificity")


class ThresholdError(ValueError):
    """Validation records that give no threshold to choose."""


@dataclass(frozen=True)
class OperatingPoint:
    """A threshold and how it was reached.

    Attributes:
        name: ``fixed``, ``val_chosen`` or ``matched_specificity``.
        threshold: m (mm³ for the volume score, a probability for ``max_prob``).
        rule: ``fixed``, ``f1``, ``youden`` or ``matched_specificity``.
        fallback: why the fixed m was used instead of a chosen one ('' when it was not).
    """

    name: str
    threshold: float
    rule: str
    fallback: str = ""


def _cumulative_counts(values: np.ndarray, truth: np.ndarray):
    """Candidates (midpoints between sorted unique scores) and TP, FP at each of them."""
    unique, inverse = np.unique(values, return_inverse=True)
    positives_at = np.bincount(inverse, weights=truth.astype(float), minlength=len(unique)).astype(np.int64)
    negatives_at = np.bincount(inverse, weights=(~truth).astype(float), minlength=len(unique)).astype(np.int64)
    # Cases at or above unique[i + 1] are called positive by the candidate between unique[i] and unique[i + 1].
    tp = np.cumsum(positives_at[::-1])[::-1][1:]
    fp = np.cumsum(negatives_at[::-1])[::-1][1:]
    return (unique[:-1] + unique[1:]) / 2.0, tp, fp


def choose_threshold(records: pd.DataFrame, rule: str = "f1", score: str = "volume") -> float:
    """Choose the detection threshold on validation records; it is then applied unchanged to test.

    Candidates are the midpoints between consecutive sorted unique scores, so every candidate
    separates the scans differently and none sits on a score. ``rule="f1"`` maximizes
    F1 = 2TP/(2TP+FP+FN); ``rule="youden"`` maximizes Youden's J = sensitivity + specificity - 1
    (compared in exact integer arithmetic). Ties go to the smaller threshold.

    Args:
        records: validation records.
        rule: ``f1`` or ``youden``.
        score: ``volume`` or ``max_prob``.

    Raises:
        ValueError: unknown rule.
        ThresholdError: fewer than two distinct scores, no positives (F1, Youden) or no negatives
            (Youden). :func:`choose_operating_point` turns these into a fallback.
    """
    if rule not in RULES:
        raise ValueError(f"unknown threshold rule {rule!r}: expected 'f1' or 'youden'")
    values, truth = scores(records, score), labels(records)
    source = source_name(records)
    positives, negatives = int(truth.sum()), int((~truth).sum())
    if positives == 0:
        raise ThresholdError(f"{source}: cannot choose a threshold by {rule}: no positive scans")
    if rule == "youden" and negatives == 0:
        raise ThresholdError(f"{source}: cannot choose a threshold by youden: no negative scans")
    if len(np.unique(values)) < 2:
        raise ThresholdError(
            f"{source}: cannot choose a threshold: all {len(values)} scores equal {values[0]!r}, "
            "so no threshold separates any scans"
        )
    candidates, tp, fp = _cumulative_counts(values, truth)
    fn, tn = positives - tp, negatives - fp
    if rule == "f1":
        objective = 2.0 * tp / (2.0 * tp + fp + fn)
    else:
        # J = (tp*N + tn*P)/(P*N) - 1: compare the integer numerators so ties are exact.
        objective = tp * negatives + tn * positives
    # argmax returns the first maximum; candidates ascend, so ties go to the smaller threshold.
    return float(candidates[int(np.argmax(objective))])


def choose_operating_point(
    records: pd.DataFrame | None, rule: str, fixed: float, score: str = "volume"
) -> OperatingPoint:
    """The validation-chosen operating point, or the fixed m with the reason when there is nothing to choose.

    Args:
        records: validation records (None or empty: fall back).
        rule: ``f1`` or ``youden`` (``fixed`` returns the fixed point).
        fixed: the recipe's fixed m.
        score: ``volume`` or ``max_prob``.
    """
    if rule == "fixed":
        return OperatingPoint("fixed", float(fixed), "fixed")
    if records is None or len(records) == 0:
        return OperatingPoint("val_chosen", float(fixed), rule, f"no validation records to choose a threshold by {rule}")
    try:
        return OperatingPoint("val_chosen", choose_threshold(records, rule, score), rule)
    except ThresholdError as error:
        return OperatingPoint("val_chosen", float(fixed), rule, str(error))


def specificity_at(records: pd.DataFrame, threshold: float, score: str = "volume") -> float:
    """Specificity of the records at a threshold (NaN without negatives)."""
    truth = labels(records)
    negatives = int((~truth).sum())
    if negatives == 0:
        return float("nan")
    return float(((scores(records, score) <= threshold) & ~truth).sum() / negatives)


def matched_specificity_point(
    records: pd.DataFrame | None, target_specificity: float, fixed: float, score: str = "volume"
) -> OperatingPoint:
    """The threshold on these (validation) records whose specificity equals ``target_specificity``.

    With discrete scores an exact match may not exist: the smallest threshold reaching at least the
    target is taken (the most sensitive one that is not less specific). Falls back to the fixed m,
    with the reason, when there are no records, no negatives or no target.

    Args:
        records: the other model's validation records.
        target_specificity: the baseline's validation specificity at its operating point.
        fixed: the recipe's fixed m.
        score: ``volume`` or ``max_prob``.
    """
    def fallback(reason: str) -> OperatingPoint:
        return OperatingPoint("matched_specificity", float(fixed), "matched_specificity", reason)

    if records is None or len(records) == 0:
        return fallback("no validation records to match specificity on")
    if not np.isfinite(target_specificity):
        return fallback("the baseline's validation specificity is undefined (no negative scans)")
    values, truth = scores(records, score), labels(records)
    negatives = int((~truth).sum())
    if negatives == 0:
        return fallback(f"{source_name(records)}: no negative scans to match specificity on")
    unique = np.unique(values)
    # Candidates: below every score (specificity 0), between consecutive scores, above every score (1).
    candidates = np.concatenate([[unique[0] - 1.0], (unique[:-1] + unique[1:]) / 2.0, [unique[-1] + 1.0]])
    negative_scores = np.sort(values[~truth])
    specificity = np.searchsorted(negative_scores, candidates, side="right") / negatives
    # A tiny tolerance: the target is a ratio of other counts and may differ in its last bit.
    reaching = np.flatnonzero(specificity >= target_specificity - 1e-12)
    return OperatingPoint("matched_specificity", float(candidates[reaching[0]]), "matched_specificity")
