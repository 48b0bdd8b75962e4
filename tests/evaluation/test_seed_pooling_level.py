"""The pooled seed interval (Student's t over the K per-seed differences) holds its 5% level on
simulated null studies over a grid of regimes, and it is what pool_seeds reports as the headline.

The grid: 18 and 40 tumors, per-seed spreads 0.2-0.5 (the standard deviation of the per-seed
paired sensitivity differences; 0.31 in the arterial row of docs/seeds.md), K = 5 seeds, 20,000
null studies per regime: the Monte-Carlo error of a 5% rate is 0.15 percentage points, so the
band [2.5%, 7.5%] is about 16 such errors either side. The table in docs/design.md is
``python -m lightning_modules.evaluation.pooling_level``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from lightning_modules.evaluation.pooling_level import (
    SPREADS,
    TUMORS,
    main,
    per_seed_differences,
    t_false_positive_rate,
    training_sd_for_spread,
)
from lightning_modules.evaluation.seed_pooling import format_pooled, pool_seeds, seed_t_interval

NULLS = 20_000


def test_the_t_interval_holds_its_level_over_the_grid_of_regimes():
    assert math.sqrt(0.05 * 0.95 / NULLS) < 0.0016
    rates = {}
    for tumors in TUMORS:
        for spread in SPREADS:
            training_sd = training_sd_for_spread(spread, tumors)
            per_seed = per_seed_differences(tumors, 5, training_sd, NULLS, seed=2026)
            assert per_seed.shape == (5, NULLS)
            reached = math.sqrt(per_seed.var(axis=0, ddof=1).mean())
            assert abs(reached - spread) < 0.02, (tumors, spread, reached)
            rates[tumors, spread] = t_false_positive_rate(per_seed)
    assert all(0.025 <= rate <= 0.075 for rate in rates.values()), rates


def test_the_t_interval_stays_below_its_level_where_sensitivities_crowd_at_one():
    # At a mean sensitivity of 0.75 a wide spread pushes seeds to find all or nothing: the t-interval
    # turns conservative there, never liberal.
    for spread in (0.3, 0.5):
        training_sd = training_sd_for_spread(spread, 18, sensitivity=0.75)
        rate = t_false_positive_rate(per_seed_differences(18, 5, training_sd, NULLS, seed=7, sensitivity=0.75))
        assert 0.01 <= rate <= 0.075, (spread, rate)


def test_seed_t_interval_is_the_one_sample_t_test_per_row():
    per_seed = np.array([[-0.778, 0.10, 0.2, 0.0, 0.1],
                         [-0.278, 0.10, np.nan, 0.0, np.nan],
                         [-0.056, 0.10, 0.4, 0.0, np.nan],
                         [-0.722, 0.10, -0.1, 0.0, np.nan],
                         [-0.389, 0.10, 0.3, 0.0, np.nan]])
    pooled = seed_t_interval(per_seed)
    for row in (0, 2):  # the arterial seeds of docs/seeds.md; a row with one seed undefined (3 degrees of freedom)
        values = per_seed[:, row][~np.isnan(per_seed[:, row])]
        test = scipy.stats.ttest_1samp(values, 0.0)
        interval = test.confidence_interval(0.95)
        assert (pooled["ci_low"][row], pooled["ci_high"][row]) == pytest.approx((interval.low, interval.high))
        assert pooled["p_value"][row] == pytest.approx(test.pvalue)
        assert pooled["seeds"][row] == len(values) and pooled["mean_delta"][row] == pytest.approx(values.mean())
    assert pooled["ci_high"][0] < 0  # the arterial row: every seed below 0, about -0.44
    # Seeds that all agree: no spread to judge by; [0, 0] with p = 1 at 0, nothing elsewhere.
    assert np.isnan([pooled["ci_low"][1], pooled["ci_high"][1], pooled["p_value"][1]]).all()
    assert pooled["mean_delta"][1] == pytest.approx(0.1)
    assert (pooled["ci_low"][3], pooled["ci_high"][3], pooled["p_value"][3]) == pytest.approx((0.0, 0.0, 1.0))
    # One seed: a mean, no interval.
    assert pooled["mean_delta"][4] == pytest.approx(0.1) and np.isnan(pooled["ci_low"][4]) and np.isnan(pooled["p_value"][4])


def test_pool_seeds_headline_is_the_t_interval_and_the_bootstrap_is_kept_beside_it():
    from test_seed_pooling import cohort, replicates  # the simulated replicates of the pooling tests

    rng = np.random.default_rng(17)
    runs = replicates(cohort(80, rng), 5, rng, training_sd=1.0)
    table = pool_seeds(runs, [("synthx", "sham")], n_resamples=300, attributes=("phase",))
    deltas = table[[f"delta {seed}" for seed in "01234"]].to_numpy().T
    pooled = seed_t_interval(deltas)
    for column in ("mean_delta", "ci_low", "ci_high", "p_value"):
        assert table[column].to_numpy() == pytest.approx(pooled[column], nan_ok=True), column
    excludes = (table["ci_low"] > 0) | (table["ci_high"] < 0)
    assert (table["significant"] == (excludes & table["supported"])).all()
    assert {"boot_ci_low", "boot_ci_high", "p_bootstrap", "defined_fraction"} <= set(table.columns)
    assert not np.allclose(table["boot_ci_low"].dropna(), table["ci_low"].dropna())
    assert set(table["interval"]) == {"t"}


def test_replicates_that_all_agree_fall_back_to_the_bootstrap_interval():
    from test_seed_pooling import cohort, replicates  # the simulated replicates of the pooling tests

    rng = np.random.default_rng(19)
    one = replicates(cohort(80, rng), 1, rng, training_sd=1.0)["0"]
    table = pool_seeds({"0": one, "1": one, "2": one}, [("synthx", "sham")], n_resamples=300, attributes=("phase",))
    moved = table["mean_delta"].notna() & (table["mean_delta"] != 0)
    assert moved.any()
    rows = table[moved]
    assert (rows["interval"] == "bootstrap").all()
    assert rows["ci_low"].to_numpy() == pytest.approx(rows["boot_ci_low"].to_numpy())
    assert rows["p_value"].to_numpy() == pytest.approx(rows["p_bootstrap"].to_numpy())
    assert (rows["ci_low"] < rows["ci_high"]).all()  # the patients' spread, not a point
    assert " b" in format_pooled(table)


def test_the_grid_entry_prints_its_table_and_refuses_bad_settings(capsys):
    assert main(["--nulls", "2000", "--bootstrap-nulls", "0"]) == 0
    out = capsys.readouterr().out
    assert "t_interval" in out and "spread_reached" in out and len(out.splitlines()) == 2 + len(TUMORS) * len(SPREADS)
    assert main(["--nulls", "10"]) == 2
    assert "--nulls >= 100" in capsys.readouterr().err
