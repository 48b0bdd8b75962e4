"""The comparison at specificity matched within a subgroup (``compare(..., subgroup="phase:arterial")``):
its thresholds read validation records only, its rows carry the tests of every metric at the same
thresholds, and a malformed subgroup is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluation"))  # test_detection_metrics' records

from test_detection_metrics import random_records  # noqa: E402

from lightning_modules.evaluation.thresholds import specificity_at, subgroup_matched_specificity_point  # noqa: E402
from lightning_modules.workflows.evaluate import EvaluatedRun, EvaluationError, _compare_pair, compare  # noqa: E402

ARTERIAL = ("phase", "arterial")
SETTINGS = {"n_resamples": 20, "confidence": 0.95, "score": "volume", "subgroup": ARTERIAL}


def runs(test_scale: float = 2.0, val_b=None):
    test_records, val_a = random_records(150, 1), random_records(90, 2)
    test_records["raw_volume_mm3"] = test_records["volume_mm3"] + 30.0
    val_b = random_records(90, 3) if val_b is None else val_b
    baseline = EvaluatedRun("a" * 32, "sham", test_records, val_a, {"fixed": 50.0, "val_chosen": 20.0})
    other = EvaluatedRun("b" * 32, "synthx", test_records.assign(volume_mm3=test_records["volume_mm3"] * test_scale),
                         val_b, {"fixed": 50.0, "val_chosen": 30.0})
    return baseline, other


def subgroup_rows(baseline, other):
    notes: list[str] = []
    table = _compare_pair(baseline, other, dict(SETTINGS), notes)
    return table[table["operating_point"] == "subgroup_matched_specificity"], notes


def test_the_subgroup_matched_point_is_chosen_on_validation_within_the_subgroup():
    baseline, other = runs()
    rows, notes = subgroup_rows(baseline, other)
    assert not any("matched" in note for note in notes) and set(rows["matched_subgroup"]) == {"phase:arterial"}
    target = specificity_at(baseline.val_records, 20.0, subgroup=ARTERIAL)
    expected = subgroup_matched_specificity_point(other.val_records, target, 50.0, ARTERIAL).threshold
    assert (rows["threshold_a"] == 20.0).all() and (rows["threshold_b"] == expected).all()
    assert rows["nested_threshold"].all()  # the CIs carry the subgroup-matched choice's uncertainty
    # Every other point keeps its rows; only the subgroup point names a subgroup.
    table = _compare_pair(baseline, other, dict(SETTINGS), [])
    assert set(table["operating_point"]) == {"fixed", "val_chosen", "matched_specificity", "subgroup_matched_specificity"}
    assert set(table.loc[table["operating_point"] != "subgroup_matched_specificity", "matched_subgroup"]) == {""}
    # Sensitivity, specificity and AUC of phase:arterial at this point: one pair of thresholds, each its test.
    arterial = rows[(rows["attribute"] == "phase") & (rows["group"] == "arterial")].set_index("metric")
    assert arterial.loc["specificity", "test"] == "mcnemar_exact" and arterial.loc["auc", "test"] == "delong"
    assert arterial.loc["specificity", "p_value"] == arterial.loc["specificity", "p_mcnemar"]
    assert arterial.loc["auc", "p_value"] == arterial.loc["auc", "p_delong"]


def test_test_records_do_not_move_the_subgroup_matched_threshold_and_its_validation_scans_do():
    chosen = subgroup_rows(*runs())[0]["threshold_b"].iloc[0]
    # Other test scores: the same threshold.
    assert subgroup_rows(*runs(test_scale=5.0))[0]["threshold_b"].iloc[0] == chosen
    # The subgroup's healthy validation scans of the other arm scaled up: another threshold.
    val_b = random_records(90, 3)
    healthy_arterial = (val_b["phase"] == "arterial") & (val_b["label"] == 0) & (val_b["volume_mm3"] > 0)
    assert healthy_arterial.sum() >= 2
    val_b.loc[healthy_arterial, "volume_mm3"] *= 10.0
    assert subgroup_rows(*runs(val_b=val_b))[0]["threshold_b"].iloc[0] != chosen
    # Without validation records it falls back to the fixed m and says so.
    baseline, other = runs()
    other.val_records = None
    rows, notes = subgroup_rows(baseline, other)
    assert (rows["threshold_b"] == 50.0).all()
    assert any("subgroup matched specificity: no validation records" in note for note in notes)


def test_a_malformed_subgroup_is_refused_before_any_run_is_read():
    with pytest.raises(EvaluationError, match="attribute:group"):
        compare(["a" * 32, "b" * 32], subgroup="arterial")
    with pytest.raises(EvaluationError, match="unknown subgroup attribute 'colour'"):
        compare(["a" * 32, "b" * 32], subgroup="colour:red")


def test_compare_adds_the_subgroup_point_only_when_a_subgroup_is_named(monkeypatch):
    import lightning_modules.workflows.evaluate as evaluate_module

    loaded = dict(zip(("a" * 32, "b" * 32), runs()))
    monkeypatch.setattr(evaluate_module, "_load_run", lambda client, run_id, stage, folder: loaded[run_id])
    table, logged = compare(list(loaded), "test", uri="sqlite:///:memory:", n_resamples=20, subgroup="phase:arterial")
    assert logged is None
    assert set(table["operating_point"]) == {"fixed", "val_chosen", "matched_specificity", "subgroup_matched_specificity"}
    direct = subgroup_rows(*loaded.values())[0]
    at_point = table[table["operating_point"] == "subgroup_matched_specificity"]
    assert at_point["threshold_b"].iloc[0] == direct["threshold_b"].iloc[0]
    plain, _ = compare(list(loaded), "test", uri="sqlite:///:memory:", n_resamples=20)
    assert set(plain["operating_point"]) == {"fixed", "val_chosen", "matched_specificity"}
