"""Tests for lightning_modules.evaluation.bootstrap (seeded patient-level resampling), subgroup_intervals (the
vectorized CIs against a slow scikit-learn loop on the same resamples), paired_comparison (paired differences)
and multiplicity (Holm).

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/test_bootstrap.py -x -q
"""

from __future__ import annotations

import hashlib
import math
import warnings

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import confusion_matrix, f1_score, recall_score, roc_auc_score

from lightning_modules.evaluation.bootstrap import (
    case_weight_matrix,
    evaluation_set_hash,
    patient_index,
    patient_weight_blocks,
    resample_indices,
    resample_statistics,
)
from lightning_modules.evaluation.multiplicity import holm_adjust
from lightning_modules.evaluation.paired_comparison import bootstrap_p_values, paired_difference, paired_differences
from lightning_modules.evaluation.subgroup_intervals import bootstrap_subgroup_metrics
from lightning_modules.evaluation.detection import WeightedSubgroupEvaluator, subgroup_metrics
from lightning_modules.evaluation.records import ATTRIBUTE_COLUMNS
from lightning_modules.data.metadata import AGE_BAND_NAMES, PHASES

METRICS = ("sensitivity", "specificity", "f1", "auc", "auc_binary")
# The scikit-learn reference loop costs a few ms per subgroup and resample: keep it to a few groups.
REFERENCE_ATTRIBUTES = ("phase", "race", "tumor_size")


def random_records(n: int = 90, seed: int = 0) -> pd.DataFrame:
    """Random per-case records: 1-3 scans per patient, tied volumes, small subgroups, Unknowns."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 2, n)
    detected = rng.random(n) < np.where(label == 1, 0.7, 0.3)
    patient = np.sort(rng.integers(0, int(n * 0.6), n))
    return pd.DataFrame(
        {
            "case_id": [f"C{i:03d}" for i in range(n)],
            "patient_id": [f"P{p:03d}" for p in patient],
            "label": label,
            "volume_mm3": np.where(detected, np.ceil(rng.lognormal(2 + label, 1.0, n)), 0.0) * 8.0,
            "max_prob": np.round(rng.random(n), 2),
            "age_band": rng.choice(list(AGE_BAND_NAMES) + ["Unknown"], n),
            "sex": rng.choice(["F", "M", "Unknown"], n),
            "race": rng.choice(["White", "Black", "Asian", "Unknown"], n, p=[0.5, 0.2, 0.1, 0.2]),
            "phase": rng.choice(list(PHASES) + ["Unknown"], n, p=[0.1, 0.2, 0.5, 0.1, 0.1]),
            "cohort": rng.choice(["E-Coast", "PanTS"], n),
            "tumor_size": np.where(label == 1, rng.choice(["small", "large"], n), ""),
            "tumor_location": np.where(label == 1, rng.choice(["head", "body", "tail", ""], n), ""),
        }
    )


def reference_bootstrap(records: pd.DataFrame, threshold: float, draws: np.ndarray, table: pd.DataFrame) -> dict:
    """The slow reference: per resample, expand the drawn patients to their scans and call scikit-learn.

    Returns metric -> (n_resamples x n_rows), NaN where undefined.
    """
    patients, case_patient = patient_index(records["case_id"], records["patient_id"])
    cases_of = [np.flatnonzero(case_patient == p) for p in range(len(patients))]
    y_all = records["label"].to_numpy()
    score_all = records["volume_mm3"].to_numpy()
    masks = [
        np.ones(len(records), bool) if a == "overall" else (records[ATTRIBUTE_COLUMNS[a]] == g).to_numpy()
        for a, g in zip(table["attribute"], table["group"])
    ]
    out = {m: np.full((len(draws), len(table)), np.nan) for m in METRICS}
    for r, drawn in enumerate(draws):
        cases = np.concatenate([cases_of[p] for p in drawn])
        for k, mask in enumerate(masks):
            chosen = cases[mask[cases]]
            y, s = y_all[chosen], score_all[chosen]
            d = (s > threshold).astype(int)
            if len(y) == 0:
                continue
            tn, fp, fn, tp = confusion_matrix(y, d, labels=[0, 1]).ravel()
            sen = recall_score(y, d) if tp + fn else math.nan
            spe = tn / (tn + fp) if tn + fp else math.nan
            out["sensitivity"][r, k], out["specificity"][r, k] = sen, spe
            out["f1"][r, k] = f1_score(y, d, zero_division=np.nan)
            out["auc"][r, k] = roc_auc_score(y, s) if 0 < y.sum() < len(y) else math.nan
            out["auc_binary"][r, k] = (sen + spe) / 2
    return out


def reference_interval(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """95% percentile interval per column over defined resamples, computed directly with numpy."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="All-NaN slice encountered", category=RuntimeWarning)
        low, high = np.nanpercentile(samples, [2.5, 97.5], axis=0)
    return low, high


