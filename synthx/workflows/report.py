"""The study report: one self-contained HTML page built from what a study's runs logged in MLflow.

It opens with the verdict (:mod:`synthx.verdict`), then: the baseline by subgroup (sensitivity,
specificity and AUC with CIs, the designed gaps marked), tumors found per subgroup and arm, the
BenchX table-6 comparison per arm and operating point, a forest plot per operating point
(significance marked, axis scaled to the data), ROC curves per phase and arm, the worst group per
attribute, the training curves of every run, the synthetic cohort (cells, real and synthetic
tumors side by side with their measured contrast, a quality summary), the leakage checks, the
recipes and the versions. Values are in %, groups carry labels (:mod:`synthx.labels`), and tables
fit a 1,280 px screen. Figures are embedded as base64 PNG, so the file opens anywhere (the MLflow
UI previews it among the parent run's artifacts). An item a study did not log is shown as "not
available", with the reason. :func:`results_markdown` writes the short results page
(docs/results.md) from the same run.

:func:`publish_study` is what the study calls when it finishes: headline metrics on the parent run
(so the experiment table sorts studies by them), the verdict as its description, registry aliases
scoped by experiment with a description on each version, and the report.

Example::

    benchx report --run-id <study parent run> --out outputs/study/report.html
    benchx report --run-id <study parent run> --markdown docs/results.md
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

from lightning_modules.data.metadata import PHASES
from lightning_modules.evaluation.artifacts import download_records
from lightning_modules.evaluation.subgroups import gaps
from lightning_modules.monitoring import format_duration
from lightning_modules.tracking.pyfunc import set_aliases
from lightning_modules.workflows.evaluate import percent, significance_mark
from synthx.endpoint import PrimaryEndpoint
from synthx.labels import arm_label, attribute_label, group_label, metric_label, point_label
from synthx.painters import PHANTOM_PAINTER
from synthx.quality import DISPLAY_WINDOW, quality_report, QualityError
from synthx.verdict import arm_results, available_point, comparison_arms, designed_gap_subgroups, study_verdict


REPORT_ARTIFACT = "report/study_report.html"
COMPARISON_ARTIFACT = "comparison/test_comparison.csv"
NOTE_TAG = "mlflow.note.content"
HEADLINE_METRICS = ("sensitivity", "f1")
TABLE_METRICS = ("sensitivity", "specificity", "f1")
STEP_TAG_PREFIX = "step."


class ReportError(ValueError):
    """A run that is not a study's parent run (no ``step.*`` tags naming its child runs)."""


@dataclass
class StudyRuns:
    """The study's parent run and its child runs by step name, read from MLflow."""

    client: MlflowClient
    parent: object
    steps: dict[str, str]
    folder: Path
    _cache: dict = field(default_factory=dict)

    def run(self, step: str):
        if step not in self.steps:
            raise LookupError(f"the study has no '{step}' step")
        if step not in self._cache:
            self._cache[step] = self.client.get_run(self.steps[step])
        return self._cache[step]

    def artifact(self, step: str, path: str) -> Path:
        """Download one artifact of a step's run (LookupError naming it when absent)."""
        run_id = self.run(step).info.run_id
        try:
            return Path(self.client.download_artifacts(run_id, path, str(self.folder / run_id)))
        except Exception as error:  # MLflow raises several types for a missing artifact
            raise LookupError(f"run {run_id} ({step}) has no artifact {path}") from error

    def csv(self, step: str, path: str) -> pd.DataFrame:
        return pd.read_csv(self.artifact(step, path), keep_default_na=False, na_values=[""])


def load_study(run_id: str, uri: str, folder: Path) -> StudyRuns:
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(run_id)
    steps = {k[len(STEP_TAG_PREFIX):]: v for k, v in parent.data.tags.items() if k.startswith(STEP_TAG_PREFIX)}
    if not steps:
        raise ReportError(f"run {run_id} names no study steps (tags step.*): pass the study's parent run id")
    return StudyRuns(client, parent, steps, Path(folder))


# ------------------------------------------------------------------------------------------------
# Numbers


PRIMARY_POINT = "val_chosen"


