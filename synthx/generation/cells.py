"""The cells SynthX targets and what is counted in them: the grid sex x age band x phase
(the subgroups of docs/explanation/detection-and-statistics.md "Subgroups"), a cohort's labelled
cases, the training positives and the canvases (healthy real training scans) per cell. A case whose
sex, age or phase is Unknown belongs to no cell. The rules that size requests from these counts are
:mod:`synthx.generation.targeting`.

Example::

    cases = labelled_cases(load_cohort("data/phantom"), load_split("splits/phantom.csv"))
    positives, canvases = count_positives(cases, "train"), count_canvases(cases)
"""

from __future__ import annotations

from typing import Mapping, Sequence

import pandas as pd

from lightning_modules.data.cohort import Cohort
from lightning_modules.data.metadata import AGE_BAND_NAMES, PHASES, SEXES, UNKNOWN, normalize_phase, normalize_sex

CELL_COLUMNS = ("sex", "age_band", "phase")
TARGET_COLUMNS = CELL_COLUMNS + ("real_positives", "requested")


class TargetingError(ValueError):
    """A targeting rule, table or split cannot be used; the message says which and why."""


def cell_grid(
    sexes: Sequence[str] = SEXES,
    age_bands: Sequence[str] = AGE_BAND_NAMES,
    phases: Sequence[str] = PHASES,
) -> pd.DataFrame:
    """Every (sex, age band, phase) cell in the stable order used by all targeting tables."""
    for value, allowed, column in ((sexes, SEXES, "sex"), (age_bands, AGE_BAND_NAMES, "age_band"), (phases, PHASES, "phase")):
        unknown = [v for v in value if v not in allowed]
        if unknown:
            raise TargetingError(f"{column} {unknown} is not a cell value (allowed: {', '.join(allowed)})")
    # Keep the canonical order whatever order the caller listed the values in.
    rows = [
        (sex, band, phase)
        for sex in SEXES
        if sex in sexes
        for band in AGE_BAND_NAMES
        if band in age_bands
        for phase in PHASES
        if phase in phases
    ]
    return pd.DataFrame(rows, columns=list(CELL_COLUMNS))


def labelled_cases(cohort: Cohort, split: pd.DataFrame, lesion_class: str = "pancreatic_lesion") -> pd.DataFrame:
    """The cohort's normalized metadata with the resolved scan-level ``tumor`` label and each case's ``split``.

    Args:
        cohort: the real cohort.
        split: its split table, checked against the cohort (:func:`lightning_modules.data.splits.load_split`).
        lesion_class: the lesion mask that defines a positive case when ``tumor`` is not recorded.

    Cases missing from the split file get split ``""`` (in no split).
    """
    table = cohort.metadata.copy()
    table["tumor"] = cohort.resolve_tumor_labels(lesion_class).to_numpy()
    split_of = dict(zip(split["case_id"], split["split"]))
    table["split"] = [split_of.get(case_id, "") for case_id in table["case_id"]]
    return table


def count_positives(cases: pd.DataFrame, split_name: str, grid: pd.DataFrame | None = None) -> pd.DataFrame:
    """Positive real cases of one split per cell: the grid with a ``count`` column.

    Synthetic rows and rows with an Unknown sex, age band or phase are not counted.
    """
    grid = cell_grid() if grid is None else grid
    chosen = cases[
        (cases["split"] == split_name)
        & (cases["tumor"].astype(int) == 1)
        & (cases.get("synthetic", 0) == 0)
        & (cases["sex"] != UNKNOWN)
        & (cases["age_band"] != UNKNOWN)
        & (cases["phase"] != UNKNOWN)
    ]
    counts = chosen.groupby(list(CELL_COLUMNS)).size().rename("count").reset_index()
    table = grid.merge(counts, on=list(CELL_COLUMNS), how="left")
    table["count"] = table["count"].fillna(0).astype(int)
    return table


def count_canvases(cases: pd.DataFrame, grid: pd.DataFrame | None = None) -> pd.DataFrame:
    """Healthy real training cases per cell (the canvases generation may paint into): the grid with ``count``."""
    grid = cell_grid() if grid is None else grid
    counts = cases[canvas_mask(cases)].groupby(list(CELL_COLUMNS)).size().rename("count").reset_index()
    table = grid.merge(counts, on=list(CELL_COLUMNS), how="left")
    table["count"] = table["count"].fillna(0).astype(int)
    return table


def canvas_mask(cases: pd.DataFrame) -> pd.Series:
    """Which rows of :func:`labelled_cases` are canvases: real, healthy, training, with a known phase."""
    return (
        (cases["split"] == "train")
        & (cases["tumor"].astype(int) == 0)
        & (cases["synthetic"].astype(int) == 0)
        & (cases["phase"] != UNKNOWN)
    )


def read_cell(row: Mapping, where: str) -> tuple[str, str, str]:
    try:
        sex = normalize_sex(row.get("sex"))
        phase = normalize_phase(row.get("phase"))
    except ValueError as error:
        raise TargetingError(f"{where}: {error}") from None
    band = str(row.get("age_band", "")).strip()
    if sex == UNKNOWN or phase == UNKNOWN or band not in AGE_BAND_NAMES:
        raise TargetingError(
            f"{where}: ({row.get('sex')!r}, {row.get('age_band')!r}, {row.get('phase')!r}) is not a cell "
            f"(sex F/M, age band one of {', '.join(AGE_BAND_NAMES)}, a known phase; Unknown never forms a cell)"
        )
    return sex, band, phase