def test_evaluation_set_hash_is_order_free_sha256_of_sorted_ids():
    ids = ["b", "a", "c"]
    assert evaluation_set_hash(ids) == hashlib.sha256(b"a\nb\nc").hexdigest()
    assert evaluation_set_hash(pd.Series(["c", "a", "b"])) == evaluation_set_hash(ids)
    assert evaluation_set_hash(["a", "b"]) != evaluation_set_hash(ids)
    with pytest.raises(ValueError, match="'a' appears more than once"):
        evaluation_set_hash(["a", "b", "a"])


def test_resamples_are_deterministic_and_independent_of_row_order():
    records = random_records()
    first = resample_indices(records["case_id"], records["patient_id"], n_resamples=50)
    again = resample_indices(records["case_id"], records["patient_id"], n_resamples=50)
    shuffled = records.sample(frac=1.0, random_state=7)
    reordered = resample_indices(shuffled["case_id"], shuffled["patient_id"], n_resamples=50)
    n_patients = records["patient_id"].nunique()
    assert first.shape == (50, n_patients)
    assert np.array_equal(first, again) and np.array_equal(first, reordered)
    # Resample r does not depend on how many are drawn.
    assert np.array_equal(first[:10], resample_indices(records["case_id"], records["patient_id"], n_resamples=10))
    # Another evaluation set (one case fewer) gets other draws; an explicit seed overrides the set's.
    smaller = records.iloc[1:]
    other_set = resample_indices(smaller["case_id"], smaller["patient_id"], 50)
    assert not np.array_equal(first[:, : n_patients - 1], other_set[:, : n_patients - 1])
    assert not np.array_equal(first, resample_indices(records["case_id"], records["patient_id"], 50, seed=1))


def test_resampling_keeps_a_patients_scans_together():
    records = random_records()
    weights = case_weight_matrix(records["case_id"], records["patient_id"], n_resamples=200)
    assert weights.shape == (200, len(records))
    for _, cases in records.groupby("patient_id").indices.items():
        assert (weights[:, cases] == weights[:, cases[:1]]).all()
    # Each resample draws as many patients as there are; some patients appear several times.
    patients, case_patient = patient_index(records["case_id"], records["patient_id"])
    first_case = np.unique(case_patient, return_index=True)[1]
    assert (weights[:, first_case].sum(axis=1) == len(patients)).all()
    assert weights.max() > 1 and (weights == 0).any()


def test_weight_blocks_equal_the_draws_whatever_the_block_size():
    draws = resample_indices(["a", "b", "c", "d"], ["p", "p", "q", "r"], n_resamples=7, seed=3)
    expected = np.stack([np.bincount(row, minlength=3) for row in draws])
    for block_size in (1, 3, 7):
        blocks = [block for _, block in patient_weight_blocks(3, 7, seed=3, block_size=block_size)]
        assert np.array_equal(np.concatenate(blocks, axis=1).T, expected)


