"""Import real datasets into a cohort in AbdomenAtlas layout A, resumably (``docs/explanation/data.md "Cohorts on disk"``).

Sources: a TotalSegmentator folder (per-class files or one multilabel volume), an nnU-Net raw
dataset, a Medical Segmentation Decathlon task, or DICOM CT series (pseudonymized, see
:mod:`lightning_modules.cohorts.importers.dicom`). Every case keeps its image's own grid and affine, masks
are binary and never resampled, writes are atomic, a rerun skips finished cases, and a case that
fails is listed in ``<out>/quarantine.csv`` with the reason while nothing of it enters the cohort.

Run::

    benchx import msd Task07_Pancreas --out data/msd_pancreas
    benchx import nnunet Dataset007_Pancreas --out data/pancreas --class-map classes.json
    benchx import totalseg TotalSegmentator_v2 --out data/totalseg --cohort TotalSegmentator
    benchx import dicom exports/ct --out data/site_a --cohort site-a --salt "$SECRET" --metadata ids.csv

``--class-map FILE`` (JSON, YAML or CSV ``label,class``) maps label values or source class names to
AbdomenAtlas classes (or to ``[]`` to leave a label out); for ``totalseg`` it may also be the name
of a built-in table, ``totalseg-v2`` (the default) or ``totalseg-v1``. ``--metadata FILE`` is a CSV
keyed by case_id whose values (patient_id, age, sex, phase, ...) replace what the source gives: the
way to add what a format cannot carry. Anything not recorded is Unknown, never guessed.
The exit status is 0 when every case is in the cohort, 1 when some are quarantined.
"""

from __future__ import annotations

from lightning_modules.cohorts.importers.class_maps import (
    ATLAS_CLASSES,
    TOTALSEGMENTATOR_V1_LABELS,
    TOTALSEGMENTATOR_V2_LABELS,
    class_map_from_argument,
    load_class_map,
)
from lightning_modules.cohorts.importers.dicom import list_dicom
from lightning_modules.cohorts.importers.dicom_privacy import (
    folder_pseudonym,
    looks_like_date_or_identifier,
    name_is_harmless,
    pseudonymous_patient_id,
)
from lightning_modules.cohorts.importers.dicom_series import series_geometry
from lightning_modules.cohorts.importers.metadata_rows import read_metadata_overrides
from lightning_modules.cohorts.importers.nifti import list_msd, list_nnunet, list_totalsegmentator
from lightning_modules.cohorts.importers.resumable_import import QUARANTINE_FILE, ImportReport, run_import
from lightning_modules.cohorts.importers.source_cases import ImportCaseError, ImportSourceError, LoadedCase, SourceCase

__all__ = [
    "ATLAS_CLASSES",
    "QUARANTINE_FILE",
    "TOTALSEGMENTATOR_V1_LABELS",
    "TOTALSEGMENTATOR_V2_LABELS",
    "ImportCaseError",
    "ImportReport",
    "ImportSourceError",
    "LoadedCase",
    "SourceCase",
    "folder_pseudonym",
    "import_source",
    "looks_like_date_or_identifier",
    "name_is_harmless",
    "list_dicom",
    "list_msd",
    "list_nnunet",
    "list_totalsegmentator",
    "load_class_map",
    "pseudonymous_patient_id",
    "run_import",
    "series_geometry",
]

SOURCE_KINDS = ("totalseg", "nnunet", "msd", "dicom")


def import_source(
    kind: str,
    src,
    out,
    cohort: str | None = None,
    class_map: str | None = None,
    metadata: str | None = None,
    salt: str | None = None,
) -> ImportReport:
    """List a source of the given kind and import it into ``out`` (what ``benchx import`` runs; see :mod:`lightning_modules.commands.import_cohort`).

    Args:
        kind: ``totalseg``, ``nnunet``, ``msd`` or ``dicom``.
        src: the source folder.
        out: the cohort root (layout A).
        cohort: cohort name for metadata.csv (required for DICOM).
        class_map: class map file or built-in table name.
        metadata: CSV of per-case metadata (case_id + columns) replacing what the source gives.
        salt: DICOM only: secret for pseudonymous patient ids.
    """
    overrides = read_metadata_overrides(metadata)
    if kind == "totalseg":
        cases = list_totalsegmentator(src, cohort, class_map_from_argument(class_map, None))
    elif kind == "nnunet":
        cases = list_nnunet(src, cohort, class_map_from_argument(class_map))
    elif kind == "msd":
        cases = list_msd(src, cohort, class_map_from_argument(class_map))
    elif kind == "dicom":
        if class_map is not None:
            raise ImportSourceError("--class-map does not apply to DICOM images (they carry no labels)")
        given = frozenset(case_id for case_id, row in overrides.items() if row.get("patient_id"))
        cases = list_dicom(src, cohort or "", salt, given)
    else:
        raise ImportSourceError(f"unknown source kind {kind!r}; expected one of {', '.join(SOURCE_KINDS)}")
    return run_import(cases, out, overrides)
