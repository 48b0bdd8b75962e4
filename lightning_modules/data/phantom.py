"""The embedded phantom cohort: CT-like abdominal volumes with organ and lesion masks (DESIGN.md section 8).

No public abdominal CT can ship with the project, so this module simulates a cohort that has the
AbdomenAtlas layout (layout A) and metadata: int16 Hounsfield-unit volumes with a body outline
(subcutaneous fat, muscle wall, visceral fat, bowel loops), the spine, the organs ``liver, pancreas,
kidney_left, kidney_right, spleen, aorta, postcava, stomach, gall_bladder`` and the lesions
``pancreatic_lesion`` (the BenchX target), ``liver_lesion`` and ``kidney_lesion``.

What it simulates:

- attenuation by contrast phase (the HU table of DESIGN.md section 8); lesions are
  hypo-attenuating against their organ, near iso on non-contrast, most conspicuous in the
  arterial (pancreatic) phase and clear in the venous phase;
- sites (cohorts) with their own scanner, noise level, blur, phase mix and demographic mix;
- organ size that follows age and sex (the pancreas atrophies with age, males are a bit larger);
- skewed prevalence: venous scans and older adults are common, non-contrast and arterial scans,
  young patients and some recorded race groups are rare; about 13% of patients have a second scan
  (another phase, same anatomy and tumor, new noise), so splits must group by patient;
- Unknown values in the metadata (a recorded Unknown hides a true value that the renderer uses).

What it does not: real anatomy, real pathology, or any clinical relationship. Shapes are smooth
ellipsoids and tubes; subgroup effects are designed in (e.g. tumor contrast by phase), so results on
this cohort show that the machinery works, not clinical truth. Race is a recorded label only and
changes nothing in the images.

Each scan draws from random streams keyed by (seed, patient index, stream, scan number) with
:class:`numpy.random.SeedSequence`, so a cohort is deterministic for a seed, a rerun skips complete
case folders, and a resumed or partial run is byte-identical to a fresh one. A smaller field of view
than the reference abdomen (240 x 240 x 192 mm) shrinks the whole anatomy to fit; recorded
diameters are the simulated ones in mm.

Run::

    benchx phantom --out data/phantom --cases 200 --seed 0
    python -m lightning_modules.data.phantom --out /tmp/tiny --cases 12 --shape 48 48 32
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
from scipy import ndimage
from scipy.interpolate import CubicSpline
from scipy.spatial.transform import Rotation

from lightning_modules.data.cohort import (
    CT_FILE,
    ORGAN_CLASSES,
    METADATA_FILE,
    SEGMENTATION_DIR,
    atomic_write_bytes,
    write_case,
    write_metadata,
)
from lightning_modules.data.metadata import PHASES, UNKNOWN, normalize_metadata

# Bump when the rendering changes, so a rerun into an older cohort refuses to mix the two.
PHANTOM_VERSION = 1
PARAMS_FILE = "phantom.json"
CASE_ID_PREFIX = "PH"
PATIENT_ID_PREFIX = "PT"

LESION_CLASSES = ("pancreatic_lesion", "liver_lesion", "kidney_lesion")
# The anatomy is designed for this field of view (mm, x y z); a smaller one scales it down.
REFERENCE_FOV_MM = (240.0, 240.0, 192.0)
MIN_SHAPE = 16
METADATA_COLUMNS = (
    "case_id",
    "patient_id",
    "cohort",
    "age",
    "sex",
    "race",
    "phase",
    "scanner",
    "spacing",
    "tumor",
    "tumor_diameter_mm",
    "tumor_location",
    "synthetic",
)


class Tissue(IntEnum):
    """Labels of the internal label map; several tissues make up one organ mask."""

    AIR = 0
    SUBCUTANEOUS_FAT = 1
    MUSCLE = 2
    VISCERAL_FAT = 3
    BOWEL_WALL = 4
    BOWEL_FLUID = 5
    BOWEL_GAS = 6
    CANCELLOUS_BONE = 7
    CORTICAL_BONE = 8
    SPINAL_CANAL = 9
    DISC = 10
    LIVER = 11
    GALL_BLADDER = 12
    STOMACH_WALL = 13
    STOMACH_FLUID = 14
    STOMACH_GAS = 15
    SPLEEN = 16
    KIDNEY_LEFT_CORTEX = 17
    KIDNEY_LEFT_MEDULLA = 18
    KIDNEY_RIGHT_CORTEX = 19
    KIDNEY_RIGHT_MEDULLA = 20
    PANCREAS = 21
    AORTA = 22
    POSTCAVA = 23
    PANCREATIC_LESION = 24
    LIVER_LESION = 25
    KIDNEY_LEFT_LESION = 26
    KIDNEY_RIGHT_LESION = 27


N_TISSUES = len(Tissue)

# Which tissues make up each written mask: an organ mask includes its lesion (AbdomenAtlas).
MASK_TISSUES: dict[str, tuple[Tissue, ...]] = {
    "aorta": (Tissue.AORTA,),
    "gall_bladder": (Tissue.GALL_BLADDER,),
    "kidney_left": (Tissue.KIDNEY_LEFT_CORTEX, Tissue.KIDNEY_LEFT_MEDULLA, Tissue.KIDNEY_LEFT_LESION),
    "kidney_right": (Tissue.KIDNEY_RIGHT_CORTEX, Tissue.KIDNEY_RIGHT_MEDULLA, Tissue.KIDNEY_RIGHT_LESION),
    "liver": (Tissue.LIVER, Tissue.LIVER_LESION),
    "pancreas": (Tissue.PANCREAS, Tissue.PANCREATIC_LESION),
    "postcava": (Tissue.POSTCAVA,),
    "spleen": (Tissue.SPLEEN,),
    "stomach": (Tissue.STOMACH_WALL, Tissue.STOMACH_FLUID, Tissue.STOMACH_GAS),
    "pancreatic_lesion": (Tissue.PANCREATIC_LESION,),
    "liver_lesion": (Tissue.LIVER_LESION,),
    "kidney_lesion": (Tissue.KIDNEY_LEFT_LESION, Tissue.KIDNEY_RIGHT_LESION),
}

# ----------------------------------------------------------------------------------------------
# Attenuation (HU), DESIGN.md section 8: (non-contrast, arterial, venous, delayed).

_PHASE_INDEX = {phase: i for i, phase in enumerate(PHASES)}
_ATTENUATION: dict[Tissue, tuple[float, float, float, float]] = {
    Tissue.AIR: (-1000, -1000, -1000, -1000),
    Tissue.SUBCUTANEOUS_FAT: (-105, -105, -105, -105),
    Tissue.MUSCLE: (50, 58, 62, 56),
    Tissue.VISCERAL_FAT: (-95, -95, -95, -95),
    Tissue.BOWEL_WALL: (35, 75, 85, 65),
    Tissue.BOWEL_FLUID: (12, 12, 12, 12),
    Tissue.BOWEL_GAS: (-850, -850, -850, -850),
    Tissue.CANCELLOUS_BONE: (250, 250, 250, 250),
    Tissue.CORTICAL_BONE: (750, 750, 750, 750),
    Tissue.SPINAL_CANAL: (15, 15, 15, 15),
    Tissue.DISC: (85, 85, 85, 85),
    Tissue.LIVER: (60, 80, 110, 85),
    Tissue.GALL_BLADDER: (8, 8, 8, 8),
    Tissue.STOMACH_WALL: (40, 85, 95, 70),
    Tissue.STOMACH_FLUID: (12, 12, 12, 12),
    Tissue.STOMACH_GAS: (-900, -900, -900, -900),
    Tissue.SPLEEN: (48, 112, 122, 95),
    Tissue.KIDNEY_LEFT_CORTEX: (35, 180, 165, 125),
    Tissue.KIDNEY_LEFT_MEDULLA: (32, 85, 150, 140),
    Tissue.KIDNEY_RIGHT_CORTEX: (35, 180, 165, 125),
    Tissue.KIDNEY_RIGHT_MEDULLA: (32, 85, 150, 140),
    Tissue.PANCREAS: (45, 135, 115, 75),
    Tissue.AORTA: (40, 300, 165, 115),
    Tissue.POSTCAVA: (40, 95, 150, 110),
}
# Lesion minus its organ (HU). Pancreatic adenocarcinoma: near iso without contrast, most
# conspicuous in the pancreatic (arterial) phase, clear in the venous phase (DESIGN.md section 8).
# Arterial and venous sit at the strong end of the table's ranges (tumor 60 / 65 HU against
# pancreas 135 / 115): with weaker contrast the CPU profile's 600-step U-Net barely finds lesions.
# Liver (hypovascular metastasis-like) and kidney (cyst/RCC-like) lesions have no source table:
# chosen hypo-attenuating with the same near-iso non-contrast behaviour.
_LESION_CONTRAST: dict[str, tuple[float, float, float, float]] = {
    "pancreatic_lesion": (-5, -75, -50, -12),
    "liver_lesion": (-12, -30, -50, -30),
    "kidney_lesion": (-8, -120, -105, -80),
}
_LESION_ORGAN_TISSUE = {
    Tissue.PANCREATIC_LESION: Tissue.PANCREAS,
    Tissue.LIVER_LESION: Tissue.LIVER,
    Tissue.KIDNEY_LEFT_LESION: Tissue.KIDNEY_LEFT_CORTEX,
    Tissue.KIDNEY_RIGHT_LESION: Tissue.KIDNEY_RIGHT_CORTEX,
}
_LESION_KIND = {
    Tissue.PANCREATIC_LESION: "pancreatic_lesion",
    Tissue.LIVER_LESION: "liver_lesion",
    Tissue.KIDNEY_LEFT_LESION: "kidney_lesion",
    Tissue.KIDNEY_RIGHT_LESION: "kidney_lesion",
}


def _phase_column(phase: str) -> int:
    if phase not in _PHASE_INDEX:
        raise ValueError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
    return _PHASE_INDEX[phase]


def phase_attenuation(phase: str) -> dict[str, float]:
    """Typical attenuation (HU) of every simulated tissue in a contrast phase, before per-scan jitter.

    Args:
        phase: one of :data:`lightning_modules.data.metadata.PHASES`.
    """
    column = _phase_column(phase)
    table = {tissue.name.lower(): float(values[column]) for tissue, values in _ATTENUATION.items()}
    for tissue, organ in _LESION_ORGAN_TISSUE.items():
        kind = _LESION_KIND[tissue]
        table[tissue.name.lower()] = float(_ATTENUATION[organ][column] + _LESION_CONTRAST[kind][column])
    return table


def lesion_contrast_hu(phase: str, lesion: str = "pancreatic_lesion") -> float:
    """Typical lesion-minus-organ attenuation (HU, negative = hypo-attenuating) in a phase.

    Args:
        phase: one of :data:`lightning_modules.data.metadata.PHASES`.
        lesion: ``pancreatic_lesion``, ``liver_lesion`` or ``kidney_lesion``.
    """
    if lesion not in _LESION_CONTRAST:
        raise ValueError(f"lesion {lesion!r} is not one of {', '.join(_LESION_CONTRAST)}")
    return float(_LESION_CONTRAST[lesion][_phase_column(phase)])


# ----------------------------------------------------------------------------------------------
# Sites and the cohort plan (metadata-level sampling: cheap, no volumes).


@dataclass(frozen=True)
class Site:
    """A simulated source site: scanner, image quality, phase mix and demographic mix.

    Mixes are ``(value, probability)`` pairs; probabilities are normalized when sampled.
    """

    name: str
    weight: float
    scanner: str
    noise_sigma_hu: float
    blur_mm: float
    phase_mix: tuple[tuple[str, float], ...]
    age_band_mix: tuple[tuple[str, float], ...]
    female_fraction: float
    race_mix: tuple[tuple[str, float], ...]
    phase_unknown_rate: float = 0.05


# Invented sites. Their noise (9-19 HU) and blur stand for scanner and protocol differences; the
# phase mixes make venous common (~58% overall) and non-contrast/arterial rare, as in BenchX's
# training data; Pacific Islander and the young bands are deliberately rare.
SITES: tuple[Site, ...] = (
    Site(
        name="PH-Academic",
        weight=0.40,
        scanner="Siemens SOMATOM Force",
        noise_sigma_hu=9.0,
        blur_mm=0.6,
        phase_mix=(("non-contrast", 0.10), ("arterial", 0.15), ("venous", 0.60), ("delayed", 0.15)),
        age_band_mix=(("le20", 0.02), ("20-40", 0.08), ("40-60", 0.28), ("60-80", 0.47), ("gt80", 0.15)),
        female_fraction=0.48,
        race_mix=(
            ("White", 0.55), ("Black", 0.18), ("Asian", 0.12), ("Hispanic", 0.08),
            ("Pacific Islander", 0.01), (UNKNOWN, 0.06),
        ),
    ),
    Site(
        name="PH-Community",
        weight=0.30,
        scanner="GE LightSpeed VCT",
        noise_sigma_hu=14.0,
        blur_mm=1.0,
        phase_mix=(("non-contrast", 0.13), ("arterial", 0.05), ("venous", 0.72), ("delayed", 0.10)),
        age_band_mix=(("le20", 0.01), ("20-40", 0.05), ("40-60", 0.22), ("60-80", 0.52), ("gt80", 0.20)),
        female_fraction=0.52,
        race_mix=(
            ("White", 0.72), ("Black", 0.10), ("Asian", 0.03), ("Hispanic", 0.08),
            ("Pacific Islander", 0.005), (UNKNOWN, 0.065),
        ),
    ),
    Site(
        name="PH-Pacific",
        weight=0.18,
        scanner="Canon Aquilion ONE",
        noise_sigma_hu=12.0,
        blur_mm=0.8,
        phase_mix=(("non-contrast", 0.12), ("arterial", 0.22), ("venous", 0.53), ("delayed", 0.13)),
        age_band_mix=(("le20", 0.03), ("20-40", 0.10), ("40-60", 0.30), ("60-80", 0.44), ("gt80", 0.13)),
        female_fraction=0.50,
        race_mix=(
            ("Asian", 0.35), ("White", 0.30), ("Pacific Islander", 0.08), ("Hispanic", 0.12),
            ("Black", 0.05), (UNKNOWN, 0.10),
        ),
    ),
    Site(
        name="PH-Rural",
        weight=0.12,
        scanner="Philips Ingenuity",
        noise_sigma_hu=19.0,
        blur_mm=1.3,
        phase_mix=(("non-contrast", 0.27), ("arterial", 0.05), ("venous", 0.58), ("delayed", 0.10)),
        age_band_mix=(("le20", 0.02), ("20-40", 0.06), ("40-60", 0.25), ("60-80", 0.47), ("gt80", 0.20)),
        female_fraction=0.47,
        race_mix=(
            ("White", 0.60), ("Hispanic", 0.20), ("Black", 0.08), ("Asian", 0.02),
            ("Pacific Islander", 0.01), (UNKNOWN, 0.09),
        ),
    ),
)
SITES_BY_NAME = {site.name: site for site in SITES}

# Ages drawn uniformly within the band (years, inclusive).
_AGE_RANGES = {"le20": (14, 20), "20-40": (21, 40), "40-60": (41, 60), "60-80": (61, 80), "gt80": (81, 95)}
_SECOND_SCAN_RATE = 0.13
_SEX_UNKNOWN_RATE = 0.03
_AGE_UNKNOWN_RATE = 0.02
# Pancreatic adenocarcinoma is mostly in the head (clinical rule of thumb; not from BenchX).
_LOCATION_MIX = (("head", 0.60), ("body", 0.25), ("tail", 0.15))
# Where a lesion centre lies along the pancreas centreline (0 = uncinate, 1 = tail tip; the neck
# is at ~0.3 of its length), per recorded location.
_LESION_CENTER_RANGES = {"head": (0.06, 0.26), "body": (0.36, 0.62), "tail": (0.73, 0.92)}


def _tumor_probability(age: int) -> float:
    # Overall ~50% so training has positives; lower in the young, as pancreatic cancer is rare there.
    if age <= 40:
        return 0.30
    if age <= 60:
        return 0.50
    return 0.55


@dataclass(frozen=True)
class LesionPlan:
    """One planned lesion: its class, largest diameter in reference mm, and where it lies.

    ``location`` is ``head``/``body``/``tail`` for a pancreatic lesion, ``left``/``right`` for a
    kidney lesion, empty for a liver lesion.
    """

    kind: str
    diameter_mm: float
    location: str = ""


@dataclass(frozen=True)
class ScanPlan:
    """Everything decided about one scan before rendering: true attributes and recorded metadata.

    The renderer uses the true ``age``, ``sex`` and ``phase``; the metadata records
    ``recorded_*``, which may be Unknown.
    """

    case_index: int
    case_id: str
    patient_index: int
    patient_id: str
    scan_number: int
    site: Site
    age: int
    sex: str
    race: str
    phase: str
    recorded_age: int | None
    recorded_sex: str
    recorded_phase: str
    lesions: tuple[LesionPlan, ...] = field(default_factory=tuple)

    def lesion(self, kind: str) -> LesionPlan | None:
        return next((lesion for lesion in self.lesions if lesion.kind == kind), None)

    @property
    def tumor(self) -> int:
        return int(self.lesion("pancreatic_lesion") is not None)

    def lesion_classes(self) -> tuple[str, ...]:
        return tuple(sorted({lesion.kind for lesion in self.lesions}))

    def expected_mask_files(self) -> set[str]:
        return {f"{name}.nii.gz" for name in ORGAN_CLASSES + self.lesion_classes()}


def _stream(seed: int, patient_index: int, stream: int, scan_number: int = 0) -> np.random.Generator:
    """A random stream keyed by (seed, patient, stream, scan): independent of every other case."""
    return np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(patient_index, stream, scan_number)))


_PLAN_STREAM, _ANATOMY_STREAM, _ACQUISITION_STREAM = 0, 1, 2


def _choose(rng: np.random.Generator, mix: Sequence[tuple[str, float]]) -> str:
    values = [value for value, _ in mix]
    weights = np.array([weight for _, weight in mix], dtype=float)
    return values[int(rng.choice(len(values), p=weights / weights.sum()))]


def _plan_patient(seed: int, patient_index: int) -> list[dict]:
    """The scans of one patient (one or two), as keyword dicts for :class:`ScanPlan` (no case ids yet)."""
    rng = _stream(seed, patient_index, _PLAN_STREAM)
    site = _choose(rng, [(s.name, s.weight) for s in SITES])
    site = SITES_BY_NAME[site]
    band = _choose(rng, site.age_band_mix)
    low, high = _AGE_RANGES[band]
    age = int(rng.integers(low, high + 1))
    sex = "F" if rng.random() < site.female_fraction else "M"
    race = _choose(rng, site.race_mix)
    recorded_sex = UNKNOWN if rng.random() < _SEX_UNKNOWN_RATE else sex
    recorded_age = None if rng.random() < _AGE_UNKNOWN_RATE else age
    n_scans = 2 if rng.random() < _SECOND_SCAN_RATE else 1

    lesions = []
    if rng.random() < _tumor_probability(age):
        location = _choose(rng, _LOCATION_MIX)
        # 10-45 mm, ~35% small (<= 20 mm), ~13% under 15 mm: small tumors exist, most are learnable.
        diameter = 10.0 + 35.0 * rng.beta(1.6, 2.4)
        lesions.append(LesionPlan("pancreatic_lesion", round(float(diameter), 1), location))
    # Liver lesions are more common with a pancreatic tumor (metastasis-like); rates are invented.
    if rng.random() < (0.18 if lesions else 0.07):
        lesions.append(LesionPlan("liver_lesion", round(float(10.0 + 30.0 * rng.beta(1.5, 2.5)), 1)))
    if rng.random() < 0.08:
        side = "left" if rng.random() < 0.5 else "right"
        lesions.append(LesionPlan("kidney_lesion", round(float(10.0 + 25.0 * rng.beta(1.5, 2.5)), 1), side))

    first_phase = _choose(rng, site.phase_mix)
    phases = [first_phase]
    if n_scans == 2:
        phases.append(_choose(rng, [(p, w) for p, w in site.phase_mix if p != first_phase]))
    scans = []
    for scan_number, phase in enumerate(phases):
        recorded_phase = UNKNOWN if rng.random() < site.phase_unknown_rate else phase
        scans.append(
            dict(
                patient_index=patient_index,
                patient_id=f"{PATIENT_ID_PREFIX}{patient_index + 1:04d}",
                scan_number=scan_number,
                site=site,
                age=age,
                sex=sex,
                race=race,
                phase=phase,
                recorded_age=recorded_age,
                recorded_sex=recorded_sex,
                recorded_phase=recorded_phase,
                lesions=tuple(lesions),
            )
        )
    return scans


def plan_phantom_cohort(n_cases: int = 200, seed: int = 0) -> list[ScanPlan]:
    """Plan a cohort of ``n_cases`` scans: patients in order, each with one or two scans.

    A smaller cohort is a prefix of a larger one with the same seed (the last patient may lose
    its second scan), which is what lets a run be resumed or extended.

    Args:
        n_cases: number of scans (case folders).
        seed: non-negative integer seed.
    """
    _check_count_and_seed(n_cases, seed)
    plans: list[ScanPlan] = []
    patient_index = 0
    while len(plans) < n_cases:
        for scan in _plan_patient(seed, patient_index):
            if len(plans) == n_cases:
                break
            case_index = len(plans)
            plans.append(ScanPlan(case_index=case_index, case_id=f"{CASE_ID_PREFIX}{case_index + 1:04d}", **scan))
        patient_index += 1
    return plans


def geometry_scale(shape: Sequence[int], spacing: Sequence[float]) -> float:
    """How much the reference anatomy shrinks to fit the field of view (1.0 when it fits)."""
    fov = np.asarray(shape, dtype=float) * np.asarray(spacing, dtype=float)
    return float(min(1.0, *(fov / np.asarray(REFERENCE_FOV_MM))))


def _spacing_text(spacing: Sequence[float]) -> str:
    return "x".join(f"{float(s):g}" for s in spacing)


def metadata_table(plans: Sequence[ScanPlan], shape: Sequence[int], spacing: Sequence[float]) -> pd.DataFrame:
    """The ``metadata.csv`` table of planned scans (recorded values, Unknown where not recorded)."""
    scale = geometry_scale(shape, spacing)
    spacing_text = _spacing_text(spacing)
    rows = []
    for plan in plans:
        tumor = plan.lesion("pancreatic_lesion")
        rows.append(
            {
                "case_id": plan.case_id,
                "patient_id": plan.patient_id,
                "cohort": plan.site.name,
                "age": plan.recorded_age if plan.recorded_age is not None else pd.NA,
                "sex": plan.recorded_sex,
                "race": plan.race,
                "phase": plan.recorded_phase,
                "scanner": plan.site.scanner,
                "spacing": spacing_text,
                "tumor": plan.tumor,
                "tumor_diameter_mm": round(tumor.diameter_mm * scale, 1) if tumor else math.nan,
                "tumor_location": tumor.location if tumor else "",
                "synthetic": 0,
            }
        )
    table = pd.DataFrame(rows, columns=list(METADATA_COLUMNS))
    table["age"] = table["age"].astype("Int64")
    return table


def sample_phantom_metadata(
    n_cases: int = 200,
    seed: int = 0,
    shape: Sequence[int] = (96, 96, 64),
    spacing: Sequence[float] = (2.5, 2.5, 3.0),
) -> pd.DataFrame:
    """The metadata table that :func:`generate_phantom_cohort` would write, without rendering volumes.

    Args:
        n_cases: number of scans.
        seed: non-negative integer seed.
        shape: volume shape (voxels); only affects recorded diameters through the field of view.
        spacing: voxel spacing (mm).
    """
    return metadata_table(plan_phantom_cohort(n_cases, seed), shape, spacing)


# ----------------------------------------------------------------------------------------------
# Rendering: a label map of tissues in reference-mm coordinates, then intensities.


class _Grid:
    """Voxel-centre coordinates of the volume in reference mm (world mm divided by the scale).

    World coordinates follow NIfTI RAS+: the first axis increases toward the patient's Right, the
    second toward Anterior, the third toward Superior; the volume centre is at the origin.
    """

    def __init__(self, shape: Sequence[int], spacing: Sequence[float]):
        self.shape = tuple(int(n) for n in shape)
        self.spacing = np.asarray(spacing, dtype=float)
        self.scale = geometry_scale(shape, spacing)
        origin = -(np.asarray(self.shape) - 1) / 2.0 * self.spacing
        self.affine = np.diag([*self.spacing, 1.0])
        self.affine[:3, 3] = origin
        self.axes = [
            ((origin[i] + np.arange(n) * self.spacing[i]) / self.scale).astype(np.float32)
            for i, n in enumerate(self.shape)
        ]

    def box(self, center: Sequence[float], half_extent: Sequence[float]) -> tuple[slice, slice, slice] | None:
        """Index slices covering an axis-aligned box (reference mm), or None when it misses the volume."""
        slices = []
        for axis, c, h in zip(self.axes, center, half_extent):
            start = int(np.searchsorted(axis, c - h, side="left"))
            stop = int(np.searchsorted(axis, c + h, side="right"))
            if start >= stop:
                return None
            slices.append(slice(start, stop))
        return tuple(slices)

    def local(self, box: tuple[slice, slice, slice]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Broadcastable coordinate arrays of a box."""
        x, y, z = (axis[s] for axis, s in zip(self.axes, box))
        return x[:, None, None], y[None, :, None], z[None, None, :]