def test_vectorized_cis_equal_a_slow_sklearn_loop_on_the_same_resamples():
    records, threshold, n_resamples = random_records(), 40.0, 30
    table = bootstrap_subgroup_metrics(records, threshold, n_resamples=n_resamples, attributes=REFERENCE_ATTRIBUTES)
    draws = resample_indices(records["case_id"], records["patient_id"], n_resamples=n_resamples)
    reference = reference_bootstrap(records, threshold, draws, table)
    for metric in METRICS:
        low, high = reference_interval(reference[metric])
        defined = table[metric].notna().to_numpy()
        assert defined.sum() >= 5
        np.testing.assert_allclose(table[f"{metric}_ci_low"].to_numpy()[defined], low[defined], rtol=0, atol=1e-9)
        np.testing.assert_allclose(table[f"{metric}_ci_high"].to_numpy()[defined], high[defined], rtol=0, atol=1e-9)
        assert table.loc[~defined, f"{metric}_ci_low"].isna().all()
    # The point estimates are the plain subgroup table's.
    point = subgroup_metrics(records, threshold, attributes=REFERENCE_ATTRIBUTES)
    pd.testing.assert_frame_equal(table[point.columns], point)
    assert table.attrs["evaluation_set_sha256"] == evaluation_set_hash(records["case_id"])


def test_bootstrap_is_reproducible_across_row_order_and_block_size():
    records = random_records(seed=4)
    table = bootstrap_subgroup_metrics(records, 40.0, n_resamples=80)
    shuffled = records.sample(frac=1.0, random_state=1)
    tiny_blocks = bootstrap_subgroup_metrics(shuffled, 40.0, n_resamples=80, memory_budget_mb=1e-3)
    pd.testing.assert_frame_equal(table, tiny_blocks)
    ci = table[[f"{m}_ci_{s}" for m in METRICS for s in ("low", "high")]]
    assert ci.notna().any().all()
    overall = table.iloc[0]
    for metric in METRICS:
        assert overall[f"{metric}_ci_low"] <= overall[metric] <= overall[f"{metric}_ci_high"]


def test_threaded_blocks_give_the_same_statistics_as_one_thread():
    records = random_records(n=300, seed=6)
    evaluators = [WeightedSubgroupEvaluator(records, m) for m in (20.0, 60.0)]
    # Tiny blocks: many blocks in flight across the threads, each writing its own rows.
    serial = resample_statistics(evaluators, 200, seed=3, memory_budget_mb=1e-3, threads=1)
    threaded = resample_statistics(evaluators, 200, seed=3, memory_budget_mb=1e-3, threads=3)
    for one, many in zip(serial, threaded):
        for metric in METRICS:
            np.testing.assert_array_equal(one[metric], many[metric])
    assert np.isfinite(serial[0]["auc"]).any()
    with pytest.raises(ValueError, match="threads"):
        resample_statistics(evaluators, 10, seed=3, threads=0)


def test_an_evaluator_sharing_the_reference_subgroups_equals_one_built_from_scratch():
    records = random_records(n=200, seed=7)
    other = records.assign(volume_mm3=np.random.default_rng(1).permutation(records["volume_mm3"].to_numpy()))
    shuffled = other.sample(frac=1.0, random_state=2)
    reference = WeightedSubgroupEvaluator(records, 40.0)
    shared = WeightedSubgroupEvaluator.on_same_cases(reference, shuffled, 25.0)
    alone = WeightedSubgroupEvaluator(other, 25.0)
    _, block = next(patient_weight_blocks(reference.n_patients, 16, seed=5, block_size=16))
    for name, values in alone.evaluate_columns(block).items():
        np.testing.assert_array_equal(values, shared.evaluate_columns(block)[name], err_msg=name)
    assert (shared.row_patients == alone.row_patients).all()
    with pytest.raises(ValueError, match="C000 of the reference is not in the records"):
        WeightedSubgroupEvaluator.on_same_cases(reference, shuffled[shuffled["case_id"] != "C000"], 25.0)
    with pytest.raises(ValueError, match="volume_mm3"):
        WeightedSubgroupEvaluator.on_same_cases(reference, shuffled.assign(volume_mm3=np.nan), 25.0)