def primary_point(comparison: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows of one operating point: the validation-chosen one when compared, else the first
    (the headline and the forest plots use it; the table shows every point)."""
    if "operating_point" not in comparison.columns:
        return comparison, ""
    points = list(dict.fromkeys(comparison["operating_point"]))
    point = PRIMARY_POINT if PRIMARY_POINT in points else points[0]
    return comparison[comparison["operating_point"] == point], str(point)


def headline(comparison: pd.DataFrame) -> pd.DataFrame:
    """Per attribute and metric: the worst group's value for baseline and SynthX and their difference
    (at the primary operating point, :func:`primary_point`)."""
    comparison, _ = primary_point(comparison)
    rows = []
    columns = ["attribute", "group", "positives", "negatives"]
    for metric in HEADLINE_METRICS:
        part = comparison[comparison["metric"] == metric]
        baseline = gaps(part.rename(columns={"a": metric})[[*columns, metric]], metric)
        synthx = gaps(part.rename(columns={"b": metric})[[*columns, metric]], metric)
        for a, b in zip(baseline.itertuples(index=False), synthx.itertuples(index=False)):
            rows.append({"attribute": a.attribute, "metric": metric, "baseline_worst_group": a.worst_group,
                         "baseline": a.worst, "synthx_worst_group": b.worst_group, "synthx": b.worst,
                         "delta": b.worst - a.worst})
    return pd.DataFrame(rows)


def headline_metrics(table: pd.DataFrame, stage: str = "test") -> dict[str, float]:
    """MLflow keys of the headline: ``<variant>/<stage>/<metric>_worst/<attribute>``, variant baseline,
    synthx or delta (docs/design.md "MLflow runs and keys")."""
    metrics = {}
    for row in table.itertuples(index=False):
        for variant in ("baseline", "synthx", "delta"):
            value = float(getattr(row, variant))
            if not math.isnan(value):
                metrics[f"{variant}/{stage}/{row.metric}_worst/{row.attribute}"] = value
    return metrics


def log_headline(client: MlflowClient, parent_id: str, comparison: pd.DataFrame) -> dict[str, float]:
    metrics = headline_metrics(headline(comparison))
    for key, value in metrics.items():
        client.log_metric(parent_id, key, value)
    return metrics


# ------------------------------------------------------------------------------------------------
# HTML pieces


def _figure_html(figure) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(figure)
    return f'<img alt="figure" src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}">'


def _pct(value, sign: bool = False) -> str:
    """A fraction as % with one decimal, as the comparison tables print it."""
    return percent(value, sign)


def _table_html(frame: pd.DataFrame) -> str:
    return f"<div class='scroll'>{frame.to_html(index=False, escape=True, na_rep='-', border=0, classes='data')}</div>"


def _subgroup_name(attribute, group) -> str:
    return "All scans" if str(attribute) == "overall" else f"{attribute_label(attribute)}: {group_label(attribute, group)}"


def _mark(row) -> str:
    try:
        return significance_mark(row).strip()
    except (KeyError, TypeError, ValueError):
        return ""


def comparison_html(comparison: pd.DataFrame) -> str:
    """Table 6, one table per compared arm and operating point: per subgroup its scans and, per
    metric, reference -> arm and the difference with its paired CI, in %; fits a 1,280 px screen."""
    keys = [k for k in ("run", "operating_point") if k in comparison.columns]
    metrics = [m for m in (*TABLE_METRICS, "auc") if m in set(comparison["metric"])]
    parts = []
    for key, table in comparison.groupby(keys, sort=False) if keys else [((), comparison)]:
        key = key if isinstance(key, tuple) else (key,)
        named = dict(zip(keys, key))
        rows = []
        for (attribute, group), part in table.groupby(["attribute", "group"], sort=False):
            first = part.iloc[0]
            row = {"Subgroup": _subgroup_name(attribute, group), "Tumor / healthy": f"{int(first['positives'])} / {int(first['negatives'])}"}
            for metric in metrics:
                hit = part[part["metric"] == metric]
                if hit.empty:
                    continue
                r = hit.iloc[0]
                row[metric_label(metric)] = ("-" if _pct(r["a"]) == _pct(r["b"]) == "-" else
                                             f"{_pct(r['a'])} → {_pct(r['b'])}: {_pct(r['delta'], True)} "
                                             f"[{_pct(r['ci_low'], True)}, {_pct(r['ci_high'], True)}] {_mark(r)}")
            rows.append(row)
        reference = str(table["reference"].iloc[0]) if "reference" in table.columns else "baseline"
        title = f"{arm_label(named.get('run', 'SynthX'))} against {arm_label(reference)}"
        if "operating_point" in named:
            title += f" at {point_label(named['operating_point'])}"
            if {"threshold_a", "threshold_b"} <= set(table.columns):
                title += f" (m {table['threshold_a'].iloc[0]:,.0f} and {table['threshold_b'].iloc[0]:,.0f} mm³)"
        parts.append(f"<h3>{html.escape(title)}</h3>" + _table_html(pd.DataFrame(rows)))
    note = ("<p class='note'>In %: reference → arm: difference [paired 95% bootstrap CI]. * significant: the CI "
            "excludes 0 and the subgroup is large enough; ** also after Holm's correction; ~ the CI excludes 0 "
            "but the subgroup is below the support rule; - undefined.</p>")
    return "".join(parts) + note


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def forest_html(comparison: pd.DataFrame) -> str:
    """One forest plot per operating point (and compared arm): the paired difference with its CI per
    subgroup and metric; significant differences filled and marked, the axis scaled to the data."""
    plt = _pyplot()
    keys = [k for k in ("run", "operating_point") if k in comparison.columns]
    metrics = [m for m in (*HEADLINE_METRICS, "specificity", "auc") if m in set(comparison["metric"])]
    parts = []
    for key, table in comparison.groupby(keys, sort=False) if keys else [((), comparison)]:
        key = key if isinstance(key, tuple) else (key,)
        named = dict(zip(keys, key))
        subgroups = list(dict.fromkeys(zip(table["attribute"], table["group"])))
        figure, axes = plt.subplots(1, len(metrics), figsize=(2.9 * len(metrics) + 1.5, 0.26 * len(subgroups) + 1.3),
                                    sharey=True, squeeze=False)
        for axis, metric in zip(axes[0], metrics):
            rows = table[table["metric"] == metric].set_index(["attribute", "group"]).reindex(subgroups)
            delta, low, high = (100 * rows[c].astype(float) for c in ("delta", "ci_low", "ci_high"))
            marks = [_mark(r) if r.notna().any() else "" for _, r in rows.reset_index().iterrows()]
            y = np.arange(len(subgroups))
            for i, mark in enumerate(marks):
                if np.isnan(delta.iloc[i]):
                    continue
                significant = mark in ("*", "**")
                axis.errorbar(delta.iloc[i], y[i], xerr=[[max(delta.iloc[i] - low.iloc[i], 0)], [max(high.iloc[i] - delta.iloc[i], 0)]],
                              fmt="o", capsize=2, color="#c0392b" if significant else "#34495e",
                              markerfacecolor="#c0392b" if significant else "white", markersize=4)
                if mark:
                    axis.annotate(mark, (high.iloc[i], y[i]), xytext=(3, -3), textcoords="offset points", fontsize=8)
            finite = pd.concat([low, high]).replace([np.inf, -np.inf], np.nan).dropna()
            lo, hi = (min(finite.min(), 0.0), max(finite.max(), 0.0)) if len(finite) else (-1.0, 1.0)
            pad = max((hi - lo) * 0.12, 1.0)
            axis.set_xlim(lo - pad, hi + pad)
            axis.axvline(0.0, color="black", linewidth=0.8)
            axis.set_xlabel(f"{metric_label(metric)}: difference (points)", fontsize=8)
            axis.grid(axis="x", alpha=0.3)
            axis.tick_params(labelsize=7)
        axes[0][0].set_yticks(range(len(subgroups)))
        axes[0][0].set_yticklabels([_subgroup_name(a, g) for a, g in subgroups], fontsize=7)
        axes[0][0].invert_yaxis()
        reference = str(table["reference"].iloc[0]) if "reference" in table.columns else "baseline"
        title = f"{arm_label(named.get('run', 'synthx'))} minus {arm_label(reference)}"
        if "operating_point" in named:
            title += f" at {point_label(named['operating_point'])}"
        figure.suptitle(title + " (paired 95% CI; filled red: significant)", fontsize=9)
        parts.append(f"<h3>{html.escape(title)}</h3>{_figure_html(figure)}")
    return "".join(parts)


def baseline_subgroup_html(study: StudyRuns) -> str:
    """The baseline's sensitivity, specificity and AUC per subgroup with CIs (test, validation-chosen
    point), the designed gaps marked."""
    table = None
    for path in ("evaluation/test_val_chosen_subgroups.csv", "evaluation/test_subgroups.csv"):
        try:
            table = study.csv("evaluate_baseline", path)
            break
        except LookupError:
            continue
    if table is None:
        raise LookupError("the baseline evaluation logged no test subgroup table")
    plt = _pyplot()
    designed = {(a, g): label.split(" (")[0] for label, a, g in designed_gap_subgroups()}
    subgroups = list(zip(table["attribute"].astype(str), table["group"].astype(str)))
    metrics = [m for m in ("sensitivity", "specificity", "auc") if m in table.columns]
    figure, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics) + 1.6, 0.26 * len(subgroups) + 1.3), sharey=True, squeeze=False)
    y = np.arange(len(subgroups))
    for axis, metric in zip(axes[0], metrics):
        value = 100 * table[metric].astype(float)
        low = 100 * table.get(f"{metric}_ci_low", table[metric]).astype(float)
        high = 100 * table.get(f"{metric}_ci_high", table[metric]).astype(float)
        colors = ["#c0392b" if key in designed else "#34495e" for key in subgroups]
        for i in range(len(subgroups)):
            if not np.isnan(value.iloc[i]):
                axis.errorbar(value.iloc[i], y[i], xerr=[[max(value.iloc[i] - low.iloc[i], 0)], [max(high.iloc[i] - value.iloc[i], 0)]],
                              fmt="o", capsize=2, color=colors[i], markersize=4)
        axis.set_xlim(-3, 103)
        axis.set_xlabel(f"{metric_label(metric)} (%)", fontsize=8)
        axis.grid(axis="x", alpha=0.3)
        axis.tick_params(labelsize=7)
    labels = [_subgroup_name(a, g) + (f"  ◀ {designed[(a, g)]}" if (a, g) in designed else "") for a, g in subgroups]
    axes[0][0].set_yticks(y)
    axes[0][0].set_yticklabels(labels, fontsize=7)
    for tick, key in zip(axes[0][0].get_yticklabels(), subgroups):
        if key in designed:
            tick.set_color("#c0392b")
    axes[0][0].invert_yaxis()
    figure.suptitle("Baseline on test, 95% CIs; designed gaps in red", fontsize=9)
    return _figure_html(figure)


def found_html(comparison: pd.DataFrame) -> str:
    """Tumors found per subgroup and arm at the primary operating point."""
    comparison, point = primary_point(comparison)
    part = comparison[(comparison["metric"] == "sensitivity") & (comparison["positives"] > 0)]
    rows = []
    for (attribute, group), rows_ in part.groupby(["attribute", "group"], sort=False):
        row = {"Subgroup": _subgroup_name(attribute, group)}
        for result in arm_results(rows_, "sensitivity"):
            row[arm_label(result.arm)] = (f"{result.found} of {result.of} ({_pct(result.value)}%)"
                                          if result.found is not None else "-")
        rows.append(row)

    return f"<p>At {html.escape(point_label(point))}.</p>" + _table_html(pd.DataFrame(rows))


def roc_html(study: StudyRuns) -> str:
    """ROC curves on test per phase, one curve per evaluated arm (scan score: predicted tumor volume)."""
    from sklearn.metrics import roc_auc_score, roc_curve


    arms = {}
    for step in study.steps:
        if step.startswith("evaluate_"):
            records = download_records(study.client, study.steps[step], "test", study.folder / step)
            if records is not None:
                arms[study.run(step).data.tags.get("variant", step[len("evaluate_"):])] = records
    if not arms:
        raise LookupError("no evaluation run logged test records")
    plt = _pyplot()
    phases = [p for p in ("non-contrast", "arterial", "venous", "delayed")
              if any((r["phase"].astype(str) == p).any() for r in arms.values())]
    figure, axes = plt.subplots(1, len(phases) + 1, figsize=(2.7 * (len(phases) + 1), 2.9), squeeze=False)
    for axis, phase in zip(axes[0], ["all", *phases]):
        for arm, records in arms.items():
            part = records if phase == "all" else records[records["phase"].astype(str) == phase]
            labels = part["label"].astype(int).to_numpy()
            score = part["volume_mm3"].astype(float).to_numpy() if "volume_mm3" in part else part["max_prob"].astype(float).to_numpy()
            if len(np.unique(labels)) < 2:
                continue
            fpr, tpr, _ = roc_curve(labels, score)
            axis.plot(100 * fpr, 100 * tpr, label=f"{arm_label(arm)} AUC {100 * roc_auc_score(labels, score):.0f}%")
        axis.plot([0, 100], [0, 100], color="grey", linewidth=0.6, linestyle=":")
        axis.set_title("all phases" if phase == "all" else phase, fontsize=9)
        axis.set_xlabel("1 - specificity (%)", fontsize=8)
        axis.tick_params(labelsize=7)
        if axis.lines[:-1]:
            axis.legend(fontsize=6, loc="lower right")
    axes[0][0].set_ylabel("sensitivity (%)", fontsize=8)
    return _figure_html(figure)


def training_curves_html(study: StudyRuns) -> str:
    """train/loss of every training run of the study (arms and generator), from MLflow's metric history."""
    curves = {}
    for step in study.steps:
        if step.startswith("evaluate") or step in ("data", "targeting", "synthesize", "compare"):
            continue
        history = study.client.get_metric_history(study.steps[step], "train/loss")
        if history:
            name = "SynthX generator" if step == "synthx_train" else arm_label(study.run(step).data.tags.get("variant", step))
            curves[name] = sorted((m.step, m.value) for m in history)
    if not curves:
        raise LookupError("no training run logged train/loss")
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(10, 2.9), squeeze=False)
    for name, points in curves.items():
        axis = axes[0][1] if name == "SynthX generator" else axes[0][0]
        axis.plot([p[0] for p in points], [p[1] for p in points], label=name, linewidth=1)
    for axis, title in zip(axes[0], ("segmentation arms", "generator")):
        axis.set_title(title, fontsize=9)
        axis.set_xlabel("step", fontsize=8)
        axis.set_ylabel("train/loss", fontsize=8)
        axis.tick_params(labelsize=7)
        if axis.lines:
            axis.legend(fontsize=7)
    return _figure_html(figure)


