"""The audit's finding: one observation of one layer (duplicates, patients, source), with its severity.

A ``leak`` fails ``benchx audit`` (exit 1) and refuses training unless ``data.allow_leakage``; a
``warning`` and an ``info`` are reported only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_modules.data.splits import SPLITS

SEVERITIES = ("leak", "warning", "info")


def split_order(split: str) -> int:
    """Position of a split name in train, val, test (for naming pairs and sorting)."""
    return SPLITS.index(split)


@dataclass(frozen=True)
class Finding:
    """One audit finding. ``severity``: ``leak`` (fails the audit), ``warning`` or ``info``."""

    layer: str
    kind: str
    severity: str
    case_id: str = ""
    other_case_id: str = ""
    split: str = ""
    other_split: str = ""
    patient_id: str = ""
    value: float = math.nan
    detail: str = ""

    def __str__(self) -> str:
        parts = [f"[{self.severity}] {self.layer}/{self.kind}"]
        if self.case_id:
            cases = self.case_id + (f" ({self.split})" if self.split else "")
            if self.other_case_id:
                cases += f" ~ {self.other_case_id}" + (f" ({self.other_split})" if self.other_split else "")
            parts.append(cases)
        parts.append(self.detail)
        return ": ".join(parts)


