"""Cohort metadata: the columns of ``metadata.csv`` and their normalization (``docs/explanation/data.md "Cohorts on disk"``).

Everything that reads subgroup attributes (the data layer, evaluation, SynthX targeting) goes
through :func:`normalize_metadata`, so that ``female``, ``F`` and ``f`` are one group and
``portal venous`` is ``venous``. Unknown is a value, never a guess: anything that cannot be read
becomes ``Unknown`` only when the raw value is empty; an unreadable non-empty value is a problem
reported with the case id, never silently mapped.

This module is the one home of the table's column lists: :data:`STANDARD_COLUMNS` (every
normalized table has them), :data:`OPTIONAL_COLUMNS` (known, kept when present) and
:data:`RECORD_COLUMNS` (what travels with each evaluation item into the per-case records).

Example::

    table, problems = normalize_metadata(read_metadata_csv("data/phantom/metadata.csv"))
"""

from __future__ import annotations

import math
import re
from typing import Iterable

import numpy as np
import pandas as pd

from lightning_modules.data.problems import Problem

UNKNOWN = "Unknown"
METADATA_FILE = "metadata.csv"

SEXES = ("F", "M")
PHASES = ("non-contrast", "arterial", "venous", "delayed")
# docs/explanation/detection-and-statistics.md "Subgroups": lower bound exclusive, upper bound inclusive.
AGE_BANDS: tuple[tuple[str, float, float], ...] = (
    ("le20", -math.inf, 20.0),
    ("20-40", 20.0, 40.0),
    ("40-60", 40.0, 60.0),
    ("60-80", 60.0, 80.0),
    ("gt80", 80.0, math.inf),
)
AGE_BAND_NAMES = tuple(name for name, _, _ in AGE_BANDS)

REQUIRED_COLUMNS = ("case_id",)
# Columns every normalized table has (filled with defaults when absent from the CSV).
STANDARD_COLUMNS = (
    "case_id",
    "patient_id",
    "cohort",
    "age",
    "sex",
    "race",
    "phase",
    "tumor",
    "synthetic",
    "source_case_id",
    "generator_run_id",
)
# Known columns kept as given when present (never filled in: the importers, the phantom and SynthX
# write them; lightning_modules.data.lesions derives the tumor's size and location from the masks).
OPTIONAL_COLUMNS = ("scanner", "spacing", "kvp", "tumor_diameter_mm", "tumor_location")
# Columns carried with every evaluation item into its per-case record (strings or numbers).
RECORD_COLUMNS = (
    "case_id",
    "patient_id",
    "cohort",
    "age_band",
    "sex",
    "race",
    "phase",
    "tumor_diameter_mm",
    "tumor_location",
    "synthetic",
)

# AbdomenAtlas 3.0 and other common headers accepted as aliases (compared case-insensitively,
# spaces and dashes folded to underscores).
COLUMN_ALIASES = {
    "bdmap_id": "case_id",
    "case": "case_id",
    "id": "case_id",
    "patient": "patient_id",
    "patientid": "patient_id",
    "contrast": "phase",
    "contrast_phase": "phase",
    "ct_phase": "phase",
    "gender": "sex",
    "ethnicity": "race",
    "site": "cohort",
    "dataset": "cohort",
    "spacing_mm": "spacing",
    "scanner_model": "scanner",
}

_SEX_SYNONYMS = {"f": "F", "female": "F", "woman": "F", "m": "M", "male": "M", "man": "M"}
_PHASE_SYNONYMS = {
    "non-contrast": "non-contrast",
    "noncontrast": "non-contrast",
    "non contrast": "non-contrast",
    "plain": "non-contrast",
    "unenhanced": "non-contrast",
    "native": "non-contrast",
    "nc": "non-contrast",
    "arterial": "arterial",
    "art": "arterial",
    "pancreatic": "arterial",
    "late arterial": "arterial",
    "venous": "venous",
    "portal venous": "venous",
    "portal-venous": "venous",
    "portal": "venous",
    "pv": "venous",
    "delayed": "delayed",
    "delay": "delayed",
}
_UNKNOWN_TOKENS = {"", "unknown", "nan", "none", "na", "n/a", "null", "?", "unk"}


def _is_unknown(value) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    return str(value).strip().lower() in _UNKNOWN_TOKENS