def synthetic_html(study: StudyRuns) -> str:
    """Cells requested and filled by the synthesis step, the cells left unfilled, and examples."""
    per_cell = study.csv("synthesize", "synthx/per_cell.csv")
    parts = ["<h3>Cells</h3>", _table_html(_cells(per_cell))]
    filled = per_cell["generated"] + per_cell.get("skipped", 0)
    unfilled = per_cell[filled < per_cell["requested"]]
    note = ""
    try:
        targets = _logged_table(study.artifact("synthesize", "synthx/targets.json"))
    except LookupError as missing_targets:
        # Explicit requests (not a targeting rule) log no targets table: only the painted cells are known.
        note = f"<p>requested cells without a painted case: not available ({missing_targets}).</p>"
    else:
        merged = targets.merge(per_cell, on=["sex", "age_band", "phase"], how="left", suffixes=("", "_made"))
        missing = merged[(merged["requested"] > 0) & merged["generated"].isna()]
        unfilled = pd.concat([unfilled, missing[["sex", "age_band", "phase", "requested"]]], ignore_index=True)
    parts.append("<h3>Unfillable cells</h3>")
    parts.append(note)
    parts.append(_table_html(_cells(unfilled)) if len(unfilled) else "<p>none: every requested cell was filled.</p>")
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


