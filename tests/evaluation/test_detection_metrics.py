"""Tests for lightning_modules.evaluation.detection: every metric against scikit-learn, hand-computed
subgroups (empty, no positives, Unknown), BenchX table values, threshold rules, gaps and MLflow keys.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/evaluation/test_detection_metrics.py -x -q
"""

from __future__ import annotations

import math

import mlflow
import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import confusion_matrix, f1_score, recall_score, roc_auc_score

from lightning_modules.evaluation.detection import WeightedSubgroupEvaluator, decisions, subgroup_metrics
from lightning_modules.evaluation.metric_keys import mlflow_metric_keys
from lightning_modules.evaluation.records import ATTRIBUTE_COLUMNS, ATTRIBUTES, scores, tumor_size_groups
from lightning_modules.evaluation.subgroups import gaps
from lightning_modules.evaluation.thresholds import choose_threshold
from lightning_modules.data.metadata import AGE_BAND_NAMES, PHASES


def random_records(n: int = 240, seed: int = 0) -> pd.DataFrame:
    """Random per-case records with every attribute, Unknowns, repeated patients and tied volumes."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 2, n)
    detected = rng.random(n) < np.where(label == 1, 0.75, 0.25)
    return pd.DataFrame(
        {
            "case_id": [f"C{i:04d}" for i in range(n)],
            "patient_id": [f"P{i // 3:04d}" if i % 5 else f"Q{i:04d}" for i in range(n)],
            "label": label,
            # Whole voxels of 3.375 mm^3, zero when nothing is segmented: many ties, as in practice.
            "volume_mm3": np.where(detected, np.ceil(rng.lognormal(3 + label, 1.0, n)), 0.0) * 3.375,
            "max_prob": np.round(rng.random(n), 2),
            "age_band": rng.choice(list(AGE_BAND_NAMES) + ["Unknown"], n),
            "sex": rng.choice(["F", "M", "Unknown", ""], n, p=[0.45, 0.45, 0.05, 0.05]),
            "race": rng.choice(["White", "Black", "Asian", "Unknown"], n),
            "phase": rng.choice(list(PHASES) + ["Unknown"], n),
            "cohort": rng.choice(["E-Coast", "PanTS"], n),
            "tumor_size": np.where(label == 1, rng.choice(["small", "large", "Unknown"], n), ""),
            "tumor_location": np.where(label == 1, rng.choice(["head", "body", "tail", ""], n), ""),
        }
    )


def sklearn_row(y: np.ndarray, score: np.ndarray, threshold: float, sample_weight=None) -> dict[str, float]:
    """The reference: scikit-learn's metrics for one subgroup (NaN where undefined)."""
    decision = (score > threshold).astype(int)
    tn, fp, fn, tp = confusion_matrix(y, decision, labels=[0, 1], sample_weight=sample_weight).ravel()
    has_pos, has_neg = (y == 1).any(), (y == 0).any()
    sensitivity = recall_score(y, decision, sample_weight=sample_weight) if has_pos else math.nan
    specificity = recall_score(y, decision, pos_label=0, sample_weight=sample_weight) if has_neg else math.nan
    f1 = f1_score(y, decision, sample_weight=sample_weight, zero_division=np.nan)
    auc = roc_auc_score(y, score, sample_weight=sample_weight) if has_pos and has_neg else math.nan
    return {
        "tp": tp, "fp": fp, "tn": tn, "fn": fn, "sensitivity": sensitivity, "specificity": specificity,
        "f1": f1, "auc": auc, "auc_binary": (sensitivity + specificity) / 2,
    }


def member_mask(records: pd.DataFrame, attribute: str, group: str) -> np.ndarray:
    if attribute == "overall":
        return np.ones(len(records), dtype=bool)
    return (records[ATTRIBUTE_COLUMNS[attribute]].astype(str) == group).to_numpy()


