"""Marks and intervals that say what decides: the marks follow the whole-family Holm, the verdict
follows the exact McNemar test (also where Newcombe's interval disagrees), a shown interval that
spans 0 is never marked, and the reader meets one named interval per quantity."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fake_study  # noqa: E402
from test_report_arms import tables_of  # noqa: E402

from lightning_modules.evaluation.small_counts import mcnemar_exact_p, newcombe_paired_interval  # noqa: E402
from synthx.analysis.endpoint import endpoint_summary, family_mark, label_results, PrimaryEndpoint  # noqa: E402

# The fake study's tables hold the overall matched point: the endpoint judged there (version 1).
ENDPOINT = PrimaryEndpoint.of_version(1)


def _row(table: pd.DataFrame, run: str, reference: str, point: str, group: str = "arterial",
         metric: str = "sensitivity") -> pd.Index:
    return table.index[(table["run"] == run) & (table["reference"] == reference) & (table["operating_point"] == point)
                       & (table["group"] == group) & (table["metric"] == metric)]


def disagreeing_family() -> pd.DataFrame:
    """Two rows where the per-attribute and the family Holm disagree.

    - SynthX - sham, arterial, validation-chosen point: p 0.01, significant after Holm over the
      phases (``significant_holm``), but not over the whole secondary family of 39 rows;
    - the primary endpoint (matched specificity): p 0.03, not significant after Holm over the
      phases, but its family is itself.
    """
    table = fake_study.comparison_table()
    secondary = _row(table, "synthx", "sham", "val_chosen")
    table.loc[secondary, ["p_value", "p_mcnemar", "significant", "p_holm", "significant_holm"]] = [0.01, 0.01, True, 0.04, True]
    primary = _row(table, "synthx", "sham", "matched_specificity")
    table.loc[primary, ["p_value", "p_mcnemar", "significant", "p_holm", "significant_holm"]] = [0.03, 0.03, True, 0.09, False]
    return table


def _section(page: str, title: str) -> str:
    return page.split(f"<h2>{title}</h2>")[1].split("<h2>")[0]


def test_marks_come_from_the_family_holm_not_the_per_attribute_one(tmp_path):
    from synthx.workflows.report.html_page import render
    from synthx.workflows.report.markdown_page import results_markdown
    from synthx.workflows.report.runs import load_study

    table = disagreeing_family()
    labelled = label_results(table, ENDPOINT)
    assert labelled.loc[_row(table, "synthx", "sham", "val_chosen"), "significant_family"].item() is False
    assert labelled.loc[_row(table, "synthx", "sham", "matched_specificity"), "significant_family"].item() is True

    uri, parent_id = fake_study.write_study(tmp_path, comparison=table)
    study = load_study(parent_id, uri, tmp_path / "download")
    page = render(study)
    tables = tables_of(_section(page, "Arms compared (BenchX table 6)").replace("<h3>", "<h3>"))
    at_chosen = {r["Subgroup"]: r for r in tables["SynthX against sham at the validation-chosen operating point (m 2,547 and 1,800 mm³)"]}
    matched = {r["Subgroup"]: r for r in tables["SynthX against sham at matched specificity (m 2,547 and 1,900 mm³)"]}
    assert at_chosen["Phase: arterial"]["Sensitivity"].endswith("] *"), at_chosen["Phase: arterial"]
    assert matched["Phase: arterial"]["Sensitivity"].endswith("] **"), matched["Phase: arterial"]
    assert not at_chosen["Phase: venous"]["Sensitivity"].endswith("*")
    # The results page carries the same mark.
    markdown = results_markdown(study)
    arterial = next(line for line in markdown.splitlines() if line.startswith("| Phase: arterial"))
    assert re.search(r"\+55\.0 \[\+43\.0, \+67\.0\] \* \|", arterial) and "**" not in arterial, arterial


def test_a_shown_interval_spanning_zero_is_never_marked():
    """+0.273 [-0.100, +0.411] with p 0.0027 (DeLong, AUC: no Newcombe interval) carries no mark."""
    from synthx.workflows.report.html_page import comparison_html

    table = fake_study.comparison_table()
    auc = table[table["metric"] == "sensitivity"].copy()
    auc["metric"], auc["test"], auc["newcombe_low"], auc["newcombe_high"] = "auc", "delong", float("nan"), float("nan")
    table = pd.concat([table, auc], ignore_index=True)
    rows = _row(table, "synthx", "sham", "val_chosen", metric="auc")
    table.loc[rows, ["delta", "ci_low", "ci_high", "p_value", "significant", "p_holm", "significant_holm"]] = \
        [0.273, -0.100, 0.411, 0.0027, True, 0.0027, True]
    table.loc[~table.index.isin(rows), "supported"] = False  # a family of one: Holm leaves p = 0.0027
    labelled = label_results(table, ENDPOINT)
    row = labelled.loc[rows].iloc[0]
    assert row["p_family"] == pytest.approx(0.0027) and not row["significant_family"]
    assert family_mark(row) == ""
    page = comparison_html(labelled)
    assert re.search(r"\+27\.3 \[-10\.0, \+41\.1\]</td>", page), "no mark after an interval through 0"
    summary = endpoint_summary(labelled, ENDPOINT)
    assert "+27.3 points" not in summary, "not listed among the significant secondary results"


def _verdict_table(only_synthx: int, only_sham: int, both: int = 14) -> pd.DataFrame:
    """The primary endpoint's subgroup (arterial, 18 tumors): both arms find ``both``, SynthX alone
    ``only_synthx``, sham alone ``only_sham``; exact McNemar p and Newcombe's interval from the counts."""
    table = fake_study.comparison_table()
    n = 18
    low, high = newcombe_paired_interval(both, only_synthx, only_sham, n - both - only_synthx - only_sham)
    rows = (table["group"] == "arterial") & (table["metric"] == "sensitivity")
    table.loc[rows, "positives"] = n
    primary = _row(table, "synthx", "sham", "matched_specificity")
    a, b = (both + only_sham) / n, (both + only_synthx) / n
    table.loc[primary, ["a", "b", "delta", "newcombe_low", "newcombe_high", "ci_low", "ci_high", "p_mcnemar", "p_value"]] = \
        [a, b, b - a, low, high, 0.05, 0.40, mcnemar_exact_p(only_synthx, only_sham), mcnemar_exact_p(only_synthx, only_sham)]
    return table