def normalize_sex(value) -> str:
    """Map a recorded sex to ``F``, ``M`` or ``Unknown``; raise ValueError on anything else."""
    if _is_unknown(value):
        return UNKNOWN
    key = str(value).strip().lower()
    if key in _SEX_SYNONYMS:
        return _SEX_SYNONYMS[key]
    raise ValueError(f"unknown sex {value!r} (expected one of F, M, female, male, Unknown)")


def normalize_phase(value) -> str:
    """Map a recorded contrast phase to one of :data:`PHASES` or ``Unknown``."""
    if _is_unknown(value):
        return UNKNOWN
    key = re.sub(r"[_\s]+", " ", str(value).strip().lower())
    if key in _PHASE_SYNONYMS:
        return _PHASE_SYNONYMS[key]
    key = key.replace(" phase", "")
    if key in _PHASE_SYNONYMS:
        return _PHASE_SYNONYMS[key]
    raise ValueError(
        f"unknown phase {value!r} (expected non-contrast, arterial, venous, delayed, "
        "plain, portal venous, pv, delay or Unknown)"
    )


def normalize_age(value) -> float:
    """Return the age in years as a float, NaN when unknown; raise ValueError when unreadable."""
    if _is_unknown(value):
        return math.nan
    text = str(value).strip().lower()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(y|yr|yrs|years?|m|months?)?", text)
    if match is None:
        # DICOM AgeString, e.g. 054Y / 006M
        match = re.fullmatch(r"(\d{3})([ymwd])", text)
    if match is None:
        raise ValueError(f"unreadable age {value!r} (expected years, e.g. 54 or 54Y)")
    number, unit = float(match.group(1)), (match.group(2) or "y")
    years = number / 12.0 if unit.startswith("m") else number
    if unit == "w":
        years = number / 52.0
    elif unit == "d":
        years = number / 365.25
    if not 0 <= years <= 125:
        raise ValueError(f"age {value!r} is outside 0-125 years")
    return years


def age_band(age: float) -> str:
    """The BenchX age band of an age in years (``docs/explanation/detection-and-statistics.md "Subgroups"``), ``Unknown`` for NaN."""
    if age is None or (isinstance(age, float) and math.isnan(age)):
        return UNKNOWN
    for name, low, high in AGE_BANDS:
        if low < age <= high:
            return name
    raise ValueError(f"age {age!r} falls in no band")


def age_bands(ages: Iterable[float]) -> np.ndarray:
    """Vectorized :func:`age_band` for an array of ages (NaN -> ``Unknown``)."""
    return np.array([age_band(float(a)) for a in ages], dtype=object)


def normalize_race(value) -> str:
    """Keep the recorded category (whitespace-trimmed); empty becomes ``Unknown``. Never inferred."""
    if _is_unknown(value):
        return UNKNOWN
    return str(value).strip()


def _normalize_binary(value, column: str) -> int:
    # -1 is how a normalized table marks "not recorded", so written-back tables read back the same.
    if _is_unknown(value) or str(value).strip() in {"-1", "-1.0"}:
        return -1
    text = str(value).strip().lower()
    if text in {"1", "1.0", "true", "yes", "y", "positive"}:
        return 1
    if text in {"0", "0.0", "false", "no", "n", "negative"}:
        return 0
    raise ValueError(f"{column} must be 0 or 1, got {value!r}")


class MetadataReadError(ValueError):
    """A ``metadata.csv`` that cannot be read as a table; ``problem`` names the file and what is wrong."""

    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(str(problem))


def read_metadata_csv(path) -> pd.DataFrame:
    """The raw table of a cohort's ``metadata.csv``, every cell as text: the one reader of that file.

    Raises:
        MetadataReadError: the file is empty, ragged (a row with more fields than the header), not
            UTF-8 text, or not readable; the message names the file and, where known, the line.
    """
    try:
        return pd.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8")
    except pd.errors.EmptyDataError:
        message = "cannot read metadata: the file is empty (it needs a header line with at least case_id)"
    except pd.errors.ParserError as error:
        detail = str(error).strip().replace("Error tokenizing data. C error: ", "")
        message = f"cannot read metadata: ragged table, every row needs the header's number of fields ({detail})"
    except UnicodeDecodeError as error:
        message = (f"cannot read metadata: not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
                   f"{error.start}); save it as UTF-8")
    except OSError as error:
        message = f"cannot read metadata: {error}"
    raise MetadataReadError(Problem("<cohort>", str(path), message))


