"""The study's verdict in plain sentences: one per designed subgroup gap and one for the primary endpoint.

The sentences open the HTML report, the Markdown results page, the last lines of ``benchx study`` and
the description of the study's parent run. They are built from the comparison table alone (the
``compare`` step's ``comparison/test_comparison.csv``), whatever arms it holds: the baseline is the
reference every other arm (``run`` column) was compared with; a ``sham`` arm, when the study has
one, is the control SynthX is judged against (docs/explanation/detection-and-statistics.md "Reading the verdict").

Outcome of a gap or endpoint, SynthX minus its control, decided by one rule: the test that decides
significance in the comparison (``p_value``: the exact McNemar test for sensitivity):

- ``closed``: a positive difference, the test rejects at 5% and the shown interval lies above 0;
- ``open`` (printed "not closed"): the difference is not positive (nothing more found: 0 of 11 in
  every arm is not closed, whatever the width of its interval);
- ``undetermined``: a positive difference the test does not reject (or whose shown interval still
  spans 0), or no difference could be computed.

A contrast without a test p (the pooled seeds) is decided by its interval: closed above 0, not
closed at or below 0, undetermined across 0. The interval shown is
:func:`synthx.analysis.endpoint.shown_interval`'s: Newcombe's for a paired proportion, else the bootstrap's.

:func:`contrast_sentence` is pure (values in, one sentence out); :func:`study_verdict` reads a
comparison table.

Example::

    for line in study_verdict(pd.read_csv("test_comparison.csv")):
        print(line)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import pandas as pd

from synthx.analysis.endpoint import ALPHA, PrimaryEndpoint, shown_interval, TEST_NAMES
from synthx.analysis.labels import arm_label, group_label, point_label
from synthx.painters import PHANTOM_PAINTER

CLOSED, OPEN, UNDETERMINED = "closed", "open", "undetermined"
VERDICT_WORDS = {CLOSED: "closed", OPEN: "not closed", UNDETERMINED: "undetermined"}  # as sentences print them
REFERENCE_ARM = "baseline"
TREATMENT_ARM = "synthx"
CONTROL_ARM = "sham"


POSITIVE_CONTROL_LABEL = "phantom painter (positive control)"

ArmNamer = Callable[[str], str]


def arm_namer(painter: str | None = None) -> ArmNamer:
    """How an arm is named in sentences and tables, by what it is: with the phantom painter (the
    positive control) the augmented arm is named for that painter, not "SynthX"."""
    if painter == PHANTOM_PAINTER:
        return lambda arm: POSITIVE_CONTROL_LABEL if str(arm) == TREATMENT_ARM else arm_label(arm)
    return arm_label


@dataclass(frozen=True)
class ArmResult:
    """One arm's value of a metric in one subgroup (a fraction); ``found``/``of`` for a sensitivity."""

    arm: str
    value: float
    found: int | None = None
    of: int | None = None


@dataclass(frozen=True)
class Contrast:
    """The paired difference treatment minus control with its shown 95% CI (fractions), the
    interval's name, and the p of the test that decides (NaN where the table has none)."""

    treatment: str
    control: str
    delta: float
    ci_low: float
    ci_high: float
    interval: str = ""
    p_value: float = math.nan
    test: str = ""


def outcome(contrast: Contrast) -> str:
    """``closed``, ``open`` or ``undetermined`` (see the module docstring)."""
    low, high, delta, p_value = (float(contrast.ci_low), float(contrast.ci_high), float(contrast.delta),
                                 float(contrast.p_value))
    if not math.isnan(p_value):
        if math.isnan(delta):
            return UNDETERMINED
        if delta <= 0:
            return OPEN
        return CLOSED if p_value < ALPHA and low > 0 else UNDETERMINED
    if math.isnan(low) or math.isnan(high):
        return UNDETERMINED
    if low > 0:
        return CLOSED
    if high <= 0 or float(contrast.delta) <= 0:
        return OPEN
    return UNDETERMINED


def _percent(value: float) -> str:
    return "-" if value is None or math.isnan(float(value)) else f"{100 * float(value):.0f}%"


