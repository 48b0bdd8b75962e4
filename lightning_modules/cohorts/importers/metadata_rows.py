"""The rows of a cohort's ``metadata.csv`` written by an import: ``--metadata`` overrides, one case's
row with the standard columns (Unknown where nothing was recorded), and reading and ordering the rows
of a file already there."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

from lightning_modules.cohorts.importers.source_cases import ImportCaseError, ImportSourceError
from lightning_modules.data.metadata import (
    UNKNOWN,
    canonical_column,
    normalize_age,
    normalize_metadata,
    normalize_phase,
    normalize_race,
    normalize_sex,
)


def read_metadata_overrides(path: Path | str | None) -> dict[str, dict[str, str]]:
    """``--metadata FILE``: a CSV keyed by case_id whose non-empty values replace what a source gives.

    This is how known values a source format cannot carry (patient ids, phase from a dataset's
    description, sex and age from a clinical table) reach ``metadata.csv``; nothing is inferred.
    """
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise ImportSourceError(f"metadata file {path}: does not exist")
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    table = table.rename(columns={c: canonical_column(c) for c in table.columns})
    if "case_id" not in table.columns:
        raise ImportSourceError(f"metadata file {path}: needs a case_id column, has {list(table.columns)}")
    duplicated = sorted(set(table.loc[table["case_id"].duplicated(), "case_id"]))
    if duplicated:
        raise ImportSourceError(f"metadata file {path}: case id(s) {duplicated} appear more than once")
    overrides = {}
    for record in table.to_dict("records"):
        case_id = record.pop("case_id").strip()
        overrides[case_id] = {k: v.strip() for k, v in record.items() if str(v).strip() != ""}
    return overrides


def _format_age(age: float) -> str:
    return "" if math.isnan(age) else f"{age:g}"


def build_row(case_id: str, metadata: Mapping[str, object], source: str) -> dict[str, object]:
    """A ``metadata.csv`` row with the standard columns; Unknown where nothing was recorded.

    Raises:
        ImportCaseError: when a recorded value is unreadable (e.g. sex ``X``), naming the column.
    """
    row: dict[str, object] = {
        "case_id": case_id,
        "patient_id": "",
        "cohort": UNKNOWN,
        "age": "",
        "sex": UNKNOWN,
        "race": UNKNOWN,
        "phase": UNKNOWN,
        # Left empty so the cohort derives it from the lesion mask of the class a recipe uses.
        "tumor": "",
        "synthetic": 0,
    }
    for key, value in metadata.items():
        row[canonical_column(key)] = value
    try:
        row["sex"] = normalize_sex(row["sex"])
        row["phase"] = normalize_phase(row["phase"])
        row["race"] = normalize_race(row["race"])
        row["age"] = _format_age(normalize_age(row["age"]))
    except ValueError as error:
        raise ImportCaseError(f"{case_id} ({source}): metadata: {error}") from error
    _, problems = normalize_metadata(pd.DataFrame([{k: "" if v is None else str(v) for k, v in row.items()}]))
    if problems:
        raise ImportCaseError(f"{case_id} ({source}): metadata: " + "; ".join(str(p) for p in problems))
    return row


def _read_rows(path: Path) -> dict[str, dict[str, object]]:
    if not path.exists():
        return {}
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    if "case_id" not in table.columns:
        raise ImportSourceError(f"{path}: existing file has no case_id column; refusing to overwrite it")
    return {record["case_id"]: record for record in table.to_dict("records")}


def _rows_table(rows: Mapping[str, Mapping[str, object]], leading: Sequence[str]) -> pd.DataFrame:
    columns = list(leading)
    for row in rows.values():
        columns += [c for c in row if c not in columns]
    # Sorted by case id, so the file does not depend on the order in which runs finished cases.
    ordered = [rows[case_id] for case_id in sorted(rows)]
    return pd.DataFrame([{c: row.get(c, "") for c in columns} for row in ordered], columns=columns)
