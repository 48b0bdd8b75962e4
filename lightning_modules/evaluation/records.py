"""Per-case evaluation records: their columns, their checks, and the values metrics read from them.

A record is one scan: ``case_id``, ``patient_id``, ``label`` (0/1, true scan-level tumor),
``volume_mm3`` (predicted tumor volume after small components are removed), ``raw_volume_mm3``
(every predicted tumor voxel), ``localized_volume_mm3`` (on a tumor scan only the components that
overlap the lesion), ``lesions`` and ``lesions_found``, ``max_prob`` and the attribute columns ``age_band, sex,
race, phase, cohort, tumor_size, tumor_location`` (docs/explanation/detection-and-statistics.md "Subgroups"). ``Unknown`` or an
empty value leaves a case out of that attribute's subgroups and keeps it in ``overall`` (BenchX 4.1).
Everything that reads records (detection metrics, operating points, subgroups, the bootstrap) reads
them through this module, so a bad record is refused once, naming the case and the column.

Example::

    validate_records(records)               # ValueError naming the first bad cases
    values, truth = scores(records), labels(records)
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from lightning_modules.data.lesions import PANCREAS_LOCATIONS, SMALL_TUMOR_MM, TUMOR_SIZE_GROUPS, tumor_size_group
from lightning_modules.data.metadata import AGE_BAND_NAMES, PHASES, SEXES, UNKNOWN

ATTRIBUTES = ("age", "sex", "race", "phase", "tumor_size", "tumor_location", "cohort")
ATTRIBUTE_COLUMNS = {
    "age": "age_band",
    "sex": "sex",
    "race": "race",
    "phase": "phase",
    "tumor_size": "tumor_size",
    "tumor_location": "tumor_location",
    "cohort": "cohort",
}
TUMOR_SIZES = TUMOR_SIZE_GROUPS
TUMOR_LOCATIONS = PANCREAS_LOCATIONS
# Attributes with a closed vocabulary: every group gets a row (an empty one reports n=0), and any
# other value is an error rather than a silently new group.
CLOSED_GROUPS: dict[str, tuple[str, ...]] = {
    "age": AGE_BAND_NAMES,
    "sex": SEXES,
    "phase": PHASES,
    "tumor_size": TUMOR_SIZES,
}
# Open attributes list the recorded categories; these come first, in anatomical order.
PREFERRED_ORDER: dict[str, tuple[str, ...]] = {"tumor_location": TUMOR_LOCATIONS}
EXCLUDED_VALUES = frozenset({UNKNOWN, ""})
# volume: predicted tumor volume after removing small components (the ROC score); raw_volume: every
# predicted tumor voxel (BenchX's fixed-m rule); localized_volume: on a tumor scan only the predicted
# components that overlap the true lesion (docs/explanation/detection-and-statistics.md "Scan-level detection").
SCORE_COLUMNS = {"volume": "volume_mm3", "raw_volume": "raw_volume_mm3", "localized_volume": "localized_volume_mm3",
                 "max_prob": "max_prob"}
# The score BenchX's fixed m is applied to, per score kind: its protocol thresholds the raw
# predicted tumor voxels, with no component removal first.
FIXED_RULE_SCORES = {"volume": "raw_volume"}


def fixed_rule_score(score: str, records: pd.DataFrame | None = None) -> str:
    """The score the fixed m is applied to for a score kind (``volume`` -> ``raw_volume``).

    With ``records`` that lack the raw column (records written before it existed) ``score`` is kept.
    """
    score_column(score)
    raw = FIXED_RULE_SCORES.get(score, score)
    return raw if records is None or score_column(raw) in records.columns else score


def source_name(records: pd.DataFrame) -> str:
    """The name errors use for the records: ``records.attrs['source']`` (e.g. a CSV path) if set."""
    return str(records.attrs.get("source", "records"))


def score_column(score: str) -> str:
    """The record column holding a score kind (``volume`` -> ``volume_mm3``, ``max_prob``)."""
    if score not in SCORE_COLUMNS:
        raise ValueError(f"unknown score {score!r}: expected one of {sorted(SCORE_COLUMNS)}")
    return SCORE_COLUMNS[score]


def case_ids(records: pd.DataFrame) -> np.ndarray:
    """The case ids as stripped strings, in row order."""
    return records["case_id"].astype(str).str.strip().to_numpy()


def attribute_values(records: pd.DataFrame, attribute: str) -> np.ndarray:
    """An attribute's values as stripped strings; NaN/None and any spelling of unknown read as ``Unknown``."""
    if attribute not in ATTRIBUTE_COLUMNS:
        raise ValueError(f"unknown attribute {attribute!r}: expected one of {ATTRIBUTES}")
    column = records[ATTRIBUTE_COLUMNS[attribute]]
    text = column.astype(str).str.strip()
    values = text.to_numpy(dtype=object)
    values[column.isna().to_numpy() | (text.str.lower() == UNKNOWN.lower()).to_numpy()] = UNKNOWN
    return values


