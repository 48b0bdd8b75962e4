"""The pre-specified primary endpoint: one primary row, the secondary family Holm-adjusted as a whole."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from lightning_modules.evaluation.multiplicity import holm_adjust
from synthx.analysis.endpoint import PrimaryEndpoint, endpoint_summary, label_results


def _comparison() -> pd.DataFrame:
    rows = []
    p = iter([0.001, 0.004, 0.02, 0.03, 0.2, 0.5, 0.01, 0.04, 0.3, 0.6, 0.002, 0.9])
    for run in ("synthx", "baseline"):
        for point in ("val_chosen", "matched_specificity"):
            for attribute, group in (("phase", "arterial"), ("phase", "venous"), ("sex", "F")):
                value = next(p)
                rows.append({"run": run, "operating_point": point, "attribute": attribute, "group": group,
                             "metric": "sensitivity", "a": 0.1, "b": 0.5, "delta": 0.4, "ci_low": 0.1, "ci_high": 0.7,
                             "p_value": value, "supported": group != "F" or point == "val_chosen",
                             "significant": value < 0.05})
    return pd.DataFrame(rows)


def test_roles_and_one_holm_family_over_all_secondary_rows():
    endpoint = PrimaryEndpoint.of_version(1)  # the table holds the overall matched point only
    table = label_results(_comparison(), endpoint)
    primary = table[table["role"] == "primary"]
    assert len(primary) == 1
    assert primary.iloc[0][["run", "attribute", "group", "operating_point"]].tolist() == \
        ["synthx", "phase", "arterial", "matched_specificity"]
    assert primary.iloc[0]["p_family"] == primary.iloc[0]["p_value"]  # a family of one
    # Secondary: every other supported SynthX row, across attributes and operating points, in one family.
    secondary = table[table["role"] == "secondary"]
    tested = secondary["p_value"].where(secondary["supported"])
    np.testing.assert_allclose(secondary["p_family"].to_numpy(), holm_adjust(tested.to_numpy()))
    assert secondary["p_family"].notna().sum() == 4  # sex:F at matched specificity is not supported
    per_attribute = holm_adjust(secondary.loc[secondary["attribute"] == "phase", "p_value"].to_numpy())
    assert secondary.loc[secondary["attribute"] == "phase", "p_family"].min() > per_attribute.min()
    # Baseline minus sham is its own family.
    schedule = table[table["role"] == "schedule"]
    assert len(schedule) == 6 and set(schedule["run"]) == {"baseline"}
    np.testing.assert_allclose(schedule["p_family"].to_numpy(),
                               holm_adjust(schedule["p_value"].where(schedule["supported"]).to_numpy()))
    assert table.loc[table["p_family"] >= 0.05, "significant_family"].eq(False).all()
    text = endpoint_summary(table, endpoint)
    assert text.startswith("Primary endpoint (pre-specified): sensitivity in phase:arterial at matched specificity")
    assert "+40.0 points, bootstrap 95% CI +10.0 to +70.0" in text


def test_a_missing_endpoint_row_is_said_not_hidden():
    table = _comparison()
    table = table[table["group"] != "arterial"]
    assert "not in the comparison" in endpoint_summary(table, PrimaryEndpoint())
    assert "not in the comparison" in endpoint_summary(table, PrimaryEndpoint.of_version(1))
    with pytest.raises(TypeError):
        PrimaryEndpoint(unknown="x")  # the endpoint's fields are fixed


def test_the_logged_endpoint_reads_back_from_the_run_params():
    from synthx.analysis.endpoint import PrimaryEndpoint

    chosen = PrimaryEndpoint(group="non-contrast", operating_point="val_chosen")
    assert PrimaryEndpoint.from_params({**chosen.params(), "other": "x"}) == chosen
    assert PrimaryEndpoint.from_params({}) == PrimaryEndpoint()


def test_the_endpoint_names_the_test_set_it_is_read_on():
    """A study with the locked cohort reads its endpoint there; one run with --locked-cases 0 reads it
    on the split's test set, and its printed endpoint and pooled page say that, not 'locked'."""
    from synthx.workflows.study.settings import StudySettings

    locked = StudySettings()
    locked.check()
    assert "(volume score, locked test cohort)" in locked.endpoint.describe()
    split = StudySettings(locked_cases=0)
    split.check()
    assert split.endpoint.test_set == "split"
    assert "(volume score, split's test set)" in split.endpoint.describe() and "locked" not in split.endpoint.describe()
    assert PrimaryEndpoint.from_params(split.endpoint.params()).test_set_label() == "split's test set"


def test_copy_paste_rows_are_their_own_placement_family():
    """Copy-paste minus sham is neither SynthX's secondary family nor the schedule's: its own Holm family."""
    copy_paste = _comparison().query("run == 'baseline'").assign(run="copy_paste", p_value=[0.01, 0.02, 0.03, 0.5, 0.6, 0.7])
    table = label_results(pd.concat([_comparison(), copy_paste], ignore_index=True), PrimaryEndpoint())
    placement = table[table["role"] == "placement"]
    assert len(placement) == 6 and set(placement["run"]) == {"copy_paste"}
    np.testing.assert_allclose(placement["p_family"].to_numpy(),
                               holm_adjust(placement["p_value"].where(placement["supported"]).to_numpy()))
    assert set(table.loc[table["run"] == "baseline", "role"]) == {"schedule"}
    secondary = table[table["role"] == "secondary"]
    np.testing.assert_allclose(secondary["p_family"].to_numpy(),
                               holm_adjust(secondary["p_value"].where(secondary["supported"]).to_numpy()))
