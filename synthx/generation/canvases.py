"""Canvases and requests: which healthy training scan each requested synthetic case is painted into.

A canvas is a healthy (``tumor == 0``) real case of the TRAINING split with a known phase. A
request names a cell (sex, age band, phase) and an index within it; it is painted only into a
canvas of that very cell, so the synthetic case's metadata (the canvas' own sex, age and phase)
describes the scan it lives in. A cell without such a canvas is unfillable: it is reported, never
relabeled (docs/explanation/synthx.md "Synthetic data"). Canvases are reused across requests and generations,
so one scan may carry tumors in several synthetic cases. The sizes of the tumors drawn into them
follow, unless the recipe sets weights, the real training tumors (:func:`training_tumor_diameters`).

Example::

    canvases = canvas_table(cohort, split)
    fillable, unfillable = partition_requests(as_requests({("F", "60-80", "venous"): 2}), canvases)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from lightning_modules.data.cohort import Cohort
from lightning_modules.data.lesions import largest_lesion_extent_mm
from lightning_modules.data.metadata import AGE_BAND_NAMES, PHASES, SEXES, UNKNOWN
from synthx.generation.cells import CELL_COLUMNS, canvas_mask, labelled_cases
from synthx.generation.targeting import requests_from_targets

LESION_CLASS = "pancreatic_lesion"
ORGAN_CLASS = "pancreas"


class GenerationError(ValueError):
    """Generation cannot start or a case cannot be made; the message names the case and the problem."""


@dataclass(frozen=True)
class SynthesisRequest:
    """One synthetic case to make: its cell and its index within the cell."""

    sex: str
    age_band: str
    phase: str
    index: int

    def case_id(self, seed: int) -> str:
        return f"SX{seed}_{self.sex}_{self.age_band}_{self.phase}_{self.index:04d}"

    @property
    def key(self) -> str:
        return f"{self.sex}/{self.age_band}/{self.phase}#{self.index}"

    @property
    def cell(self) -> tuple[str, str, str]:
        return (self.sex, self.age_band, self.phase)

    def rng(self, seed: int) -> np.random.Generator:
        """The request's own random stream: a function of (seed, cell, index) only."""
        cell = (SEXES.index(self.sex), AGE_BAND_NAMES.index(self.age_band), PHASES.index(self.phase))
        return np.random.default_rng(np.random.SeedSequence([int(seed), *cell, int(self.index)]))


def as_requests(requests) -> list[SynthesisRequest]:
    """Requests from a targeting table, a ``{(sex, age band, phase): count}`` mapping or a list of requests."""
    if isinstance(requests, pd.DataFrame):
        return [SynthesisRequest(**r) for r in requests_from_targets(requests)]
    if isinstance(requests, Mapping):
        table = pd.DataFrame(
            [{"sex": k[0], "age_band": k[1], "phase": k[2], "requested": int(v)} for k, v in requests.items()]
        )
        return [SynthesisRequest(**r) for r in requests_from_targets(table)] if len(table) else []
    result = [r if isinstance(r, SynthesisRequest) else SynthesisRequest(**r) for r in requests]
    keys = [r.key for r in result]
    if len(set(keys)) != len(keys):
        raise GenerationError("the request list names the same (cell, index) twice")
    return result


def _check_canvas(row: pd.Series, case_id: str) -> None:
    if row["split"] != "train":
        where = f"the {row['split']} split" if row["split"] else "no split"
        raise GenerationError(
            f"canvas {case_id} is in {where}: only real TRAINING cases may serve as canvases "
            '(docs/explanation/synthx.md "Synthetic data")'
        )
    if int(row["synthetic"]) == 1:
        raise GenerationError(f"canvas {case_id} is synthetic: canvases must be real cases")
    if int(row["tumor"]) != 0:
        raise GenerationError(f"canvas {case_id} has a tumor (tumor={int(row['tumor'])}): canvases must be healthy")
    if row["phase"] == UNKNOWN:
        raise GenerationError(f"canvas {case_id} has an Unknown phase: a synthetic case takes its canvas' phase")


