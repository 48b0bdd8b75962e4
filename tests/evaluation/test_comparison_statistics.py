"""The comparison table at small counts and with an uncertain threshold: Wilson, Newcombe, exact McNemar
and DeLong beside the bootstrap, the test that decides significance, and the nested threshold bootstrap."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from lightning_modules.evaluation.paired_comparison import paired_difference
from lightning_modules.evaluation.subgroup_intervals import bootstrap_subgroup_metrics
from lightning_modules.evaluation.thresholds import (
    choose_threshold,
    resampled_choices,
    resampled_matched_thresholds,
    specificity_at,
)


def phase_records(volumes: dict[str, tuple[list[float], list[float]]]) -> pd.DataFrame:
    """One scan per patient; per phase the volumes of its positive and of its negative scans."""
    rows = []
    for phase, (positives, negatives) in volumes.items():
        for label, values in ((1, positives), (0, negatives)):
            for value in values:
                rows.append({"label": label, "volume_mm3": float(value), "phase": phase})
    records = pd.DataFrame(rows)
    records["case_id"] = [f"C{i:03d}" for i in range(len(records))]
    records["patient_id"] = [f"P{i:03d}" for i in range(len(records))]
    return records


def test_five_of_eleven_found_only_by_one_model_is_not_significant_by_the_exact_test():
    # Arterial: the baseline finds 0 of 11 tumors, the other model 5 (no other discordant scan).
    # Delayed: neither finds any of 11. Venous: both find all 12.
    baseline = phase_records({"arterial": ([0.0] * 11, [0.0] * 11), "delayed": ([0.0] * 11, [0.0] * 11),
                              "venous": ([500.0] * 12, [0.0] * 12)})
    other = baseline.copy()
    arterial_positives = np.flatnonzero((other["phase"] == "arterial") & (other["label"] == 1))[:5]
    other.loc[arterial_positives, "volume_mm3"] = 500.0
    table = paired_difference(baseline, other, 50.0, 50.0, n_resamples=400, metrics=("sensitivity", "f1", "auc"),
                              attributes=("phase",))
    rows = table.set_index(["metric", "group"])
    arterial = rows.loc[("sensitivity", "arterial")]
    assert (arterial["a"], arterial["b"]) == (0.0, pytest.approx(5 / 11))
    # The bootstrap calls it (p < 0.05), the exact McNemar test does not (p = 2 / 2^5).
    assert arterial["p_bootstrap"] < 0.05 and arterial["ci_low"] > 0
    assert arterial["test"] == "mcnemar_exact" and arterial["p_value"] == pytest.approx(0.0625)
    assert not arterial["significant"] and not arterial["significant_holm"]
    # F1 moves with the same 5 scans: its bootstrap interval excludes 0, but no exact test finds
    # changed decisions (McNemar on the positives 0.0625, x 2 for positives or negatives).
    f1 = rows.loc[("f1", "arterial")]
    assert f1["ci_low"] > 0 and f1["test"] == "bootstrap+mcnemar" and f1["p_mcnemar"] == pytest.approx(0.125)
    assert f1["p_value"] == pytest.approx(0.125) and not f1["significant"]
    assert arterial["a_wilson_low"] == 0.0 and arterial["a_wilson_high"] == pytest.approx(0.2588, abs=1e-4)
    assert 0 < arterial["newcombe_low"] < 5 / 11 < arterial["newcombe_high"] < 1
    # 0 of 11 against 0 of 11: the bootstrap collapses to [0, 0]; Wilson and Newcombe do not.
    delayed = rows.loc[("sensitivity", "delayed")]
    assert (delayed["ci_low"], delayed["ci_high"]) == (0.0, 0.0)
    assert delayed["b_wilson_high"] == pytest.approx(0.2588, abs=1e-4)
    assert delayed["newcombe_low"] == pytest.approx(-0.2588, abs=1e-4) and delayed["newcombe_high"] == pytest.approx(0.2588, abs=1e-4)
    assert delayed["p_value"] == 1.0
    # AUC is in the table, decided by DeLong's test.
    auc = rows.loc[("auc", "arterial")]
    assert auc["test"] == "delong" and auc["p_value"] == auc["p_delong"] and 0 < auc["p_delong"] < 1
    assert np.isnan(rows.loc[("sensitivity", "arterial"), "p_delong"])


def test_a_supported_difference_is_significant_when_the_exact_test_says_so():
    baseline = phase_records({"venous": ([0.0] * 20, [0.0] * 20)})
    other = baseline.assign(volume_mm3=np.where(baseline["label"] == 1, 500.0, 0.0))
    table = paired_difference(baseline, other, 50.0, 50.0, n_resamples=200, metrics=("sensitivity", "f1"), attributes=("phase",))
    venous = table[table["group"] == "venous"].set_index("metric")
    sensitivity, f1 = venous.loc["sensitivity"], venous.loc["f1"]
    assert sensitivity["p_value"] == pytest.approx(2 * 0.5**20) and sensitivity["significant"] and sensitivity["significant_holm"]
    assert f1["p_mcnemar"] == pytest.approx(4 * 0.5**20) and f1["significant"]


def unstable_validation(rng) -> pd.DataFrame:
    """Overlapping classes on 30 validation scans: Youden's J has its maximum anywhere in 300-600 mm^3."""
    return phase_records({"venous": (rng.uniform(300, 1000, 15).round(), rng.uniform(0, 600, 15).round())})