def test_the_exact_mcnemar_test_decides_where_newcombe_s_interval_disagrees():
    from synthx.analysis.verdict import study_verdict

    table = _verdict_table(only_synthx=4, only_sham=0)
    row = table.loc[_row(table, "synthx", "sham", "matched_specificity")].iloc[0]
    assert (round(100 * row["newcombe_low"], 1), round(100 * row["newcombe_high"], 1)) == (0.2, 45.2)
    assert row["p_value"] == pytest.approx(0.125)
    primary = study_verdict(table, endpoint=ENDPOINT)[-1]
    assert "sham found 14 of 18 (78%), SynthX found 18 of 18 (100%)" in primary and " - undetermined (" in primary, primary
    assert ("(SynthX - sham +22.2 percentage points, Newcombe 95% CI +0.2 to +45.2; the exact McNemar test "
            "decides, p = 0.125, not below 0.05).") in primary, primary
    # Twelve found by both, six by SynthX alone: p = 0.031, and the same rule closes it.
    closed = study_verdict(_verdict_table(only_synthx=6, only_sham=0, both=12), endpoint=ENDPOINT)[-1]
    assert "sham found 12 of 18 (67%), SynthX found 18 of 18 (100%)" in closed
    assert " - closed (" in closed and "the exact McNemar test decides, p = 0.0312)." in closed, closed


def test_the_reader_meets_one_named_interval_per_quantity(tmp_path):
    """The primary endpoint's interval is the same in the verdict and the printed summary; a gap's
    in the verdict and the results table. The summary says in words what its p decides."""
    from synthx.analysis.verdict import study_verdict
    from synthx.workflows.report.markdown_page import results_table

    table = _verdict_table(only_synthx=4, only_sham=0)
    labelled = label_results(table, ENDPOINT)
    verdict = study_verdict(labelled, endpoint=ENDPOINT)
    summary = endpoint_summary(labelled, ENDPOINT)
    assert "Newcombe 95% CI +0.2 to +45.2" in verdict[-1] and "Newcombe 95% CI +0.2 to +45.2" in summary
    assert "supported:" not in summary and "significant: True" not in summary
    assert "exact McNemar test p = 0.125: not significant at 5%" in summary, summary
    gap = verdict[0]  # the scarcity gap, at the validation-chosen point
    interval = re.search(r"SynthX - sham \+(\d+\.\d) percentage points, Newcombe 95% CI \+(\d+\.\d) to \+(\d+\.\d)", gap)
    row = results_table(labelled, "val_chosen").set_index("Subgroup").loc["Phase: arterial"]
    assert row["SynthX - sham [Newcombe 95% CI]"] == "+{} [+{}, +{}]".format(*interval.groups())