def _logged_table(path: Path) -> pd.DataFrame:
    """A table logged with ``log_table`` (JSON with columns and data)."""
    content = json.loads(Path(path).read_text())
    return pd.DataFrame(content["data"], columns=content["columns"])


def _quality(study: StudyRuns):
    """The synthetic cohort measured against the real training tumors (:func:`synthx.quality.quality_report`),
    computed once per report."""
    if "quality" not in study._cache:

        outputs = json.loads(study.run("synthesize").data.tags.get("study_outputs", "{}"))
        synthetic = Path(outputs.get("cohort", ""))
        real = Path(study.run("evaluate_baseline").data.tags.get("eval_cohort", ""))
        split = study.run("baseline").data.params.get("data.split", "") if "baseline" in study.steps else ""
        for what, path in (("synthetic cohort", synthetic), ("real cohort", real), ("split", Path(split))):
            if not str(path) or not path.exists():
                raise LookupError(f"the {what} {path} is not on this machine")
        try:
            study._cache["quality"] = quality_report(real, split, synthetic)
        except QualityError as error:
            raise LookupError(str(error)) from error
    return study._cache["quality"]


def quality_html(study: StudyRuns) -> str:
    """The synthetic cohort's quality summary per phase: tumor contrast against the surrounding
    pancreas and HU inside the tumor, real against synthetic, and whether a phase classifier trained
    on real tumors recognises the phase each synthetic tumor was made for."""
    report = _quality(study)
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
            "Phase recognised (%)": _pct(accuracy),
        })
    return ("<p>Measured in the volumes (synthx/quality.py): contrast is the tumor's mean HU minus that of a "
            "5 mm rim of pancreas around it; real tumors are the training split's.</p>" + _table_html(pd.DataFrame(rows)))


