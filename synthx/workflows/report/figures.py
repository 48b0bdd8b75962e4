"""The report's figures: forest plots of the compared arms, the baseline by subgroup, ROC curves
per phase and arm, training curves, and real beside synthetic tumors. Each returns an embedded PNG
(base64) in HTML."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd

from lightning_modules.data.metadata import PHASES
from lightning_modules.tracking.recorder import download_records
from synthx.analysis.endpoint import shown_interval
from synthx.analysis.labels import arm_label, metric_label, point_label
from synthx.analysis.quality import DISPLAY_WINDOW
from synthx.analysis.verdict import ArmNamer, designed_gap_subgroups
from synthx.workflows.report.formatting import cell_mark, figure_html, pyplot, subgroup_name
from synthx.workflows.report.runs import HEADLINE_METRICS, study_arm_namer, study_quality, StudyRuns


def forest_html(comparison: pd.DataFrame, name_of: ArmNamer = arm_label) -> str:
    """One forest plot per operating point (and compared arm): the paired difference with its CI per
    subgroup and metric; significant differences filled and marked, the axis scaled to the data."""
    plt = pyplot()
    keys = [k for k in ("run", "reference", "operating_point") if k in comparison.columns]
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
            shown = [shown_interval(r) if r.notna().any() else ("", np.nan, np.nan) for _, r in rows.reset_index().iterrows()]
            delta = 100 * rows["delta"].astype(float)
            low = pd.Series([100 * s[1] for s in shown], index=delta.index)
            high = pd.Series([100 * s[2] for s in shown], index=delta.index)
            marks = [cell_mark(r) if r.notna().any() else "" for _, r in rows.reset_index().iterrows()]
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
        axes[0][0].set_yticklabels([subgroup_name(a, g) for a, g in subgroups], fontsize=7)
        axes[0][0].invert_yaxis()
        reference = str(table["reference"].iloc[0]) if "reference" in table.columns else "baseline"
        title = f"{name_of(named.get('run', 'synthx'))} minus {name_of(reference)}"
        if "operating_point" in named:
            title += f" at {point_label(named['operating_point'])}"
        figure.suptitle(title + " (95% CI: Newcombe for sensitivity and specificity; filled red: significant)", fontsize=9)
        parts.append(f"<h3>{html.escape(title)}</h3>{figure_html(figure)}")
    return "".join(parts)


def baseline_subgroup_html(table: pd.DataFrame, caption: str) -> str:
    """The baseline's sensitivity, specificity and AUC per subgroup with CIs from ``table`` (one
    subgroup table, at the operating point ``caption`` names), the designed gaps marked."""
    plt = pyplot()
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
    labels = [subgroup_name(a, g) + (f"  ◀ {designed[(a, g)]}" if (a, g) in designed else "") for a, g in subgroups]
    axes[0][0].set_yticks(y)
    axes[0][0].set_yticklabels(labels, fontsize=7)
    for tick, key in zip(axes[0][0].get_yticklabels(), subgroups):
        if key in designed:
            tick.set_color("#c0392b")
    axes[0][0].invert_yaxis()
    figure.suptitle(f"Baseline on test, {caption}, 95% CIs; designed gaps in red", fontsize=9)
    return figure_html(figure)


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
    name_of = study_arm_namer(study)
    plt = pyplot()
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
            axis.plot(100 * fpr, 100 * tpr, label=f"{name_of(arm)} AUC {100 * roc_auc_score(labels, score):.0f}%")
        axis.plot([0, 100], [0, 100], color="grey", linewidth=0.6, linestyle=":")
        axis.set_title("all phases" if phase == "all" else phase, fontsize=9)
        axis.set_xlabel("1 - specificity (%)", fontsize=8)
        axis.tick_params(labelsize=7)
        if axis.lines[:-1]:
            axis.legend(fontsize=6, loc="lower right")
    axes[0][0].set_ylabel("sensitivity (%)", fontsize=8)
    return figure_html(figure)


def training_curves_html(study: StudyRuns) -> str:
    """train/loss of every training run of the study (arms and generator), from MLflow's metric history."""
    curves = {}
    name_of = study_arm_namer(study)
    for step in study.steps:
        if step.startswith("evaluate") or step in ("data", "targeting", "synthesize", "compare"):
            continue
        history = study.client.get_metric_history(study.steps[step], "train/loss")
        if history:
            name = "SynthX generator" if step == "synthx_train" else name_of(study.run(step).data.tags.get("variant", step))
            curves[name] = sorted((m.step, m.value) for m in history)
    if not curves:
        raise LookupError("no training run logged train/loss")
    plt = pyplot()
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
    return figure_html(figure)


def example_grid_html(study: StudyRuns) -> str:
    """Per phase, a real and a synthetic tumor side by side (axial slice through the tumor) with their measured contrast."""
    plt = pyplot()
    records = study_quality(study).records
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
    return figure_html(figure)