def test_the_nested_threshold_bootstrap_widens_the_interval_where_the_threshold_is_unstable():
    rng = np.random.default_rng(0)
    validation = unstable_validation(rng)
    # Test tumors sit where the threshold moves: sensitivity depends on where m falls.
    test = phase_records({"venous": (rng.uniform(300, 600, 80).round(), [0.0] * 80)})
    choices = resampled_choices(validation, "youden", n_resamples=300)
    assert np.nanpercentile(choices, 97.5) - np.nanpercentile(choices, 2.5) > 100  # an unstable choice
    m = choose_threshold(validation, "youden")
    fixed = bootstrap_subgroup_metrics(test, m, n_resamples=300, attributes=("phase",)).iloc[0]
    nested = bootstrap_subgroup_metrics(test, m, n_resamples=300, attributes=("phase",), resample_thresholds=choices).iloc[0]
    assert nested["sensitivity"] == fixed["sensitivity"]  # the point estimate keeps the chosen m
    fixed_width = fixed["sensitivity_ci_high"] - fixed["sensitivity_ci_low"]
    nested_width = nested["sensitivity_ci_high"] - nested["sensitivity_ci_low"]
    assert nested_width > 1.5 * fixed_width


def test_a_stable_threshold_leaves_the_interval_as_it_is():
    validation = phase_records({"venous": ([1000.0] * 15, [0.0] * 15)})
    rng = np.random.default_rng(1)
    test = phase_records({"venous": (rng.uniform(300, 900, 60).round(), rng.uniform(0, 700, 60).round())})
    choices = resampled_choices(validation, "youden", n_resamples=200)
    assert np.all(choices == 500.0)
    fixed = bootstrap_subgroup_metrics(test, 500.0, n_resamples=200, attributes=("phase",))
    nested = bootstrap_subgroup_metrics(test, 500.0, n_resamples=200, attributes=("phase",), resample_thresholds=choices)
    columns = [c for c in fixed.columns if c.endswith(("_ci_low", "_ci_high"))]
    pd.testing.assert_frame_equal(fixed[columns], nested[columns])


def test_paired_nested_bootstrap_applies_each_runs_resampled_choice():
    rng = np.random.default_rng(2)
    validation = unstable_validation(rng)
    test_a = phase_records({"venous": (rng.uniform(300, 600, 60).round(), [0.0] * 60)})
    test_b = test_a.assign(volume_mm3=test_a["volume_mm3"] + 40.0 * test_a["label"])
    choices = resampled_choices(validation, "youden", n_resamples=200)
    matched = resampled_matched_thresholds(validation, choices, validation)
    # The same validation records matched to themselves give back a threshold of the same specificity.
    for r in np.flatnonzero(~np.isnan(choices))[:20]:
        assert not np.isnan(matched[r]) and matched[r] <= choices[r] + 1e-9
    m = choose_threshold(validation, "youden")
    fixed = paired_difference(test_a, test_b, m, m, n_resamples=200, metrics=("sensitivity",), attributes=("phase",))
    nested = paired_difference(test_a, test_b, m, m, n_resamples=200, metrics=("sensitivity",), attributes=("phase",),
                               resample_thresholds=(choices, choices))
    assert nested.attrs["nested_threshold"] and not fixed.attrs["nested_threshold"]
    np.testing.assert_array_equal(nested["delta"], fixed["delta"])
    assert not (nested[["ci_low", "ci_high"]].to_numpy() == fixed[["ci_low", "ci_high"]].to_numpy()).all()
    assert specificity_at(validation, m) > 0


def test_the_localization_aware_score_does_not_count_a_blob_away_from_the_tumor():
    from lightning_modules.evaluation.detection import subgroup_metrics

    # Three tumor scans, each with one predicted blob of 500 mm^3: only the first overlaps its lesion.
    records = phase_records({"venous": ([500.0, 500.0, 500.0], [0.0, 0.0]), "arterial": ([0.0], [300.0])})
    records["localized_volume_mm3"] = [500.0, 0.0, 0.0, 0.0, 0.0, 0.0, 300.0]
    records["lesions"] = [1, 1, 2, 0, 0, 1, 0]
    records["lesions_found"] = [1, 0, 0, 0, 0, 0, 0]
    by_volume = subgroup_metrics(records, 50.0, score="volume", attributes=("phase",)).set_index("group")
    localized = subgroup_metrics(records, 50.0, score="localized_volume", attributes=("phase",)).set_index("group")
    assert by_volume.loc["venous", "sensitivity"] == 1.0
    assert localized.loc["venous", "sensitivity"] == pytest.approx(1 / 3)
    # A negative scan's blob is a false positive under both scores.
    assert localized.loc["arterial", "specificity"] == by_volume.loc["arterial", "specificity"] == 0.0
    assert (localized.loc["venous", "lesions_found"], localized.loc["venous", "lesions"]) == (1, 4)
    assert localized.loc["all", "lesion_hit_rate"] == pytest.approx(1 / 5)