def example_grid_html(study: StudyRuns) -> str:
    """Per phase, a real and a synthetic tumor side by side (axial slice through the tumor) with their measured contrast."""
    plt = _pyplot()
    records = _quality(study).records
    phases = [p for p in PHASES if any(r.phase == p and r.synthetic for r in records)]
    figure, axes = plt.subplots(len(phases), 2, figsize=(5.0, 2.6 * len(phases)), squeeze=False)
    for row_axes, phase in zip(axes, phases):
        for axis, (kind, flag) in zip(row_axes, (("real", 0), ("synthetic", 1))):
            axis.axis("off")
            record = next((r for r in records if r.phase == phase and r.synthetic == flag), None)
            if record is None:
                axis.set_title(f"{kind}, {phase}: none in training", fontsize=8)
                continue
            axis.imshow(record.slice_image.T, cmap="gray", vmin=DISPLAY_WINDOW[0], vmax=DISPLAY_WINDOW[1], origin="lower")
            axis.contour(record.slice_mask.T, levels=[0.5], colors="tab:red", linewidths=0.8, origin="lower")
            axis.set_title(f"{kind}, {phase}: {record.stats.get('contrast', float('nan')):+.0f} HU\n{record.case_id}", fontsize=8)
    figure.tight_layout()
    return _figure_html(figure)


def leakage_html(study: StudyRuns) -> str:
    """The leakage checks: an audit step's report if the study ran one, else the training runs' checks."""
    if "audit" in study.steps:
        run_id = study.steps["audit"]
        files = [a.path for a in study.client.list_artifacts(run_id, "audit")]
        text = [p for p in files if p.endswith((".md", ".txt"))]
        if text:
            return f"<pre>{html.escape(study.artifact('audit', text[0]).read_text())}</pre>"
    rows = []
    for step in ("baseline", "augmented"):
        if step not in study.steps:
            continue
        run = study.run(step)
        overridden = run.data.tags.get("leakage_override") == "true"
        rows.append({"training run": step, "run id": run.info.run_id,
                     "leakage check": "OVERRIDDEN (data.allow_leakage=true): see leakage_override.txt" if overridden
                     else "passed (no patient overlap or duplicate across splits)"})
    if not rows:
        raise LookupError("no audit step and no training runs")
    return ("<p>Before each training, the split was checked for patients in two splits and duplicate scans; "
            "training refuses a leaking split unless overridden.</p>" + _table_html(pd.DataFrame(rows)))