def canonical_column(name: str) -> str:
    """The standard column name for a header (aliases such as ``BDMAP ID`` -> ``case_id``)."""
    key = re.sub(r"[\s\-]+", "_", str(name).strip().lower())
    return COLUMN_ALIASES.get(key, key)


def normalize_metadata(raw: pd.DataFrame) -> tuple[pd.DataFrame, list[Problem]]:
    """Normalize a raw ``metadata.csv`` table.

    Returns the normalized table (standard columns always present; ``tumor`` is -1 where it must be
    derived from the masks) and every problem found, each naming the case and the column. Rows
    with problems are kept with the offending value set to Unknown so that all problems can be
    listed at once; callers decide whether problems are fatal.
    """
    problems: list[Problem] = []
    table = raw.rename(columns={c: canonical_column(c) for c in raw.columns}).copy()
    duplicated_headers = table.columns[table.columns.duplicated()].tolist()
    for column in duplicated_headers:
        problems.append(Problem("<header>", METADATA_FILE, column=column, message="column given twice (after aliases)"))
    table = table.loc[:, ~table.columns.duplicated()]
    for column in REQUIRED_COLUMNS:
        if column not in table.columns:
            problems.append(Problem("<header>", METADATA_FILE, column=column, message="required column is missing"))
            return pd.DataFrame(columns=list(STANDARD_COLUMNS)), problems

    table["case_id"] = table["case_id"].map(lambda v: "" if _is_unknown(v) else str(v).strip())
    for i, case_id in enumerate(table["case_id"]):
        if case_id == "":
            problems.append(Problem(f"<row {i + 2}>", METADATA_FILE, column="case_id", message="empty case id"))
        elif "/" in case_id or "\\" in case_id or case_id in {".", ".."} or ".." in case_id:
            problems.append(Problem(case_id, METADATA_FILE, column="case_id", message="unsafe case id (path separator or '..')"))
    for case_id in table.loc[table["case_id"].duplicated() & (table["case_id"] != ""), "case_id"].unique():
        problems.append(Problem(case_id, METADATA_FILE, column="case_id", message="duplicate case id"))

    def apply(column: str, function, default):
        if column not in table.columns:
            table[column] = default
            return
        values = []
        for case_id, value in zip(table["case_id"], table[column]):
            try:
                values.append(function(value))
            except ValueError as error:
                problems.append(Problem(case_id, METADATA_FILE, column=column, message=str(error)))
                values.append(function(None))
        table[column] = values

    apply("sex", normalize_sex, UNKNOWN)
    apply("phase", normalize_phase, UNKNOWN)
    apply("race", normalize_race, UNKNOWN)
    apply("age", normalize_age, math.nan)
    apply("tumor", lambda v: _normalize_binary(v, "tumor"), -1)
    apply("synthetic", lambda v: max(_normalize_binary(v, "synthetic"), 0), 0)

    if "patient_id" not in table.columns:
        table["patient_id"] = table["case_id"]
        table.attrs["patient_id_missing"] = True
    else:
        table["patient_id"] = [
            case_id if _is_unknown(p) else str(p).strip() for case_id, p in zip(table["case_id"], table["patient_id"])
        ]
        table.attrs["patient_id_missing"] = False
    for column in ("cohort",):
        if column not in table.columns:
            table[column] = UNKNOWN
        else:
            table[column] = table[column].map(lambda v: UNKNOWN if _is_unknown(v) else str(v).strip())
    for column in ("source_case_id", "generator_run_id"):
        if column not in table.columns:
            table[column] = ""
        else:
            table[column] = table[column].map(lambda v: "" if _is_unknown(v) else str(v).strip())
    for case_id, synthetic, source in zip(table["case_id"], table["synthetic"], table["source_case_id"]):
        if synthetic == 1 and source == "":
            problems.append(Problem(case_id, METADATA_FILE, column="source_case_id", message="synthetic case without a source (canvas) case id"))
    table["age_band"] = age_bands(table["age"])
    ordered = list(STANDARD_COLUMNS) + ["age_band"] + [c for c in OPTIONAL_COLUMNS if c in table.columns]
    table = table[ordered + [c for c in table.columns if c not in ordered]]
    return table.reset_index(drop=True), problems
