"""DICOM CT series to NIfTI cases, keeping only whitelisted, non-identifying acquisition fields.

This module lists a DICOM source as cases (:func:`list_dicom`); the name checks and pseudonyms are
:mod:`~lightning_modules.cohorts.importers.dicom_privacy`, reading a series (geometry, HU,
metadata) is :mod:`~lightning_modules.cohorts.importers.dicom_series`.

Read with pydicom. Every folder under ``SRC`` that holds files is one series and one case; the
case id is the folder's path below ``SRC`` with ``/`` replaced by ``_``. Folder and file names are
shown only when proven harmless
(:func:`~lightning_modules.cohorts.importers.dicom_privacy.name_is_harmless`), checked against the
series' first readable header when the source is listed:

- a folder path that contains the series' PatientID (also without leading zeros), OtherPatientIDs,
  AccessionNumber, a part of PatientName, OtherPatientNames, PatientBirthName or
  PatientMotherBirthName (transliterated: ``Mueller_Juergen`` matches ``Müller^Jürgen``; any case,
  any separator) or PatientBirthDate in any common spelling (``19520314``, ``1952-03-14``,
  ``14.3.52``, ``14Mar1952``, ``03/14/1952``, ``520314``, ...;
  :func:`~lightning_modules.cohorts.importers.dicom_privacy.date_spellings`) is refused;
- a folder name that holds the study date, any date, an identifier (6 or more digits in a row) or a
  ``^``, or whose series has no readable header (nothing to check it against), is not refused but
  replaced by a pseudonym.

Either way the case id, the ``source`` column of ``quarantine.csv``, log lines and error messages
carry the pseudonym (``DCM`` + 12 hex digits of HMAC-SHA256(salt, folder path)), never the folder's
name; a ``--metadata`` row for such a folder is keyed by the pseudonym
(:func:`~lightning_modules.cohorts.importers.dicom_privacy.folder_pseudonym`). Without a salt the
pseudonym is an unkeyed hash of the path: give ``--salt`` for real data. File names never reach an
output; in a pseudonymized series, or one with
any file name that is not harmless (``BROWN_BOB_19600101_003.dcm``), errors call a slice by its
position in name order (``file 3 of 120 (by name)``).

Privacy (what reaches ``metadata.csv``, the NIfTI header and the logs):

- kept: PatientSex -> sex, PatientAge -> age (study variables), Manufacturer +
  ManufacturerModelName -> scanner, KVP -> kvp, the voxel spacing, and ContrastBolusAgent -> phase
  only when it names a phase explicitly (``venous``, ``arterial``, ...); otherwise phase is Unknown.
- patient_id: the ``patient_id`` of ``--metadata FILE`` for the case when given; else
  ``P`` + the first 16 hex digits of HMAC-SHA256(key = salt, message = PatientID), the salt coming
  from ``--salt`` or ``BENCHX_PSEUDONYM_SALT`` (keep it secret and the same across imports, so one
  patient keeps one pseudonym); empty when the series has no PatientID (each case is then its own
  patient). PatientID itself is never written.
- never written to any output: names, birth date, accession number, other patient ids (read only
  to check folder names, see above), institution, station, physicians, UIDs (Siemens UIDs embed
  the acquisition time), descriptions, dates and times. The NIfTI header is built fresh (descrip,
  db_name, aux_file empty). Errors name files (by position when a name is not harmless) and tags,
  never values; a pseudonymized folder's errors name its pseudonym instead of its path.

Example::

    cases = list_dicom("exports/ct", cohort="site-a", salt=os.environ["BENCHX_PSEUDONYM_SALT"])
    run_import(cases, "data/site_a")
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path

from lightning_modules.cohorts.importers.dicom_privacy import (
    SALT_ENVIRONMENT_VARIABLE,
    _without_names,
    folder_pseudonym,
    identifying_fields_in,
    name_is_harmless,
)
from lightning_modules.cohorts.importers.dicom_series import _read_header, _series_files, load_dicom_series
from lightning_modules.cohorts.importers.source_cases import ImportCaseError, ImportSourceError, LoadedCase, SourceCase

logger = logging.getLogger("lightning_modules.cohorts.importers")

def list_dicom(
    src: Path | str,
    cohort: str,
    salt: str | None = None,
    patient_ids_given: frozenset[str] = frozenset(),
) -> list[SourceCase]:
    """One case per folder under ``src`` that holds files (``src`` itself when it holds the slices).

    Args:
        src: the export root.
        cohort: the cohort name written to metadata.csv (required: no default from the data).
        salt: secret for the pseudonymous patient id (default: ``BENCHX_PSEUDONYM_SALT``).
        patient_ids_given: case ids whose patient_id comes from ``--metadata`` (no salt needed).
    """
    src = Path(src)
    if not src.is_dir():
        raise ImportSourceError(f"{src}: DICOM source folder does not exist")
    if not cohort:
        raise ImportSourceError("DICOM import needs --cohort NAME")
    salt = salt or os.environ.get(SALT_ENVIRONMENT_VARIABLE) or None
    folders = sorted({p.parent for p in src.rglob("*") if p.is_file() and not p.name.startswith(".")})
    folders = [f for f in folders if not any(part.startswith(".") for part in f.relative_to(src).parts)]
    if not folders:
        raise ImportSourceError(f"{src}: no files found")
    cases = []
    for folder in folders:
        if not _series_files(folder):
            continue
        cases.append(_source_case(src, folder, cohort, salt, patient_ids_given))
    return cases


def _first_header(folder: Path):
    """The first readable DICOM header of a folder (None when none reads): for checking its name."""
    for path in _series_files(folder):
        try:
            return _read_header(path, "")
        except ImportCaseError:
            continue
    return None


def _source_case(src: Path, folder: Path, cohort: str, salt: str | None, patient_ids_given: frozenset[str]) -> SourceCase:
    """One folder as a case; its name and its files' names checked against the series' header (module docstring)."""
    relative = folder.relative_to(src)
    names = [src.name] if relative == Path(".") else list(relative.parts)
    case_id = "_".join(names)
    header = _first_header(folder)
    # File names never become outputs, but errors would quote them: a series with one doubtful
    # file name refers to all its slices by position.
    hide_file_names = not all(name_is_harmless(path.name, header) for path in _series_files(folder))
    identifying = sorted({keyword for name in [case_id, *names] for keyword in identifying_fields_in(name, header)})
    if not identifying and all(name_is_harmless(name, header) for name in [case_id, *names]):
        load = partial(load_dicom_series, folder, case_id, salt, case_id in patient_ids_given, None, hide_file_names)
        return SourceCase(case_id=case_id, source=str(folder), load=load, metadata={"cohort": cohort})
    pseudonym = folder_pseudonym(str(relative if relative != Path(".") else src.name), salt)
    label = f"<DICOM folder {pseudonym}>"
    base = src if relative != Path(".") else src.parent
    if identifying:
        message = (
            f"{label}: the folder name contains the series' {', '.join(identifying)}; rename the folder "
            "to a pseudonymous id (its name is not recorded)"
        )
        load = partial(_refuse, message)
    else:
        # A date, an identifier or an unreadable header: imported under the pseudonym instead.
        load = partial(_private_load, folder, label, pseudonym, salt, pseudonym in patient_ids_given)
    return SourceCase(case_id=pseudonym, source=f"{base}/{label}", load=load, metadata={"cohort": cohort})


def _refuse(message: str) -> LoadedCase:
    raise ImportCaseError(message)


def _private_load(folder: Path, label: str, case_id: str, salt: str | None, patient_id_given: bool) -> LoadedCase:
    """:func:`load_dicom_series` of a pseudonymized folder: its errors name neither the folder nor a file."""
    try:
        return load_dicom_series(folder, case_id, salt, patient_id_given, folder_label=label, hide_file_names=True)
    except Exception as error:
        paths = _series_files(folder)
        names = [(path, f"{label} file {i} of {len(paths)} (by name)") for i, path in enumerate(paths, start=1)]
        message = _without_names(str(error), names, folder, label)
        raise ImportCaseError(message if isinstance(error, ImportCaseError) else f"{type(error).__name__}: {message}") from None