def _ellipsoid(
    grid: _Grid, center: Sequence[float], semi_axes: Sequence[float], rotation: np.ndarray | None = None
) -> tuple[tuple[slice, slice, slice], np.ndarray] | None:
    """The voxels inside an ellipsoid (reference mm); ``rotation`` rows are its axes in world space."""
    semi = np.asarray(semi_axes, dtype=float)
    rotation = np.eye(3) if rotation is None else np.asarray(rotation, dtype=float)
    half_extent = np.sqrt(((rotation * semi[:, None]) ** 2).sum(axis=0))
    box = grid.box(center, half_extent)
    if box is None:
        return None
    dx, dy, dz = (coordinate - np.float32(c) for coordinate, c in zip(grid.local(box), center))
    total = 0.0
    for k in range(3):
        u = rotation[k, 0] * dx + rotation[k, 1] * dy + rotation[k, 2] * dz
        total = total + (u / semi[k]) ** 2
    return box, total <= 1.0


def _tube(
    grid: _Grid, points: np.ndarray, radii: np.ndarray
) -> tuple[tuple[slice, slice, slice], np.ndarray] | None:
    """The voxels inside a swept sphere along densely sampled centreline points with varying radius."""
    low = (points - radii[:, None]).min(axis=0)
    high = (points + radii[:, None]).max(axis=0)
    box = grid.box((low + high) / 2, (high - low) / 2)
    if box is None:
        return None
    x, y, z = grid.local(box)
    nearest = np.full(tuple(s.stop - s.start for s in box), np.inf, dtype=np.float32)
    for (px, py, pz), r in zip(points, radii):
        np.minimum(nearest, ((x - px) ** 2 + (y - py) ** 2 + (z - pz) ** 2) / np.float32(r * r), out=nearest)
    return box, nearest <= 1.0


