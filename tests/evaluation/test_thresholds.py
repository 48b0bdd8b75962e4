"""Tests for lightning_modules.evaluation.thresholds: the validation-chosen operating point, its
fallback to the fixed m when validation gives nothing to choose from, the bagged choice, and
matched specificity."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from test_detection_metrics import random_records, small_records

from lightning_modules.evaluation.bootstrap import resample_indices
from lightning_modules.evaluation.thresholds import (
    ThresholdError,
    bagged_threshold,
    choose_operating_point,
    choose_threshold,
    matched_specificity_point,
    specificity_at,
)


def test_constant_validation_scores_fall_back_to_the_fixed_m_and_say_why():
    constant = small_records().assign(volume_mm3=0.0)
    with pytest.raises(ThresholdError, match="all 8 scores equal"):
        choose_threshold(constant, rule="youden")
    for rule in ("f1", "youden"):
        point = choose_operating_point(constant, rule, fixed=50.0)
        assert point.threshold == 50.0 and point.name == "val_chosen" and point.rule == rule
        assert "all 8 scores equal" in point.fallback


@pytest.mark.parametrize(
    "records, message",
    [
        (None, "no validation records"),
        (small_records().assign(label=0, tumor_size=""), "no positive scans"),
        (small_records().assign(label=1), "no negative scans"),
    ],
)
def test_other_degenerate_validation_sets_fall_back(records, message):
    point = choose_operating_point(records, "youden", fixed=12.5)
    assert point.threshold == 12.5 and message in point.fallback


def test_a_usable_validation_set_gives_the_chosen_threshold_without_fallback():
    records = small_records()
    point = choose_operating_point(records, "f1", fixed=50.0)
    assert point.fallback == "" and point.threshold == choose_threshold(records, "f1")
    assert choose_operating_point(records, "fixed", fixed=50.0).threshold == 50.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matched_specificity_reaches_the_target_with_the_most_sensitive_threshold(seed):
    records = random_records(120, seed=seed)
    target = specificity_at(random_records(120, seed=seed + 10), 20.0)
    point = matched_specificity_point(records, target, fixed=50.0)
    assert point.fallback == ""
    achieved = specificity_at(records, point.threshold)
    assert achieved >= target - 1e-12
    # Any smaller candidate (the next lower unique score) falls below the target.
    lower = np.unique(records["volume_mm3"])
    lower = lower[lower < point.threshold]
    if len(lower):
        assert specificity_at(records, lower[-1] - 1e-9) < target


def test_matched_specificity_falls_back_without_negatives_or_target():
    records = small_records()
    assert "no negative" in matched_specificity_point(records.assign(label=1), 0.8, fixed=7.0).fallback
    assert "undefined" in matched_specificity_point(records, float("nan"), fixed=7.0).fallback
    assert matched_specificity_point(None, 0.5, fixed=7.0).threshold == 7.0


def ordered_records(labels: list[int]) -> pd.DataFrame:
    """One scan per patient, scores 100, 200, ... in the order of ``labels``."""
    n = len(labels)
    return pd.DataFrame({
        "case_id": [f"C{i:03d}" for i in range(n)],
        "patient_id": [f"P{i:03d}" for i in range(n)],
        "label": labels,
        "volume_mm3": np.arange(1, n + 1, dtype=float) * 100.0,
    })


def test_bagged_threshold_is_the_mean_of_the_rule_on_each_patient_resample():
    records = random_records(90, seed=3)
    bagged = bagged_threshold(records, "youden", n_resamples=60)
    # Reference: rebuild each resample as a table, patient by patient, and apply the plain rule.
    patients = np.unique(records["patient_id"].astype(str))
    by_patient = {patient: rows for patient, rows in records.groupby(records["patient_id"].astype(str))}
    choices, undecided = [], 0
    for draw in resample_indices(records["case_id"], records["patient_id"], 60):
        resample = pd.concat([by_patient[patients[i]] for i in draw], ignore_index=True)
        try:
            choices.append(choose_threshold(resample, "youden"))
        except ThresholdError:  # a resample without a choice is left out of the mean
            undecided += 1
    assert bagged.defined == len(choices) == 60 - undecided and bagged.resamples == 60
    assert bagged.threshold == pytest.approx(np.mean(choices), rel=1e-12)
    assert (bagged.low, bagged.high) == pytest.approx(tuple(np.percentile(choices, [2.5, 97.5])), rel=1e-12)
    # The draws are the evaluation set's, so the row order does not matter.
    shuffled = records.sample(frac=1.0, random_state=0)
    assert bagged_threshold(shuffled, "youden", n_resamples=60) == bagged


def test_bagging_damps_a_jump_of_the_plain_choice_between_equal_maxima():
    # Youden's J has three equal maxima (m = 1050, 2050, 3050); ties go to the smallest.
    labels = [0] * 10 + [1] * 5 + [0] * 5 + [1] * 5 + [0] * 5 + [1] * 10
    # One healthy scan's score moves from the bottom to just below the top block of tumors.
    moved = [0] * 9 + [1] * 5 + [0] * 5 + [1] * 5 + [0] * 6 + [1] * 10
    before, after = ordered_records(labels), ordered_records(moved)
    assert (choose_threshold(before, "youden"), choose_threshold(after, "youden")) == (1050.0, 3050.0)
    bagged_before = bagged_threshold(before, "youden", n_resamples=2000).threshold
    bagged_after = bagged_threshold(after, "youden", n_resamples=2000).threshold
    assert abs(bagged_after - bagged_before) < 0.25 * 2000.0
    assert 1050.0 < bagged_before < 3050.0


def test_bagged_operating_point_reports_its_spread_and_falls_back_when_too_few_resamples_choose():
    records = random_records(90, seed=4)
    point = choose_operating_point(records, "youden", fixed=50.0, bootstrap=200)
    bagged = bagged_threshold(records, "youden", n_resamples=200)
    assert point.fallback == "" and point.threshold == bagged.threshold
    assert point.interval == (bagged.low, bagged.high)
    assert point.rule == f"youden (mean of {bagged.defined} of 200 resamples)"
    # One tumor patient among 20 and one scan whose score differs from the others': a resample
    # chooses only when it draws both (about 0.63 x 0.63 of them), so no choice is bagged.
    sparse = ordered_records([0] * 19 + [1]).assign(volume_mm3=[5.0] + [0.0] * 19)
    assert choose_threshold(sparse, "youden") == 2.5
    point = choose_operating_point(sparse, "youden", fixed=50.0, bootstrap=200)
    assert point.threshold == 50.0 and "cannot bag a threshold by youden: only" in point.fallback
    with pytest.raises(ValueError, match="at least 1 resample"):
        bagged_threshold(records, "youden", n_resamples=0)