def _identity_problems(records: pd.DataFrame) -> list[str]:
    ids = records["case_id"].astype(str).str.strip()
    problems: list[str] = []
    empty = records["case_id"].isna() | (ids == "")
    if empty.any():
        problems.append(f"row {int(np.flatnonzero(empty.to_numpy())[0])}: empty case_id")
    for case_id in ids[ids.duplicated()].unique()[:5]:
        problems.append(f"case {case_id}: duplicate case_id")
    patients = records["patient_id"]
    empty_patient = patients.isna().to_numpy() | (patients.astype(str).str.strip() == "").to_numpy()
    for i in np.flatnonzero(empty_patient)[:5]:
        problems.append(f"case {ids.iloc[i]}: column 'patient_id' is empty")
    return problems


def _value_problems(records: pd.DataFrame, score: str) -> list[str]:
    ids = case_ids(records)
    problems: list[str] = []
    label_values = pd.to_numeric(records["label"], errors="coerce").to_numpy(dtype=float)
    for i in np.flatnonzero(~np.isin(label_values, (0.0, 1.0)))[:5]:
        problems.append(f"case {ids[i]}: column 'label' must be 0 or 1, got {records['label'].iloc[i]!r}")
    column = score_column(score)
    values = pd.to_numeric(records[column], errors="coerce").to_numpy(dtype=float)
    for i in np.flatnonzero(~np.isfinite(values))[:5]:
        problems.append(f"case {ids[i]}: column '{column}' must be a finite number, got {records[column].iloc[i]!r}")
    return problems


def _attribute_problems(records: pd.DataFrame, attributes: Sequence[str]) -> list[str]:
    ids = case_ids(records)
    problems: list[str] = []
    for attribute in attributes:
        if attribute not in CLOSED_GROUPS:
            continue
        values = attribute_values(records, attribute)
        allowed = set(CLOSED_GROUPS[attribute]) | EXCLUDED_VALUES
        for i in np.flatnonzero(~np.isin(values, list(allowed)))[:5]:
            problems.append(
                f"case {ids[i]}: column '{ATTRIBUTE_COLUMNS[attribute]}' has {values[i]!r}; "
                f"expected one of {list(CLOSED_GROUPS[attribute])} or Unknown/empty"
            )
    if "tumor_size" in attributes:
        sizes = attribute_values(records, "tumor_size")
        label_values = pd.to_numeric(records["label"], errors="coerce").to_numpy(dtype=float)
        for i in np.flatnonzero(np.isin(sizes, TUMOR_SIZES) & (label_values == 0))[:5]:
            problems.append(
                f"case {ids[i]}: column 'tumor_size' is {sizes[i]!r} on a scan with label 0 "
                "(tumor size is for positive scans only; use '' for negatives)"
            )
    return problems


