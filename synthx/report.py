"""The study report: one self-contained HTML page built from what a study's runs logged in MLflow.

Sections: the headline (per attribute, the worst group's sensitivity and F1 for the baseline and the
SynthX-augmented model and their difference), the BenchX table-6 comparison with paired bootstrap
CIs at each operating point, forest plots per attribute, the baseline's subgroup table, the synthetic
cohort (cells requested and filled, cells that could not be filled, one example per phase), the
leakage checks, the recipes and the code and library versions. Figures are embedded as base64 PNG,
so the file opens anywhere (the MLflow UI previews it among the parent run's artifacts). An item a
study did not log is shown as "not available", with the reason.

:func:`publish_study` is what the study calls when it finishes: headline metrics on the parent run
(so the experiment table sorts studies by them), registry aliases, and the report.

Example::

    benchx report --run-id <study parent run> --out outputs/study/report.html
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

import pandas as pd
from mlflow.tracking import MlflowClient

from synthx.labels import arm_label
from synthx.painters import PHANTOM_PAINTER

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
    from lightning_modules.evaluation.subgroups import gaps

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
    try:
        value = float(value)
    except (TypeError, ValueError):
        return "-"
    if math.isnan(value):
        return "-"
    return f"{value * 100:+.1f}" if sign else f"{value * 100:.1f}"


def _table_html(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, escape=True, na_rep="-", border=0, classes="data")


def comparison_html(comparison: pd.DataFrame) -> str:
    """Table 6: one row per subgroup; per metric base, SynthX and the difference with its paired CI."""
    by_point = "operating_point" if "operating_point" in comparison.columns else None
    parts = []
    for point, table in comparison.groupby(by_point, sort=False) if by_point else [(None, comparison)]:
        rows = []
        for (attribute, group), part in table.groupby(["attribute", "group"], sort=False):
            row = {"attribute": attribute, "group": group, "n": int(part["n"].iloc[0])}
            for metric in TABLE_METRICS:
                hit = part[part["metric"] == metric]
                if hit.empty:
                    continue
                r = hit.iloc[0]
                star = " **" if bool(r.get("significant_holm", False)) else " *" if bool(r["significant"]) else ""
                row[f"{metric} base"] = _pct(r["a"])
                row[f"{metric} SynthX"] = _pct(r["b"])
                row[f"{metric} delta [95% CI]"] = f"{_pct(r['delta'], True)} [{_pct(r['ci_low'], True)}, {_pct(r['ci_high'], True)}]{star}"
            rows.append(row)
        title = ""
        if point is not None:
            # The two thresholds (compare writes them with every operating point), so a moved
            # operating point is visible beside the differences.
            thresholds = f" (m baseline {table['threshold_a'].iloc[0]:,.4g}, SynthX {table['threshold_b'].iloc[0]:,.4g})"
            title = f"<h3>Operating point: {html.escape(str(point) + thresholds)}</h3>"
        parts.append(title + _table_html(pd.DataFrame(rows)))
    note = ("<p class='note'>In %. * significant: the paired 95% bootstrap CI of the difference excludes 0 and the "
            "subgroup is large enough; ** also after Holm's correction over the groups of its attribute; "
            "- undefined.</p>")
    return "".join(parts) + note


def forest_html(comparison: pd.DataFrame) -> str:
    """One forest plot per attribute: SynthX minus baseline with the paired CI, per group and metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comparison, point = primary_point(comparison)
    parts = [f"<p>Operating point: {html.escape(point)}.</p>" if point else ""]
    for attribute, table in comparison[comparison["attribute"] != "overall"].groupby("attribute", sort=False):
        groups = list(dict.fromkeys(table["group"]))
        figure, axes = plt.subplots(1, len(HEADLINE_METRICS), figsize=(9, 0.45 * len(groups) + 1.4), sharey=True)
        for axis, metric in zip(axes, HEADLINE_METRICS):
            rows = table[table["metric"] == metric].set_index("group").reindex(groups)
            delta = rows["delta"].astype(float)
            low = (delta - rows["ci_low"].astype(float)).clip(lower=0).fillna(0)
            high = (rows["ci_high"].astype(float) - delta).clip(lower=0).fillna(0)
            axis.errorbar(delta, range(len(groups)), xerr=[low, high], fmt="o", capsize=3)
            axis.axvline(0.0, color="black", linewidth=1)
            axis.set_xlim(-1.02, 1.02)
            axis.set_xlabel(f"{metric}: SynthX minus baseline")
            axis.grid(axis="x", alpha=0.3)
        axes[0].set_yticks(range(len(groups)))
        axes[0].set_yticklabels([f"{g} (n={int(n)})" for g, n in zip(groups, table.groupby("group", sort=False)["n"].first())])
        axes[0].invert_yaxis()
        figure.suptitle(f"{attribute}: paired 95% CI")
        parts.append(f"<h3>{html.escape(str(attribute))}</h3>{_figure_html(figure)}")
    return "".join(parts)


