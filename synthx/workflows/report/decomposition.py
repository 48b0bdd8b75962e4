"""The report's decomposition section: where SynthX's difference to sham comes from (the copy-paste
arm, :mod:`synthx.analysis.decomposition`), and the realism of the synthetic and copy-pasted tumors against
the real training tumors (:mod:`synthx.analysis.realism`).

Both are read from what the study logged: the decomposition table on the parent run
(``synthx/decomposition.csv``, :func:`synthx.workflows.study.publish.publish_decomposition`) and the
realism table on the synthesis run (``synthx_quality/realism.csv``).

Example::

    html = decomposition_html(study, study_arm_namer(study))
"""

from __future__ import annotations

import html

import pandas as pd

from synthx.analysis.labels import arm_label, point_label
from synthx.analysis.realism import realism_summary
from synthx.analysis.verdict import ArmNamer, DECOMPOSITION_WORDS, designed_gap_subgroups
from synthx.workflows.report.formatting import pct, table_html
from synthx.workflows.report.runs import study_decomposition, StudyRuns

REALISM_ARTIFACT = "synthx_quality/realism.csv"
# The steps whose run may carry the realism table, first found wins.
REALISM_STEPS = ("synthesize", "synthesize_copy_paste")
COMPONENT_ORDER = ("placement", "content", "total", "ceiling")


def decomposition_rows(table: pd.DataFrame, name_of: ArmNamer = arm_label) -> pd.DataFrame:
    """Per designed subgroup (and all scans): each component's arm minus reference in sensitivity, in %."""
    subgroups = [("All scans", "overall", "all")] + [(label, a, g) for label, a, g in designed_gap_subgroups()]
    rows = []
    for label, attribute, group in subgroups:
        part = table[(table["attribute"].astype(str) == attribute) & (table["group"].astype(str) == group)]
        for component in COMPONENT_ORDER:
            hit = part[part["component"] == component]
            if hit.empty:
                continue
            r = hit.iloc[0]
            rows.append({
                "Subgroup": label,
                "Component": f"{component}: {DECOMPOSITION_WORDS.get(component, component)}",
                "Arm - reference": f"{name_of(r['arm'])} - {name_of(r['reference'])}",
                "Found (arm / reference of tumors)": f"{int(r['arm_detected'])} / {int(r['reference_detected'])} of {int(r['positives'])}",
                "Difference [95% CI]": f"{pct(r['difference'], True)} [{pct(r['ci_low'], True)}, {pct(r['ci_high'], True)}]",
                "McNemar p": "-" if pd.isna(r["p_value"]) else f"{float(r['p_value']):.3f}",
            })
    return pd.DataFrame(rows)


def decomposition_html(study: StudyRuns, name_of: ArmNamer = arm_label) -> str:
    """The decomposition table (LookupError when the study logged none) and, when the study has
    it, the realism of each painted cohort against the real training tumors."""
    table = study_decomposition(study)
    rows = decomposition_rows(table, name_of)
    if rows.empty:
        raise LookupError("the decomposition holds none of the designed subgroups")
    point = point_label(study.parent.data.params.get("endpoint.operating_point", "matched_specificity"))
    head = (f"<p>Sensitivity on the test set's tumor scans at the primary endpoint's operating point ({html.escape(point)}, "
            "each arm at the m of its comparison against sham, so the components add up). Placement: copy-paste (real training tumors pasted at SynthX's sites in SynthX's "
            "canvases) minus sham (the real tumor cases themselves); content: SynthX minus copy-paste; total: SynthX "
            "minus sham; ceiling: the positive control minus sham. Paired 95% CI (Newcombe), exact McNemar p; in "
            "percentage points.</p>")
    return head + table_html(rows)


def realism_html(study: StudyRuns) -> str:
    """Per phase, SynthX's tumors and the copy-pasted ones against the real training tumors
    (:func:`synthx.analysis.realism.realism_summary`); LookupError when no synthesis run logged the table."""
    for step in REALISM_STEPS:
        if step not in study.steps:
            continue
        try:
            table = study.csv(step, REALISM_ARTIFACT)
        except LookupError:
            continue
        parts = []
        for comparison, title in (("synthetic", "SynthX"), ("copy_paste", "copy-paste")):
            summary = realism_summary(table, comparison).rename(columns=lambda c: c.replace(comparison, title))
            if not summary.empty:
                parts.append(f"<h3>Real against {html.escape(title)}</h3>" + table_html(summary))
        if parts:
            return ("<p>Radiomic features of each tumor (synthx/analysis/realism.py): real / other [95% CI of other - real], "
                    "* the interval excludes 0; the classifier AUC tells real from the other set (0.5: "
                    "indistinguishable).</p>" + "".join(parts))
    raise LookupError(f"no synthesis step of the study logged {REALISM_ARTIFACT}")
