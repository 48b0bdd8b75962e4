"""The phantom painter: real-appearance tumors rendered by the phantom itself, the study's positive control.

SynthX's result depends on two things at once: whether synthetic tumors look like real ones, and
whether more tumors of a thin subgroup help the detector at all. The phantom painter separates
them. For a request it takes a matching healthy training canvas of the embedded phantom cohort
(the same canvases, cells and random streams as :func:`synthx.generation.run.synthesize` with the
diffusion generator) and renders that very scan again with one pancreatic tumor planned into it:
the same patient, anatomy, site and acquisition, and a tumor drawn from the phantom's own tumor
distribution (diameter 10-45 mm, location head/body/tail) with the phantom's own appearance for the
canvas' phase. No model is trained and no real tumor is copied: the tumor is new, and its
appearance is the phantom's forward model, which no generator can beat.

What it answers: with tumors that are as real as the phantom's, does the study, at the same budget,
ratio and training, narrow the scarcity gap, and does it leave the physics gap shut? If it does,
the study can see a real effect and a SynthX null result is about the generator; if it does not,
the budget or the mixing is too weak to test SynthX at all. It works only on a phantom cohort
(``phantom.json`` names its seed, shape and spacing); any other cohort is refused.

Example::

    painter = PhantomPainter("data/phantom")
    case = painter.paint(canvas_row, request, request.rng(seed), seed)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping

import nibabel as nib
import numpy as np
from threadpoolctl import threadpool_limits

from lightning_modules.data.cohort import CT_FILE
from lightning_modules.data.lesions import pancreas_location
from lightning_modules.cohorts.phantom import (
    PARAMS_FILE,
    PHANTOM_VERSION,
    LesionPlan,
    ScanPlan,
    plan_phantom_cohort,
    render_scan,
)
from lightning_modules.cohorts.phantom.plan import CASE_ID_PREFIX, draw_pancreatic_tumor
from synthx.generation.canvases import LESION_CLASS, ORGAN_CLASS, GenerationError, SynthesisRequest
from synthx.generation.painting import GeneratedCase, synthetic_row
from synthx.painters import PHANTOM_PAINTER


class PhantomPainter:
    """Renders healthy phantom canvases again with a planned pancreatic tumor.

    Args:
        cohort_root: the phantom cohort; its ``phantom.json`` must come from this phantom version.
    """

    def __init__(self, cohort_root: Path | str):
        self.root = Path(cohort_root)
        params_path = self.root / PARAMS_FILE
        if not params_path.is_file():
            raise GenerationError(
                f"the phantom painter renders tumors with the phantom's own model, so it needs a phantom cohort: "
                f"{self.root} has no {PARAMS_FILE}"
            )
        params = json.loads(params_path.read_text())
        if params.get("version") != PHANTOM_VERSION:
            raise GenerationError(
                f"{params_path}: phantom version {params.get('version')!r}, this code renders version {PHANTOM_VERSION!r}; "
                "regenerate the cohort with this code before painting into it"
            )
        self.seed = int(params["seed"])
        self.shape = tuple(int(n) for n in params["shape"])
        self.spacing = tuple(float(s) for s in params["spacing"])
        # Canvases are reused across requests: each is planned and checked against its file once.
        self._plans: dict[str, ScanPlan] = {}
        self._checked: set[str] = set()

    def plan_of(self, case_id: str) -> ScanPlan:
        """The canvas' scan plan (the phantom's plans are a prefix-stable sequence, so its index suffices)."""
        if not case_id.startswith(CASE_ID_PREFIX) or not case_id[len(CASE_ID_PREFIX):].isdigit():
            raise GenerationError(f"canvas {case_id}: not a phantom case id ({CASE_ID_PREFIX}<number>)")
        if case_id in self._plans:
            return self._plans[case_id]
        index = int(case_id[len(CASE_ID_PREFIX):]) - 1
        plan = plan_phantom_cohort(index + 1, self.seed)[index]
        if plan.case_id != case_id:
            raise GenerationError(f"canvas {case_id}: the phantom's plan has {plan.case_id} at that index")
        if plan.tumor:
            raise GenerationError(f"canvas {case_id}: the phantom planned a pancreatic tumor in it; a canvas must be healthy")
        self._plans[case_id] = plan
        return plan

    def paint(self, canvas_row: Mapping, request: SynthesisRequest, rng: np.random.Generator, seed: int) -> GeneratedCase:
        """The canvas rendered again with one pancreatic tumor; its metadata describes the canvas."""
        case_id = request.case_id(seed)
        canvas_id = str(canvas_row["case_id"])
        plan = self.plan_of(canvas_id)
        diameter, location = draw_pancreatic_tumor(rng)
        painted = dataclasses.replace(plan, lesions=plan.lesions + (LesionPlan(LESION_CLASS, diameter, location),))
        scan = self._render(painted)
        self._check_matches_canvas(canvas_id, scan, plan)
        tumor = scan.masks[LESION_CLASS].astype(bool)
        spacing = nib.affines.voxel_sizes(scan.affine)
        row = synthetic_row(canvas_id, canvas_row, request, case_id, tumor, spacing, "", seed)
        row["tumor_location"] = pancreas_location(scan.masks[ORGAN_CLASS], tumor, scan.affine)
        row["synthx_painter"] = PHANTOM_PAINTER
        return GeneratedCase(case_id, scan.ct, scan.affine, scan.masks, row)

    def _render(self, plan: ScanPlan):
        # Single-threaded BLAS, as the phantom's writer renders: with more threads a voxel may round 1 HU apart.
        with threadpool_limits(limits=1):
            return render_scan(plan, self.shape, self.spacing, self.seed)

    def _check_matches_canvas(self, canvas_id: str, scan, plan) -> None:
        """The canvas on disk must be the phantom's healthy rendering of this plan (same grid, same scan); once per canvas."""
        if canvas_id in self._checked:
            return
        path = self.root / canvas_id / CT_FILE
        image = nib.load(path)
        if image.shape[:3] != scan.ct.shape or not np.allclose(image.affine, scan.affine, atol=1e-4):
            raise GenerationError(f"canvas {canvas_id}: {path} is not on the phantom's grid {scan.ct.shape}; was it resampled?")
        healthy = self._render(plan).ct
        if not np.array_equal(np.asarray(image.dataobj), healthy):
            raise GenerationError(f"canvas {canvas_id}: {path} differs from the phantom's rendering of that case; was it edited?")
        self._checked.add(canvas_id)


__all__ = ["PhantomPainter"]