def _allowed(*tissues: Tissue) -> np.ndarray:
    table = np.zeros(N_TISSUES, dtype=bool)
    table[list(tissues)] = True
    return table


# What a structure may be painted over: organs only claim visceral fat and bowel, so painting
# order plus these sets decide who wins where shapes overlap.
_CAVITY = (Tissue.VISCERAL_FAT, Tissue.BOWEL_WALL, Tissue.BOWEL_FLUID, Tissue.BOWEL_GAS)
_ON_CAVITY = _allowed(*_CAVITY)
_ON_FAT = _allowed(Tissue.VISCERAL_FAT)
_ON_LIVER_OR_CAVITY = _allowed(Tissue.LIVER, *_CAVITY)
_ON_SOFT_ORGANS = _allowed(
    *_CAVITY,
    Tissue.LIVER, Tissue.GALL_BLADDER, Tissue.STOMACH_WALL, Tissue.STOMACH_FLUID, Tissue.STOMACH_GAS,
    Tissue.SPLEEN, Tissue.KIDNEY_LEFT_CORTEX, Tissue.KIDNEY_LEFT_MEDULLA, Tissue.KIDNEY_RIGHT_CORTEX,
    Tissue.KIDNEY_RIGHT_MEDULLA, Tissue.PANCREAS,
)
_ON_POSTERIOR_WALL = _allowed(Tissue.VISCERAL_FAT, Tissue.SUBCUTANEOUS_FAT, Tissue.MUSCLE)


