"""The study report as one self-contained HTML page built from what a study's runs logged in MLflow.

It opens with the verdict (:mod:`synthx.analysis.verdict`), then: the baseline by subgroup (sensitivity,
specificity and AUC with CIs, the designed gaps marked), tumors found per subgroup and arm, the
BenchX table-6 comparison per arm and operating point, a forest plot per operating point
(significance marked, axis scaled to the data), ROC curves per phase and arm, the worst group per
attribute, the decomposition of SynthX's difference to sham with the copy-paste arm and the
realism of the painted tumors, the training curves of every run, the synthetic cohort (cells, real and synthetic
tumors side by side with their measured contrast, a quality summary), the leakage checks, the
recipes and the versions. Values are in %, groups carry labels (:mod:`synthx.analysis.labels`), and tables
fit a 1,280 px screen. Figures are embedded as base64 PNG, so the file opens anywhere (the MLflow
UI previews it among the parent run's artifacts). An item a study did not log is shown as "not
available", with the reason.

Example::

    benchx report --run-id <study parent run> --out outputs/study/report.html
"""

from __future__ import annotations

import html
import tempfile
from pathlib import Path
from typing import Callable

import pandas as pd

from synthx.analysis.labels import arm_label, attribute_label, group_label, metric_label, point_label
from synthx.painters import PHANTOM_PAINTER
from synthx.analysis.verdict import arm_results, ArmNamer, POSITIVE_CONTROL_LABEL
from synthx.workflows.report.figures import (
    baseline_subgroup_html,
    example_grid_html,
    forest_html,
    roc_html,
    training_curves_html,
)
from synthx.workflows.report.decomposition import decomposition_html, realism_html
from synthx.workflows.report.formatting import cell_mark, difference_cell, MARKS_NOTE, pct, subgroup_name, table_html
from synthx.workflows.report.runs import (
    baseline_subgroups,
    headline,
    load_study,
    logged_table,
    primary_point,
    study_arm_namer,
    study_arms,
    study_comparison,
    study_painter,
    study_quality,
    StudyRuns,
    verdict_lines,
)


REPORT_ARTIFACT = "report/study_report.html"
TABLE_METRICS = ("sensitivity", "specificity", "f1")


def comparison_html(comparison: pd.DataFrame, name_of: ArmNamer = arm_label) -> str:
    """Table 6, one table per compared arm and operating point: per subgroup its scans and, per
    metric, reference -> arm and the difference with its paired CI, in %; fits a 1,280 px screen."""
    keys = [k for k in ("run", "reference", "operating_point") if k in comparison.columns]
    metrics = [m for m in (*TABLE_METRICS, "auc") if m in set(comparison["metric"])]
    parts = []
    for key, table in comparison.groupby(keys, sort=False) if keys else [((), comparison)]:
        key = key if isinstance(key, tuple) else (key,)
        named = dict(zip(keys, key))
        rows = []
        for (attribute, group), part in table.groupby(["attribute", "group"], sort=False):
            first = part.iloc[0]
            row = {"Subgroup": subgroup_name(attribute, group), "Tumor / healthy": f"{int(first['positives'])} / {int(first['negatives'])}"}
            for metric in metrics:
                hit = part[part["metric"] == metric]
                if hit.empty:
                    continue
                r = hit.iloc[0]
                row[metric_label(metric)] = ("-" if pct(r["a"]) == pct(r["b"]) == "-" else
                                             f"{pct(r['a'])} → {pct(r['b'])}: {difference_cell(r)}")
            rows.append(row)
        reference = str(table["reference"].iloc[0]) if "reference" in table.columns else "baseline"
        title = f"{name_of(named.get('run', 'synthx'))} against {name_of(reference)}"
        if "operating_point" in named:
            title += f" at {point_label(named['operating_point'])}"
            if {"threshold_a", "threshold_b"} <= set(table.columns):
                title += f" (m {table['threshold_a'].iloc[0]:,.0f} and {table['threshold_b'].iloc[0]:,.0f} mm³)"
        parts.append(f"<h3>{html.escape(title)}</h3>" + table_html(pd.DataFrame(rows)))
    note = ("<p class='note'>In %: reference → arm: difference [95% CI: Newcombe's for sensitivity and "
            f"specificity, the paired bootstrap's for F1 and AUC]. {html.escape(MARKS_NOTE)}; - undefined. Every "
            "other interval (the bootstrap's beside Newcombe's, each arm's Wilson interval) is in the compare "
            "step's comparison/test_comparison.csv.</p>")
    return "".join(parts) + note