def assert_close(actual: float, expected: float, tol: float = 1e-9) -> None:
    if math.isnan(expected):
        assert math.isnan(actual), f"expected undefined (NaN), got {actual}"
    else:
        assert abs(actual - expected) <= tol, f"{actual} != {expected}"


@pytest.mark.parametrize("score,threshold", [("volume", 50.0), ("max_prob", 0.5)])
def test_every_subgroup_matches_sklearn(score, threshold):
    records = random_records()
    table = subgroup_metrics(records, threshold, score=score)
    values = scores(records, score)
    y = records["label"].to_numpy()
    assert len(table) > 20
    for row in table.itertuples(index=False):
        mask = member_mask(records, row.attribute, row.group)
        assert row.n == mask.sum() and row.positives == y[mask].sum()
        if row.n == 0:
            continue
        expected = sklearn_row(y[mask], values[mask], threshold)
        for name, value in expected.items():
            assert_close(float(getattr(row, name)), float(value))


def test_patient_weights_match_sklearn_sample_weight():
    records = random_records(seed=3)
    evaluator = WeightedSubgroupEvaluator(records, 40.0)
    weights = np.random.default_rng(1).integers(0, 4, evaluator.n_patients)
    statistics = evaluator.evaluate(weights)
    case_weights = weights[evaluator.case_patient]
    y, values = records["label"].to_numpy(), scores(records)
    for k, row in enumerate(evaluator.rows.itertuples(index=False)):
        mask = member_mask(records, row.attribute, row.group) & (case_weights > 0)
        if mask.sum() == 0:
            continue
        expected = sklearn_row(y[mask], values[mask], 40.0, sample_weight=case_weights[mask])
        for name, value in expected.items():
            assert_close(float(statistics[name][0, k]), float(value))


def small_records() -> pd.DataFrame:
    """Eight hand-made scans (threshold 10 mm^3) whose table is worked out in the tests below."""
    return pd.DataFrame(
        {
            "case_id": ["a", "b", "c", "d", "e", "f", "g", "h"],
            "patient_id": ["p1", "p1", "p2", "p3", "p4", "p5", "p6", "p7"],
            "label": [1, 1, 0, 0, 1, 0, 0, 1],
            "volume_mm3": [50.0, 5.0, 20.0, 0.0, 30.0, 0.0, 10.0, 0.0],
            "max_prob": [0.9, 0.4, 0.6, 0.1, 0.8, 0.2, 0.5, 0.1],
            "age_band": ["60-80", "60-80", "60-80", "40-60", "40-60", "le20", "le20", "Unknown"],
            "sex": ["F", "F", "M", "M", "F", "M", "F", "Unknown"],
            "race": ["White", "White", "Black", "Black", "White", "Black", "White", "Unknown"],
            "phase": ["venous", "venous", "venous", "arterial", "arterial", "non-contrast", "non-contrast", "Unknown"],
            "cohort": ["A"] * 8,
            "tumor_size": ["small", "large", "", "", "small", "", "", "Unknown"],
            "tumor_location": ["head", "tail", "", "", "head", "", "", ""],
        }
    )


def row(table: pd.DataFrame, attribute: str, group: str) -> pd.Series:
    selected = table[(table["attribute"] == attribute) & (table["group"] == group)]
    assert len(selected) == 1, f"no single row for {attribute}/{group}"
    return selected.iloc[0]


def test_hand_computed_table():
    table = subgroup_metrics(small_records(), 10.0)
    # Decisions at m = 10 (volume > 10): a, c, e positive; g (exactly 10) negative.
    overall = row(table, "overall", "all")
    assert (overall.tp, overall.fp, overall.tn, overall.fn) == (2, 1, 3, 2)
    assert overall.sensitivity == pytest.approx(2 / 4) and overall.specificity == pytest.approx(3 / 4)
    assert overall.f1 == pytest.approx(4 / 7)
    # AUC by hand: positives {50, 5, 30, 0}, negatives {20, 0, 0, 10}; pairs won 4 + 2 + 4 + 2 * 0.5 = 11 of 16.
    assert overall.auc == pytest.approx(11 / 16)
    venous = row(table, "phase", "venous")
    assert (venous.n, venous.tp, venous.fp, venous.tn, venous.fn) == (3, 1, 1, 0, 1)
    assert venous.specificity == 0.0 and venous.auc == pytest.approx(1 / 2)


