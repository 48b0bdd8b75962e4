"""Where SynthX's shortfall comes from: its canvases and placement, or its generated content
(docs/explanation/synthx.md "The copy-paste arm and the decomposition").

Four arms train on the same schedule and are tested on the same tumors: ``sham`` (each synthetic
slot filled by a real training tumor case of the slot's cell), ``copy_paste`` (that kind of real
tumor pasted at SynthX's site in SynthX's canvas, :mod:`synthx.generation.copy_paste`), ``synthx``
(the generated tumor at that site) and, optionally, ``phantom`` (the phantom's own renderer paints
the tumor: the positive control). Per designed subgroup, the sensitivity at the endpoint's
operating point is compared in pairs, always as arm minus reference:

- ``placement``: copy_paste - sham, what SynthX's canvases and placement cost (negative: real
  tumors pasted into healthy canvases help less than the real cases themselves);
- ``content``: synthx - copy_paste, what the generated content costs (negative: SynthX's tumors
  help less than real ones at the same sites);
- ``total``: synthx - sham, the study's primary comparison. Each arm is judged at one m in every
  component (the study takes it from the primary comparison, where each arm's m is matched to
  sham's), so total = placement + content exactly, per subgroup; an arm judged at a different m
  in each pair would break that sum;
- ``ceiling``: phantom - sham, what real-appearance tumors at new sites can gain (when given).

Per comparison and subgroup: the paired 2x2 table of the tumors both arms find, only one finds,
neither finds; Newcombe's paired interval of the difference and the exact McNemar p, the
study's tests for a paired sensitivity (:mod:`lightning_modules.evaluation.small_counts`); the
subgroup's support (:func:`lightning_modules.evaluation.subgroups.supported`). Over K seeds,
:func:`pooled_decomposition` pools each comparison with
:func:`lightning_modules.evaluation.seed_pooling.pool_seeds`.

Example::

    found = {arm: detections(records[arm], thresholds[arm]) for arm in ("sham", "copy_paste", "synthx")}
    table = decompose(found, attributes=("phase",))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from lightning_modules.evaluation.records import labels, scores
from lightning_modules.evaluation.seed_pooling import ArmRecords, comparison_name, pool_seeds
from lightning_modules.evaluation.small_counts import mcnemar_exact_p, newcombe_paired_interval
from lightning_modules.evaluation.subgroups import subgroup_membership, supported


@dataclass(frozen=True)
class Component:
    """One paired comparison of the decomposition: ``arm`` minus ``reference``."""

    name: str
    arm: str
    reference: str
    meaning: str


COMPONENTS = (
    Component("placement", "copy_paste", "sham", "what SynthX's canvases and placement cost"),
    Component("content", "synthx", "copy_paste", "what SynthX's generated content costs"),
    Component("total", "synthx", "sham", "SynthX against the sham arm (placement + content)"),
    Component("ceiling", "phantom", "sham", "real-appearance tumors at new sites (the positive control)"),
)
REQUIRED_ARMS = ("sham", "copy_paste", "synthx")
COLUMNS = ("component", "comparison", "arm", "reference", "attribute", "group", "n_patients", "positives",
           "arm_detected", "reference_detected", "both", "only_arm", "only_reference", "neither",
           "arm_sensitivity", "reference_sensitivity", "difference", "ci_low", "ci_high", "p_value",
           "supported", "significant")


def detections(records: pd.DataFrame, threshold: float, score: str = "volume") -> pd.DataFrame:
    """The tumor scans of per-case test records with ``detected`` (score above ``threshold``, the
    evaluator's rule at an operating point); the other columns are kept (subgroups, patients)."""
    truth = labels(records)
    found = scores(records, score) > float(threshold)
    return records[truth].assign(detected=found[truth].astype(int)).reset_index(drop=True)


def _components(arms: Sequence[str]) -> list[Component]:
    missing = [arm for arm in REQUIRED_ARMS if arm not in arms]
    if missing:
        raise ValueError(f"the decomposition needs the arms {', '.join(REQUIRED_ARMS)}; missing: {', '.join(missing)}")
    return [c for c in COMPONENTS if c.arm in arms and c.reference in arms]


def _paired(arm_table: pd.DataFrame, reference_table: pd.DataFrame, arm: str, reference: str) -> tuple[pd.DataFrame, np.ndarray]:
    """The reference's tumors (its subgroup columns) and the arm's decision on each, matched by case id."""
    for name, table in ((arm, arm_table), (reference, reference_table)):
        missing = [c for c in ("case_id", "detected") if c not in table.columns]
        if missing:
            raise ValueError(f"arm {name}: detection records lack {', '.join(missing)}")
        values = pd.to_numeric(table["detected"], errors="coerce")
        if not values.isin((0, 1)).all():
            bad = table["case_id"].iloc[int(np.flatnonzero(~values.isin((0, 1)).to_numpy())[0])]
            raise ValueError(f"arm {name}: case {bad}: 'detected' must be 0 or 1")
        if table["case_id"].duplicated().any():
            raise ValueError(f"arm {name}: case {table['case_id'][table['case_id'].duplicated()].iloc[0]} appears twice")
    arm_found = dict(zip(arm_table["case_id"].astype(str), pd.to_numeric(arm_table["detected"]).astype(int)))
    reference_ids = reference_table["case_id"].astype(str)
    extra = sorted(set(arm_found) - set(reference_ids))
    absent = [case for case in reference_ids if case not in arm_found]
    if extra or absent:
        case, where = (absent[0], f"arm {arm}") if absent else (extra[0], f"arm {reference}")
        raise ValueError(f"{comparison_name(arm, reference)}: the arms are not paired: case {case} is missing from {where}")
    return reference_table.reset_index(drop=True), np.array([arm_found[c] for c in reference_ids], dtype=bool)


def paired_sensitivity_rows(arm_table: pd.DataFrame, reference_table: pd.DataFrame, arm: str, reference: str,
                            attributes: Sequence[str] = ("phase",), confidence: float = 0.95, alpha: float = 0.05) -> pd.DataFrame:
    """Per subgroup (``overall`` first), arm minus reference in sensitivity on the same tumors.

    Args:
        arm_table / reference_table: each arm's tumor scans (``case_id``, ``detected`` 0/1, the
            subgroup columns; ``patient_id`` for the support rule, else one patient per scan).
        attributes: the subgroup attributes (:data:`lightning_modules.evaluation.records.ATTRIBUTES`).
        confidence: Newcombe interval level; ``alpha``: the McNemar level of ``significant``.
    """
    reference_cases, arm_found = _paired(arm_table, reference_table, arm, reference)
    reference_found = pd.to_numeric(reference_cases["detected"]).to_numpy().astype(bool)
    patients = reference_cases["patient_id"].astype(str) if "patient_id" in reference_cases else reference_cases["case_id"].astype(str)
    rows, membership = subgroup_membership(reference_cases, attributes)
    out = []
    for index, (attribute, group) in enumerate(rows.itertuples(index=False)):
        member = membership[:, index]
        a, r = arm_found[member], reference_found[member]
        both, only_arm, only_reference = int((a & r).sum()), int((a & ~r).sum()), int((~a & r).sum())
        n = int(member.sum())
        neither = n - both - only_arm - only_reference
        # Newcombe's table: b = the first proportion's (the arm's) solo successes, so the interval is of arm - reference.
        low, high = newcombe_paired_interval(both, only_arm, only_reference, neither, confidence)
        out.append({
            "attribute": attribute, "group": group, "n_patients": int(patients[member].nunique()), "positives": n,
            "arm_detected": both + only_arm, "reference_detected": both + only_reference, "both": both,
            "only_arm": only_arm, "only_reference": only_reference, "neither": neither,
            "arm_sensitivity": (both + only_arm) / n if n else np.nan,
            "reference_sensitivity": (both + only_reference) / n if n else np.nan,
            "difference": (only_arm - only_reference) / n if n else np.nan,
            "ci_low": low, "ci_high": high, "p_value": mcnemar_exact_p(only_arm, only_reference) if n else np.nan,
        })
    table = pd.DataFrame(out)
    table.insert(0, "component", "")
    table.insert(1, "comparison", comparison_name(arm, reference))
    table.insert(2, "arm", arm)
    table.insert(3, "reference", reference)
    table["supported"] = supported(table["n_patients"], table["positives"], np.zeros(len(table)), "sensitivity")
    table["significant"] = table["supported"] & (table["p_value"] < alpha)
    return table


def decompose(detected: Mapping[str, pd.DataFrame], attributes: Sequence[str] = ("phase",), confidence: float = 0.95,
              alpha: float = 0.05) -> pd.DataFrame:
    """The decomposition of one replicate: per component (:data:`COMPONENTS`) and subgroup, arm minus reference.

    Args:
        detected: arm name -> its tumor scans with ``detected`` at the endpoint's operating point
            (:func:`detections`); ``sham``, ``copy_paste`` and ``synthx`` are required, ``phantom``
            adds the ceiling.
        attributes: subgroup attributes; confidence / alpha: see :func:`paired_sensitivity_rows`.

    Returns:
        One row per (component, subgroup) with the columns of :data:`COLUMNS`.
    """
    frames = []
    for component in _components(list(detected)):
        frame = paired_sensitivity_rows(detected[component.arm], detected[component.reference], component.arm,
                                        component.reference, attributes, confidence, alpha)
        frame["component"] = component.name
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)[list(COLUMNS)]