def found_html(comparison: pd.DataFrame, name_of: ArmNamer = arm_label) -> str:
    """Tumors found per subgroup and arm at the primary operating point."""
    comparison, point = primary_point(comparison)
    part = comparison[(comparison["metric"] == "sensitivity") & (comparison["positives"] > 0)]
    rows = []
    for (attribute, group), rows_ in part.groupby(["attribute", "group"], sort=False):
        row = {"Subgroup": subgroup_name(attribute, group)}
        for result in arm_results(rows_, "sensitivity"):
            row[name_of(result.arm)] = (f"{result.found} of {result.of} ({pct(result.value)}%)"
                                        if result.found is not None else "-")
        rows.append(row)

    return f"<p>At {html.escape(point_label(point))}.</p>" + table_html(pd.DataFrame(rows))


def synthetic_html(study: StudyRuns) -> str:
    """Cells requested and filled by the synthesis step, the cells left unfilled, and examples."""
    per_cell = study.csv("synthesize", "synthx/per_cell.csv")
    parts = ["<h3>Cells</h3>", table_html(_cells(per_cell))]
    filled = per_cell["generated"] + per_cell.get("skipped", 0)
    unfilled = per_cell[filled < per_cell["requested"]]
    note = ""
    try:
        targets = logged_table(study.artifact("synthesize", "synthx/targets.json"))
    except LookupError as missing_targets:
        # Explicit requests (not a targeting rule) log no targets table: only the painted cells are known.
        note = f"<p>requested cells without a painted case: not available ({missing_targets}).</p>"
    else:
        merged = targets.merge(per_cell, on=["sex", "age_band", "phase"], how="left", suffixes=("", "_made"))
        missing = merged[(merged["requested"] > 0) & merged["generated"].isna()]
        unfilled = pd.concat([unfilled, missing[["sex", "age_band", "phase", "requested"]]], ignore_index=True)
    parts.append("<h3>Unfillable cells</h3>")
    parts.append(note)
    parts.append(table_html(_cells(unfilled)) if len(unfilled) else "<p>none: every requested cell was filled.</p>")
    parts.append("<h3>Real and synthetic tumors per phase</h3>")
    parts.append(_section_body(lambda: example_grid_html(study)))
    parts.append("<h3>Quality summary</h3>")
    parts.append(_section_body(lambda: quality_html(study)))
    return "".join(parts)


def _cells(table: pd.DataFrame) -> pd.DataFrame:
    """A per-cell table with labels: sex and age band as people say them, capitalized headers."""
    table = table.copy()
    for column, attribute in (("sex", "sex"), ("age_band", "age")):
        if column in table.columns:
            table[column] = [group_label(attribute, value) for value in table[column]]
    return table.rename(columns={"age_band": "age"}).rename(columns=lambda c: str(c).capitalize())


def quality_html(study: StudyRuns) -> str:
    """The synthetic cohort's quality summary per phase: tumor contrast against the surrounding
    pancreas and HU inside the tumor, real against synthetic, and whether a phase classifier trained
    on real tumors recognises the phase each synthetic tumor was made for."""
    report = study_quality(study)
    intensity = report.intensity[report.intensity["attribute"].isin(["overall", "phase"])]
    faithful = report.faithfulness.set_index("phase") if len(report.faithfulness) else None

    def hu(value) -> str:
        return "-" if value != value else f"{value:+.0f}"

    rows = []
    for row in intensity.to_dict("records"):
        phase = str(row["group"])
        accuracy = faithful["accuracy"].get(phase, float("nan")) if faithful is not None else float("nan")
        rows.append({
            "Phase": "all phases" if row["attribute"] == "overall" else phase,
            "Tumors real / synthetic": f"{int(row['n_real'])} / {int(row['n_synthetic'])}",
            "Contrast to pancreas, real (HU)": hu(row["contrast_real"]),
            "Contrast, synthetic (HU)": hu(row["contrast_synthetic"]),
            "Tumor HU SD, real / synthetic": f"{hu(row['tumor_sd_real'])} / {hu(row['tumor_sd_synthetic'])}".replace("+", ""),
            "Phase recognised (%)": pct(accuracy),
        })
    return ("<p>Measured in the volumes (synthx/analysis/quality.py): contrast is the tumor's mean HU minus that of a "
            "5 mm rim of pancreas around it; real tumors are the training split's.</p>" + table_html(pd.DataFrame(rows)))


