"""Tests for lightning_modules.evaluation.thresholds: the validation-chosen operating point, its
fallback to the fixed m when validation gives nothing to choose from, and matched specificity."""

from __future__ import annotations

import numpy as np
import pytest
from test_detection_metrics import random_records, small_records

from lightning_modules.evaluation.thresholds import (
    ThresholdError,
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
