"""Tests for specificity matched within a subgroup (lightning_modules.evaluation.thresholds): on a
constructed validation set where matching overall leaves the arterial specificities far apart,
matching within phase:arterial makes them equal; its fallbacks; and its choice on each validation
resample for the nested threshold bootstrap."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from test_detection_metrics import random_records

from lightning_modules.evaluation.thresholds import (
    OPERATING_POINTS,
    matched_specificity_point,
    resampled_choices,
    resampled_matched_thresholds,
    specificity_at,
    subgroup_matched_specificity_point,
    subgroup_members,
)

ARTERIAL = ("phase", "arterial")


def scans(arterial_healthy, venous_healthy, arterial_tumor=(400.0,) * 6, venous_tumor=(400.0,) * 6) -> pd.DataFrame:
    """Validation records: one scan per patient, each list the volumes (mm³) of that phase and label."""
    parts = [(arterial_healthy, "arterial", 0), (venous_healthy, "venous", 0),
             (arterial_tumor, "arterial", 1), (venous_tumor, "venous", 1)]
    rows = [(volume, phase, label) for volumes, phase, label in parts for volume in volumes]
    frame = pd.DataFrame(rows, columns=["volume_mm3", "phase", "label"])
    frame.insert(0, "case_id", [f"V{i:03d}" for i in range(len(frame))])
    frame.insert(1, "patient_id", [f"P{i:03d}" for i in range(len(frame))])
    return frame


# The reference (sham) at its validation-chosen m = 50: 6 of 10 arterial healthy scans below it,
# every venous one: 0.6 within arterial, 0.8 overall.
SHAM = scans([0.0] * 6 + [100.0] * 4, [0.0] * 10)
SHAM_M = 50.0
# The other arm: its arterial healthy scans spread from 5 to 50, its venous ones split 0 / 300.
SYNTHX = scans([5.0 * k for k in range(1, 11)], [0.0] * 6 + [300.0] * 4)


def test_subgroup_matching_equalizes_the_subgroup_specificity_that_overall_matching_leaves_apart():
    overall = matched_specificity_point(SYNTHX, specificity_at(SHAM, SHAM_M), fixed=50.0)
    sham_arterial = specificity_at(SHAM, SHAM_M, subgroup=ARTERIAL)
    assert sham_arterial == pytest.approx(0.6)
    # Matched overall (0.8 both), the arterial specificities are 0.6 and 1.0.
    assert specificity_at(SYNTHX, overall.threshold) == pytest.approx(0.8)
    assert specificity_at(SYNTHX, overall.threshold, subgroup=ARTERIAL) == pytest.approx(1.0)
    within = subgroup_matched_specificity_point(SYNTHX, sham_arterial, fixed=50.0, subgroup=ARTERIAL)
    assert within.fallback == "" and within.name == "subgroup_matched_specificity"
    assert within.rule == "subgroup_matched_specificity within phase:arterial"
    assert specificity_at(SYNTHX, within.threshold, subgroup=ARTERIAL) == pytest.approx(sham_arterial)
    assert within.threshold == pytest.approx(32.5)  # the most sensitive m reaching 6 of 10
    assert "subgroup_matched_specificity" in OPERATING_POINTS


def test_only_the_subgroups_validation_scans_move_the_subgroup_matched_threshold():
    point = subgroup_matched_specificity_point(SYNTHX, 0.6, fixed=50.0, subgroup=ARTERIAL).threshold
    # Other phases' healthy scans and every tumor scan leave it where it is ...
    changed_elsewhere = SYNTHX.copy()
    changed_elsewhere.loc[changed_elsewhere["phase"] == "venous", "volume_mm3"] = 999.0
    changed_elsewhere.loc[changed_elsewhere["label"] == 1, "volume_mm3"] = 1.0
    assert subgroup_matched_specificity_point(changed_elsewhere, 0.6, 50.0, ARTERIAL).threshold == point
    # ... the subgroup's healthy scans move it.
    changed_within = SYNTHX.copy()
    changed_within.loc[(changed_within["phase"] == "arterial") & (changed_within["label"] == 0), "volume_mm3"] *= 2
    assert subgroup_matched_specificity_point(changed_within, 0.6, 50.0, ARTERIAL).threshold == pytest.approx(65.0)


def test_subgroup_matching_falls_back_to_the_fixed_m_and_says_why():
    no_healthy_arterial = scans([], [0.0] * 10)
    point = subgroup_matched_specificity_point(no_healthy_arterial, 0.6, fixed=7.0, subgroup=ARTERIAL)
    assert point.threshold == 7.0 and "no negative scans in phase:arterial" in point.fallback
    undefined = subgroup_matched_specificity_point(SYNTHX, specificity_at(no_healthy_arterial, 50.0, subgroup=ARTERIAL),
                                                   fixed=7.0, subgroup=ARTERIAL)
    assert undefined.threshold == 7.0 and "phase:arterial is undefined" in undefined.fallback
    assert "no validation records" in subgroup_matched_specificity_point(None, 0.6, 7.0, ARTERIAL).fallback
    assert specificity_at(SHAM, SHAM_M, subgroup=("overall", "all")) == specificity_at(SHAM, SHAM_M)


def test_resampled_subgroup_matching_reaches_each_resamples_subgroup_target():
    reference, other = random_records(150, 4), random_records(150, 5).assign(volume_mm3=lambda f: f["volume_mm3"] * 1.7)
    other[["patient_id", "phase", "label"]] = reference[["patient_id", "phase", "label"]]  # the same validation cases
    base = resampled_choices(reference, "youden", n_resamples=40)
    within = resampled_matched_thresholds(reference, base, other, subgroup=ARTERIAL)
    overall = resampled_matched_thresholds(reference, base, other)
    assert np.isfinite(within).sum() >= 30 and not np.array_equal(within, overall, equal_nan=True)
    # Re-derive resample r's draw and check the match within arterial against its own target.
    from lightning_modules.evaluation.thresholds import _patient_resamples

    for r, picked in enumerate(_patient_resamples(reference, 40)):
        if not np.isfinite(within[r]):
            continue
        drawn_reference, drawn_other = reference.iloc[picked], other.iloc[picked]
        target = specificity_at(drawn_reference, base[r], subgroup=ARTERIAL)
        achieved = specificity_at(drawn_other, within[r], subgroup=ARTERIAL)
        assert achieved >= target - 1e-12
        assert within[r] == subgroup_matched_specificity_point(drawn_other, target, 0.0, ARTERIAL).threshold
