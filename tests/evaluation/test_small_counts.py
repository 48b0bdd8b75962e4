"""Wilson, Newcombe, exact McNemar and DeLong against published worked examples and independent computations."""

import itertools

import numpy as np
import pytest
import scipy.stats
from sklearn.metrics import roc_auc_score

from lightning_modules.evaluation.small_counts import (
    delong_covariance,
    delong_test,
    mcnemar_exact_p,
    newcombe_paired_interval,
    newcombe_paired_intervals,
    wilson_interval,
)


def test_wilson_interval_does_not_collapse_at_zero_and_matches_the_closed_form():
    low, high = wilson_interval([0, 7, 11], [11, 20, 11])
    assert low[0] == 0.0 and high[0] == pytest.approx(0.2588, abs=1e-4)
    assert low[2] == pytest.approx(0.7412, abs=1e-4) and high[2] == pytest.approx(1.0)
    # Wilson (1927): (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)
    z, p, n = scipy.stats.norm.ppf(0.975), 7 / 20, 20
    centre, spread = p + z**2 / (2 * n), z * np.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    assert (low[1], high[1]) == pytest.approx(((centre - spread) / (1 + z**2 / n), (centre + spread) / (1 + z**2 / n)))
    assert np.isnan(wilson_interval([0], [0])[0][0])


def test_newcombe_paired_interval_reproduces_the_published_worked_example():
    # Fagerland, Lydersen & Laake, Statistical Analysis of Contingency Tables (2017), chapter 8:
    # complete response before and after consolidation therapy (Cavo et al. 2012), a=59 b=6 c=16 d=80,
    # Newcombe square-and-add: -0.0621 (-0.1186 to -0.0046).
    low, high = newcombe_paired_interval(59, 6, 16, 80)
    assert (round(low, 4), round(high, 4)) == (-0.1186, -0.0046)
    # Bentur et al. 2009 (same book): the difference is -6/21 and the interval holds it strictly.
    low, high = newcombe_paired_interval(1, 1, 7, 12)
    assert low < -6 / 21 < high < 0


def test_newcombe_interval_does_not_collapse_when_nothing_is_found_by_either_arm():
    low, high = newcombe_paired_interval(0, 0, 0, 11)
    assert low == pytest.approx(-0.2588, abs=1e-4) and high == pytest.approx(0.2588, abs=1e-4)


def test_newcombe_uses_the_correlation_of_the_pairs():
    # Strongly concordant pairs narrow the interval against the independent (phi = 0) one.
    concordant = newcombe_paired_interval(40, 5, 1, 40)
    low_first, high_second = float(wilson_interval(45, 86)[0]), float(wilson_interval(41, 86)[1])
    low_independent = (45 / 86 - 41 / 86) - np.hypot(45 / 86 - low_first, high_second - 41 / 86)
    assert concordant[0] > low_independent + 0.05


@pytest.mark.parametrize("only_first, only_second", [(0, 5), (5, 0), (3, 9), (12, 2), (7, 7), (1, 0)])
def test_mcnemar_exact_p_is_the_binomial_test_of_the_discordant_pairs(only_first, only_second):
    reference = scipy.stats.binomtest(only_first, only_first + only_second, 0.5).pvalue
    assert mcnemar_exact_p(only_first, only_second) == pytest.approx(reference)
    assert mcnemar_exact_p(0, 5) == pytest.approx(0.0625)
    assert mcnemar_exact_p(0, 0) == 1.0


def _brute_force_delong(truth, score_sets):
    """DeLong et al. (1988) from their definition: placement values over all positive-negative pairs."""
    truth = np.asarray(truth, dtype=bool)
    v10s, v01s = [], []
    for scores in score_sets:
        x, y = scores[truth], scores[~truth]
        psi = (x[:, None] > y[None, :]) + 0.5 * (x[:, None] == y[None, :])
        v10s.append(psi.mean(axis=1))
        v01s.append(psi.mean(axis=0))
    m, n = truth.sum(), (~truth).sum()
    return np.array([v.mean() for v in v10s]), np.cov(np.array(v10s)) / m + np.cov(np.array(v01s)) / n