def pooled_decomposition(replicates: Mapping[str, Mapping[str, ArmRecords]], attributes: Sequence[str] = ("phase",),
                         pair_thresholds: Mapping[str, Mapping[tuple[str, str], tuple[float, float]]] | None = None,
                         **pooling) -> pd.DataFrame:
    """The decomposition pooled over K seeds: each component's sensitivity difference by
    :func:`~lightning_modules.evaluation.seed_pooling.pool_seeds` (mean over seeds, two-level bootstrap).

    Args:
        replicates: seed -> arm -> :class:`~lightning_modules.evaluation.seed_pooling.ArmRecords`
            (the test records and m of each arm); ``sham``, ``copy_paste``, ``synthx`` required.
        attributes: subgroup attributes.
        pair_thresholds: seed -> ``(arm, reference)`` -> ``(reference's m, arm's m)`` for pairs
            compared at their own operating point (matched specificity); other pairs use each arm's m.
        pooling: further :func:`pool_seeds` keywords (``n_resamples``, ``confidence``, ``score``, ``seed``).

    Returns:
        :func:`pool_seeds`' sensitivity rows with a first column ``component``.
    """
    arms = set.intersection(*(set(by_arm) for by_arm in replicates.values())) if replicates else set()
    frames = []
    for component in _components(sorted(arms)):
        pair = (component.arm, component.reference)
        paired = {}
        for seed, by_arm in replicates.items():
            chosen = {arm: by_arm[arm] for arm in pair}
            if pair_thresholds is not None and pair in pair_thresholds.get(seed, {}):
                reference_m, arm_m = pair_thresholds[seed][pair]
                chosen = {component.reference: ArmRecords(by_arm[component.reference].records, reference_m),
                          component.arm: ArmRecords(by_arm[component.arm].records, arm_m)}
            paired[seed] = chosen
        frame = pool_seeds(paired, [pair], metrics=("sensitivity",), attributes=attributes, **pooling)
        frame.insert(0, "component", component.name)
        frames.append(frame)
    table = pd.concat(frames, ignore_index=True)
    table.attrs.update(frames[0].attrs)
    return table


__all__ = ["COLUMNS", "COMPONENTS", "Component", "REQUIRED_ARMS", "decompose", "detections", "paired_sensitivity_rows",
           "pooled_decomposition"]
