"""The decomposition of SynthX's shortfall (synthx.analysis.decomposition) on simulated paired runs with planted effects.

Simulation: every arm decides each test tumor independently with its own planted sensitivity per
phase. Arterial: sham 0.9, copy_paste 0.9, synthx 0.4, phantom 0.95 (the content costs 0.5, the
placement nothing); venous: every arm 0.7 (no effect anywhere).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from lightning_modules.evaluation.seed_pooling import ArmRecords
from lightning_modules.evaluation.small_counts import mcnemar_exact_p, newcombe_paired_interval
from synthx.analysis.decomposition import COLUMNS, decompose, detections, pooled_decomposition

PLANTED = {"arterial": {"sham": 0.9, "copy_paste": 0.9, "synthx": 0.4, "phantom": 0.95},
           "venous": {"sham": 0.7, "copy_paste": 0.7, "synthx": 0.7, "phantom": 0.7}}
ARMS = ("sham", "copy_paste", "synthx", "phantom")
EXPECTED = {"placement": ("copy_paste", "sham"), "content": ("synthx", "copy_paste"), "total": ("synthx", "sham"),
            "ceiling": ("phantom", "sham")}
THRESHOLD = 100.0


def _tumors(per_phase: int) -> pd.DataFrame:
    phases = np.repeat(["arterial", "venous"], per_phase)
    ids = [f"C{i:04d}" for i in range(len(phases))]
    return pd.DataFrame({"case_id": ids, "patient_id": [f"P{i:04d}" for i in range(len(phases))], "phase": phases})


def _simulate(tumors: pd.DataFrame, rng: np.random.Generator, arms=ARMS) -> dict[str, pd.DataFrame]:
    out = {}
    for arm in arms:
        chance = tumors["phase"].map(lambda phase: PLANTED[phase][arm]).to_numpy()
        out[arm] = tumors.assign(detected=(rng.random(len(tumors)) < chance).astype(int))
    return out


def _planted(component: str, phase: str) -> float:
    arm, reference = EXPECTED[component]
    return PLANTED[phase][arm] - PLANTED[phase][reference]


def test_planted_effects_are_recovered_with_their_signs_sizes_intervals_and_tests():
    # One draw, 8 rows: at 95% one of them misses about one draw in three, so this draw is read at
    # 99% (about one in twelve); the 95% rates over many draws are the next test's.
    found = _simulate(_tumors(300), np.random.default_rng(5))
    table = decompose(found, attributes=("phase",), confidence=0.99, alpha=0.01)
    assert list(table.columns) == list(COLUMNS)
    rows = table.set_index(["component", "group"])
    for component, (arm, reference) in EXPECTED.items():
        assert set(table.loc[table["component"] == component, "comparison"]) == {f"{arm} - {reference}"}
        for phase in ("arterial", "venous"):
            row = rows.loc[(component, phase)]
            planted = _planted(component, phase)
            assert (row["arm"], row["reference"], row["positives"]) == (arm, reference, 300)
            # Within 3 standard errors of a paired difference of independent decisions.
            p_arm, p_ref = PLANTED[phase][arm], PLANTED[phase][reference]
            error = np.sqrt((p_arm * (1 - p_arm) + p_ref * (1 - p_ref)) / 300)
            assert abs(row["difference"] - planted) < 3 * error, (component, phase)
            assert row["ci_low"] < planted < row["ci_high"], (component, phase)
            if planted == 0 or abs(planted) >= 0.3:  # the ceiling's +0.05 is left to chance either way
                assert row["significant"] == (planted != 0), (component, phase)
    content = rows.loc[("content", "arterial")]
    assert content["difference"] < -0.4 and content["p_value"] < 1e-10 and content["ci_high"] < -0.35
    # What the arms found, as counted from the simulated decisions.
    arterial = found["synthx"]["phase"] == "arterial"
    assert content["arm_detected"] == found["synthx"].loc[arterial, "detected"].sum()
    assert content["reference_detected"] == found["copy_paste"].loc[arterial, "detected"].sum()
    # The total is placement plus content, exactly, in every subgroup.
    for group in table["group"].unique():
        if rows.loc[("total", group), "positives"]:
            assert rows.loc[("total", group), "difference"] == pytest.approx(
                rows.loc[("placement", group), "difference"] + rows.loc[("content", group), "difference"])
    # The study's tests, called as the primary endpoint calls them (the arm's solo finds in Newcombe's b).
    assert (content["ci_low"], content["ci_high"]) == newcombe_paired_interval(
        content["both"], content["only_arm"], content["only_reference"], content["neither"], 0.99)
    assert content["p_value"] == mcnemar_exact_p(content["only_arm"], content["only_reference"])
    assert content["difference"] == (content["only_arm"] - content["only_reference"]) / 300
    empty = rows.loc[("content", "delayed")]
    assert empty["positives"] == 0 and not empty["supported"] and not empty["significant"]


def test_over_simulated_studies_the_interval_covers_the_planted_value_and_the_nulls_hold_their_level():
    rng = np.random.default_rng(17)
    tumors = _tumors(60)
    covered, false_positives, runs = 0, 0, 200
    for _ in range(runs):
        rows = decompose(_simulate(tumors, rng, ARMS[:3]), attributes=("phase",)).set_index(["component", "group"])
        content = rows.loc[("content", "arterial")]
        covered += content["ci_low"] <= -0.5 <= content["ci_high"]
        false_positives += bool(rows.loc[("placement", "venous"), "significant"])
    assert covered / runs >= 0.9 and false_positives / runs <= 0.08, (covered, false_positives)


def test_without_the_positive_control_there_is_no_ceiling_and_a_required_arm_is_named():
    found = _simulate(_tumors(20), np.random.default_rng(0), ARMS[:3])
    assert set(decompose(found)["component"]) == {"placement", "content", "total"}
    with pytest.raises(ValueError, match="missing: copy_paste"):
        decompose({arm: found[arm] for arm in ("sham", "synthx")})


def test_unpaired_or_bad_detection_records_are_refused_naming_the_case():
    found = _simulate(_tumors(20), np.random.default_rng(0), ARMS[:3])
    short = dict(found, synthx=found["synthx"].iloc[1:])
    with pytest.raises(ValueError, match="case C0000 is missing from arm synthx"):
        decompose(short)
    bad = dict(found, copy_paste=found["copy_paste"].assign(detected=lambda t: t["detected"].where(t.index != 3, 2)))
    with pytest.raises(ValueError, match="arm copy_paste: case C0003: 'detected' must be 0 or 1"):
        decompose(bad)


def _records(tumors: pd.DataFrame, found: pd.DataFrame, healthy: int = 40) -> pd.DataFrame:
    """Test records of an arm: its tumors (volume above m where detected) and healthy scans below m."""
    positives = tumors.assign(label=1, volume_mm3=np.where(found["detected"] == 1, 2 * THRESHOLD, THRESHOLD / 2))
    negatives = pd.DataFrame({"case_id": [f"N{i:03d}" for i in range(healthy)], "patient_id": [f"Q{i:03d}" for i in range(healthy)],
                              "phase": np.where(np.arange(healthy) % 2, "venous", "arterial"), "label": 0,
                              "volume_mm3": THRESHOLD / 2})
    return pd.concat([positives, negatives], ignore_index=True)


def test_detections_keep_the_tumors_decided_above_m():
    tumors = _tumors(5)
    found = _simulate(tumors, np.random.default_rng(1), ("sham",))["sham"]
    back = detections(_records(tumors, found), THRESHOLD)
    assert list(back["case_id"]) == list(tumors["case_id"]) and list(back["detected"]) == list(found["detected"])


def test_the_pooled_decomposition_averages_each_seeds_paired_difference_and_recovers_the_effect():
    rng = np.random.default_rng(23)
    tumors = _tumors(150)
    replicates, per_seed = {}, {}
    for seed in ("0", "1", "2"):
        found = _simulate(tumors, rng)
        replicates[seed] = {arm: ArmRecords(_records(tumors, found[arm]), THRESHOLD) for arm in ARMS}
        per_seed[seed] = decompose(found).set_index(["component", "group"])
    table = pooled_decomposition(replicates, attributes=("phase",), n_resamples=400)
    assert set(table["component"]) == set(EXPECTED) and set(table["metric"]) == {"sensitivity"}
    rows = table.set_index(["component", "group"])
    for component in EXPECTED:
        for phase in ("arterial", "venous"):
            row = rows.loc[(component, phase)]
            for seed in replicates:
                assert row[f"delta {seed}"] == pytest.approx(per_seed[seed].loc[(component, phase), "difference"])
            assert row["ci_low"] < _planted(component, phase) < row["ci_high"], (component, phase)
    assert rows.loc[("content", "arterial"), "significant"] and rows.loc[("content", "arterial"), "mean_delta"] < -0.4
    assert not rows.loc[("placement", "venous"), "significant"] and not rows.loc[("content", "venous"), "significant"]
    # A pair compared at its own m (matched specificity): every tumor of copy_paste found, so placement >= 0.
    moved = {seed: {("copy_paste", "sham"): (THRESHOLD, THRESHOLD / 4)} for seed in replicates}
    shifted = pooled_decomposition(replicates, pair_thresholds=moved, n_resamples=100).set_index(["component", "group"])
    assert shifted.loc[("placement", "arterial"), "mean_delta"] > 0.05
    assert shifted.loc[("content", "arterial"), "mean_delta"] == pytest.approx(rows.loc[("content", "arterial"), "mean_delta"])