def _paint(labels: np.ndarray, shape_voxels, tissue: Tissue, allowed: np.ndarray) -> int:
    """Set ``tissue`` where the shape covers an allowed label; returns the number of voxels painted."""
    if shape_voxels is None:
        return 0
    box, inside = shape_voxels
    view = labels[box]
    claim = inside & allowed[view]
    view[claim] = tissue
    return int(claim.sum())


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
    quaternion = rng.standard_normal(4)
    return Rotation.from_quat(quaternion / np.linalg.norm(quaternion)).as_matrix()


def _axis_rotation(x_deg: float = 0.0, y_deg: float = 0.0, z_deg: float = 0.0) -> np.ndarray:
    return Rotation.from_euler("xyz", [x_deg, y_deg, z_deg], degrees=True).as_matrix()


@dataclass(frozen=True)
class _Anatomy:
    """Per-patient random draws (shared by all scans of a patient), drawn in a fixed order."""

    body_jitter: float
    fat_mm: float
    organ_jitter: dict[str, float]
    position_jitter: np.ndarray  # (n_structures, 3) mm
    pancreas_jitter: np.ndarray  # (6, 3) mm
    bowel: list[tuple[np.ndarray, np.ndarray, np.ndarray, bool]]
    lesion_fraction: dict[str, float]
    lesion_direction: dict[str, np.ndarray]
    lesion_rotation: dict[str, np.ndarray]
    lesion_axes: dict[str, np.ndarray]
    disc_offset_mm: float


