"""Where the phantom's planned lesions are painted: centred on a voxel of their organ, never empty.

A pancreatic lesion lies along the pancreas centreline at its recorded location (head, body, tail)
and sits inside the gland: where it grows beyond the pancreas into fat or bowel, the gland is
locally expanded around it (a rim of parenchyma, :data:`PANCREATIC_RIM_MM`), as a pancreatic mass
enlarges the gland's contour. Against neighbouring organs it may touch them directly; it never
grows into vessels, bone or muscle.

Why the rim: without it, a large tumor filled the whole thickness of the gland and bulged into the
fat as a bare, round, uniform blob, the shape and attenuation of a fluid-filled bowel loop; a
detector then had nothing in the image to tell the two apart (phantom version 3: confident
false-positive blobs on bowel loops beside healthy pancreases, and large tumors missed). A
hypo-attenuating mass inside enhancing parenchyma is what the pancreatic phase is read for, and it
keeps the designed gaps: the rim enhances with the pancreas (no contrast without it: the physics gap
stays), and an arterial tumor inside its bright rim still sits at healthy venous pancreas HU (the
scarcity gap stays).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lightning_modules.cohorts.phantom.anatomy import _Anatomy, _ellipsoid, _Grid, _Layout, _paint
from lightning_modules.cohorts.phantom.plan import ScanPlan
from lightning_modules.cohorts.phantom.tissues import _CAVITY, _ON_CAVITY, _ON_SOFT_ORGANS, Tissue, _allowed

# Where a lesion centre lies along the pancreas centreline (0 = uncinate, 1 = tail tip; the neck
# is at ~0.3 of its length), per recorded location.
_LESION_CENTER_RANGES = {"head": (0.06, 0.26), "body": (0.36, 0.62), "tail": (0.73, 0.92)}
# Thickness (reference mm) of the parenchyma kept around a pancreatic lesion where it meets fat or bowel.
PANCREATIC_RIM_MM = 5.0


def _nearest_voxel(labels: np.ndarray, grid: _Grid, target: np.ndarray, tissues: Sequence[Tissue]) -> np.ndarray:
    """Reference-mm centre of the voxel of ``tissues`` closest to ``target``."""
    box = grid.box(target, (30.0, 30.0, 30.0))
    candidates = None
    if box is not None:
        local = np.argwhere(_allowed(*tissues)[labels[box]])
        if len(local):
            candidates = local + np.array([s.start for s in box])
    if candidates is None:
        candidates = np.argwhere(_allowed(*tissues)[labels])
    coordinates = np.stack([grid.axes[i][candidates[:, i]] for i in range(3)], axis=1)
    return coordinates[np.argmin(((coordinates - target) ** 2).sum(axis=1))].astype(float)


def _place_lesions(plan: ScanPlan, grid: _Grid, anatomy: _Anatomy, layout: _Layout) -> None:
    """Paint the planned lesions. Each is centred on a voxel of its organ, so it is never empty."""
    labels = layout.labels
    for lesion in plan.lesions:
        kind = lesion.kind
        if kind == "pancreatic_lesion":
            low, high = _LESION_CENTER_RANGES[lesion.location]
            target = layout.pancreas_curve(low + (high - low) * anatomy.lesion_fraction[kind])
            organ_tissues = (Tissue.PANCREAS,)
            tissue = Tissue.PANCREATIC_LESION
            # A large tumor bulges out of the original gland (inside its rim, below) and may touch
            # neighbouring organs, never vessels, bone or muscle; the pancreas mask includes the bulge.
            allowed = _ON_SOFT_ORGANS
        elif kind == "liver_lesion":
            depth = 0.6 * anatomy.lesion_fraction[kind]
            target = layout.organ_centers["liver"] + anatomy.lesion_direction[kind] * layout.organ_semi["liver"] * depth
            organ_tissues = (Tissue.LIVER,)
            tissue = Tissue.LIVER_LESION
            allowed = _allowed(Tissue.LIVER)
        elif kind == "kidney_lesion":
            name = f"kidney_{lesion.location}"
            depth = 0.4 + 0.5 * anatomy.lesion_fraction[kind]
            target = layout.organ_centers[name] + anatomy.lesion_direction[kind] * layout.organ_semi[name] * depth
            if lesion.location == "left":
                organ_tissues = (Tissue.KIDNEY_LEFT_CORTEX, Tissue.KIDNEY_LEFT_MEDULLA)
                tissue = Tissue.KIDNEY_LEFT_LESION
            else:
                organ_tissues = (Tissue.KIDNEY_RIGHT_CORTEX, Tissue.KIDNEY_RIGHT_MEDULLA)
                tissue = Tissue.KIDNEY_RIGHT_LESION
            # Kidney lesions may be exophytic: they may grow into the surrounding fat.
            allowed = _allowed(*organ_tissues, *_CAVITY)
        else:
            raise ValueError(f"{plan.case_id}: unknown lesion class {kind!r}")
        center = _nearest_voxel(labels, grid, np.asarray(target, dtype=float), organ_tissues)
        semi = lesion.diameter_mm / 2.0 * anatomy.lesion_axes[kind]
        if kind == "pancreatic_lesion":
            # The gland expands around the mass: a rim of parenchyma where the tumor meets fat or bowel.
            rim = _ellipsoid(grid, center, semi + PANCREATIC_RIM_MM, anatomy.lesion_rotation[kind])
            _paint(labels, rim, Tissue.PANCREAS, _ON_CAVITY)
        painted = _paint(labels, _ellipsoid(grid, center, semi, anatomy.lesion_rotation[kind]), tissue,
                         allowed | _allowed(*organ_tissues))
        if painted == 0:
            raise RuntimeError(f"{plan.case_id}: {kind} was planned but covers no voxel")