def synthetic_html(study: StudyRuns) -> str:
    """Cells requested and filled by the synthesis step, the cells left unfilled, and examples."""
    per_cell = study.csv("synthesize", "synthx/per_cell.csv")
    parts = ["<h3>Cells</h3>", _table_html(per_cell)]
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
    parts.append(_table_html(unfilled) if len(unfilled) else "<p>none: every requested cell was filled.</p>")
    parts.append("<h3>Examples per phase</h3>")
    parts.append(_section_body(lambda: example_grid_html(study)))
    return "".join(parts)


def _logged_table(path: Path) -> pd.DataFrame:
    """A table logged with ``log_table`` (JSON with columns and data)."""
    content = json.loads(Path(path).read_text())
    return pd.DataFrame(content["data"], columns=content["columns"])


def example_grid_html(study: StudyRuns) -> str:
    """One axial slice through a synthetic tumor per phase, from the synthetic cohort on disk."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import nibabel as nib
    import numpy as np

    outputs = json.loads(study.run("synthesize").data.tags.get("study_outputs", "{}"))
    root = Path(outputs.get("cohort", ""))
    metadata = study.csv("synthesize", "synthx/metadata.csv") if not (root / "metadata.csv").exists() else pd.read_csv(root / "metadata.csv")
    if not root.is_dir():
        raise LookupError(f"the synthetic cohort folder {root} is not on this machine")
    examples = metadata.drop_duplicates("phase")
    figure, axes = plt.subplots(1, max(len(examples), 1), figsize=(3 * max(len(examples), 1), 3.2), squeeze=False)
    for axis, row in zip(axes[0], examples.itertuples(index=False)):
        case = root / str(row.case_id)
        ct = np.asarray(nib.load(str(case / "ct.nii.gz")).dataobj, dtype=np.float32)
        masks = sorted((case / "segmentations").glob("*lesion*.nii.gz"))
        tumor = np.asarray(nib.load(str(masks[0])).dataobj) > 0 if masks else np.zeros(ct.shape, bool)
        z = int(np.argmax(tumor.sum(axis=(0, 1)))) if tumor.any() else ct.shape[2] // 2
        axis.imshow(np.rot90(np.clip(ct[:, :, z], -175, 250)), cmap="gray")
        if tumor[:, :, z].any():
            axis.contour(np.rot90(tumor[:, :, z]), levels=[0.5], colors="red", linewidths=1)
        axis.set_title(f"{row.phase}\n{row.case_id} ({row.sex}, {getattr(row, 'age', '')})", fontsize=8)
        axis.axis("off")
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
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table.data { border-collapse: collapse; font-size: 13px; margin: 0.5em 0; }
table.data th, table.data td { padding: 3px 8px; border-bottom: 1px solid #ddd; text-align: right; }
table.data th { background: #f3f3f3; }
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
        head = f"<p>Detection threshold {threshold:g} mm<sup>3</sup> (docs/design.md \"Scan-level detection\").</p>" if threshold is not None else ""
        columns = [c for c in table.columns if c in ("attribute", "group", "n", "positives", "negatives") or
                   c.split("_ci_")[0] in TABLE_METRICS or c == "auc"]
        return head + _table_html(table[columns].round(3))

    return [
        ("Headline: worst group per attribute (test)", lambda: _table_html(headline(comparison()).round(3))),
        ("Baseline vs SynthX (BenchX table 6)", lambda: comparison_html(comparison())),
        ("Forest plots per attribute", lambda: forest_html(comparison())),
        ("Baseline subgroup table (test)", baseline_table),
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
    from synthx.verdict import study_verdict

    lines = study_verdict(study_comparison(study), PRIMARY_POINT)
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
    from lightning_modules.models.pyfunc import set_aliases

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
    from synthx.labels import arm_label, attribute_label, group_label
    from synthx.verdict import comparison_arms

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


def _markdown_table(frame: pd.DataFrame) -> str:
    header = "| " + " | ".join(str(c) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    lines = ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *lines])


def results_markdown(study: StudyRuns) -> str:
    """docs/results.md: the verdict and a short table, naming the run and the commit that produced them."""
    from synthx.labels import point_label

    parent = study.parent
    experiment = study.client.get_experiment(parent.info.experiment_id).name
    comparison = study_comparison(study)
    from synthx.verdict import available_point

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
        "",
        "## Verdict (test set)",
        "",
        *[f"- {line}" for line in verdict_lines(study)],
        "",
        f"## Sensitivity in % at {point_label(point)}{thresholds}",
        "",
        _markdown_table(results_table(comparison, point)),
        "",
        "Differences are in percentage points with paired 95% bootstrap CIs over patients "
        "(docs/design.md \"Confidence intervals and comparisons\"). The full tables are in the study's HTML report.",
        "",
    ]
    return "\n".join(lines)


def write_results_markdown(run_id: str, uri: str, out: str | Path) -> Path:
    """Write :func:`results_markdown` of a study's parent run to ``out``."""
    out = Path(out)
    with tempfile.TemporaryDirectory() as folder:
        try:
            text = results_markdown(load_study(run_id, uri, Path(folder)))
        except LookupError as error:
            raise ReportError(f"run {run_id}: no results page without a finished comparison: {error}") from error
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out