def test_float32_blocks_give_the_same_statistics_as_float64():
    records = random_records(seed=5)
    evaluator = WeightedSubgroupEvaluator(records, 40.0)
    _, block = next(patient_weight_blocks(evaluator.n_patients, 16, seed=11, block_size=16))
    exact = evaluator.evaluate_columns(block.astype(np.float64))
    fast = evaluator.evaluate_columns(block.astype(np.float32))
    for name in exact:
        np.testing.assert_array_equal(exact[name], fast[name])


def test_paired_difference_of_identical_runs_is_exactly_zero():
    records = random_records()
    result = paired_difference(records, records.sample(frac=1.0, random_state=2), 40.0, 40.0, n_resamples=40)
    defined = result["delta"].notna()
    assert defined.sum() > 50
    assert (result.loc[defined, ["delta", "ci_low", "ci_high"]] == 0.0).all().all()
    assert not result["significant"].any()
    assert set(result["metric"]) == set(METRICS)


def test_paired_difference_uses_the_same_resamples_for_both_runs():
    records_a = random_records(seed=6)
    records_b = records_a.copy()
    # Run B finds more tumors: positives get larger volumes.
    records_b.loc[records_b["label"] == 1, "volume_mm3"] += 200.0
    n_resamples = 30
    result = paired_difference(
        records_a, records_b, 40.0, 40.0, n_resamples=n_resamples, attributes=REFERENCE_ATTRIBUTES
    )
    table = subgroup_metrics(records_a, 40.0, attributes=REFERENCE_ATTRIBUTES)
    draws = resample_indices(records_a["case_id"], records_a["patient_id"], n_resamples=n_resamples)
    reference_a = reference_bootstrap(records_a, 40.0, draws, table)
    reference_b = reference_bootstrap(records_b, 40.0, draws, table)
    for metric in ("sensitivity", "auc"):
        rows = result[result["metric"] == metric].reset_index(drop=True)
        low, high = reference_interval(reference_b[metric] - reference_a[metric])
        defined = rows["delta"].notna().to_numpy()
        np.testing.assert_allclose(rows["ci_low"].to_numpy()[defined], low[defined], atol=1e-9, rtol=0)
        np.testing.assert_allclose(rows["ci_high"].to_numpy()[defined], high[defined], atol=1e-9, rtol=0)
        # The p-value from the same paired differences, counted directly.
        differences = reference_b[metric] - reference_a[metric]
        for k in np.flatnonzero(defined):
            column = differences[:, k][~np.isnan(differences[:, k])]
            expected = min(1.0, 2 * min(np.mean(column <= 0), np.mean(column >= 0)))
            assert rows.loc[k, "p_bootstrap"] == pytest.approx(expected, abs=1e-12)
        # Significance follows the small-count test of the metric: exact McNemar, DeLong for AUC.
        decisive = {"sensitivity": "p_mcnemar", "auc": "p_delong"}[metric]
        np.testing.assert_array_equal(rows.loc[defined, "p_value"], rows.loc[defined, decisive])
        # Holm within each attribute, over its supported groups only.
        for attribute, group_rows in rows.groupby("attribute"):
            supported = group_rows[group_rows["supported"] & group_rows["p_value"].notna()]
            np.testing.assert_allclose(supported["p_holm"], holm_adjust(supported["p_value"].to_numpy()))
            assert group_rows.loc[~group_rows["supported"], "p_holm"].isna().all()
    overall_sensitivity = result[(result["metric"] == "sensitivity") & (result["attribute"] == "overall")].iloc[0]
    assert overall_sensitivity.delta > 0 and overall_sensitivity.ci_low > 0 and overall_sensitivity.significant
    # A family of one: Holm leaves the overall p-value as it is.
    assert overall_sensitivity.p_holm == overall_sensitivity.p_value < 0.05 and overall_sensitivity.significant_holm
    assert not (result["significant_holm"] & ~result["significant"]).any()


