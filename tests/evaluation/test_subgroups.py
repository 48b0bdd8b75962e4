"""Tests for lightning_modules.evaluation.subgroups and the significance rule of the bootstrap:
worst group and gap only where the metric is defined; significance withheld below the support rule."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from test_detection_metrics import random_records, small_records

from lightning_modules.evaluation.paired_comparison import paired_difference
from lightning_modules.evaluation.subgroup_intervals import bootstrap_subgroup_metrics
from lightning_modules.evaluation.detection import subgroup_metrics
from lightning_modules.evaluation.subgroups import MIN_NEGATIVES, MIN_PATIENTS, MIN_POSITIVES, gaps, supported


def test_f1_worst_group_is_never_a_group_without_tumors():
    # At m = 5, scan g (healthy, non-contrast, 10 mm^3) is a false positive: F1 of the tumor-free
    # non-contrast group is 0, which says nothing about detection there.
    table = subgroup_metrics(small_records(), 5.0)
    non_contrast = table[(table["attribute"] == "phase") & (table["group"] == "non-contrast")].iloc[0]
    assert non_contrast["positives"] == 0 and non_contrast["f1"] == 0.0
    phase = gaps(table, "f1").set_index("attribute").loc["phase"]
    assert phase.worst_group in ("venous", "arterial") and phase.groups_defined == 2


def test_support_rule():
    assert supported(MIN_PATIENTS, MIN_POSITIVES, 0, "sensitivity")
    assert not supported(MIN_PATIENTS - 1, 50, 50, "sensitivity")
    assert not supported(50, MIN_POSITIVES - 1, 50, "f1")
    assert not supported(50, 50, MIN_NEGATIVES - 1, "specificity")
    assert supported(50, 0, MIN_NEGATIVES, "specificity")
    assert not supported(50, 50, MIN_NEGATIVES - 1, "auc")


def _one_patient_group_records() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Two runs on 60 patients; the baseline misses and the other finds the one 'delayed' tumor."""
    records = random_records(180, seed=3)
    records["phase"] = np.where(records["phase"] == "delayed", "venous", records["phase"])
    records.loc[0, ["phase", "label", "volume_mm3", "tumor_size"]] = ["delayed", 1, 0.0, "small"]
    other = records.copy()
    other.loc[0, "volume_mm3"] = 500.0
    return records, other


def test_significance_is_withheld_on_a_one_patient_group():
    baseline, other = _one_patient_group_records()
    table = paired_difference(baseline, other, 50.0, 50.0, n_resamples=200, metrics=("sensitivity",))
    delayed = table[(table["attribute"] == "phase") & (table["group"] == "delayed")].iloc[0]
    assert (delayed["n_patients"], delayed["positives"], delayed["negatives"]) == (1, 1, 0)
    # The CI is [1, 1] whenever the patient is drawn: it excludes 0, yet the group supports no claim.
    assert delayed["delta"] == 1.0 and delayed["ci_low"] == 1.0 and delayed["ci_high"] == 1.0
    assert not delayed["supported"] and not delayed["significant"]
    # About 1 - (1 - 1/n)^n of the resamples draw that patient at all.
    n = baseline["patient_id"].nunique()
    assert delayed["defined_fraction"] == pytest.approx(1 - (1 - 1 / n) ** n, abs=0.1)
    assert {"n_patients", "positives", "negatives", "defined_fraction", "supported", "significant"} <= set(table.columns)


def test_a_supported_group_with_a_ci_excluding_zero_is_significant():
    baseline = random_records(400, seed=5)
    other = baseline.copy()
    other.loc[other["label"] == 1, "volume_mm3"] = 1000.0  # finds every tumor
    table = paired_difference(baseline, other, 50.0, 50.0, n_resamples=200, metrics=("sensitivity",))
    overall = table[table["attribute"] == "overall"].iloc[0]
    assert overall["supported"] and overall["significant"] and overall["ci_low"] > 0
    assert overall["defined_fraction"] == 1.0


def test_bootstrap_table_reports_patients_and_defined_fractions():
    baseline, _ = _one_patient_group_records()
    table = bootstrap_subgroup_metrics(baseline, 50.0, n_resamples=100)
    delayed = table[(table["attribute"] == "phase") & (table["group"] == "delayed")].iloc[0]
    assert delayed["n_patients"] == 1 and 0 < delayed["sensitivity_defined"] < 1
    assert delayed["specificity_defined"] == 0.0 and np.isnan(delayed["specificity_ci_low"])
    overall = table[table["attribute"] == "overall"].iloc[0]
    assert overall["n_patients"] == baseline["patient_id"].nunique() and overall["f1_defined"] == 1.0
