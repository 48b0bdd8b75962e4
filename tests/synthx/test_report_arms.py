"""Every number, plot point and label of the report comes from its own arm: a fake study whose arms
(baseline, sham, SynthX) have distinct values and distinct m, and its phantom-painter variant."""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fake_study  # noqa: E402
from fake_study import GROUPS, VAL_CHOSEN_M, WORST_PHASE, write_study  # noqa: E402


class _Tables(HTMLParser):
    """Each HTML table as (the heading before it, rows of cell texts)."""

    def __init__(self):
        super().__init__()
        self.tables, self.heading, self._text, self._cell, self._in_heading = [], "", [], None, False

    def handle_starttag(self, tag, attrs):
        if tag in ("h2", "h3"):
            self._in_heading, self._text = True, []
        elif tag == "table":
            self.tables.append((self.heading, []))
        elif tag == "tr":
            self.tables[-1][1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("h2", "h3"):
            self._in_heading, self.heading = False, "".join(self._text).strip()
        elif tag in ("td", "th") and self._cell is not None:
            self.tables[-1][1][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._in_heading:
            self._text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def tables_of(page: str) -> dict[str, list[dict[str, str]]]:
    """heading -> the rows (header -> cell) of the first table under it."""
    parser = _Tables()
    parser.feed(page)
    tables = {}
    for heading, rows in parser.tables:
        if rows and heading not in tables:
            tables[heading] = [dict(zip(rows[0], row)) for row in rows[1:]]
    return tables


@pytest.fixture
def figures(monkeypatch):
    """The figures the report embeds, captured as matplotlib figures (title -> figure)."""
    from synthx.workflows.report import figures as module

    captured = {}
    real = module.figure_html

    def capture(figure):
        captured[figure._suptitle.get_text() if figure._suptitle else f"figure {len(captured)}"] = figure
        return real(figure)

    monkeypatch.setattr(module, "figure_html", capture)
    return captured


def _points(axis) -> list[float]:
    """The x of every point an errorbar plot drew on ``axis``, top to bottom."""
    return [float(line.get_xdata()[0]) for line in axis.lines if line.get_marker() == "o"]


def _render(tmp_path, painter="synthx"):
    from synthx.workflows.report.html_page import render
    from synthx.workflows.report.runs import load_study

    uri, parent_id = write_study(tmp_path, painter)
    return render(load_study(parent_id, uri, tmp_path / "download")), uri, parent_id


def test_worst_group_per_attribute_comes_from_each_arm(tmp_path, figures):
    from synthx.workflows.report.runs import headline, headline_metrics, log_headline

    table = headline(fake_study.comparison_table())
    phase = table[(table["attribute"] == "phase") & (table["metric"] == "sensitivity")].iloc[0]
    for arm, (group, worst) in WORST_PHASE.items():
        assert (phase[f"{arm}_worst_group"], phase[arm]) == (group, pytest.approx(worst)), arm
    assert phase["delta"] == pytest.approx(WORST_PHASE["synthx"][1] - WORST_PHASE["baseline"][1])
    metrics = headline_metrics(table)
    assert metrics["baseline/test/sensitivity_worst/phase"] == pytest.approx(0.30)
    assert metrics["sham/test/sensitivity_worst/phase"] == pytest.approx(0.20)

    page, uri, parent_id = _render(tmp_path)
    rows = tables_of(page)["Worst group per attribute (test)"]
    sensitivity = next(r for r in rows if r["Metric"] == "Sensitivity")
    assert sensitivity["baseline: worst group"] == "non-contrast (30.0%)"
    assert sensitivity["sham: worst group"] == "arterial (20.0%)"
    assert sensitivity["SynthX: worst group"] == "delayed (45.0%)"
    # The parent run's metrics carry the same numbers.
    log_headline(MlflowClient(uri), parent_id, fake_study.comparison_table())
    logged = MlflowClient(uri).get_run(parent_id).data.metrics
    assert logged["baseline/test/sensitivity_worst/phase"] == pytest.approx(0.30)
    assert logged["synthx/test/sensitivity_worst/phase"] == pytest.approx(0.45)


def test_tables_and_forest_plots_take_each_arm_s_values(tmp_path, figures):
    page, _, _ = _render(tmp_path)
    found = {r["Subgroup"]: r for r in tables_of(page)["Tumors found per subgroup (test)"]}
    assert found["Phase: arterial"] == {"Subgroup": "Phase: arterial", "baseline": "9 of 20 (45.0%)",
                                         "sham": "4 of 20 (20.0%)", "SynthX": "15 of 20 (75.0%)"}
    for run, reference in fake_study.PAIRS:
        label = {"synthx": "SynthX"}.get(run, run), {"synthx": "SynthX"}.get(reference, reference)
        heading = f"{label[0]} against {label[1]} at the validation-chosen operating point"
        m = f"(m {VAL_CHOSEN_M[reference]:,.0f} and {VAL_CHOSEN_M[run]:,.0f} mm³)"
        rows = {r["Subgroup"]: r for r in tables_of(page)[f"{heading} {m}"]}
        a, b = fake_study.value(reference, "sensitivity", "arterial"), fake_study.value(run, "sensitivity", "arterial")
        assert rows["Phase: arterial"]["Sensitivity"].startswith(f"{100 * a:.1f} → {100 * b:.1f}: {100 * (b - a):+.1f}")
        title = next(t for t in figures if t.startswith(f"{label[0]} minus {label[1]} at the validation-chosen"))
        axis = figures[title].axes[0]  # sensitivity
        assert _points(axis) == pytest.approx([100 * (fake_study.value(run, "sensitivity", g)
                                                      - fake_study.value(reference, "sensitivity", g)) for _, g in GROUPS])


def test_the_baseline_plot_caption_and_table_share_one_operating_point(tmp_path, figures):
    page, _, _ = _render(tmp_path)
    title = next(t for t in figures if t.startswith("Baseline on test"))
    assert "the validation-chosen operating point, m = 2,249 mm³" in title
    sensitivity, specificity = figures[title].axes[:2]
    assert _points(sensitivity) == pytest.approx([100 * v for v in fake_study.SENSITIVITY["baseline"]])
    assert _points(specificity) == pytest.approx([100 * v for v in fake_study.SPECIFICITY["baseline"]])
    rows = {r["Subgroup"]: r for r in tables_of(page)["Baseline by subgroup (test)"]}
    assert rows["All scans"]["Sensitivity"].startswith("50.0 ") and rows["All scans"]["Specificity"].startswith("80.0 ")
    section = page.split("<h2>Baseline by subgroup (test)</h2>")[1].split("<h2>")[0]
    assert "m = 2,249 mm³" in section and "m = 50 " not in section


def test_the_leakage_audit_and_recipes_list_every_trained_arm(tmp_path, figures):
    page, _, _ = _render(tmp_path)
    rows = tables_of(page)["Leakage audit"]
    assert [r["arm"] for r in rows] == ["baseline", "sham", "SynthX"]
    recipes = page.split("<h2>Recipes</h2>")[1].split("<h2>")[0]
    assert all(f"<summary>{step}</summary>" in recipes for step in ("baseline", "sham", "augmented"))


def test_the_results_page_names_each_arm_s_own_m(tmp_path):
    from synthx.workflows.report.markdown_page import results_markdown
    from synthx.workflows.report.runs import load_study

    uri, parent_id = write_study(tmp_path)
    page = results_markdown(load_study(parent_id, uri, tmp_path / "download"))
    assert "(m = 2,249 mm³ for the baseline, 2,547 for sham, 1,800 for SynthX)" in page
    rows = _markdown_rows(page)
    arterial = rows["Phase: arterial"]
    assert (arterial["baseline"], arterial["sham"], arterial["SynthX"]) == ("45.0", "20.0", "75.0"), arterial


def _markdown_rows(page: str) -> dict[str, dict[str, str]]:
    lines = [line.strip("| ").split(" | ") for line in page.splitlines() if line.startswith("|")]
    return {row[0]: dict(zip(lines[0], row)) for row in lines[2:]}


def test_a_phantom_painted_study_names_its_arm_the_positive_control(tmp_path, figures):
    from synthx.workflows.report.markdown_page import results_markdown
    from synthx.workflows.report.runs import load_study, verdict_lines

    page, uri, parent_id = _render(tmp_path, painter="phantom")
    study = load_study(parent_id, uri, tmp_path / "download2")
    lines = verdict_lines(study)
    assert lines and all("SynthX" not in line for line in lines), lines
    assert any("phantom painter (positive control) found 15 of 20" in line for line in lines), lines
    assert re.search(r"phantom painter \(positive control\) - sham [+-]?\d", lines[-1]), lines[-1]
    after_intro = page.split("<h2>Baseline by subgroup")[1]
    assert "SynthX" not in after_intro.split("<h2>Training curves")[0]
    assert "phantom painter (positive control): worst group" in page
    assert any(t.startswith("phantom painter (positive control) minus sham") for t in figures)
    markdown = results_markdown(study)
    assert "1,800 for phantom painter (positive control)" in markdown
    arterial = _markdown_rows(markdown)["Phase: arterial"]
    assert arterial["phantom painter (positive control)"] == "75.0"
    assert "phantom painter (positive control) - sham [Newcombe 95% CI]" in arterial
    assert "SynthX" not in markdown.split("## Verdict")[1]


def test_the_copy_paste_arm_has_its_own_column_decomposition_and_realism(tmp_path, figures):
    """With the copy-paste arm every arm table gains a 'copy-paste' column holding that arm's own
    values, the forest plots and leakage list it, and the decomposition and realism sections show
    what the study logged."""
    from synthx.workflows.report.html_page import render
    from synthx.workflows.report.markdown_page import results_markdown
    from synthx.workflows.report.runs import load_study, verdict_lines

    uri, parent_id = write_study(tmp_path, copy_paste=True)
    study = load_study(parent_id, uri, tmp_path / "download")
    page = render(study)
    tables = tables_of(page)
    found = {r["Subgroup"]: r for r in tables["Tumors found per subgroup (test)"]}
    assert found["Phase: arterial"] == {"Subgroup": "Phase: arterial", "sham": "4 of 20 (20.0%)", "SynthX": "15 of 20 (75.0%)",
                                         "copy-paste": "8 of 20 (40.0%)", "baseline": "9 of 20 (45.0%)"}
    assert found["Phase: delayed"]["copy-paste"] == "13 of 20 (65.0%)"
    worst = next(r for r in tables["Worst group per attribute (test)"] if r["Metric"] == "Sensitivity")
    assert worst["copy-paste: worst group"] == "non-contrast (35.0%)"
    heading = "copy-paste against sham at the validation-chosen operating point (m 2,547 and 2,100 mm³)"
    assert tables[heading][2]["Sensitivity"].startswith("20.0 → 40.0: +20.0"), tables[heading][2]
    title = next(t for t in figures if t.startswith("copy-paste minus sham at the validation-chosen"))
    assert _points(figures[title].axes[0]) == pytest.approx(
        [100 * (fake_study.value("copy_paste", "sensitivity", g) - fake_study.value("sham", "sensitivity", g)) for _, g in GROUPS])
    assert [r["arm"] for r in tables["Leakage audit"]] == ["baseline", "sham", "SynthX", "copy-paste"]
    # The decomposition: per designed subgroup, placement, content and total, from the parent run's table.
    parts = [r for r in tables["Decomposition (test)"] if r["Subgroup"] == "Scarcity gap (arterial)"]
    assert [(r["Component"], r["Arm - reference"], r["Difference [95% CI]"]) for r in parts] == [
        ("placement: canvases and placement", "copy-paste - sham", "+20.0 [-5.0, +45.0]"),
        ("content: generated content", "SynthX - copy-paste", "+35.0 [+10.0, +55.0]"),
        ("total: both", "SynthX - sham", "+55.0 [+30.0, +75.0]")]
    assert parts[0]["Found (arm / reference of tumors)"] == "8 / 4 of 20"
    # The realism of SynthX's and the copy-pasted tumors, each against the real ones.
    synthx_rows = {r["Phase"]: r for r in tables["Real against SynthX"]}
    pasted_rows = {r["Phase"]: r for r in tables["Real against copy-paste"]}
    assert synthx_rows["arterial"]["Real vs SynthX AUC"].startswith("0.91 [0.81, 1.00]")
    assert pasted_rows["arterial"]["Real vs copy-paste AUC"].startswith("0.62 [0.52, 0.72]")
    assert pasted_rows["venous"]["Tumors real / copy-paste"] == "12 / 4"
    assert pasted_rows["venous"]["Edge gradient (HU/mm)"].startswith("3.0 / 4.5")
    # The verdict ends on the decomposition line of each designed subgroup, with its intervals.
    lines = verdict_lines(study)
    scarcity = next(line for line in lines if line.startswith("Scarcity gap (arterial), decomposed"))
    assert ("copy-paste - sham (canvases and placement) +20.0 percentage points, 95% CI -5.0 to +45.0; "
            "SynthX - copy-paste (generated content) +35.0 percentage points, 95% CI +10.0 to +55.0; "
            "together SynthX - sham +55.0") in scarcity
    assert lines[-1].startswith("Physics gap (")
    arterial = _markdown_rows(results_markdown(study))["Phase: arterial"]
    assert (arterial["sham"], arterial["SynthX"], arterial["copy-paste"]) == ("20.0", "75.0", "40.0")


def test_a_study_without_the_copy_paste_arm_says_the_decomposition_is_not_available(tmp_path, figures):
    page, _, _ = _render(tmp_path)
    section = page.split("<h2>Decomposition (test)</h2>")[1].split("<h2>")[0]
    assert "not available" in section and "synthx/decomposition.csv" in section
    assert "copy-paste" not in page.split("<h2>Decomposition (test)</h2>")[0]