def canvas_table(cohort: Cohort, split: pd.DataFrame, canvas_ids: Sequence[str] | None = None) -> pd.DataFrame:
    """Healthy real training cases with a known phase: the candidate canvases.

    Args:
        cohort: the real cohort.
        split: its split table (checked against the cohort).
        canvas_ids: restrict to these cases; each must be a healthy real training case, else a
            :class:`GenerationError` names it and says why (val/test canvases are refused).
    """
    cases = labelled_cases(cohort, split, LESION_CLASS)
    if canvas_ids is not None:
        by_id = cases.set_index("case_id")
        for case_id in canvas_ids:
            if case_id not in by_id.index:
                raise GenerationError(f"canvas {case_id} is not in cohort {cohort.root}")
            _check_canvas(by_id.loc[case_id], case_id)
        cases = cases[cases["case_id"].isin(list(canvas_ids))]
    return cases[canvas_mask(cases)].sort_values("case_id").reset_index(drop=True)


def training_tumor_diameters(cohort: Cohort, split: pd.DataFrame) -> pd.Series:
    """The size of every real tumor case of the TRAINING split (mm, by case id): what the mask prior copies.

    A case's size is its recorded ``tumor_diameter_mm``; without one, the largest 3D extent of its
    lesion mask (the project's one size rule, as the evaluation records measure it). Validation and
    test cases are never read.

    Raises:
        GenerationError: the training split has no tumor case, or a case without a recorded size
            has no readable, non-empty lesion mask (naming the case and the file).
    """
    import nibabel as nib

    cases = labelled_cases(cohort, split, LESION_CLASS)
    real = cases["synthetic"].astype(int) == 0 if "synthetic" in cases else True
    positives = cases[(cases["split"] == "train") & (cases["tumor"].astype(int) == 1) & real]
    if positives.empty:
        raise GenerationError(
            f"{cohort.root}: the training split has no real tumor case to take tumor sizes from; "
            "set mask_prior.size_source=weights (with mask_prior.size_class_weights) in the SynthX recipe"
        )
    recorded = pd.to_numeric(positives.get("tumor_diameter_mm", pd.Series(np.nan, index=positives.index)), errors="coerce")
    sizes = {}
    for case_id, diameter in zip(positives["case_id"], recorded):
        if np.isfinite(diameter) and diameter > 0:
            sizes[case_id] = float(diameter)
            continue
        path = cohort.case(case_id).mask_path(LESION_CLASS)
        try:
            image = nib.load(path)
            mask = np.asarray(image.dataobj) > 0
        except Exception as error:  # nibabel raises several types; name the case and the file
            raise GenerationError(f"{case_id}: no recorded tumor_diameter_mm and {path} cannot be read: {error}") from error
        if not mask.any():
            raise GenerationError(f"{case_id}: recorded as a tumor case without tumor_diameter_mm, but {path} is empty")
        sizes[case_id] = largest_lesion_extent_mm(mask, [float(z) for z in image.header.get_zooms()[:3]])
    return pd.Series(sizes, name="tumor_diameter_mm", dtype=float)


def canvases_of(canvases: pd.DataFrame, cell: tuple[str, str, str]) -> pd.DataFrame:
    """The canvases whose own sex, age band and phase are the cell's."""
    sex, band, phase = cell
    return canvases[(canvases["sex"] == sex) & (canvases["age_band"] == band) & (canvases["phase"] == phase)]


def partition_requests(
    requests: Sequence[SynthesisRequest], canvases: pd.DataFrame
) -> tuple[list[SynthesisRequest], pd.DataFrame]:
    """Split requests into those with a canvas of their cell and a table of the unfillable cells.

    Returns:
        (fillable requests in their order, ``sex, age_band, phase, requested`` per unfillable cell).
    """
    fillable, unfillable = [], {}
    for request in requests:
        if len(canvases_of(canvases, request.cell)):
            fillable.append(request)
        else:
            unfillable[request.cell] = unfillable.get(request.cell, 0) + 1
    table = pd.DataFrame(
        [dict(zip(CELL_COLUMNS, cell), requested=n) for cell, n in unfillable.items()], columns=[*CELL_COLUMNS, "requested"]
    )
    return fillable, table


def choose_canvas(canvases: pd.DataFrame, request: SynthesisRequest, rng: np.random.Generator) -> dict:
    """A canvas of the request's own cell, drawn with the request's random stream.

    Raises:
        GenerationError: the cell has no canvas (:func:`partition_requests` keeps such requests out).
    """
    pool = canvases_of(canvases, request.cell)
    if pool.empty:
        raise GenerationError(f"no healthy training canvas is {request.sex}, {request.age_band}, {request.phase}")
    return pool.iloc[int(rng.integers(len(pool)))].to_dict()