_JITTERED = ("liver", "spleen", "kidney_left", "kidney_right", "stomach", "gall_bladder", "pancreas", "aorta")


def _draw_anatomy(rng: np.random.Generator) -> _Anatomy:
    body_jitter = float(np.clip(rng.normal(1.0, 0.035), 0.92, 1.08))
    fat_mm = float(rng.uniform(8.0, 26.0))
    organ_jitter = {name: float(np.clip(rng.normal(1.0, 0.06), 0.85, 1.15)) for name in _JITTERED}
    position_jitter = rng.normal(0.0, 3.0, size=(len(_JITTERED), 3))
    pancreas_jitter = rng.normal(0.0, 2.5, size=(6, 3))
    bowel = []
    for _ in range(int(rng.integers(7, 11))):
        center = np.array([rng.uniform(-62, 62), rng.uniform(-12, 45), rng.uniform(-92, 2)])
        semi = rng.uniform(11.0, 22.0, size=3)
        bowel.append((center, semi, _random_rotation(rng), bool(rng.random() < 0.4)))
    lesion_fraction, lesion_direction, lesion_rotation, lesion_axes = {}, {}, {}, {}
    for kind in LESION_CLASSES:
        lesion_fraction[kind] = float(rng.random())
        direction = rng.standard_normal(3)
        lesion_direction[kind] = direction / np.linalg.norm(direction)
        lesion_rotation[kind] = _random_rotation(rng)
        lesion_axes[kind] = np.array([1.0, rng.uniform(0.75, 1.0), rng.uniform(0.7, 1.0)])
    return _Anatomy(
        body_jitter=body_jitter,
        fat_mm=fat_mm,
        organ_jitter=organ_jitter,
        position_jitter=position_jitter,
        pancreas_jitter=pancreas_jitter,
        bowel=bowel,
        lesion_fraction=lesion_fraction,
        lesion_direction=lesion_direction,
        lesion_rotation=lesion_rotation,
        lesion_axes=lesion_axes,
        disc_offset_mm=float(rng.uniform(0.0, 32.0)),
    )


def organ_size_factors(age: float, sex: str) -> dict[str, float]:
    """Designed size factors by age and sex (1.0 = reference adult), before per-patient jitter.

    The pancreas thins with age (atrophy from ~45 years), liver, kidneys and spleen shrink a
    little after 50, the aorta widens, males are ~5-9% larger, adolescents smaller. The slopes
    are chosen to be visible, not taken from a source.

    Args:
        age: true age in years.
        sex: ``F`` or ``M`` (true sex).
    """
    male = sex == "M"
    if age < 18:
        body = 0.88
    elif age <= 20:
        body = 0.95
    else:
        body = 1.0
    body *= 1.04 if male else 1.0
    organ_sex = 1.05 if male else 0.96
    return {
        "body": body,
        "pancreas": organ_sex * max(0.68, 1.0 - 0.0075 * max(age - 45.0, 0.0)),
        "liver": organ_sex * (1.0 - 0.0025 * max(age - 50.0, 0.0)),
        "kidney": organ_sex * (1.0 - 0.003 * max(age - 50.0, 0.0)),
        "spleen": organ_sex * (1.0 - 0.003 * max(age - 50.0, 0.0)),
        "stomach": organ_sex,
        "gall_bladder": 1.0,
        "aorta_radius_mm": (9.0 + (1.0 if male else 0.0) + 0.05 * max(age - 30.0, 0.0)),
        "muscle_mm": 9.0 * (1.15 if male else 1.0) * (1.0 - 0.006 * max(age - 60.0, 0.0)),
    }


# Pancreas centreline control points (reference mm, x = patient's right, y = anterior, z = superior):
# uncinate, head, neck, body, body/tail, tail tip; and the radius at each.
_PANCREAS_POINTS = np.array(
    [[34, 10, -14], [30, 18, -4], [12, 24, 4], [-14, 22, 10], [-40, 12, 16], [-58, 2, 22]], dtype=float
)
_PANCREAS_RADII = np.array([11.0, 14.0, 11.0, 10.0, 9.0, 7.5])


@dataclass
class _Layout:
    """The label map and the geometry a lesion needs (pancreas centreline, organ centres)."""

    labels: np.ndarray
    pancreas_curve: CubicSpline
    organ_centers: dict[str, np.ndarray]
    organ_semi: dict[str, np.ndarray]


def _superellipse(x: np.ndarray, y: np.ndarray, a: float, b: float, power: float = 2.3) -> np.ndarray:
    return (np.abs(x / a) ** power + np.abs(y / b) ** power) <= 1.0