def leakage_html(study: StudyRuns) -> str:
    """The leakage checks: an audit step's report if the study ran one, else the training runs' checks."""
    if "audit" in study.steps:
        run_id = study.steps["audit"]
        files = [a.path for a in study.client.list_artifacts(run_id, "audit")]
        text = [p for p in files if p.endswith((".md", ".txt"))]
        if text:
            return f"<pre>{html.escape(study.artifact('audit', text[0]).read_text())}</pre>"
    rows = []
    name_of = study_arm_namer(study)
    for step, arm in study_arms(study):
        run = study.run(step)
        overridden = run.data.tags.get("leakage_override") == "true"
        rows.append({"arm": name_of(arm), "training run": step, "run id": run.info.run_id,
                     "leakage check": "OVERRIDDEN (data.allow_leakage=true): see leakage_override.txt" if overridden
                     else "passed (no patient overlap or duplicate across splits)"})
    if not rows:
        raise LookupError("no audit step and no training runs")
    return ("<p>Before each training, the split was checked for patients in two splits and duplicate scans; "
            "training refuses a leaking split unless overridden.</p>" + table_html(pd.DataFrame(rows)))


def recipes_html(study: StudyRuns) -> str:
    parts = []
    steps = [step for step, _ in study_arms(study)] + [s for s in ("synthx_train",) if s in study.steps]
    for step in steps:
        text = _section_body(lambda step=step: f"<pre>{html.escape(study.artifact(step, 'recipe.yaml').read_text())}</pre>")
        parts.append(f"<details><summary>{step}</summary>{text}</details>")
    return "".join(parts)


def versions_html(study: StudyRuns) -> str:
    from importlib.metadata import PackageNotFoundError, version

    rows = [{"what": "study git commit", "value": study.parent.data.tags.get("git_commit", "not recorded")}]
    for step, run_id in study.steps.items():
        commit = study.run(step).data.tags.get("git_commit")
        if commit and commit != rows[0]["value"]:
            rows.append({"what": f"{step} git commit", "value": commit})
    for package in ("torch", "lightning", "monai", "diffusers", "mlflow", "benchx-synthx"):
        try:
            installed = version(package)
        except PackageNotFoundError:
            installed = "not installed"
        rows.append({"what": f"{package} (report built with)", "value": installed})
    return table_html(pd.DataFrame(rows))


def _section_body(build: Callable[[], str]) -> str:
    try:
        return build()
    except (LookupError, FileNotFoundError, KeyError, ValueError) as error:
        return f"<p class='missing'>not available: {html.escape(str(error))}</p>"


STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.2em auto; max-width: 1180px; padding: 0 12px; color: #222; }
table.data { border-collapse: collapse; font-size: 12px; margin: 0.5em 0; max-width: 100%; }
table.data th, table.data td { padding: 2px 6px; border-bottom: 1px solid #ddd; text-align: right; }
table.data td:first-child, table.data th:first-child { text-align: left; }
table.data th { background: #f3f3f3; }
.scroll { overflow-x: auto; max-width: 100%; }
ul.verdict { font-size: 15px; line-height: 1.45; background: #fdf6e3; border-left: 4px solid #c0392b; padding: 0.6em 1.6em; }
.missing { color: #a33; font-style: italic; }
.note { color: #555; font-size: 12px; }
img { max-width: 100%; }
pre { background: #f7f7f7; padding: 1em; font-size: 12px; overflow-x: auto; }
"""


def report_sections(study: StudyRuns) -> list[tuple[str, Callable[[], str]]]:
    """(title, builder) of every section; a builder raises LookupError when its item is absent."""
    comparison = lambda: study_comparison(study)  # noqa: E731

    name_of = study_arm_namer(study)

    def baseline_table() -> str:
        table, point, threshold = baseline_subgroups(study)
        caption = f"at {point_label(point)}" + (f", m = {threshold:,.0f} mm³" if threshold is not None else "")
        head = f"<p>{html.escape(caption[0].upper() + caption[1:])} (docs/explanation/detection-and-statistics.md \"Scan-level detection\"). In %.</p>"
        rows = []
        for row in table.to_dict("records"):
            out = {"Subgroup": subgroup_name(row["attribute"], row["group"]),
                   "Tumor / healthy": f"{int(row['positives'])} / {int(row['negatives'])}"}
            for metric in ("sensitivity", "specificity", "auc", "f1"):
                if metric in row:
                    interval = (f" [{pct(row[f'{metric}_ci_low'])}, {pct(row[f'{metric}_ci_high'])}]"
                                if f"{metric}_ci_low" in row else "")
                    out[metric_label(metric)] = pct(row[metric]) + interval
            rows.append(out)
        return head + baseline_subgroup_html(table, caption) + table_html(pd.DataFrame(rows))

    def worst_groups() -> str:
        table = headline(comparison())
        arms = [c[:-len("_worst_group")] for c in table.columns if c.endswith("_worst_group")]
        columns = {"Attribute": [attribute_label(a) for a in table["attribute"]],
                   "Metric": [metric_label(m) for m in table["metric"]]}
        for arm in arms:
            columns[f"{name_of(arm)}: worst group"] = [f"{group_label(a, g)} ({pct(v)}%)" for a, g, v in
                                                       zip(table["attribute"], table[f"{arm}_worst_group"], table[arm])]
        columns[f"{name_of('synthx')} - {name_of('baseline')} (points)"] = [pct(d, True) for d in table["delta"]]
        return table_html(pd.DataFrame(columns))

    return [
        ("Baseline by subgroup (test)", baseline_table),
        ("Tumors found per subgroup (test)", lambda: found_html(comparison(), name_of)),
        ("Arms compared (BenchX table 6)", lambda: comparison_html(comparison(), name_of)),
        ("Forest plots per operating point", lambda: forest_html(comparison(), name_of)),
        ("ROC curves per phase and arm (test)", lambda: roc_html(study)),
        ("Worst group per attribute (test)", worst_groups),
        ("Decomposition (test)", lambda: decomposition_html(study, name_of)),
        ("Realism of the painted tumors", lambda: realism_html(study)),
        ("Training curves", lambda: training_curves_html(study)),
        ("Synthetic cohort", lambda: synthetic_html(study)),
        ("Leakage audit", lambda: leakage_html(study)),
        ("Recipes", lambda: recipes_html(study)),
        ("Versions", lambda: versions_html(study)),
    ]


def verdict_html(study: StudyRuns) -> str:
    items = "".join(f"<li>{html.escape(line)}</li>" for line in verdict_lines(study))
    return (f"<ul class='verdict'>{items}</ul><p class='note'>One rule decides, the test named in each sentence "
            "(the exact McNemar test for sensitivity): closed, more found and the test rejects at 5% with the interval "
            "above 0; not closed, no more found; undetermined, more found but the test does not reject. The interval "
            "(Newcombe's for sensitivity) shows the difference's precision (docs/explanation/detection-and-statistics.md \"Reading the verdict\").</p>")


def render(study: StudyRuns) -> str:
    parent = study.parent
    name = parent.info.run_name or parent.info.run_id
    experiment = study.client.get_experiment(parent.info.experiment_id).name
    body = [f"<h1>Study report: {html.escape(name)}</h1>",
            f"<section id='verdict'><h2>Verdict (test)</h2>{_section_body(lambda: verdict_html(study))}</section>",
            f"<p>Experiment <b>{html.escape(experiment)}</b>, parent run <code>{parent.info.run_id}</code>, "
            f"commit <code>{html.escape(parent.data.tags.get('git_commit', 'not recorded'))}</code>. "
            f"Steps: {', '.join(html.escape(s) for s in study.steps)}.</p>"]
    if study_painter(study) == PHANTOM_PAINTER:
        body.append("<p><b>Positive control:</b> the synthetic tumors were painted by the phantom's own renderer "
                    f"(<code>--painter phantom</code>), not by SynthX: the '{html.escape(POSITIVE_CONTROL_LABEL)}' columns below "
                    "are the model trained with them, and show what the study detects when the added tumors are as "
                    "real as the phantom's.</p>")
    for title, build in report_sections(study):
        body.append(f"<h2>{html.escape(title)}</h2>{_section_body(build)}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(name)} report</title>"
            f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>")


def build_report(run_id: str, uri: str, out: str | Path | None = None, log: bool = True) -> Path:
    """Write the study report of a parent run to ``out`` (default ``study_report_<run>.html``) and
    log it to that run as ``report/study_report.html``. Returns the written file."""
    out = Path(out) if out else Path(f"study_report_{run_id[:8]}.html")
    with tempfile.TemporaryDirectory() as folder:
        study = load_study(run_id, uri, Path(folder))
        text = render(study)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    if log:
        study.client.log_text(run_id, text, REPORT_ARTIFACT)
    return out
