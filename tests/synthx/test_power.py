"""The locked cohort's power calculation: statsmodels' power functions, the phantom's own arterial share."""

from __future__ import annotations

import math

from synthx.power import (detectable_difference, locked_cohort_plan, main, positives_needed, power_table,
                          seed_effect_sd)


def test_detectable_difference_and_positives_needed_are_inverse():
    for n in (10, 15, 40):
        effect = detectable_difference(n, 0.1)
        assert positives_needed(effect, 0.1) == n  # the smallest n for that effect
        assert positives_needed(effect * 1.2, 0.1) < n
    # A textbook figure: 0.5 -> 0.7 (Cohen's h 0.41) needs about 93 per arm at alpha 0.05, power 0.8.
    assert 90 <= positives_needed(0.2, 0.5) <= 95
    assert detectable_difference(400, 0.1) < detectable_difference(100, 0.1)


def test_k_seed_t_test_threshold_shrinks_with_seeds():
    assert seed_effect_sd(5) > seed_effect_sd(10) > 0
    assert math.isclose(seed_effect_sd(5), 1.68, abs_tol=0.01)


def test_locked_cohort_is_sized_from_the_phantoms_arterial_share(capsys):
    plan = locked_cohort_plan(5 / 11, 0.1, seed=1000, reference_cases=400)
    assert 0 < plan["arterial_positive_share"] < 0.2
    assert plan["cases"] * plan["arterial_positive_share"] >= plan["positives_needed"]
    assert plan["detectable_difference"] <= 5 / 11
    table = power_table(0.1, 1000, [100, 400])
    assert list(table["cases"]) == [100, 400] and table["detectable_difference"].is_monotonic_decreasing
    assert main(["--seeds", "5"]) == 0
    assert "scans" in capsys.readouterr().out