def _build_labels(plan: ScanPlan, grid: _Grid, anatomy: _Anatomy) -> _Layout:
    factors = organ_size_factors(plan.age, plan.sex)
    b = factors["body"] * anatomy.body_jitter
    x2, y2 = grid.axes[0][:, None], grid.axes[1][None, :]

    # Body cross-section (same at every z): skin, subcutaneous fat, muscle wall, cavity. The cavity
    # follows the skeleton frame b; fat and muscle are added outside it and capped by the view.
    cavity_a, cavity_b = 84.0 * b, 60.0 * b
    muscle = factors["muscle_mm"]
    half_view = min(abs(grid.axes[0][0]), abs(grid.axes[1][0])) * 0.97
    fat = min(anatomy.fat_mm, half_view - muscle - max(cavity_a, cavity_b))
    section = np.zeros(grid.shape[:2], dtype=np.uint8)
    section[_superellipse(x2, y2, cavity_a + muscle + fat, cavity_b + muscle + fat)] = Tissue.SUBCUTANEOUS_FAT
    section[_superellipse(x2, y2, cavity_a + muscle, cavity_b + muscle)] = Tissue.MUSCLE
    section[_superellipse(x2, y2, cavity_a, cavity_b)] = Tissue.VISCERAL_FAT
    labels = np.repeat(section[:, :, None], grid.shape[2], axis=2)

    def jitter(name: str) -> np.ndarray:
        return anatomy.position_jitter[_JITTERED.index(name)]

    # Posterior wall: paraspinal muscles, psoas (widening toward the pelvis), spine.
    height = 300.0
    for side in (-1.0, 1.0):
        _paint(
            labels,
            _ellipsoid(grid, (24 * side * b, -58 * b, 0), (19 * b, 13 * b, height)),
            Tissue.MUSCLE,
            _ON_POSTERIOR_WALL,
        )
        psoas_box = grid.box((32 * side * b, -34 * b, 0), (16 * b, 16 * b, height))
        if psoas_box is not None:
            x, y, z = grid.local(psoas_box)
            radius = (7.0 + 7.0 * np.clip((40.0 - z) / 120.0, 0.0, 1.0)) * b
            inside = (x - 32 * side * b) ** 2 + (y + 34 * b) ** 2 <= radius**2
            _paint(labels, (psoas_box, inside), Tissue.MUSCLE, _ON_POSTERIOR_WALL)
    spine_center = (0.0, -30.0 * b, 0.0)
    vertebra = _ellipsoid(grid, spine_center, (17 * b, 14 * b, height))
    _paint(labels, vertebra, Tissue.CORTICAL_BONE, _allowed(*Tissue))
    _paint(labels, _ellipsoid(grid, spine_center, (17 * b - 2.5, 14 * b - 2.5, height)), Tissue.CANCELLOUS_BONE,
           _allowed(Tissue.CORTICAL_BONE))
    if vertebra is not None:
        box, inside = vertebra
        z = grid.local(box)[2]
        disc = ((z - anatomy.disc_offset_mm) % (32.0 * b)) < 7.0 * b
        _paint(labels, (box, inside & disc), Tissue.DISC, _allowed(Tissue.CORTICAL_BONE, Tissue.CANCELLOUS_BONE))
    _paint(labels, _ellipsoid(grid, (0, -60 * b, 0), (14 * b, 8 * b, height)), Tissue.CORTICAL_BONE,
           _ON_POSTERIOR_WALL)
    _paint(labels, _ellipsoid(grid, (0, -68 * b, 0), (4 * b, 9 * b, height)), Tissue.CORTICAL_BONE,
           _ON_POSTERIOR_WALL)
    _paint(labels, _ellipsoid(grid, (0, -50 * b, 0), (7 * b, 6 * b, height)), Tissue.SPINAL_CANAL,
           _allowed(Tissue.CORTICAL_BONE, Tissue.MUSCLE, Tissue.VISCERAL_FAT))

    # Bowel loops in the mid and lower abdomen: unlabelled soft tissue that negatives must ignore.
    for center, semi, rotation, gas in anatomy.bowel:
        outer = _ellipsoid(grid, center * b, semi * b, rotation)
        inner = _ellipsoid(grid, center * b, np.maximum(semi * b - 3.0, 1.0), rotation)
        _paint(labels, outer, Tissue.BOWEL_WALL, _ON_FAT)
        _paint(labels, inner, Tissue.BOWEL_GAS if gas else Tissue.BOWEL_FLUID, _allowed(Tissue.BOWEL_WALL))

    centers: dict[str, np.ndarray] = {}
    semis: dict[str, np.ndarray] = {}

    # Kidneys first, so that the liver and spleen wrap around them.
    kidney_scale = factors["kidney"]
    for name, side, z_center, cortex, medulla, tilt in (
        ("kidney_right", 1.0, -4.0, Tissue.KIDNEY_RIGHT_CORTEX, Tissue.KIDNEY_RIGHT_MEDULLA, -12.0),
        ("kidney_left", -1.0, 6.0, Tissue.KIDNEY_LEFT_CORTEX, Tissue.KIDNEY_LEFT_MEDULLA, 12.0),
    ):
        center = np.array([56 * side, -28, z_center]) * b + jitter(name)
        semi = np.array([22, 19, 50]) * b * kidney_scale * anatomy.organ_jitter[name]
        rotation = _axis_rotation(x_deg=-10.0, y_deg=tilt)
        _paint(labels, _ellipsoid(grid, center, semi, rotation), cortex, _ON_CAVITY)
        sinus_center = center - np.array([4.0 * side, 0, 0])
        _paint(labels, _ellipsoid(grid, sinus_center, semi * 0.6, rotation), medulla, _allowed(cortex))
        centers[name], semis[name] = center, semi

    spleen_center = np.array([-64, -30, 50]) * b + jitter("spleen")
    spleen_semi = np.array([18, 36, 42]) * b * factors["spleen"] * anatomy.organ_jitter["spleen"]
    _paint(labels, _ellipsoid(grid, spleen_center, spleen_semi, _axis_rotation(z_deg=-30.0)), Tissue.SPLEEN, _ON_CAVITY)

    liver_center = np.array([52, 4, 50]) * b + jitter("liver")
    liver_scale = factors["liver"] * anatomy.organ_jitter["liver"]
    liver_semi = np.array([66, 66, 48]) * b * liver_scale
    # Tilted so that the right lobe reaches lower laterally than medially, as a real liver does.
    liver_rotation = _axis_rotation(y_deg=25.0)
    _paint(labels, _ellipsoid(grid, liver_center, liver_semi, liver_rotation), Tissue.LIVER, _ON_CAVITY)
    left_lobe_center = np.array([0, 40, 58]) * b + jitter("liver")
    _paint(labels, _ellipsoid(grid, left_lobe_center, np.array([38, 18, 26]) * b * liver_scale), Tissue.LIVER,
           _ON_CAVITY)
    centers["liver"], semis["liver"] = liver_center, liver_semi

    gall_center = np.array([48, 42, 12]) * b + jitter("gall_bladder")
    gall_semi = np.array([13, 13, 28]) * b * factors["gall_bladder"] * anatomy.organ_jitter["gall_bladder"]
    _paint(labels, _ellipsoid(grid, gall_center, gall_semi, _axis_rotation(x_deg=30.0)), Tissue.GALL_BLADDER,
           _ON_LIVER_OR_CAVITY)

    stomach_center = np.array([-32, 30, 54]) * b + jitter("stomach")
    stomach_semi = np.array([32, 24, 34]) * b * factors["stomach"] * anatomy.organ_jitter["stomach"]
    _paint(labels, _ellipsoid(grid, stomach_center, stomach_semi), Tissue.STOMACH_WALL, _ON_CAVITY)
    lumen = _ellipsoid(grid, stomach_center, np.maximum(stomach_semi - 4.0, 1.0))
    _paint(labels, lumen, Tissue.STOMACH_FLUID, _allowed(Tissue.STOMACH_WALL))
    if lumen is not None:
        # The patient lies supine: gas rises to the anterior (non-dependent) part of the lumen.
        box, inside = lumen
        y = grid.local(box)[1]
        anterior = y > stomach_center[1] + 0.45 * (stomach_semi[1] - 4.0)
        _paint(labels, (box, inside & anterior), Tissue.STOMACH_GAS, _allowed(Tissue.STOMACH_FLUID))

    # Pancreas: a swept sphere along a smooth curve from the uncinate process to the tail.
    control = _PANCREAS_POINTS * b + anatomy.pancreas_jitter + jitter("pancreas")
    chord = np.r_[0.0, np.cumsum(np.linalg.norm(np.diff(control, axis=0), axis=1))]
    curve = CubicSpline(chord / chord[-1], control, bc_type="natural")
    radius_scale = b * factors["pancreas"] * anatomy.organ_jitter["pancreas"]
    n_samples = max(40, int(chord[-1] / (0.25 * _PANCREAS_RADII.min() * radius_scale)))
    t = np.linspace(0.0, 1.0, n_samples)
    points = curve(t)
    radii = np.interp(t, chord / chord[-1], _PANCREAS_RADII * radius_scale)
    _paint(labels, _tube(grid, points, radii), Tissue.PANCREAS, _ON_CAVITY)

    # Vessels run the whole height and may cross organs (the IVC runs through the liver).
    aorta_radius = factors["aorta_radius_mm"] * anatomy.organ_jitter["aorta"]
    aorta_center = np.array([-10 * b, -4 * b, 0]) + jitter("aorta") * np.array([1, 0.5, 0])
    _paint(labels, _ellipsoid(grid, aorta_center, (aorta_radius, aorta_radius, height)), Tissue.AORTA,
           _ON_SOFT_ORGANS)
    cava_center = np.array([22 * b, -6 * b, 0])
    _paint(labels, _ellipsoid(grid, cava_center, (12 * b, 9 * b, height)), Tissue.POSTCAVA, _ON_SOFT_ORGANS)

    voxels_per_tissue = np.bincount(labels.ravel(), minlength=N_TISSUES)
    for name in ORGAN_CLASSES:
        if voxels_per_tissue[list(MASK_TISSUES[name])].sum() == 0:
            raise ValueError(
                f"{plan.case_id}: organ {name} has no voxels at shape {grid.shape} and spacing "
                f"{tuple(grid.spacing)}; use a larger shape or finer spacing"
            )
    return _Layout(labels=labels, pancreas_curve=curve, organ_centers=centers, organ_semi=semis)


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
            # A large tumor bulges out of the pancreas into fat, bowel and neighbouring organs,
            # never into vessels, bone or muscle; the pancreas mask then includes the bulge.
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
        painted = _paint(labels, _ellipsoid(grid, center, semi, anatomy.lesion_rotation[kind]), tissue,
                         allowed | _allowed(*organ_tissues))
        if painted == 0:
            raise RuntimeError(f"{plan.case_id}: {kind} was planned but covers no voxel")