def recipes_html(study: StudyRuns) -> str:
    parts = []
    for step in ("baseline", "augmented", "synthx_train"):
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
    return _table_html(pd.DataFrame(rows))


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


# ------------------------------------------------------------------------------------------------
# The report and what a finished study publishes


def report_sections(study: StudyRuns) -> list[tuple[str, Callable[[], str]]]:
    """(title, builder) of every section; a builder raises LookupError when its item is absent."""
    comparison = lambda: study_comparison(study)  # noqa: E731

    def baseline_table() -> str:
        table = study.csv("evaluate_baseline", "evaluation/test_subgroups.csv")
        threshold = study.run("evaluate_baseline").data.metrics.get("test/threshold")
        head = f"<p>Detection threshold m = {threshold:,.0f} mm³ (docs/design.md \"Scan-level detection\"). In %.</p>" if threshold is not None else ""
        rows = []
        for row in table.to_dict("records"):
            out = {"Subgroup": _subgroup_name(row["attribute"], row["group"]),
                   "Tumor / healthy": f"{int(row['positives'])} / {int(row['negatives'])}"}
            for metric in ("sensitivity", "specificity", "auc", "f1"):
                if metric in row:
                    interval = (f" [{_pct(row[f'{metric}_ci_low'])}, {_pct(row[f'{metric}_ci_high'])}]"
                                if f"{metric}_ci_low" in row else "")
                    out[metric_label(metric)] = _pct(row[metric]) + interval
            rows.append(out)
        return head + baseline_subgroup_html(study) + _table_html(pd.DataFrame(rows))

    def worst_groups() -> str:
        table = headline(comparison())
        return _table_html(pd.DataFrame({
            "Attribute": [attribute_label(a) for a in table["attribute"]],
            "Metric": [metric_label(m) for m in table["metric"]],
            f"{arm_label('baseline')}: worst group": [f"{group_label(a, g)} ({_pct(v)}%)" for a, g, v in
                                                     zip(table["attribute"], table["baseline_worst_group"], table["baseline"])],
            f"{arm_label('synthx')}: worst group": [f"{group_label(a, g)} ({_pct(v)}%)" for a, g, v in
                                                   zip(table["attribute"], table["synthx_worst_group"], table["synthx"])],
            "Difference (points)": [_pct(d, True) for d in table["delta"]],
        }))

    return [
        ("Baseline by subgroup (test)", baseline_table),
        ("Tumors found per subgroup (test)", lambda: found_html(comparison())),
        ("Arms compared (BenchX table 6)", lambda: comparison_html(comparison())),
        ("Forest plots per operating point", lambda: forest_html(comparison())),
        ("ROC curves per phase and arm (test)", lambda: roc_html(study)),
        ("Worst group per attribute (test)", worst_groups),
        ("Training curves", lambda: training_curves_html(study)),
        ("Synthetic cohort", lambda: synthetic_html(study)),
        ("Leakage audit", lambda: leakage_html(study)),
        ("Recipes", lambda: recipes_html(study)),
        ("Versions", lambda: versions_html(study)),
    ]


def study_comparison(study: StudyRuns) -> pd.DataFrame:
    """The compare step's table (LookupError when the study has none)."""
    return study.csv("compare", COMPARISON_ARTIFACT)


def verdict_lines(study: StudyRuns) -> list[str]:
    """The study's verdict sentences (:func:`synthx.verdict.study_verdict`); LookupError without a comparison."""
    endpoint = PrimaryEndpoint.from_params(dict(study.parent.data.params))
    lines = study_verdict(study_comparison(study), PRIMARY_POINT, endpoint=endpoint)
    if not lines:
        raise LookupError("the comparison holds none of the designed subgroups")
    return lines


def verdict_html(study: StudyRuns) -> str:
    items = "".join(f"<li>{html.escape(line)}</li>" for line in verdict_lines(study))
    return (f"<ul class='verdict'>{items}</ul><p class='note'>Closed: the paired 95% CI of the difference lies above 0; "
            "not closed: at or below 0; undetermined: it spans 0 (docs/design.md \"Reading the verdict\").</p>")