def validate_records(
    records: pd.DataFrame, score: str = "volume", attributes: Sequence[str] = ATTRIBUTES
) -> None:
    """Raise ValueError naming the source, case and column of the first problems found in ``records``.

    Checks: required columns present, case ids unique and non-empty, patient ids non-empty, labels
    0/1, scores finite, closed attributes (age band, sex, phase, tumor size) within their
    vocabulary, and tumor size given only for positive scans.

    Args:
        records: per-case records (see the module docstring).
        score: ``volume`` or ``max_prob``; its column must be present and finite.
        attributes: the attributes whose columns must be present.
    """
    source = source_name(records)
    unknown_attributes = [a for a in attributes if a not in ATTRIBUTE_COLUMNS]
    if unknown_attributes:
        raise ValueError(f"unknown attributes {unknown_attributes}: expected a subset of {ATTRIBUTES}")
    required = ["case_id", "patient_id", "label", score_column(score)]
    required += [ATTRIBUTE_COLUMNS[a] for a in attributes]
    missing = [c for c in required if c not in records.columns]
    if missing:
        raise ValueError(f"{source}: missing column(s) {missing}; records need {required}")
    if len(records) == 0:
        raise ValueError(f"{source}: no records")
    problems = _identity_problems(records) + _value_problems(records, score) + _attribute_problems(records, attributes)
    if problems:
        raise ValueError(f"{source}: invalid records:\n  " + "\n  ".join(problems))


def scores(records: pd.DataFrame, score: str = "volume") -> np.ndarray:
    """The continuous detection score of each case: predicted tumor volume (mm³) or max probability.

    Args:
        records: per-case records.
        score: ``volume`` (column ``volume_mm3``) or ``max_prob``.
    """
    column = score_column(score)
    if column not in records.columns:
        raise ValueError(f"{source_name(records)}: missing column '{column}' for score {score!r}")
    values = pd.to_numeric(records[column], errors="coerce").to_numpy(dtype=float)
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        case = records["case_id"].iloc[bad[0]] if "case_id" in records else f"row {bad[0]}"
        raise ValueError(f"{source_name(records)}: case {case}: column '{column}' must be a finite number")
    return values


def labels(records: pd.DataFrame) -> np.ndarray:
    """The true scan-level labels as a boolean array (ValueError on anything but 0/1)."""
    values = pd.to_numeric(records["label"], errors="coerce").to_numpy(dtype=float)
    bad = np.flatnonzero(~np.isin(values, (0.0, 1.0)))
    if len(bad):
        raise ValueError(
            f"{source_name(records)}: case {records['case_id'].iloc[bad[0]]}: column 'label' must be 0 or 1, "
            f"got {records['label'].iloc[bad[0]]!r}"
        )
    return values == 1.0


def tumor_size_groups(diameters_mm, labels_, small_tumor_mm: float = SMALL_TUMOR_MM) -> np.ndarray:
    """The ``tumor_size`` attribute per case, by :func:`lightning_modules.data.lesions.tumor_size_group`:
    ``small`` (largest extent <= small_tumor_mm), ``large``, ``Unknown`` for a positive without a
    diameter, and ``''`` for negatives (docs/explanation/data.md "Lesion size and location").

    Args:
        diameters_mm: largest tumor extent per case (NaN when unknown).
        labels_: true scan-level labels (0/1).
        small_tumor_mm: the recipe's ``detection.small_tumor_mm`` (BenchX: 20 mm).
    """
    diameters = np.asarray(diameters_mm, dtype=float)
    positive = np.asarray(labels_).astype(int)
    return np.array([tumor_size_group(d, t, small_tumor_mm) for d, t in zip(diameters, positive)], dtype=object)


def read_records(path, source: str | None = None) -> pd.DataFrame:
    """Records from a CSV artifact; only empty cells read as missing (a race written ``NA`` stays a category)."""
    records = pd.read_csv(path, keep_default_na=False, na_values=[""])
    records.attrs["source"] = source or str(path)
    return records