def _smooth_noise(rng: np.random.Generator, shape: Sequence[int], spacing: np.ndarray, correlation_mm: float) -> np.ndarray:
    """Zero-mean, unit-variance low-frequency texture: coarse noise interpolated separably to full size."""
    coarse_shape = [max(2, int(math.ceil(n * s / correlation_mm)) + 1) for n, s in zip(shape, spacing)]
    field = rng.standard_normal(coarse_shape).astype(np.float32)
    for axis, (n_out, n_in) in enumerate(zip(shape, coarse_shape)):
        # Linear interpolation as a small matrix: one tensordot per axis instead of a 3-D zoom.
        positions = np.linspace(0.0, n_in - 1.0, n_out)
        lower = np.minimum(np.floor(positions).astype(int), n_in - 2)
        weight = (positions - lower).astype(np.float32)
        matrix = np.zeros((n_out, n_in), dtype=np.float32)
        matrix[np.arange(n_out), lower] = 1.0 - weight
        matrix[np.arange(n_out), lower + 1] = weight
        field = np.moveaxis(np.tensordot(matrix, field, axes=([1], [axis])), 0, axis)
    field -= field.mean()
    return field / max(float(field.std()), 1e-6)


def _attenuation_table(plan: ScanPlan, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per-scan HU and texture amplitude of every tissue label (phase, bolus timing, jitter)."""
    column = _phase_column(plan.phase)
    # Bolus timing varies: the enhancement (phase minus non-contrast) is scaled per scan.
    enhancement = float(np.clip(rng.normal(1.0, 0.08), 0.8, 1.2))
    hu = np.zeros(N_TISSUES, dtype=np.float32)
    for tissue, values in _ATTENUATION.items():
        base = values[0] + enhancement * (values[column] - values[0])
        hu[tissue] = base + rng.normal(0.0, 3.0)
    # Bone density falls with age (designed, so age is visible in the image).
    hu[Tissue.CANCELLOUS_BONE] -= 1.6 * max(plan.age - 35.0, 0.0)
    hu[Tissue.KIDNEY_RIGHT_CORTEX] = hu[Tissue.KIDNEY_LEFT_CORTEX]
    hu[Tissue.KIDNEY_RIGHT_MEDULLA] = hu[Tissue.KIDNEY_LEFT_MEDULLA]
    for tissue, organ in _LESION_ORGAN_TISSUE.items():
        contrast = _LESION_CONTRAST[_LESION_KIND[tissue]][column]
        hu[tissue] = hu[organ] + contrast * rng.uniform(0.85, 1.15)

    amplitude = np.full(N_TISSUES, 5.0, dtype=np.float32)
    amplitude[[Tissue.AIR, Tissue.BOWEL_GAS, Tissue.STOMACH_GAS]] = 0.0
    amplitude[[Tissue.SUBCUTANEOUS_FAT, Tissue.VISCERAL_FAT]] = 4.0
    amplitude[[Tissue.CANCELLOUS_BONE, Tissue.CORTICAL_BONE]] = 25.0
    amplitude[[Tissue.PANCREATIC_LESION, Tissue.LIVER_LESION, Tissue.KIDNEY_LEFT_LESION,
               Tissue.KIDNEY_RIGHT_LESION]] = 7.0
    if plan.phase == "arterial":
        # The spleen enhances heterogeneously in the arterial phase.
        amplitude[Tissue.SPLEEN] = 18.0
    return hu, amplitude


@dataclass
class PhantomScan:
    """A rendered scan: CT (int16 HU), masks (uint8) keyed by class, and the shared affine."""

    ct: np.ndarray
    masks: dict[str, np.ndarray]
    affine: np.ndarray


def render_scan(plan: ScanPlan, shape: Sequence[int], spacing: Sequence[float], seed: int) -> PhantomScan:
    """Render one planned scan.

    Args:
        plan: the scan (see :func:`plan_phantom_cohort`).
        shape: volume shape in voxels (each at least 16).
        spacing: voxel spacing in mm.
        seed: the cohort seed; with the plan's patient index and scan number it keys the random streams.
    """
    _check_shape_and_spacing(shape, spacing)
    grid = _Grid(shape, spacing)
    anatomy = _draw_anatomy(_stream(seed, plan.patient_index, _ANATOMY_STREAM))
    layout = _build_labels(plan, grid, anatomy)
    _place_lesions(plan, grid, anatomy, layout)
    labels = layout.labels

    acquisition = _stream(seed, plan.patient_index, _ACQUISITION_STREAM, plan.scan_number)
    hu, amplitude = _attenuation_table(plan, acquisition)
    texture = _smooth_noise(acquisition, grid.shape, grid.spacing, correlation_mm=12.0)
    image = hu[labels] + amplitude[labels] * texture
    blur_sigma = plan.site.blur_mm / grid.spacing
    image = ndimage.gaussian_filter(image, sigma=blur_sigma, mode="nearest")
    noise_sigma = plan.site.noise_sigma_hu * acquisition.uniform(0.92, 1.08)
    image += acquisition.standard_normal(grid.shape, dtype=np.float32) * np.float32(noise_sigma)
    ct = np.clip(np.rint(image), -1024, 3071).astype(np.int16)

    masks = {}
    for name in ORGAN_CLASSES + plan.lesion_classes():
        masks[name] = _allowed(*MASK_TISSUES[name])[labels].view(np.uint8)
    return PhantomScan(ct=ct, masks=masks, affine=grid.affine)


# ----------------------------------------------------------------------------------------------
# Writing a cohort.


def _check_count_and_seed(n_cases, seed) -> None:
    if not isinstance(n_cases, (int, np.integer)) or isinstance(n_cases, bool) or n_cases < 1:
        raise ValueError(f"n_cases must be a positive integer, got {n_cases!r}")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")


def _check_shape_and_spacing(shape, spacing) -> None:
    if len(shape) != 3 or any(int(n) != n or n < MIN_SHAPE for n in shape):
        raise ValueError(f"shape must be 3 integers, each at least {MIN_SHAPE}, got {tuple(shape)!r}")
    if len(spacing) != 3 or any(not np.isfinite(s) or s <= 0 for s in spacing):
        raise ValueError(f"spacing must be 3 positive numbers (mm), got {tuple(spacing)!r}")


def _case_is_complete(case_dir: Path, plan: ScanPlan) -> bool:
    segmentation_dir = case_dir / SEGMENTATION_DIR
    if not (case_dir / CT_FILE).is_file() or not segmentation_dir.is_dir():
        return False
    present = {p.name for p in segmentation_dir.iterdir() if p.is_file()}
    return present == plan.expected_mask_files()


_CASE_FOLDER = re.compile(rf"^{CASE_ID_PREFIX}\d{{4,}}$")


def generate_phantom_cohort(
    out: str | Path,
    n_cases: int = 200,
    seed: int = 0,
    shape: Sequence[int] = (96, 96, 64),
    spacing: Sequence[float] = (2.5, 2.5, 3.0),
    overwrite: bool = False,
) -> pd.DataFrame:
    """Write a phantom cohort in layout A and return its metadata table.

    Case folders are written atomically (:func:`lightning_modules.data.cohort.write_case`) and
    ``metadata.csv`` last. A rerun skips complete case folders, so an interrupted run resumes, and
    a larger ``n_cases`` extends a cohort; the result is byte-identical to a fresh run. The
    parameters are kept in ``phantom.json`` so a rerun with different ones is refused.

    Args:
        out: the cohort folder (created when missing; must be empty or hold a phantom cohort).
        n_cases: number of scans.
        seed: non-negative integer seed.
        shape: volume shape in voxels (x, y, z), each at least 16.
        spacing: voxel spacing in mm (x, y, z).
        overwrite: rewrite every case, replace a phantom cohort made with other parameters, and
            remove phantom case folders beyond ``n_cases``.

    Returns:
        The metadata table as written; ``attrs["written"]`` and ``attrs["kept"]`` count the case
        folders rendered now and those kept from an earlier run.
    """
    _check_count_and_seed(n_cases, seed)
    _check_shape_and_spacing(shape, spacing)
    shape = tuple(int(n) for n in shape)
    spacing = tuple(float(s) for s in spacing)
    out = Path(out)
    params = {"generator": __name__, "version": PHANTOM_VERSION, "seed": int(seed), "shape": list(shape),
              "spacing": list(spacing)}
    params_path = out / PARAMS_FILE
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not params_path.is_file():
            raise ValueError(
                f"{out}: folder is not empty and holds no {PARAMS_FILE}, so it is not a phantom cohort; "
                "refusing to write into it (choose an empty or new folder)"
            )
        try:
            existing = json.loads(params_path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{params_path}: unreadable phantom parameters ({error})") from error
        if existing != params and not overwrite:
            raise ValueError(
                f"{out}: holds a phantom cohort made with {existing}, not {params}; "
                "pass overwrite=True (--overwrite) to replace it"
            )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(params_path, (json.dumps(params, indent=2) + "\n").encode())

    plans = plan_phantom_cohort(n_cases, seed)
    written = kept = 0
    for plan in plans:
        case_dir = out / plan.case_id
        if not overwrite and _case_is_complete(case_dir, plan):
            kept += 1
            continue
        scan = render_scan(plan, shape, spacing, seed)
        write_case(out, plan.case_id, scan.ct, scan.affine, scan.masks)
        written += 1
    if overwrite:
        wanted = {plan.case_id for plan in plans}
        for folder in out.iterdir():
            if folder.is_dir() and _CASE_FOLDER.match(folder.name) and folder.name not in wanted:
                shutil.rmtree(folder)

    table = metadata_table(plans, shape, spacing)
    write_metadata(out, table)
    table.attrs["written"] = written
    table.attrs["kept"] = kept
    return table


def _folder_size_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _counts(series: pd.Series, order: Sequence[str] = ()) -> str:
    counts = series.value_counts()
    keys = [k for k in order if k in counts.index] + sorted(k for k in counts.index if k not in order)
    return ", ".join(f"{key} {int(counts[key])}" for key in keys)


def summarize(table: pd.DataFrame) -> str:
    """A short text summary of a phantom metadata table: size, positives, subgroup counts."""
    normalized, _ = normalize_metadata(table.astype(object).where(table.notna(), ""))
    n = len(normalized)
    positives = int((normalized["tumor"] == 1).sum())
    small = int((table["tumor_diameter_mm"] <= 20).sum())
    patients = normalized["patient_id"].nunique()
    lines = [
        f"cases {n} from {patients} patients; pancreatic tumor positives {positives} ({100 * positives / n:.0f}%), "
        f"{small} small (<= 20 mm)",
        f"  phase:    {_counts(normalized['phase'], PHASES)}",
        f"  age band: {_counts(normalized['age_band'], ('le20', '20-40', '40-60', '60-80', 'gt80'))}",
        f"  sex:      {_counts(normalized['sex'], ('F', 'M'))}",
        f"  race:     {_counts(normalized['race'])}",
        f"  cohort:   {_counts(normalized['cohort'])}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``benchx phantom``: write the phantom cohort and print a summary."""
    parser = argparse.ArgumentParser(prog="benchx phantom", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/phantom", help="cohort folder (default: data/phantom)")
    parser.add_argument("--cases", type=int, default=200, help="number of scans (default: 200)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--shape", type=int, nargs=3, default=[96, 96, 64], metavar=("X", "Y", "Z"),
                        help="volume shape in voxels (default: 96 96 64)")
    parser.add_argument("--spacing", type=float, nargs=3, default=[2.5, 2.5, 3.0], metavar=("X", "Y", "Z"),
                        help="voxel spacing in mm (default: 2.5 2.5 3.0)")
    parser.add_argument("--overwrite", action="store_true",
                        help="rewrite every case and replace a phantom cohort made with other parameters")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        table = generate_phantom_cohort(args.out, args.cases, args.seed, args.shape, args.spacing, args.overwrite)
    except ValueError as error:
        print(f"benchx phantom: error: {error}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    out = Path(args.out)
    print(
        f"phantom cohort {out} (seed {args.seed}, shape {tuple(args.shape)}, spacing {tuple(args.spacing)} mm): "
        f"{table.attrs['written']} cases written, {table.attrs['kept']} kept, in {seconds:.1f} s, "
        f"{_folder_size_bytes(out) / 1e6:.0f} MB on disk"
    )
    print(summarize(table))
    print(f"metadata: {out / METADATA_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
