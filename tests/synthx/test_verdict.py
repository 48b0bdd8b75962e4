"""The verdict sentences: a closed, an open and an undetermined gap, named operating point, % throughout,
and the sentences read from a comparison table with or without a sham arm."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from synthx.analysis.endpoint import PrimaryEndpoint
from synthx.analysis.verdict import (
    CLOSED,
    OPEN,
    UNDETERMINED,
    ArmResult,
    Contrast,
    contrast_sentence,
    outcome,
    study_verdict,
)

ARMS = [ArmResult("baseline", 0.0, 0, 11), ArmResult("sham", 0 / 11, 0, 11)]


def test_a_closed_gap():
    contrast = Contrast("synthx", "sham", 5 / 11, 0.18, 0.73)
    sentence = contrast_sentence("Scarcity gap (arterial)", [*ARMS, ArmResult("synthx", 5 / 11, 5, 11)], contrast, "val_chosen")
    assert outcome(contrast) == CLOSED
    assert sentence == ("Scarcity gap (arterial), at the validation-chosen operating point: baseline found 0 of 11 (0%), "
                        "sham found 0 of 11 (0%), SynthX found 5 of 11 (45%) - closed "
                        "(SynthX - sham +45.5 percentage points, 95% CI +18.0 to +73.0).")


def test_an_open_gap_also_when_nothing_is_found():
    """0 of 11 in every arm: the difference is exactly 0 (Newcombe's interval -25.9 to +25.9 points): not closed."""
    contrast = Contrast("synthx", "sham", 0.0, -0.2588, 0.2588)
    sentence = contrast_sentence("Scarcity gap (arterial)", [*ARMS, ArmResult("synthx", 0.0, 0, 11)], contrast, "fixed")
    assert outcome(contrast) == OPEN
    assert sentence.startswith("Scarcity gap (arterial), at BenchX's fixed m: baseline found 0 of 11 (0%)")
    assert sentence.endswith("SynthX found 0 of 11 (0%) - not closed (SynthX - sham 0 percentage points, 95% CI -25.9 to +25.9).")
    worse = Contrast("synthx", "baseline", -0.3, -0.5, -0.1)
    assert outcome(worse) == OPEN
    assert outcome(Contrast("synthx", "sham", -1 / 11, -0.35, 0.2)) == OPEN, "fewer found is not closed"


def test_the_verdict_reads_newcombe_s_interval_where_the_bootstrap_collapses():
    """0 of 11 against 0 of 11: the bootstrap gives [0, 0]; the sentence shows Newcombe's interval."""
    from synthx.analysis.endpoint import shown_interval

    row = pd.Series({"delta": 0.0, "ci_low": 0.0, "ci_high": 0.0, "newcombe_low": -0.2588, "newcombe_high": 0.2588})
    assert shown_interval(row) == ("Newcombe", -0.2588, 0.2588)
    assert shown_interval(row.drop(["newcombe_low", "newcombe_high"])) == ("bootstrap", 0.0, 0.0)
    # AUC rows have none
    assert shown_interval(pd.Series({**row.to_dict(), "newcombe_low": float("nan")})) == ("bootstrap", 0.0, 0.0)


def test_an_undetermined_gap_spans_zero():
    contrast = Contrast("synthx", "baseline", 2 / 11, -0.091, 0.455)
    sentence = contrast_sentence("Physics gap (non-contrast)", [ArmResult("baseline", 1 / 11, 1, 11),
                                                               ArmResult("synthx", 3 / 11, 3, 11)],
                                 contrast, "matched_specificity")
    assert outcome(contrast) == UNDETERMINED
    assert "at matched specificity" in sentence and "baseline found 1 of 11 (9%), SynthX found 3 of 11 (27%)" in sentence
    assert sentence.endswith("- undetermined (SynthX - baseline +18.2 percentage points, 95% CI -9.1 to +45.5, the CI spans 0).")
    assert outcome(Contrast("synthx", "baseline", math.nan, math.nan, math.nan)) == UNDETERMINED
    assert "0." not in sentence.split("(")[1].split(")")[0], "values in %, not fractions"


def _comparison(runs: list[tuple[str, str]]) -> pd.DataFrame:
    """A comparison table in the compare step's shape: (run, reference) pairs at two operating points."""
    rows = []
    for run, reference in runs:
        for point in ("fixed", "val_chosen", "matched_specificity", "subgroup_matched_specificity"):
            for group, positives, a, b, low, high in (("arterial", 11, 0.0, 4 / 11 if run == "synthx" else 0.0, 0.09, 0.64),
                                                      ("non-contrast", 8, 0.25, 0.25, -0.25, 0.25),
                                                      ("venous", 40, 0.9, 0.85, -0.1, 0.0)):
                row = {"run": run, "operating_point": point, "threshold_a": 300.0, "threshold_b": 400.0,
                       "attribute": "phase", "group": group, "n": 30, "positives": positives, "negatives": 19,
                       "metric": "sensitivity", "a": a, "b": b, "delta": b - a,
                       "ci_low": low if run == "synthx" else 0.0, "ci_high": high if run == "synthx" else 0.0}
                if reference is not None:
                    row["reference"] = reference
                rows.append(row)
    return pd.DataFrame(rows)


def test_study_verdict_of_today_s_two_arm_comparison():
    lines = study_verdict(_comparison([("synthx", None)]))
    assert [line.split(",")[0] for line in lines] == ["Scarcity gap (arterial)", "Physics gap (non-contrast)",
                                                       "Primary endpoint (sensitivity in arterial)"]
    assert "baseline found 0 of 11 (0%), SynthX found 4 of 11 (36%) - closed (SynthX - baseline" in lines[0]
    assert "validation-chosen" in lines[0] and "at subgroup-matched specificity" in lines[2]
    assert "- not closed" in lines[1], "2 of 8 in both arms: nothing more found"


def test_study_verdict_judges_synthx_against_sham_when_the_table_pairs_them():
    table = _comparison([("sham", "baseline"), ("synthx", "baseline"), ("synthx", "sham")])
    lines = study_verdict(table, endpoint=PrimaryEndpoint(operating_point="val_chosen"))
    assert "baseline found 0 of 11 (0%), sham found 0 of 11 (0%), SynthX found 4 of 11 (36%)" in lines[0]
    assert "(SynthX - sham +36.4 percentage points" in lines[0]
    assert lines[-1].startswith("Primary endpoint (sensitivity in arterial), at the validation-chosen operating point")


def test_a_subgroup_the_table_lacks_gives_no_sentence():
    table = _comparison([("synthx", None)])
    lines = study_verdict(table[table["group"] != "non-contrast"])
    assert not any("Physics gap" in line for line in lines) and len(lines) == 2


@pytest.mark.parametrize("point", ["val_chosen", "fixed"])
def test_the_gap_sentences_use_the_point_asked_for(point):
    lines = study_verdict(_comparison([("synthx", None)]), point=point)
    assert ("validation-chosen" in lines[0]) == (point == "val_chosen")


def test_a_subgroup_without_tumor_scans_is_undetermined_and_says_why():
    table = _comparison([("synthx", None)])
    table.loc[table["group"] == "arterial", ["positives", "a", "b", "delta", "ci_low", "ci_high"]] = [0, *[math.nan] * 5]
    lines = study_verdict(table)
    assert lines[0] == "Scarcity gap (arterial): the test set has no tumor scan in arterial - undetermined."
    assert lines[-1] == "Primary endpoint (sensitivity in arterial): the test set has no tumor scan in arterial - undetermined."


def test_the_decomposition_sentence_of_each_designed_subgroup_names_both_parts_with_intervals():
    from synthx.analysis.verdict import decomposition_sentences

    rows = []
    for component, arm, reference, values in (("placement", "copy_paste", "sham", (-0.10, -0.30, 0.05)),
                                              ("content", "synthx", "copy_paste", (-0.05, -0.20, 0.12)),
                                              ("total", "synthx", "sham", (-0.15, -0.35, 0.02))):
        for group in ("arterial", "non-contrast"):
            shift = 0.0 if group == "arterial" else 0.5
            rows.append({"component": component, "arm": arm, "reference": reference, "attribute": "phase",
                         "group": group, "positives": 20, "difference": values[0] + shift,
                         "ci_low": values[1] + shift, "ci_high": values[2] + shift})
    lines = decomposition_sentences(pd.DataFrame(rows))
    assert len(lines) == 2
    assert lines[0] == ("Scarcity gap (arterial), decomposed on 20 tumor scan(s) at matched specificity: copy-paste - sham "
                        "(canvases and placement) -10.0 percentage points, 95% CI -30.0 to +5.0; SynthX - copy-paste "
                        "(generated content) -5.0 percentage points, 95% CI -20.0 to +12.0; together SynthX - sham -15.0.")
    assert lines[1].startswith("Physics gap (non-contrast), decomposed on 20") and "+40.0 percentage points, 95% CI +20.0 to +55.0" in lines[1]
    # The positive control's table: the ceiling alone; no table, no sentence.
    ceiling = pd.DataFrame(rows[:1]).assign(component="ceiling", arm="phantom")
    assert decomposition_sentences(ceiling) == [
        "Scarcity gap (arterial), decomposed on 20 tumor scan(s) at matched specificity: positive control - sham "
        "(real-appearance tumors at new sites) -10.0 percentage points, 95% CI -30.0 to +5.0."]
    empty = pd.DataFrame(rows[:1]).assign(positives=0, difference=float("nan"))
    assert decomposition_sentences(empty) == ["Scarcity gap (arterial): the test set has no tumor scan in arterial to decompose."]
    assert decomposition_sentences(None) == [] and decomposition_sentences(pd.DataFrame(rows[:0], columns=list(rows[0]))) == []
