"""Operating points: the detection threshold m a model is judged at (docs/explanation/detection-and-statistics.md "Scan-level detection").

Three are reported:

- ``fixed``: BenchX's protocol, the recipe's ``detection.threshold_mm3``;
- ``val_chosen``: m chosen on the validation records by Youden's J or maximal F1, then applied
  unchanged to test. With ``detection.threshold_bootstrap`` = B > 0 it is the mean of the
  rule's choices on B patient resamples of the validation records (a bagged cut-point,
  :func:`bagged_threshold`), with the percentile interval of those choices;
- ``matched_specificity`` (comparisons only): the other model's m chosen on its validation records
  so that its specificity equals the baseline's there;
- ``subgroup_matched_specificity`` (comparisons only): the same rule restricted to one subgroup
  (e.g. ``phase:arterial``): the other model's m chosen on its validation records so that its
  specificity over that subgroup's healthy validation scans equals the baseline's over the same
  subgroup. An endpoint judged within a subgroup is compared at equal specificity there; overall
  matching can leave the subgroup's specificities far apart.

When validation gives nothing to choose from (every score equal, no positives, no negatives) the
choice falls back to the fixed m and says why (:attr:`OperatingPoint.fallback`); it never raises,
so a degenerate validation set cannot abort training, evaluation or a sweep trial.

Example::

    point = choose_operating_point(val_records, rule="youden", fixed=50.0, bootstrap=2000)
    if point.fallback:
        print(point.fallback)
    table = subgroup_metrics(test_records, point.threshold)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from lightning_modules.evaluation.bootstrap import patient_index, resample_indices
from lightning_modules.evaluation.records import attribute_values, labels, scores, source_name

RULES = ("f1", "youden")
OPERATING_POINTS = ("fixed", "val_chosen", "matched_specificity", "subgroup_matched_specificity")


class ThresholdError(ValueError):
    """Validation records that give no threshold to choose."""


@dataclass(frozen=True)
class OperatingPoint:
    """A threshold and how it was reached.

    Attributes:
        name: one of :data:`OPERATING_POINTS`.
        threshold: m (mm³ for the volume score, a probability for ``max_prob``).
        rule: ``fixed``, ``f1``, ``youden``, ``matched_specificity`` or
            ``subgroup_matched_specificity`` (then ``within <attribute>:<group>`` follows).
        fallback: why the fixed m was used instead of a chosen one ('' when it was not).
        interval: for a bagged choice, the percentile interval of the resamples' choices (else None);
            ``rule`` then says how many resamples chose.
    """

    name: str
    threshold: float
    rule: str
    fallback: str = ""
    interval: tuple[float, float] | None = None


def _cumulative_counts(values: np.ndarray, truth: np.ndarray):
    """Candidates (midpoints between sorted unique scores) and TP, FP at each of them."""
    unique, inverse = np.unique(values, return_inverse=True)
    positives_at = np.bincount(inverse, weights=truth.astype(float), minlength=len(unique)).astype(np.int64)
    negatives_at = np.bincount(inverse, weights=(~truth).astype(float), minlength=len(unique)).astype(np.int64)
    # Cases at or above unique[i + 1] are called positive by the candidate between unique[i] and unique[i + 1].
    tp = np.cumsum(positives_at[::-1])[::-1][1:]
    fp = np.cumsum(negatives_at[::-1])[::-1][1:]
    return (unique[:-1] + unique[1:]) / 2.0, tp, fp


def _choose(values: np.ndarray, truth: np.ndarray, rule: str, source: str) -> float:
    """:func:`choose_threshold` on arrays (one entry per scan)."""
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
    return _choose(scores(records, score), labels(records), rule, source_name(records))


def _patient_resamples(records: pd.DataFrame, n_resamples: int):
    """Per patient resample of the records: the case positions it holds (a patient's cases as often as drawn)."""
    patients, patient_of_case = patient_index(records["case_id"], records["patient_id"])
    cases = np.arange(len(records))
    for draw in resample_indices(records["case_id"], records["patient_id"], int(n_resamples)):
        yield np.repeat(cases, np.bincount(draw, minlength=len(patients))[patient_of_case])


def resampled_choices(records: pd.DataFrame, rule: str, score: str = "volume", n_resamples: int = 2000) -> np.ndarray:
    """The rule's threshold on each patient resample of the validation records (NaN where it cannot choose).

    The resamples are those of the evaluation set's own seed (``bootstrap.resample_indices``), so
    resample r of two runs' validation records on the same cases draws the same patients. This is
    the threshold's uncertainty: a nested bootstrap applies choice r to test resample r.

    Args:
        records: validation records.
        rule: ``f1`` or ``youden``.
        score: ``volume``, ``raw_volume``, ``localized_volume`` or ``max_prob``.
        n_resamples: patient resamples.
    """
    if rule not in RULES:
        raise ValueError(f"unknown threshold rule {rule!r}: expected 'f1' or 'youden'")
    values, truth, source = scores(records, score), labels(records), source_name(records)
    choices = np.full(int(n_resamples), np.nan)
    for r, picked in enumerate(_patient_resamples(records, n_resamples)):
        try:
            choices[r] = _choose(values[picked], truth[picked], rule, source)
        except ThresholdError:
            continue
    return choices


def resampled_matched_thresholds(
    baseline_records: pd.DataFrame,
    baseline_choices: np.ndarray,
    records: pd.DataFrame,
    score: str = "volume",
    subgroup: tuple[str, str] | None = None,
) -> np.ndarray:
    """The matched-specificity threshold of another model on each patient resample of validation.

    In resample r the baseline's specificity at its choice ``baseline_choices[r]`` on its resample r
    is the target, and the other model's threshold is matched to it on its own resample r (the
    same patients when both runs hold the same validation cases). With ``subgroup`` =
    (attribute, group) both the target and the match count only that subgroup's scans of the
    resample (:func:`subgroup_matched_specificity_point`). NaN where the baseline's choice is NaN
    or a resample holds no negatives (in the subgroup).
    """
    base_values, base_truth = scores(baseline_records, score), labels(baseline_records)
    values, truth = scores(records, score), labels(records)
    base_members, members = subgroup_members(baseline_records, subgroup), subgroup_members(records, subgroup)
    n_resamples = len(baseline_choices)
    matched = np.full(n_resamples, np.nan)
    resamples = zip(_patient_resamples(baseline_records, n_resamples), _patient_resamples(records, n_resamples))
    for r, (base_picked, picked) in enumerate(resamples):
        base_picked, picked = base_picked[base_members[base_picked]], picked[members[picked]]
        negatives = ~base_truth[base_picked]
        if np.isnan(baseline_choices[r]) or not negatives.any() or len(picked) == 0:
            continue
        target = float((base_values[base_picked][negatives] <= baseline_choices[r]).mean())
        matched[r] = _matched_threshold(values[picked], truth[picked], target)
    return matched


@dataclass(frozen=True)
class BaggedThreshold:
    """A bagged cut-point: the mean of the rule's choices over patient resamples.

    Attributes:
        threshold: the mean choice.
        low, high: the percentile interval of the choices at the requested confidence.
        defined: resamples in which the rule could choose (the others drew no positive or no
            negative patient, or only equal scores).
        resamples: resamples drawn.
    """

    threshold: float
    low: float
    high: float
    defined: int
    resamples: int


def bagged_threshold(
    records: pd.DataFrame, rule: str, score: str = "volume", n_resamples: int = 2000, confidence: float = 0.95
) -> BaggedThreshold:
    """The mean of :func:`choose_threshold` over patient resamples of the validation records.

    Youden's J (or F1) over a few dozen validation scans often has several near-equal maxima far
    apart, so the plain choice jumps between distant thresholds when one scan's score changes. The
    mean of the choices over bootstrap resamples, a bagged cut-point (the ``maximize_boot_metric``
    method of the cutpointr R package, whose default summary is also the mean), weighs those
    maxima by how often each wins. The median is not used: the choices cluster on a few plateaus,
    and when two clusters hold about half the resamples each the median jumps between them with the
    resampling seed, where the mean moves by a few percent. Patients are resampled, not scans, with
    the same draws as the subgroup bootstrap of this evaluation set (seeded by its case ids), so
    the result does not depend on row order or on the machine.

    Args:
        records: validation records (``case_id``, ``patient_id``, ``label`` and the score).
        rule: ``f1`` or ``youden``.
        score: ``volume`` or ``max_prob``.
        n_resamples: patient resamples B (at least 1).
        confidence: level of the reported interval of the choices.

    Raises:
        ValueError: unknown rule, or fewer than one resample.
        ThresholdError: the rule cannot choose on the records themselves, or on fewer than half of
            the resamples (too few positive or negative patients to bag a choice).
    """
    if rule not in RULES:
        raise ValueError(f"unknown threshold rule {rule!r}: expected 'f1' or 'youden'")
    if int(n_resamples) < 1:
        raise ValueError(f"a bagged threshold needs at least 1 resample (got {n_resamples})")
    values, truth, source = scores(records, score), labels(records), source_name(records)
    _choose(values, truth, rule, source)  # the records themselves must give a choice
    all_choices = resampled_choices(records, rule, score, int(n_resamples))
    choices = all_choices[~np.isnan(all_choices)]
    if 2 * len(choices) < len(all_choices):
        raise ThresholdError(
            f"{source}: cannot bag a threshold by {rule}: only {len(choices)} of {len(all_choices)} patient "
            "resamples hold the positive and negative scans with distinct scores that a choice needs"
        )
    tail = (1.0 - float(confidence)) / 2.0 * 100.0
    low, high = np.percentile(choices, [tail, 100.0 - tail])
    return BaggedThreshold(float(np.mean(choices)), float(low), float(high), len(choices), len(all_choices))


def choose_operating_point(
    records: pd.DataFrame | None,
    rule: str,
    fixed: float,
    score: str = "volume",
    bootstrap: int = 0,
    confidence: float = 0.95,
) -> OperatingPoint:
    """The validation-chosen operating point, or the fixed m with the reason when there is nothing to choose.

    Args:
        records: validation records (None or empty: fall back).
        rule: ``f1`` or ``youden`` (``fixed`` returns the fixed point).
        fixed: the recipe's fixed m.
        score: ``volume`` or ``max_prob``.
        bootstrap: B > 0 bags the choice over B patient resamples (:func:`bagged_threshold`);
            0 applies the rule once to the records.
        confidence: level of a bagged choice's interval.
    """
    if rule == "fixed":
        return OperatingPoint("fixed", float(fixed), "fixed")
    if records is None or len(records) == 0:
        return OperatingPoint("val_chosen", float(fixed), rule, f"no validation records to choose a threshold by {rule}")
    try:
        if int(bootstrap) > 0:
            bagged = bagged_threshold(records, rule, score, int(bootstrap), confidence)
            return OperatingPoint(
                "val_chosen", bagged.threshold, f"{rule} (mean of {bagged.defined} of {bagged.resamples} resamples)",
                interval=(bagged.low, bagged.high),
            )
        return OperatingPoint("val_chosen", choose_threshold(records, rule, score), rule)
    except ThresholdError as error:
        return OperatingPoint("val_chosen", float(fixed), rule, str(error))


def subgroup_members(records: pd.DataFrame, subgroup: tuple[str, str] | None) -> np.ndarray:
    """Which records belong to ``subgroup`` = (attribute, group), as the comparison's subgroup rows
    count them (``records.attribute_values``); every record when ``subgroup`` is None or overall."""
    if subgroup is None or tuple(subgroup) == ("overall", "all"):
        return np.ones(len(records), dtype=bool)
    attribute, group = subgroup
    return attribute_values(records, attribute) == str(group)


def specificity_at(
    records: pd.DataFrame, threshold: float, score: str = "volume", subgroup: tuple[str, str] | None = None
) -> float:
    """Specificity of the records (of ``subgroup``'s records when given) at a threshold (NaN without negatives)."""
    records = records[subgroup_members(records, subgroup)]
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
    if not (~truth).any():
        return fallback(f"{source_name(records)}: no negative scans to match specificity on")
    return OperatingPoint("matched_specificity", _matched_threshold(values, truth, target_specificity), "matched_specificity")


def subgroup_matched_specificity_point(
    records: pd.DataFrame | None,
    target_specificity: float,
    fixed: float,
    subgroup: tuple[str, str],
    score: str = "volume",
) -> OperatingPoint:
    """:func:`matched_specificity_point` within one subgroup: the threshold on these (validation)
    records whose specificity over ``subgroup``'s negative scans equals ``target_specificity``.

    The target is the baseline's specificity over the same subgroup of its validation records at
    its validation-chosen m (``specificity_at(..., subgroup=subgroup)``); the baseline keeps that m.
    Only validation records are read, so the test cohort cannot move the threshold. Falls back to
    the fixed m, with the reason, when the subgroup has no validation records, no negative scans
    or no target.

    Args:
        records: the other model's validation records.
        target_specificity: the baseline's validation specificity within the subgroup.
        fixed: the recipe's fixed m.
        subgroup: (attribute, group), e.g. ``("phase", "arterial")``.
        score: ``volume`` or ``max_prob``.
    """
    name = "subgroup_matched_specificity"
    rule = f"{name} within {subgroup[0]}:{subgroup[1]}"

    def fallback(reason: str) -> OperatingPoint:
        return OperatingPoint(name, float(fixed), rule, reason)

    if records is None or len(records) == 0:
        return fallback("no validation records to match specificity on")
    within = records[subgroup_members(records, subgroup)]
    if not np.isfinite(target_specificity):
        return fallback(f"the baseline's validation specificity in {subgroup[0]}:{subgroup[1]} is undefined "
                        "(no negative scans there)")
    values, truth = scores(within, score), labels(within)
    if not (~truth).any():
        return fallback(f"{source_name(records)}: no negative scans in {subgroup[0]}:{subgroup[1]} to match specificity on")
    return OperatingPoint(name, _matched_threshold(values, truth, target_specificity), rule)


def _matched_threshold(values: np.ndarray, truth: np.ndarray, target_specificity: float) -> float:
    """:func:`matched_specificity_point` on arrays (NaN without negatives)."""
    negatives = int((~truth).sum())
    if negatives == 0:
        return float("nan")
    unique = np.unique(values)
    # Candidates: below every score (specificity 0), between consecutive scores, above every score (1).
    candidates = np.concatenate([[unique[0] - 1.0], (unique[:-1] + unique[1:]) / 2.0, [unique[-1] + 1.0]])
    negative_scores = np.sort(values[~truth])
    specificity = np.searchsorted(negative_scores, candidates, side="right") / negatives
    # A tiny tolerance: the target is a ratio of other counts and may differ in its last bit.
    reaching = np.flatnonzero(specificity >= target_specificity - 1e-12)
    return float(candidates[reaching[0]])
