"""The audit's patient layer: which cases are audited, patients in two splits, and synthetic canvases.

A patient in two splits is a leak; so is a synthetic case in val/test, one painted on a canvas
that is not a training case of the split (the evaluation scan then leaks into training), and a
synthetic cohort whose generator learned from a case that is not a training case of the split, or
whose generator's provenance is unknown (:mod:`lightning_modules.data.synthetic_provenance`). A
table without ``patient_id`` (each case its own patient) is a warning: scans of one person cannot
be traced.
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from lightning_modules.cohorts.audit.findings import Finding, split_order
from lightning_modules.data.cohort import Cohort
from lightning_modules.data.splits import SPLITS
from lightning_modules.data.synthetic_provenance import cohort_provenance_problem, read_provenance

CASE_COLUMNS = ("case_id", "split", "patient_id", "synthetic", "source_case_id", "cohort_index")


def audited_cases(
    cohort: Cohort, split: pd.DataFrame, synthetic_cohorts: Sequence[Cohort]
) -> tuple[pd.DataFrame, list[Finding]]:
    """One row per audited case (:data:`CASE_COLUMNS`): the split's real cases, then every synthetic
    case of the cohorts (training data by construction), with findings on rows that cannot be audited."""
    if "patient_id" not in split.columns:
        split = split.assign(patient_id="")
    rows, findings = [], []
    for case_id, split_name, split_patient in zip(split["case_id"], split["split"], split["patient_id"]):
        row, finding = _split_row(cohort, case_id, split_name, split_patient)
        rows += [row] if row else []
        findings += [finding] if finding else []
    listed = {row["case_id"] for row in rows}
    for index, source in enumerate([cohort, *synthetic_cohorts]):
        for row in source.metadata.itertuples():
            if int(row.synthetic) != 1 or row.case_id in listed:
                continue
            # A synthetic case outside the split is training data (it is mixed into training only).
            rows.append(dict(zip(CASE_COLUMNS, (row.case_id, "train", str(row.patient_id), 1, str(row.source_case_id), index))))
            listed.add(row.case_id)
    return pd.DataFrame(rows, columns=list(CASE_COLUMNS)), findings


def _split_row(cohort: Cohort, case_id: str, split_name: str, split_patient: str) -> tuple[dict | None, Finding | None]:
    """The audited row of one split line, or the finding that says why it cannot be audited."""
    if split_name not in SPLITS:
        detail = f"split {split_name!r} is not train/val/test: not audited"
        return None, Finding("patients", "bad_split_value", "warning", case_id, detail=detail)
    if case_id not in cohort:
        detail = f"not in cohort {cohort.root}: cannot be audited"
        return None, Finding("patients", "unknown_case", "warning", case_id, split=split_name, detail=detail)
    metadata = cohort.row(case_id)
    patient = str(metadata["patient_id"])
    row = dict(zip(CASE_COLUMNS, (case_id, split_name, patient, int(metadata["synthetic"]), str(metadata["source_case_id"]), 0)))
    if split_patient and split_patient != patient:
        detail = f"split CSV says patient {split_patient!r}, cohort metadata says {patient!r}; the cohort's is used"
        finding = Finding("patients", "patient_id_mismatch", "warning", case_id, split=split_name, patient_id=patient, detail=detail)
        return row, finding
    return row, None


def patient_findings(cohort: Cohort, cases: pd.DataFrame) -> list[Finding]:
    """Patient overlap across splits, missing patient ids, and synthetic canvases outside train."""
    findings: list[Finding] = []
    if cohort.patient_id_missing:
        detail = (
            "metadata.csv has no patient_id column: each case is treated as its own patient, "
            "so scans of one patient in different splits cannot be detected"
        )
        findings.append(Finding("patients", "patient_id_missing", "warning", detail=detail))
    real = cases[cases["synthetic"] == 0]
    findings += _patient_overlaps(real)
    split_of = dict(zip(real["case_id"], real["split"]))
    for row in cases[cases["synthetic"] == 1].itertuples():
        findings += _synthetic_findings(row, split_of)
    return findings


def _patient_overlaps(real: pd.DataFrame) -> list[Finding]:
    findings = []
    for patient, group in real.groupby("patient_id", sort=True):
        splits = sorted(set(group["split"]), key=split_order)
        if len(splits) < 2:
            continue
        first = group[group["split"] == splits[-1]].iloc[0]
        other = group[group["split"] == splits[0]].iloc[0]
        listing = ", ".join(f"{c} ({s})" for c, s in zip(group["case_id"], group["split"]))
        findings.append(
            Finding(
                "patients", "patient_overlap", "leak", first.case_id, other.case_id, first.split, other.split,
                patient_id=str(patient), detail=f"patient {patient} is in {'/'.join(splits)}: {listing}",
            )
        )  # fmt: skip
    return findings


def _synthetic_findings(row, split_of: dict[str, str]) -> list[Finding]:
    """A synthetic case must be training data painted on a real training case of the split."""
    findings = []
    if row.split != "train":
        detail = "synthetic case in a validation/test split: synthetic data is training-only"
        findings.append(Finding("patients", "synthetic_in_eval", "leak", row.case_id, split=row.split, detail=detail))
    if not row.source_case_id:
        detail = "synthetic case without source_case_id: its canvas cannot be checked"
        findings.append(Finding("patients", "synthetic_without_source", "warning", row.case_id, split=row.split, detail=detail))
    elif row.source_case_id not in split_of:
        detail = "canvas is not in the split: only real training cases may serve as canvases"
        findings.append(
            Finding("patients", "synthetic_source_outside_split", "leak", row.case_id, row.source_case_id, row.split, detail=detail)
        )
    elif split_of[row.source_case_id] != "train":
        canvas_split = split_of[row.source_case_id]
        detail = f"canvas is a {canvas_split} case: the evaluation scan leaks into training"
        findings.append(
            Finding(
                "patients", "synthetic_source_in_eval", "leak", row.case_id, row.source_case_id, row.split, canvas_split,
                detail=detail,
            )
        )  # fmt: skip
    return findings


def generator_findings(synthetic_cohorts: Sequence[Cohort], split: pd.DataFrame, split_sha256: str) -> list[Finding]:
    """One leak per synthetic cohort whose generator learned from a case outside this split's training
    set (naming the first such case), or whose generator's provenance is missing or unreadable."""
    findings = []
    for synthetic in synthetic_cohorts:
        problem = cohort_provenance_problem(synthetic.root, split, split_sha256)
        if problem is None:
            continue
        try:
            provenance = read_provenance(synthetic.root)
        except ValueError:
            provenance = None
        split_of = dict(zip(split["case_id"].astype(str), split["split"].astype(str)))
        outside = [c for c in (provenance.training_cases if provenance else []) if split_of.get(c) != "train"]
        case_id = outside[0] if outside else ""
        kind = "synthetic_generator_learned_eval" if outside else "synthetic_generator_unknown"
        findings.append(Finding("patients", kind, "leak", case_id, split=split_of.get(case_id, "") if case_id else "", detail=problem))
    return findings
