"""The phantom cohort plan: sites, demographics, prevalence and lesions, decided per patient before rendering.

Planning is metadata-level sampling (cheap, no volumes): :func:`sample_phantom_metadata` gives the
``metadata.csv`` that :func:`lightning_modules.cohorts.phantom.generate_phantom_cohort` would write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd

from lightning_modules.data.cohort import ORGAN_CLASSES
from lightning_modules.data.metadata import OPTIONAL_COLUMNS, STANDARD_COLUMNS, UNKNOWN
from lightning_modules.data.volume_checks import size_problem

# Float32 volumes of a case's shape held at once while it is rendered (about 5, measured).
RENDER_COPIES = 6

CASE_ID_PREFIX = "PH"
PATIENT_ID_PREFIX = "PT"

LESION_CLASSES = ("pancreatic_lesion", "liver_lesion", "kidney_lesion")
# The anatomy is designed for this field of view (mm, x y z); a smaller one scales it down.
REFERENCE_FOV_MM = (240.0, 240.0, 192.0)
MIN_SHAPE = 16
# The main job's cohort: its committed split (splits/phantom.csv) holds 176 test scans.
DEFAULT_CASES = 440
# The metadata the phantom writes: the data layer's standard columns less those only synthetic cases
# carry, and the optional columns it knows.
METADATA_COLUMNS = tuple(
    c for c in (*STANDARD_COLUMNS, *OPTIONAL_COLUMNS) if c not in ("source_case_id", "generator_run_id", "kvp")
)


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
        phase_mix=(("non-contrast", 0.12), ("arterial", 0.10), ("venous", 0.63), ("delayed", 0.15)),
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
        phase_mix=(("non-contrast", 0.12), ("arterial", 0.15), ("venous", 0.60), ("delayed", 0.13)),
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


def draw_pancreatic_tumor(rng: np.random.Generator) -> tuple[float, str]:
    """A pancreatic tumor's largest diameter (reference mm, one decimal) and location, as the phantom plans them.

    10-45 mm, ~35% small (<= 20 mm), ~13% under 15 mm: small tumors exist, most are learnable.
    """
    location = _choose(rng, _LOCATION_MIX)
    diameter = 10.0 + 35.0 * rng.beta(1.6, 2.4)
    return round(float(diameter), 1), location


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
        diameter, location = draw_pancreatic_tumor(rng)
        lesions.append(LesionPlan("pancreatic_lesion", diameter, location))
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


def plan_phantom_cohort(n_cases: int = DEFAULT_CASES, seed: int = 0) -> list[ScanPlan]:
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
    n_cases: int = DEFAULT_CASES,
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


def _check_count_and_seed(n_cases, seed) -> None:
    if not isinstance(n_cases, (int, np.integer)) or isinstance(n_cases, bool) or n_cases < 1:
        raise ValueError(f"n_cases must be a positive integer, got {n_cases!r}")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")


def _check_shape_and_spacing(shape, spacing) -> None:
    if len(shape) != 3 or any(int(n) != n or n < MIN_SHAPE for n in shape):
        raise ValueError(f"shape must be 3 integers, each at least {MIN_SHAPE}, got {tuple(shape)!r}")
    # Refused before anything is allocated: rendering one case holds about five float32 copies of it.
    too_large = size_problem(shape, subject="--shape asks for", consequence="nothing was written",
                             copies=RENDER_COPIES)
    if too_large:
        raise ValueError(too_large)
    if len(spacing) != 3 or any(not np.isfinite(s) or s <= 0 for s in spacing):
        raise ValueError(f"spacing must be 3 positive numbers (mm), got {tuple(spacing)!r}")

