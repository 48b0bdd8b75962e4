"""Attenuation (HU) of every phantom tissue per contrast phase, and the per-scan intensity draws.

The lesion-minus-organ contrast table is where the designed gaps live (see the package docstring,
``docs/explanation/data.md "The phantom cohort"``): iso without contrast (the physics gap), hyper-attenuating
in the arterial phase (the scarcity gap: visible, but unlike any venous tumor), clearly
hypo-attenuating in the venous phase.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from lightning_modules.data.metadata import PHASES
from lightning_modules.cohorts.phantom.plan import ScanPlan
from lightning_modules.cohorts.phantom.tissues import N_TISSUES, Tissue

# ----------------------------------------------------------------------------------------------
# Attenuation (HU), docs/explanation/data.md "The phantom cohort": (non-contrast, arterial, venous, delayed).

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
    Tissue.PANCREAS: (45, 150, 115, 75),
    Tissue.AORTA: (40, 300, 165, 115),
    Tissue.POSTCAVA: (40, 95, 150, 110),
}
# Lesion minus its organ (HU). The designed gaps (package docstring and
# docs/explanation/data.md "The phantom cohort"):
# - venous (the reference, common): a clear hypo-attenuating tumor, -50 HU on a 115 HU pancreas;
# - arterial (the scarcity gap, rare): the tumor is HYPER-attenuating, +70 HU on a 150 HU pancreas,
#   like the arterial blush of a hypervascular (neuroendocrine-like) tumor. It is clearly visible,
#   but it looks the opposite of every venous tumor, so a model that learned tumors from venous scans
#   misses it, and only arterial examples (real or synthetic) can teach it. Pancreatic
#   adenocarcinoma itself is hypo-attenuating in the arterial phase: this is a designed appearance
#   shift, not clinical truth. (Phantom version 3 made it a -70 HU tumor on a 180 HU pancreas; once
#   tumors sat inside the gland (lesions.py), a model learned "darker than the parenchyma" and
#   found those as well as venous ones, so that gap was gone.)
# - non-contrast (the physics gap): -2 HU, with the parenchyma's texture, against 9-19 HU of noise:
#   iso-attenuating, so no data can make it visible. (At -5 HU with a coarser texture, a detector
#   averaging over a large tumor still found some: test AUC about 0.7.)
# - delayed is in between (-20 HU).
# Liver (hypovascular metastasis-like) and kidney (cyst/RCC-like) lesions have no source table:
# chosen hypo-attenuating with the same near-iso non-contrast behaviour.
_LESION_CONTRAST: dict[str, tuple[float, float, float, float]] = {
    "pancreatic_lesion": (-2, 70, -50, -20),
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
    # Tumors are a little more heterogeneous than parenchyma once contrast shows their vessels;
    # without contrast they have the parenchyma's texture (no texture cue for the physics gap).
    amplitude[[Tissue.PANCREATIC_LESION, Tissue.LIVER_LESION, Tissue.KIDNEY_LEFT_LESION,
               Tissue.KIDNEY_RIGHT_LESION]] = 5.0 if plan.phase == "non-contrast" else 7.0
    if plan.phase == "arterial":
        # The spleen enhances heterogeneously in the arterial phase.
        amplitude[Tissue.SPLEEN] = 18.0
    return hu, amplitude


# The phases whose tumors carry the designed gaps (see the package docstring).
SCARCITY_PHASE = "arterial"
PHYSICS_PHASE = "non-contrast"
REFERENCE_PHASE = "venous"


def designed_gaps() -> dict[str, dict[str, float | str]]:
    """The two designed gaps and the reference phase, with their typical pancreas and tumor HU.

    Returns:
        ``{"scarcity": {...}, "physics": {...}, "reference": {...}}``, each with ``phase``,
        ``pancreas_hu``, ``tumor_hu`` and ``contrast_hu`` (tumor minus pancreas, before per-scan jitter).
    """
    gaps = {}
    for name, phase in (("scarcity", SCARCITY_PHASE), ("physics", PHYSICS_PHASE), ("reference", REFERENCE_PHASE)):
        table = phase_attenuation(phase)
        gaps[name] = {"phase": phase, "pancreas_hu": table["pancreas"], "tumor_hu": table["pancreatic_lesion"],
                      "contrast_hu": lesion_contrast_hu(phase)}
    return gaps