def test_empty_subgroup_and_no_positive_subgroup_are_undefined_with_counts():
    table = subgroup_metrics(small_records(), 10.0)
    delayed = row(table, "phase", "delayed")  # no delayed scan at all
    assert delayed.n == 0 and delayed.positives == 0 and delayed.negatives == 0
    assert all(math.isnan(delayed[m]) for m in ("sensitivity", "specificity", "f1", "auc", "auc_binary"))
    # Non-contrast: negatives only, f (0 mm^3) and g (10 mm^3, not above m): nothing predicted.
    non_contrast = row(table, "phase", "non-contrast")
    assert (non_contrast.n, non_contrast.positives, non_contrast.tn) == (2, 0, 2)
    assert math.isnan(non_contrast.sensitivity) and math.isnan(non_contrast.auc)
    assert non_contrast.specificity == 1.0
    assert math.isnan(non_contrast.f1)  # TP + FP + FN = 0
    # Black: negatives only but c is a false positive, so F1 is defined and 0.
    black = row(table, "race", "Black")
    assert (black.positives, black.fp) == (0, 1) and black.f1 == 0.0 and math.isnan(black.sensitivity)
    # Tumor size: positives only, so specificity is undefined; 'small' holds a and e.
    small = row(table, "tumor_size", "small")
    assert (small.n, small.tp) == (2, 2) and math.isnan(small.specificity) and small.f1 == 1.0


def test_unknown_excluded_from_subgroups_but_counted_overall():
    records = small_records()
    table = subgroup_metrics(records, 10.0)
    assert row(table, "overall", "all").n == 8
    for attribute in ("age", "sex", "race", "phase"):
        groups = table[table["attribute"] == attribute]
        assert "Unknown" not in set(groups["group"])
        assert groups["n"].sum() == 7, attribute  # case h is Unknown everywhere
    sizes = table[table["attribute"] == "tumor_size"]
    assert list(sizes["group"]) == ["small", "large"] and sizes["n"].sum() == 3
    locations = table[table["attribute"] == "tumor_location"]
    assert list(locations["group"]) == ["head", "tail"] and locations["n"].sum() == 3


def test_group_order_follows_benchx():
    table = subgroup_metrics(random_records(), 50.0)
    assert tuple(table.loc[table["attribute"] == "age", "group"]) == AGE_BAND_NAMES
    assert tuple(table.loc[table["attribute"] == "phase", "group"]) == PHASES
    assert list(table.loc[table["attribute"] == "tumor_location", "group"]) == ["head", "body", "tail"]
    assert tuple(dict.fromkeys(table["attribute"])) == ("overall",) + ATTRIBUTES


# BenchX Table 4 (N-California): venous has 28 positive scans (Sen. moves in steps of 1/28),
# non-contrast 36. Specificity is given to 0.1%, so 1,000 negatives reproduce it exactly.
BENCHX_TABLE_4 = [
    # (model, phase, positives, true positives, Sen., Spe., AUC)
    ("MedNeXt", "venous", 28, 20, 71.4, 91.3, 81.4),
    ("U-Net", "venous", 28, 19, 67.9, 71.5, 69.7),
    ("Swin UNETR-T", "venous", 28, 24, 85.7, 51.8, 68.8),
    ("nnU-Net", "non-contrast", 36, 11, 30.6, 84.8, 57.7),
    ("VSmTrans", "non-contrast", 36, 0, 0.0, 100.0, 50.0),
]