def render(study: StudyRuns) -> str:
    parent = study.parent
    name = parent.info.run_name or parent.info.run_id
    experiment = study.client.get_experiment(parent.info.experiment_id).name
    body = [f"<h1>Study report: {html.escape(name)}</h1>",
            f"<section id='verdict'><h2>Verdict (test)</h2>{_section_body(lambda: verdict_html(study))}</section>",
            f"<p>Experiment <b>{html.escape(experiment)}</b>, parent run <code>{parent.info.run_id}</code>, "
            f"commit <code>{html.escape(parent.data.tags.get('git_commit', 'not recorded'))}</code>. "
            f"Steps: {', '.join(html.escape(s) for s in study.steps)}.</p>"]
    if "synthesize" in study.steps and study.run("synthesize").data.tags.get("painter") == PHANTOM_PAINTER:
        body.append("<p><b>Positive control:</b> the synthetic tumors were painted by the phantom's own renderer "
                    "(<code>--painter phantom</code>), not by SynthX: the 'SynthX' columns below are the model trained "
                    "with them, and show what the study detects when the added tumors are as real as the phantom's.</p>")
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


def study_arms(study: StudyRuns) -> list[tuple[str, str]]:
    """(training step, arm) of every trained arm of the study, baseline first: the step's run tag
    ``variant`` names the arm (``augmented`` trains ``synthx``)."""
    arms = []
    for step in study.steps:
        if step.startswith(("evaluate", "synthx_train")) or step in ("data", "targeting", "synthesize", "compare"):
            continue
        variant = study.run(step).data.tags.get("variant")
        if variant:
            arms.append((step, variant))
    return sorted(arms, key=lambda arm: arm[1] != "baseline")


def model_version_description(study: StudyRuns, step: str, arm: str, experiment: str, evaluation: str | None) -> str:
    """A registered version's description: arm, study, recipe, data and validation-chosen operating point."""
    tags = study.run(step).data.tags
    params = study.run(step).data.params
    point = "not chosen (no evaluation run)"
    if evaluation:
        run = study.client.get_run(evaluation)
        threshold = run.data.metrics.get("operating_point/val_chosen")
        if threshold is not None:
            rule = run.data.tags.get("operating_point.val_chosen.rule", "")
            point = f"m = {threshold:,.0f} mm³ chosen on validation{f' by {rule}' if rule else ''} (evaluation run {evaluation})"
    data = params.get("data.root") or tags.get("eval_cohort") or "see the training run"
    return (f"{arm_label(arm)} arm of study {experiment} (parent run {study.parent.info.run_id}, "
            f"training run {study.steps[step]}). Recipe: {tags.get('recipe', 'not recorded')} (profile {tags.get('profile', '-')}), synthetic ratio "
            f"{tags.get('synthx_ratio', '0')}. Data: {data}, split sha256 {tags.get('split_sha256', 'not recorded')[:12]}. "
            f"Operating point: {point}.")


def publish_study(uri: str, parent_id: str, output_dir: str | Path) -> Path:
    """What a finished study publishes on its parent run: registry aliases ``<experiment>-<arm>`` on
    ``benchx-<backbone>`` (scoped by experiment) and ``<experiment>`` on ``synthx-generator``, a
    description on each version, the headline metrics, the verdict as the run's description, and
    the HTML report (also written to ``output_dir``)."""
    with tempfile.TemporaryDirectory() as folder:
        study = load_study(parent_id, uri, Path(folder))
        experiment = study.client.get_experiment(study.parent.info.experiment_id).name
        aliases = {}
        for step, variant in study_arms(study):
            # Scoped by experiment: one experiment's study never moves another's aliases.
            aliases[variant] = set_aliases(study.steps[step], uri, [f"{experiment}-{variant}"])
            evaluation = study.steps.get(f"evaluate_{variant}") or study.steps.get(f"evaluate_{step}")
            if aliases[variant]:
                name, _, version = aliases[variant].partition("/")
                study.client.update_model_version(name, version, description=model_version_description(
                    study, step, variant, experiment, evaluation))
        if "synthx_train" in study.steps:
            aliases["generator"] = set_aliases(study.steps["synthx_train"], uri, [experiment], prefix="synthx-")
        for variant, target in aliases.items():
            if target:
                study.client.set_tag(parent_id, f"model.{variant}", target)
        try:
            log_headline(study.client, parent_id, study_comparison(study))
            # The parent run's description in the MLflow UI: the verdict.
            study.client.set_tag(parent_id, NOTE_TAG, "\n\n".join(verdict_lines(study)))
        except LookupError as error:
            print(f"[study] headline metrics and verdict not logged: {error}")
    return build_report(parent_id, uri, Path(output_dir) / "study_report.html")


# ------------------------------------------------------------------------------------------------
# The results page (Markdown)


