"""The phantom's tissue labels and which tissues make up each written mask.

A scan is first built as a label map of :class:`Tissue` values (see ``anatomy.py``); several
tissues make up one organ mask (``MASK_TISSUES``), and the ``_ON_*`` sets say what a structure
may be painted over, so painting order plus these sets decide who wins where shapes overlap.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np


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