def test_holm_adjustment_matches_its_definition_and_skips_untested_entries():
    # Textbook case: sorted 0.005, 0.01, 0.03, 0.04 -> 4 x 0.005, 3 x 0.01, 2 x 0.03, max(1 x 0.04, 0.06).
    np.testing.assert_allclose(holm_adjust([0.01, 0.04, 0.03, 0.005]), [0.03, 0.06, 0.06, 0.02])
    np.testing.assert_allclose(holm_adjust([0.5, np.nan, 0.4]), [0.8, np.nan, 0.8])
    assert np.isnan(holm_adjust([np.nan, np.nan])).all() and holm_adjust([]).shape == (0,)
    rng = np.random.default_rng(0)
    for _ in range(20):
        p = rng.random(7) ** 3
        order = np.argsort(p)
        brute = np.empty(7)
        for rank, index in enumerate(order):
            brute[index] = min(1.0, max((7 - j) * p[order[j]] for j in range(rank + 1)))
        np.testing.assert_allclose(holm_adjust(p), brute)


def test_bootstrap_p_values_count_both_sides_and_leave_undefined_columns_out():
    differences = np.array([[0.1, -0.2, np.nan, 0.0],
                            [0.2, 0.1, np.nan, 0.0],
                            [0.3, -0.1, np.nan, np.nan],
                            [-0.1, -0.3, np.nan, 0.0]])
    p = bootstrap_p_values(differences, np.array([0.2, -0.1, 0.0, 0.0]))
    # Column 0: 1 of 4 at or below 0 -> 0.5; column 1: 1 of 4 at or above 0 -> 0.5;
    # column 2: never defined -> NaN; column 3: every defined difference is 0 -> 1.
    np.testing.assert_allclose(p, [0.5, 0.5, np.nan, 1.0])
    assert np.isnan(bootstrap_p_values(differences, np.array([np.nan, 0.1, 0.1, 0.1]))[0])


def test_many_comparisons_in_one_pass_equal_each_pair_alone():
    """paired_differences evaluates the reference once per threshold; every table must equal the
    pairwise paired_difference (same resamples, same thresholds), whatever the row order."""
    records_a = random_records(seed=8)
    others = []
    for seed in (1, 2):
        other = records_a.sample(frac=1.0, random_state=seed).reset_index(drop=True)
        other["volume_mm3"] = other["volume_mm3"] * (1.0 + 0.5 * seed)
        others.append(other)
    comparisons = [(others[0], 40.0, 40.0), (others[1], 40.0, 80.0), (others[1], 120.0, 30.0)]
    tables = paired_differences(records_a, comparisons, n_resamples=25, attributes=REFERENCE_ATTRIBUTES)
    assert len(tables) == 3
    for table, (records_b, threshold_a, threshold_b) in zip(tables, comparisons):
        alone = paired_difference(records_a, records_b, threshold_a, threshold_b, n_resamples=25,
                                  attributes=REFERENCE_ATTRIBUTES)
        pd.testing.assert_frame_equal(table, alone)
        assert table.attrs == alone.attrs
    assert not tables[0].equals(tables[2])
    with pytest.raises(ValueError, match="same evaluation set"):
        paired_differences(records_a, [(others[0], 40.0, 40.0), (others[1].iloc[1:], 40.0, 40.0)], n_resamples=5)


def test_paired_difference_refuses_different_evaluation_sets():
    records = random_records()
    with pytest.raises(ValueError, match="same evaluation set.*1 case\\(s\\) only in A"):
        paired_difference(records, records.iloc[1:], 40.0, 40.0, n_resamples=5)
    relabeled = records.copy()
    relabeled.loc[3, "label"] = 1 - relabeled.loc[3, "label"]
    relabeled.loc[3, "tumor_size"] = "small" if relabeled.loc[3, "label"] == 1 else ""
    with pytest.raises(ValueError, match="case C003: column 'label' differs"):
        paired_difference(records, relabeled, 40.0, 40.0, n_resamples=5)


def test_bad_settings_are_refused():
    records = random_records()
    with pytest.raises(ValueError, match="n_resamples"):
        bootstrap_subgroup_metrics(records, 40.0, n_resamples=0)
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_subgroup_metrics(records, 40.0, confidence=1.5)
    with pytest.raises(ValueError, match="case C001: empty patient id"):
        resample_indices(records["case_id"], records["patient_id"].where(records.index != 1, ""), 3)