@pytest.mark.parametrize("model,phase,positives,true_positives,sen,spe,auc", BENCHX_TABLE_4)
def test_benchx_table_auc_is_mean_of_sensitivity_and_specificity(
    model, phase, positives, true_positives, sen, spe, auc
):
    negatives = 1000
    true_negatives = round(spe * 10)
    label = np.r_[np.ones(positives), np.zeros(negatives)].astype(int)
    detected = np.r_[np.arange(positives) < true_positives, np.arange(negatives) >= true_negatives]
    n = len(label)
    records = pd.DataFrame(
        {
            "case_id": [f"{model}-{i}" for i in range(n)],
            "patient_id": [f"p{i}" for i in range(n)],
            "label": label,
            "volume_mm3": np.where(detected, 100.0, 0.0),
            "max_prob": 0.5,
            "age_band": "60-80", "sex": "F", "race": "Unknown", "phase": phase, "cohort": "N-California",
            "tumor_size": np.where(label == 1, "large", ""), "tumor_location": "",
        }
    )
    result = row(subgroup_metrics(records, 50.0), "phase", phase)
    assert abs(100 * result.sensitivity - sen) <= 0.05 + 1e-9
    assert abs(100 * result.specificity - spe) <= 0.05 + 1e-9
    assert abs(100 * result.auc_binary - auc) <= 0.05 + 1e-9, f"{model} {phase}"


def test_decisions_are_strictly_above_threshold():
    records = small_records()
    assert decisions(records, 10.0).tolist() == [True, False, True, False, True, False, False, False]
    assert decisions(records, 0.5, score="max_prob").tolist() == [True, False, True, False, True, False, False, False]


def brute_force_threshold(records: pd.DataFrame, rule: str) -> float:
    values, y = scores(records), records["label"].to_numpy()
    unique = np.unique(values)
    best, best_threshold = -np.inf, None
    for threshold in (unique[:-1] + unique[1:]) / 2:
        decision = (values > threshold).astype(int)
        if rule == "f1":
            objective = f1_score(y, decision)
        else:
            objective = recall_score(y, decision) + recall_score(y, decision, pos_label=0) - 1
        if objective > best + 1e-12:
            best, best_threshold = objective, threshold
    return best_threshold


