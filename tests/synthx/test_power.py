"""The locked cohort's power calculation: the simulated power of the study's own tests against
references (Connor's normal approximation at large n, exact enumeration at small n), the phantom's
own arterial tumors, and the older figures from statsmodels' power functions."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.stats

from lightning_modules.evaluation.small_counts import newcombe_paired_interval
from synthx.analysis.power import (LOCKED_CASES, LOCKED_SEED, arterial_tumors, detectable_difference, locked_cases_for,
                          locked_cohort_plan, main, non_inferiority_power, paired_cells, positives_needed, power_table,
                          recommended_locked_cases, seed_effect_sd, superiority_power, tumors_needed)


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
    assert main(["--seeds", "5", "--sham", "0.83", "--phi", "0", "--simulations", "400"]) == 0
    out = capsys.readouterr().out
    assert "scans" in out and "exact McNemar" in out and "non-inferiority" in out and "recommended locked cohort" in out


def monte_carlo_error(power: float, n_simulations: int) -> float:
    return math.sqrt(max(power * (1 - power), 1e-4) / n_simulations)


def test_paired_cells_have_the_sensitivities_and_correlation_asked_for():
    cells = paired_cells(0.7, 0.85, 0.3)  # both, sham only, SynthX only, neither
    assert cells.sum() == pytest.approx(1.0)
    assert cells[0] + cells[1] == pytest.approx(0.7) and cells[0] + cells[2] == pytest.approx(0.85)
    phi = (cells[0] * cells[3] - cells[1] * cells[2]) / math.sqrt(0.7 * 0.3 * 0.85 * 0.15)
    assert phi == pytest.approx(0.3)
    with pytest.raises(ValueError, match="cannot have a correlation of -0.9"):
        paired_cells(0.8, 0.9, -0.9)
    with pytest.raises(ValueError, match="synthx sensitivity must lie in"):
        paired_cells(0.8, 1.2)


@pytest.mark.parametrize("sham, synthx, phi, tumors", [(0.6, 0.7, 0.2, 400), (0.75, 0.85, 0.0, 300), (0.1, 0.25, 0.0, 100)])
def test_simulated_normal_approximation_power_matches_connors_formula(sham, synthx, phi, tumors):
    # Connor (Biometrics 43:207-211, 1987): with psi the discordant share and delta = p01 - p10,
    # power = Phi((sqrt(n) |delta| - z sqrt(psi)) / sqrt(psi - delta^2)) for the uncorrected chi-square test.
    cells = paired_cells(sham, synthx, phi)
    psi, delta = cells[1] + cells[2], cells[2] - cells[1]
    z = scipy.stats.norm.ppf(0.975)
    connor = scipy.stats.norm.cdf((math.sqrt(tumors) * abs(delta) - z * math.sqrt(psi)) / math.sqrt(psi - delta**2))
    assert 0.3 < connor < 0.95  # a regime where the power is sensitive to the test
    simulated = superiority_power(sham, synthx, tumors, phi, n_simulations=20_000, seed=1, exact=False)
    assert abs(simulated - connor) < 4 * monte_carlo_error(connor, 20_000) + 0.01, (simulated, connor)


def enumerated(tumors: int, cells: np.ndarray, decides) -> float:
    """The exact probability that ``decides(a, b, c, d)`` over every paired table of ``tumors`` tumors."""
    total = 0.0
    for both, sham_only, synthx_only in itertools.product(range(tumors + 1), repeat=3):
        neither = tumors - both - sham_only - synthx_only
        if neither >= 0 and decides(both, sham_only, synthx_only, neither):
            total += scipy.stats.multinomial.pmf([both, sham_only, synthx_only, neither], tumors, cells)
    return total


@pytest.mark.parametrize("sham, synthx, phi, tumors", [(0.5, 0.9, 0.0, 12), (0.3, 0.8, 0.2, 10), (0.67, 1.0, 0.0, 12)])
def test_simulated_exact_mcnemar_power_equals_exact_enumeration(sham, synthx, phi, tumors):
    def rejects(a, b, c, d):  # the binomial test of the discordant pairs, SynthX ahead
        return c > b and scipy.stats.binomtest(c, b + c, 0.5).pvalue < 0.05

    exact = enumerated(tumors, paired_cells(sham, synthx, phi), rejects)
    assert 0.1 < exact < 0.9
    simulated = superiority_power(sham, synthx, tumors, phi, n_simulations=20_000, seed=2)
    assert abs(simulated - exact) < 4 * monte_carlo_error(exact, 20_000), (simulated, exact)


def test_simulated_non_inferiority_power_equals_exact_enumeration():
    sham, synthx, phi, tumors = 0.5, 0.8, 0.1, 12
    exact = enumerated(tumors, paired_cells(sham, synthx, phi),
                       lambda a, b, c, d: newcombe_paired_interval(a, c, b, d)[0] > -0.10)  # SynthX first
    assert 0.1 < exact < 0.9
    simulated = non_inferiority_power(sham, synthx, tumors, phi, n_simulations=20_000, seed=3)
    assert abs(simulated - exact) < 4 * monte_carlo_error(exact, 20_000), (simulated, exact)
    # SynthX behind sham by more than the margin is rarely called non-inferior.
    assert non_inferiority_power(0.8, 0.6, 60, n_simulations=5_000) < 0.05


def test_a_perfect_synthx_is_decided_only_when_sham_missed_six_or_more():
    # SynthX finds every tumor: the exact test rejects at 5% from 6 sham misses (p = 2/64), not at 5 (p = 4/64).
    expected = scipy.stats.binom.sf(5, 18, 1 - 0.83)
    assert superiority_power(0.83, 1.0, 18, n_simulations=20_000) == pytest.approx(expected, abs=4 * monte_carlo_error(expected, 20_000))


def test_tumors_needed_is_the_first_count_from_which_the_power_holds():
    assert tumors_needed(lambda n: float(n >= 37)) == 37
    sawtooth = {40: 0.81, 41: 0.79, 42: 0.82, 43: 0.83, 44: 0.84}  # falls back once after 40
    assert tumors_needed(lambda n: sawtooth.get(n, float(n > 44))) == 42
    assert tumors_needed(lambda n: 0.5, limit=64) is None


def test_the_locked_cohort_is_sized_in_the_phantoms_own_arterial_tumors():
    from synthx.workflows.study.settings import LOCKED_CASES as STUDY_LOCKED_CASES, LOCKED_SEED_OFFSET

    assert (LOCKED_CASES, LOCKED_SEED) == (STUDY_LOCKED_CASES, 0 + LOCKED_SEED_OFFSET)
    cases = locked_cases_for(25)
    assert arterial_tumors(cases) == 25 and arterial_tumors(cases - 1) == 24
    plan = recommended_locked_cases(shams=(0.7, 0.83), n_simulations=4_000)
    assert plan["sham"] == 0.83 and plan["synthx"] == 1.0
    # The first count from which 6 or more sham misses are 80% likely (the binomial's own answer, within MC error).
    first = next(n for n in range(6, 200) if all(scipy.stats.binom.sf(5, m, 0.17) >= 0.8 for m in (n, n + 1, n + 2)))
    assert abs(plan["tumors"] - first) <= 2 and plan["cases"] == locked_cases_for(plan["tumors"])
    assert arterial_tumors(plan["cases"]) == plan["tumors"]


def test_out_of_range_settings_end_with_a_short_message(capsys):
    assert main(["--sham", "1.3", "--simulations", "200"]) == 2
    assert "--sham 1.3" in capsys.readouterr().err
    assert main(["--sham", "0.9", "--phi", "-0.9", "--simulations", "200"]) == 2
    assert "cannot have a correlation" in capsys.readouterr().err