def test_delong_variance_hand_checked_on_two_by_two_cases():
    # Positives (0.9, 0.4), negatives (0.3, 0.5): AUC 3/4, V10 = (1, 1/2), V01 = (1, 1/2),
    # S10 = S01 = 1/8, so Var = 1/8/2 + 1/8/2 = 1/8. Second model: positives (0.6, 0.8), negatives
    # (0.7, 0.1): AUC 3/4, V10 = (1/2, 1), V01 = (1/2, 1); Cov(V10) = Cov(V01) = -1/8, Cov = -1/8.
    truth = np.array([1, 1, 0, 0], dtype=bool)
    a, b = np.array([0.9, 0.4, 0.3, 0.5]), np.array([0.6, 0.8, 0.7, 0.1])
    aucs, covariance = delong_covariance(truth, a, b)
    assert aucs == pytest.approx([0.75, 0.75])
    assert covariance == pytest.approx(np.array([[0.125, -0.125], [-0.125, 0.125]]))
    result = delong_test(truth, a, b)
    assert result.z == 0.0 and result.p_value == pytest.approx(1.0)


def test_fast_delong_equals_the_pairwise_definition_and_sklearn_with_ties():
    rng = np.random.default_rng(3)
    truth = rng.random(120) < 0.4
    a = np.round(rng.normal(truth * 2.0, 1.0), 1)  # rounded: ties within and across classes
    b = np.round(rng.normal(truth * 0.2, 1.0), 1)
    aucs, covariance = delong_covariance(truth, a, b)
    reference_aucs, reference_covariance = _brute_force_delong(truth, [a, b])
    assert aucs == pytest.approx([roc_auc_score(truth, a), roc_auc_score(truth, b)])
    assert aucs == pytest.approx(reference_aucs) and covariance == pytest.approx(reference_covariance)
    result = delong_test(truth, a, b)
    z = (aucs[1] - aucs[0]) / np.sqrt(covariance[0, 0] + covariance[1, 1] - 2 * covariance[0, 1])
    assert result.z == pytest.approx(z) and result.p_value == pytest.approx(2 * scipy.stats.norm.sf(abs(z)))
    assert result.p_value < 0.05  # a separating score against a weak one on 120 cases


def test_single_auc_variance_is_the_mann_whitney_placement_variance():
    # For one model, DeLong's variance is the unbiased variance of the Mann-Whitney U / mn through
    # its placement values; check it against an enumeration of every (positive, negative) pair.
    truth = np.array([1, 1, 1, 0, 0, 0, 0], dtype=bool)
    scores = np.array([3.0, 2.0, 2.0, 2.0, 1.0, 0.5, 2.5])
    (auc,), covariance = delong_covariance(truth, scores)
    pairs = [(x > y) + 0.5 * (x == y) for x, y in itertools.product(scores[truth], scores[~truth])]
    assert auc == pytest.approx(np.mean(pairs))
    assert auc == pytest.approx(scipy.stats.mannwhitneyu(scores[truth], scores[~truth]).statistic / 12)
    _, reference = _brute_force_delong(truth, [scores, scores])
    assert covariance[0, 0] == pytest.approx(reference[0, 0])


def test_delong_is_undefined_without_both_classes():
    assert np.isnan(delong_test(np.ones(4, dtype=bool), np.arange(4.0), np.arange(4.0)).p_value)


def test_newcombe_intervals_of_many_tables_equal_each_tables_own():
    tables = np.array([[59, 6, 16, 80], [1, 1, 7, 12], [0, 0, 0, 11], [40, 5, 1, 40], [0, 0, 0, 0], [3, 0, 0, 0]])
    low, high = newcombe_paired_intervals(*tables.T)
    assert (round(low[0], 4), round(high[0], 4)) == (-0.1186, -0.0046)  # the worked example above, in a batch
    for row, table in enumerate(tables[:4]):
        assert (low[row], high[row]) == pytest.approx(newcombe_paired_interval(*table))
    assert np.isnan(low[4]) and np.isnan(high[4])
    assert (low[5], high[5]) == pytest.approx(newcombe_paired_interval(3, 0, 0, 0)) and low[5] < 0 < high[5]