def results_table(comparison: pd.DataFrame, point: str, metric: str = "sensitivity") -> pd.DataFrame:
    """Overall and per phase: scans, each arm's ``metric`` in % and each compared arm's difference
    from its reference with the paired 95% CI, at ``point``."""
    table = comparison[comparison["metric"] == metric]
    if "operating_point" in table.columns:
        table = table[table["operating_point"] == point]
    table = table[table["attribute"].isin(["overall", "phase"])]
    arms = comparison_arms(comparison)
    rows = []
    for (attribute, group), part in table.groupby(["attribute", "group"], sort=False):
        first = part.iloc[0]
        row = {"Subgroup": f"{attribute_label(attribute)}: {group_label(attribute, group)}" if attribute != "overall"
               else "All scans", "Tumor scans": int(first["positives"]), "Healthy scans": int(first["negatives"])}
        references = part["reference"].astype(str) if "reference" in part.columns else pd.Series("baseline", index=part.index)
        values = {}
        for reference, r in zip(references, part.itertuples(index=False)):
            values.setdefault(reference, r.a)
            values.setdefault(str(r.run), r.b)
        for arm in arms:
            row[arm_label(arm)] = _pct(values.get(arm))
        for reference, r in zip(references, part.itertuples(index=False)):
            row[f"{arm_label(r.run)} - {arm_label(reference)} [95% CI]"] = (
                f"{_pct(r.delta, True)} [{_pct(r.ci_low, True)}, {_pct(r.ci_high, True)}]")
        rows.append(row)
    return pd.DataFrame(rows)


def markdown_table(frame: pd.DataFrame) -> str:
    header = "| " + " | ".join(str(c) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    lines = ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *lines])


def results_markdown(study: StudyRuns) -> str:
    """docs/results.md: the verdict and a short table, naming the run and the commit that produced them."""
    parent = study.parent
    experiment = study.client.get_experiment(parent.info.experiment_id).name
    comparison = study_comparison(study)

    point = available_point(comparison, PRIMARY_POINT)
    thresholds = ""
    if "threshold_a" in comparison.columns and "operating_point" in comparison.columns:
        at = comparison[comparison["operating_point"] == point]
        if len(at):
            thresholds = f" (m = {float(at['threshold_a'].iloc[0]):,.0f} mm³ for the baseline)"
    lines = [
        "# Results",
        "",
        f"Generated by `benchx report --markdown` from the study run `{parent.info.run_id}` "
        f"(experiment `{experiment}`, run name `{parent.info.run_name}`) at commit "
        f"`{parent.data.tags.get('git_commit', 'not recorded')}`. Regenerate it rather than editing it.",
        *([f"The study took {format_duration((parent.info.end_time - parent.info.start_time) / 1000)} from the start of its "
           "parent run to its end (every step's own time is in its run)."] if parent.info.end_time else []),
        "",
        "## Verdict (test set)",
        "",
        *[f"- {line}" for line in verdict_lines(study)],
        "",
        f"## Sensitivity in % at {point_label(point)}{thresholds}",
        "",
        markdown_table(results_table(comparison, point)),
        "",
        "Differences are in percentage points with paired 95% bootstrap CIs over patients that include the "
        "operating point's own uncertainty (m re-chosen in each validation resample); the verdict's intervals "
        "are Newcombe's for the paired sensitivities at the chosen m (docs/design.md \"Confidence intervals and "
        "comparisons\", \"Reading the verdict\"). The full tables are in the study's HTML report.",
        "",
    ]
    return "\n".join(lines)


RESULTS_BLOCK = ("<!-- benchx-results:start -->", "<!-- benchx-results:end -->")


def fill_results_block(document: str, page: str, block: tuple[str, str] = RESULTS_BLOCK) -> str:
    """``document`` with the text between its ``block`` markers replaced by ``page`` (a generated
    page without its title, its sections as bold lines), so a README carries the same generated
    figures as the docs page and no hand-copied ones."""
    start, end = block
    if document.count(start) != 1 or document.count(end) != 1 or document.index(start) > document.index(end):
        raise ReportError(f"the document needs exactly one {start} ... {end} block")
    body = [line for line in page.splitlines() if not line.startswith("# ")]
    body = [f"**{line[3:]}**" if line.startswith("## ") else line for line in body]
    text = "\n".join(body).strip("\n")
    head, rest = document.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{text}\n{end}{tail}"


def write_results_markdown(run_id: str, uri: str, out: str | Path) -> Path:
    """Write :func:`results_markdown` of a study's parent run to ``out``; when ``out`` already holds a
    results block (:data:`RESULTS_BLOCK`, as README.md does), only that block is rewritten."""
    out = Path(out)
    with tempfile.TemporaryDirectory() as folder:
        try:
            text = results_markdown(load_study(run_id, uri, Path(folder)))
        except LookupError as error:
            raise ReportError(f"run {run_id}: no results page without a finished comparison: {error}") from error
    if out.is_file() and RESULTS_BLOCK[0] in out.read_text(encoding="utf-8"):
        text = fill_results_block(out.read_text(encoding="utf-8"), text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out