def _points(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "-"
    text = f"{100 * value:+.1f}"
    return "0" if text in ("+0.0", "-0.0") else text


def _arm_text(result: ArmResult, metric: str, name_of: ArmNamer = arm_label) -> str:
    name = name_of(result.arm)
    if result.found is not None and result.of is not None:
        return f"{name} found {result.found} of {result.of} ({_percent(result.value)})"
    return f"{name} {_percent(result.value)} {metric}" if metric != "sensitivity" else f"{name} {_percent(result.value)}"


def contrast_sentence(label: str, results: Sequence[ArmResult], contrast: Contrast, point: str,
                      metric: str = "sensitivity", name_of: ArmNamer = arm_label) -> str:
    """One verdict sentence, e.g. ``Scarcity gap (arterial), at the validation-chosen operating point:
    baseline found 0 of 11 (0%), sham 0 of 11 (0%), SynthX 0 of 11 (0%) - not closed (SynthX - sham
    0 points, 95% CI 0 to 0).``

    Args:
        label: what is judged, e.g. ``Scarcity gap (arterial)``.
        results: each arm's value in the subgroup, in the order to print.
        contrast: the paired difference that decides the outcome.
        point: the operating point's name (``val_chosen``, ``fixed``, ``matched_specificity``).
        metric: the metric the values are (named when it is not sensitivity).
        name_of: how an arm is named (:func:`arm_namer`).
    """
    verdict = VERDICT_WORDS[outcome(contrast)]
    arms = ", ".join(_arm_text(r, metric, name_of) for r in results)
    named = f"{contrast.interval} 95% CI" if contrast.interval else "95% CI"
    difference = (f"{name_of(contrast.treatment)} - {name_of(contrast.control)} {_points(contrast.delta)} "
                  f"percentage points, {named} {_points(contrast.ci_low)} to {_points(contrast.ci_high)}")
    p_value = float(contrast.p_value)
    if not math.isnan(p_value):
        test = TEST_NAMES.get(contrast.test, contrast.test or "test")
        difference += f"; the {test} decides, p = {p_value:.3g}"
        if verdict == "undetermined" and not math.isnan(float(contrast.delta)):
            difference += ", not below 0.05" if p_value >= ALPHA else ", but the CI spans 0"
    elif verdict == "undetermined":
        difference += ", the CI spans 0" if not math.isnan(float(contrast.ci_low)) else ", no CI"
    return f"{label}, at {point_label(point)}: {arms} - {verdict} ({difference})."


# ------------------------------------------------------------------------------------------------
# From a comparison table


def comparison_arms(comparison: pd.DataFrame) -> list[str]:
    """The arms of a comparison: the reference (column ``reference`` when present, else the
    baseline) then every compared run, in table order."""
    reference = [str(r) for r in dict.fromkeys(comparison["reference"])] if "reference" in comparison.columns else [REFERENCE_ARM]
    return list(dict.fromkeys([*reference, *(str(r) for r in dict.fromkeys(comparison["run"]))]))


def _rows(comparison: pd.DataFrame, attribute: str, group: str, metric: str, point: str) -> pd.DataFrame:
    rows = comparison[(comparison["attribute"].astype(str) == attribute) & (comparison["group"].astype(str) == group)
                      & (comparison["metric"] == metric)]
    if "operating_point" in comparison.columns:
        rows = rows[rows["operating_point"] == point]
    return rows


def _reference_of(rows: pd.DataFrame) -> pd.Series:
    return rows["reference"].astype(str) if "reference" in rows.columns else pd.Series(REFERENCE_ARM, index=rows.index)


def arm_results(rows: pd.DataFrame, metric: str) -> list[ArmResult]:
    """Each arm's value (reference arms from column ``a``, compared arms from ``b``)."""
    values: dict[str, float] = {}
    for reference, row in zip(_reference_of(rows), rows.itertuples(index=False)):
        values.setdefault(reference, float(row.a))
        values.setdefault(str(row.run), float(row.b))
    positives = int(rows["positives"].iloc[0]) if "positives" in rows.columns and len(rows) else None
    results = []
    for arm, value in values.items():
        if metric == "sensitivity" and positives is not None and not math.isnan(value):
            results.append(ArmResult(arm, value, int(round(value * positives)), positives))
        else:
            results.append(ArmResult(arm, value))
    return results


def arm_contrast(rows: pd.DataFrame, arms: Sequence[str]) -> Contrast | None:
    """SynthX (else the last compared arm) against sham when the table pairs them, else against the baseline."""
    compared = [a for a in arms if a in set(rows["run"].astype(str))]
    if not compared:
        return None
    treatment = TREATMENT_ARM if TREATMENT_ARM in compared else compared[-1]
    references = _reference_of(rows)
    for control in (CONTROL_ARM, REFERENCE_ARM, *arms):
        hit = rows[(rows["run"].astype(str) == treatment) & (references == control)]
        if len(hit):
            row = hit.iloc[0]
            name, low, high = shown_interval(row)
            p_value = row.get("p_value")
            return Contrast(treatment, control, float(row["delta"]), low, high, name,
                            math.nan if p_value is None or pd.isna(p_value) else float(p_value), str(row.get("test", "")))
    return None


def designed_gap_subgroups() -> list[tuple[str, str, str]]:
    """(label, attribute, group) of the phantom's designed gaps (docs/explanation/data.md "The phantom cohort")."""
    from lightning_modules.cohorts.phantom import designed_gaps

    gaps = designed_gaps()
    return [(f"Scarcity gap ({gaps['scarcity']['phase']})", "phase", str(gaps["scarcity"]["phase"])),
            (f"Physics gap ({gaps['physics']['phase']})", "phase", str(gaps["physics"]["phase"]))]


def available_point(comparison: pd.DataFrame, preferred: str) -> str:
    """``preferred`` when the table has that operating point, else the first it has."""
    if "operating_point" not in comparison.columns:
        return preferred
    points = list(dict.fromkeys(comparison["operating_point"].astype(str)))
    return preferred if preferred in points else points[0]


def study_verdict(comparison: pd.DataFrame, point: str = "val_chosen", endpoint: PrimaryEndpoint | None = None,
                  subgroups: Sequence[tuple[str, str, str]] | None = None, name_of: ArmNamer = arm_label) -> list[str]:
    """The verdict sentences of a comparison table: one per designed gap at ``point``, then the
    primary endpoint. A subgroup the table lacks gives no sentence; ``name_of`` names the arms
    (:func:`arm_namer`: the study's painter decides what the augmented arm is called)."""
    arms = comparison_arms(comparison)
    endpoint = endpoint or PrimaryEndpoint(group=designed_gap_subgroups()[0][2])
    lines = []
    gap_point = available_point(comparison, point)
    end_point = available_point(comparison, endpoint.operating_point)
    label = f"Primary endpoint ({endpoint.metric} in {group_label(endpoint.attribute, endpoint.group)})"
    judged = [(*subgroup, "sensitivity", gap_point) for subgroup in (designed_gap_subgroups() if subgroups is None else subgroups)]
    judged.append((label, endpoint.attribute, endpoint.group, endpoint.metric, end_point))
    for label, attribute, group, metric, at in judged:
        rows = _rows(comparison, attribute, group, metric, at)
        contrast = arm_contrast(rows, arms) if len(rows) else None
        if contrast is None:
            continue
        empty = "positives" if metric == "sensitivity" else "negatives" if metric == "specificity" else None
        if empty and int(rows[empty].iloc[0]) == 0:
            lines.append(empty_sentence(label, group_label(attribute, group), empty))
        else:
            lines.append(contrast_sentence(label, arm_results(rows, metric), contrast, at, metric, name_of))
    return lines


def empty_sentence(label: str, group: str, missing: str) -> str:
    """The sentence of a subgroup the test set holds no scan to judge in."""
    kind = "tumor scan" if missing == "positives" else "healthy scan"
    return f"{label}: the test set has no {kind} in {group} - undetermined."


# ------------------------------------------------------------------------------------------------
# The decomposition (synthx.analysis.decomposition): where SynthX's difference to sham comes from

# component -> what it measures, as the verdict names it.
DECOMPOSITION_WORDS = {"placement": "canvases and placement", "content": "generated content",
                       "total": "both", "ceiling": "real-appearance tumors at new sites"}


def _component_text(row, name_of: ArmNamer) -> str:
    return (f"{name_of(row['arm'])} - {name_of(row['reference'])} ({DECOMPOSITION_WORDS.get(row['component'], row['component'])}) "
            f"{_points(row['difference'])} percentage points, 95% CI {_points(row['ci_low'])} to {_points(row['ci_high'])}")


def decomposition_sentences(table: pd.DataFrame, subgroups: Sequence[tuple[str, str, str]] | None = None,
                            name_of: ArmNamer = arm_label, point: str = "matched_specificity") -> list[str]:
    """One sentence per designed subgroup of a decomposition table (:func:`synthx.analysis.decomposition.decompose`):
    the placement (copy-paste - sham) and content (SynthX - copy-paste) components with their
    paired 95% CIs, the total (SynthX - sham) they add up to, and the positive control's ceiling
    (phantom - sham) when the table has it, each pair at ``point`` (the primary endpoint's). A
    subgroup the table lacks gives no sentence.
    """
    if table is None or table.empty:
        return []
    lines = []
    for label, attribute, group in (designed_gap_subgroups() if subgroups is None else subgroups):
        rows = table[(table["attribute"].astype(str) == attribute) & (table["group"].astype(str) == group)]
        by_component = {str(r["component"]): r for r in rows.to_dict("records")}
        if not by_component:
            continue
        positives = int(next(iter(by_component.values()))["positives"])
        if positives == 0:
            lines.append(f"{label}: the test set has no tumor scan in {group_label(attribute, group)} to decompose.")
            continue
        parts = [_component_text(by_component[c], name_of) for c in ("placement", "content") if c in by_component]
        if "total" in by_component:
            parts.append(f"together {name_of(by_component['total']['arm'])} - {name_of(by_component['total']['reference'])} "
                         f"{_points(by_component['total']['difference'])}")
        if "ceiling" in by_component:
            parts.append(_component_text(by_component["ceiling"], name_of))
        lines.append(f"{label}, decomposed on {positives} tumor scan(s) at {point_label(point)}: {'; '.join(parts)}.")
    return lines
