"""The matched operating points of a comparison: each run's m chosen on its validation records so
that its specificity equals the reference run's there, overall (``matched_specificity``) or within
one subgroup (``subgroup_matched_specificity``), and their choices on the validation resamples for
the nested threshold bootstrap (docs/explanation/detection-and-statistics.md "Scan-level detection").

The reference run keeps its validation-chosen m at both points; only validation records are read,
so the test cohort never moves a threshold.

Example::

    point = matched_point(reference, run, "volume", subgroup=("phase", "arterial"))
    nested = nested_thresholds(reference, run, {"subgroup_matched_specificity": point}, "volume", 2000,
                               subgroup=("phase", "arterial"))
"""

from __future__ import annotations

import math

from lightning_modules.evaluation.records import ATTRIBUTES
from lightning_modules.evaluation.thresholds import (
    matched_specificity_point,
    OperatingPoint,
    resampled_matched_thresholds,
    specificity_at,
    subgroup_matched_specificity_point,
)
from lightning_modules.workflows.operating_points import nested_choices

SUBGROUP_POINT = "subgroup_matched_specificity"


def parse_subgroup(subgroup: str | tuple[str, str] | None) -> tuple[str, str] | None:
    """``"phase:arterial"`` or ``("phase", "arterial")`` as (attribute, group); None stays None.

    Raises:
        ValueError: not ``attribute:group``, or an attribute the records do not split by.
    """
    if subgroup is None:
        return None
    if isinstance(subgroup, str):
        attribute, _, group = subgroup.partition(":")
    else:
        attribute, group = (tuple(subgroup) + ("", ""))[:2]
    attribute, group = str(attribute).strip(), str(group).strip()
    if not attribute or not group:
        raise ValueError(f"a matched subgroup is written attribute:group, e.g. phase:arterial (got {subgroup!r})")
    if attribute not in ATTRIBUTES:
        raise ValueError(f"unknown subgroup attribute {attribute!r} in {subgroup!r}: expected one of {', '.join(ATTRIBUTES)}")
    return attribute, group


def matched_point(reference, other, score: str, subgroup: tuple[str, str] | None = None) -> OperatingPoint:
    """``other``'s matched-specificity point against ``reference`` (runs with ``val_records`` and
    ``thresholds["val_chosen"]``, ``["fixed"]``): the target is the reference's validation
    specificity at its validation-chosen m, overall or, with ``subgroup``, within that subgroup."""
    target = math.nan
    if reference.val_records is not None and len(reference.val_records):
        target = specificity_at(reference.val_records, reference.thresholds["val_chosen"], score, subgroup)
    if subgroup is None:
        return matched_specificity_point(other.val_records, target, other.thresholds["fixed"], score)
    return subgroup_matched_specificity_point(other.val_records, target, other.thresholds["fixed"], subgroup, score)


def nested_thresholds(reference, other, matched: dict[str, OperatingPoint], score: str, n_resamples: int,
                      subgroup: tuple[str, str] | None = None) -> dict:
    """Per chosen operating point, (reference's, other's) threshold on each validation resample, or None.

    ``matched`` holds the matched points computed (``matched_specificity`` and, with ``subgroup``,
    ``subgroup_matched_specificity``). A run whose validation point fell back to the fixed m keeps
    it in every resample (None); so does a matched point that fell back.
    """
    base = None if reference.fallback else nested_choices(reference.val_records, reference.rule, score, n_resamples)
    chosen = None if other.fallback else nested_choices(other.val_records, other.rule, score, n_resamples)
    nested = {"val_chosen": None if base is None and chosen is None else (base, chosen)}
    for name, point in matched.items():
        choices = None
        if base is not None and not point.fallback and other.val_records is not None:
            within = subgroup if name == SUBGROUP_POINT else None
            choices = resampled_matched_thresholds(reference.val_records, base, other.val_records, score, within)
        nested[name] = None if base is None and choices is None else (base, choices)
    return nested