@pytest.mark.parametrize("rule", ["f1", "youden"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choose_threshold_matches_brute_force(rule, seed):
    records = random_records(120, seed=seed)
    assert choose_threshold(records, rule=rule) == pytest.approx(brute_force_threshold(records, rule), abs=0)


def test_choose_threshold_ties_go_to_the_smaller_threshold():
    # Scores 0, 10, 20, 30, 40 with labels 0, 1, 0, 0, 1: thresholds 5 and 35 both give F1 = 2/3.
    records = small_records().iloc[:5].copy()
    records["label"] = [0, 1, 0, 0, 1]
    records["volume_mm3"] = [0.0, 10.0, 20.0, 30.0, 40.0]
    records["tumor_size"] = ["", "small", "", "", "small"]
    assert choose_threshold(records, rule="f1") == 5.0


def test_choose_threshold_refuses_degenerate_validation_sets():
    records = small_records()
    no_positives = records.assign(label=0, tumor_size="")
    with pytest.raises(ValueError, match="no positive"):
        choose_threshold(no_positives, rule="f1")
    with pytest.raises(ValueError, match="no negative"):
        choose_threshold(records.assign(label=1), rule="youden")
    with pytest.raises(ValueError, match="all 8 scores equal"):
        choose_threshold(records.assign(volume_mm3=0.0), rule="f1")
    with pytest.raises(ValueError, match="unknown threshold rule"):
        choose_threshold(records, rule="accuracy")


def test_gaps_use_defined_groups_only():
    table = subgroup_metrics(small_records(), 10.0)
    phase_gap = gaps(table, "sensitivity").set_index("attribute").loc["phase"]
    # venous 1/2, arterial 1/1; non-contrast and delayed have no positives and are ignored.
    assert phase_gap.worst_group == "venous" and phase_gap.best_group == "arterial"
    assert phase_gap.gap == pytest.approx(0.5) and phase_gap.groups_defined == 2
    location_gap = gaps(table, "specificity").set_index("attribute").loc["tumor_location"]
    assert math.isnan(location_gap.gap) and location_gap.groups_defined == 0


def test_mlflow_keys_follow_design_and_leave_out_undefined():
    records = small_records()
    records.loc[records["race"] == "Black", "race"] = "Black/African American"
    table = subgroup_metrics(records, 10.0)
    keys = mlflow_metric_keys(table, "test")
    assert keys["test/f1/overall"] == pytest.approx(4 / 7)
    assert keys["test/sensitivity/phase/venous"] == pytest.approx(0.5)
    assert keys["test/n/phase/delayed"] == 0.0 and "test/f1/phase/delayed" not in keys
    assert "test/sensitivity/race/Black_African American" not in keys  # undefined: no positives
    assert keys["test/fp/race/Black_African American"] == 1.0
    assert keys["test/sensitivity_gap/phase"] == pytest.approx(0.5)
    assert keys["test/sensitivity_worst/phase"] == pytest.approx(0.5)
    assert {"test/f1_gap/age", "test/f1_worst/age", "test/auc_binary_gap/sex"} <= set(keys)
    assert not any(math.isnan(v) for v in keys.values())
    assert not any("ci_low" in k for k in keys)


def test_mlflow_keys_are_accepted_by_mlflow(mlflow_uri):
    table = subgroup_metrics(random_records(), 50.0)
    keys = mlflow_metric_keys(table, "test")
    with mlflow.start_run() as run:
        mlflow.log_metrics(keys)
    logged = mlflow.get_run(run.info.run_id).data.metrics
    assert logged == pytest.approx(keys)


def test_mlflow_keys_refuse_colliding_group_names():
    records = small_records()
    records["cohort"] = ["site/1", "site_1"] + ["A"] * 6
    with pytest.raises(ValueError, match="same MLflow key"):
        mlflow_metric_keys(subgroup_metrics(records, 10.0), "test")


def test_tumor_size_groups_use_the_recipe_diameter():
    groups = tumor_size_groups([12.0, 20.0, 20.5, np.nan, 30.0], [1, 1, 1, 1, 0], small_tumor_mm=20.0)
    assert groups.tolist() == ["small", "small", "large", "Unknown", ""]


@pytest.mark.parametrize(
    "column,value,message",
    [
        ("label", 2, "case c: column 'label' must be 0 or 1"),
        ("phase", "portal venous", "case c: column 'phase' has 'portal venous'"),
        ("volume_mm3", np.nan, "case c: column 'volume_mm3' must be a finite number"),
        ("patient_id", "", "case c: column 'patient_id' is empty"),
        ("tumor_size", "small", "case c: column 'tumor_size' is 'small' on a scan with label 0"),
    ],
)
def test_bad_records_are_refused_naming_the_case(column, value, message):
    records = small_records()
    records.attrs["source"] = "predictions.csv"
    records[column] = records[column].astype(object)
    records.loc[2, column] = value
    with pytest.raises(ValueError, match="predictions.csv") as error:
        subgroup_metrics(records, 10.0)
    assert message in str(error.value)


def test_missing_column_and_duplicate_case_are_refused():
    with pytest.raises(ValueError, match=r"missing column\(s\) \['phase'\]"):
        subgroup_metrics(small_records().drop(columns="phase"), 10.0)
    duplicated = small_records()
    duplicated.loc[1, "case_id"] = "a"
    with pytest.raises(ValueError, match="case a: duplicate case_id"):
        subgroup_metrics(duplicated, 10.0)
