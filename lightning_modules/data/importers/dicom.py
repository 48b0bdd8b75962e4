"""DICOM CT series to NIfTI cases, keeping only whitelisted, non-identifying acquisition fields.

Read with pydicom. Every folder under ``SRC`` that holds files is one series and one case; the
case id is the folder's path below ``SRC`` with ``/`` replaced by ``_``. Folder names are checked
when the source is listed, against the identifying fields of the series' first readable header:

- a folder path that contains the series' PatientID, OtherPatientIDs, a part of PatientName,
  PatientBirthDate (also written ``1952-03-14``, ``14.03.1952``, ...) or AccessionNumber is refused;
- a folder name that looks like a date (``case_19520314``) or an identifier (6 or more digits in a
  row) is not refused but replaced by a pseudonym.

Either way the case id, the ``source`` column of ``quarantine.csv``, log lines and error messages
carry the pseudonym (``DCM`` + 12 hex digits of HMAC-SHA256(salt, folder path)), never the folder's
name; a ``--metadata`` row for such a folder is keyed by the pseudonym
(:func:`folder_pseudonym`). Without a salt the pseudonym is an unkeyed hash of the path: give
``--salt`` for real data.

Geometry: slices are sorted by ImagePositionPatient projected on the slice normal (row x column
direction cosines of ImageOrientationPatient); the positions must advance by one constant step
(a missing, duplicated or misplaced slice is an error naming the file). Voxel ``(i, j, k)`` = (column,
row, slice) lies at ``IPP_0 + i * col_spacing * row_cosines + j * row_spacing * col_cosines + k * step``
in LPS; the NIfTI affine is that matrix with its x and y rows negated (LPS -> RAS). Pixel values
become HU with each slice's RescaleSlope/RescaleIntercept (pydicom's modality LUT).

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
  db_name, aux_file empty). Errors name files and tags, never values; a pseudonymized folder's
  errors name its pseudonym instead of its path.

Example::

    cases = list_dicom("exports/ct", cohort="site-a", salt=os.environ["BENCHX_PSEUDONYM_SALT"])
    run_import(cases, "data/site_a")
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from lightning_modules.data.importers.core import (
    ImportCaseError,
    ImportSourceError,
    LoadedCase,
    SourceCase,
    to_int16_hu,
)
from lightning_modules.data.metadata import normalize_phase

logger = logging.getLogger("lightning_modules.data.importers")

SALT_ENVIRONMENT_VARIABLE = "BENCHX_PSEUDONYM_SALT"
# LPS (DICOM patient coordinates) -> RAS (NIfTI world coordinates).
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])
# Slice positions may deviate from the constant step by 1% of it (DS strings are rounded).
POSITION_RELATIVE_TOLERANCE = 0.01
ORIENTATION_TOLERANCE = 1e-4
IGNORED_FILE_NAMES = frozenset({"DICOMDIR"})
# Header fields whose values must not appear in a folder name (compared on letters and digits only).
IDENTIFYING_KEYWORDS = ("PatientID", "OtherPatientIDs", "PatientName", "PatientBirthDate", "AccessionNumber")
# Shorter values (a PatientID "12", a name part "Al") occur in ordinary names by chance.
MIN_TOKEN_LENGTH = 3
# A date: 8 digits (YYYYMMDD or DDMMYYYY) or day, month and year with separators; an identifier: 6+ digits.
_DATE_PATTERNS = (
    re.compile(r"(?<!\d)(19|20)\d{2}(0[1-9]|1[0-2])(0[1-9]|[12]\d|3[01])(?!\d)"),
    re.compile(r"(?<!\d)(0[1-9]|[12]\d|3[01])(0[1-9]|1[0-2])(19|20)\d{2}(?!\d)"),
    re.compile(r"(?<!\d)\d{1,4}[-_.]\d{1,2}[-_.]\d{1,4}(?!\d)"),
)
_IDENTIFIER_PATTERN = re.compile(r"\d{6,}")


def folder_pseudonym(relative_path: str, salt: str | None) -> str:
    """``DCM`` + 12 hex digits of HMAC-SHA256(salt, folder path below the source): a stable case id
    for a folder whose name may identify the patient."""
    key = (salt or "").encode("utf-8")
    return "DCM" + hmac.new(key, relative_path.encode("utf-8"), hashlib.sha256).hexdigest()[:12]


def looks_like_date_or_identifier(name: str) -> bool:
    """True when a folder name holds a date or a run of 6+ digits (a record number, an accession number)."""
    return any(pattern.search(name) for pattern in _DATE_PATTERNS) or bool(_IDENTIFIER_PATTERN.search(name))


def _alphanumeric(text: str) -> str:
    return re.sub(r"[^0-9a-z]", "", text.lower())


def identifying_fields_in(name: str, header) -> list[str]:
    """The keywords of :data:`IDENTIFYING_KEYWORDS` whose value (or a name part, or the birth date in
    another order) occurs in ``name``; compared on lowercase letters and digits. Values never leave."""
    folded = _alphanumeric(name)
    found = []
    for keyword in IDENTIFYING_KEYWORDS:
        value = header.get(keyword) if header is not None else None
        if value is None or str(value).strip() == "":
            continue
        if keyword == "PatientName":
            tokens = str(value).replace("^", " ").replace("=", " ").split()
        elif keyword == "OtherPatientIDs" and not isinstance(value, str):
            tokens = [str(v) for v in value]
        else:
            tokens = [str(value)]
        if keyword == "PatientBirthDate" and re.fullmatch(r"\d{8}", tokens[0].strip()):
            date = tokens[0].strip()
            tokens.append(date[6:8] + date[4:6] + date[0:4])  # DDMMYYYY
            tokens.append(date[4:6] + date[6:8] + date[0:4])  # MMDDYYYY
        tokens = [_alphanumeric(t) for t in tokens]
        if any(len(t) >= MIN_TOKEN_LENGTH and t in folded for t in tokens):
            found.append(keyword)
    return found


def pseudonymous_patient_id(patient_id: str, salt: str) -> str:
    """``P`` + 16 hex digits of HMAC-SHA256(salt, PatientID): stable per salt, not reversible without it."""
    digest = hmac.new(salt.encode("utf-8"), patient_id.strip().encode("utf-8"), hashlib.sha256).hexdigest()
    return "P" + digest[:16]


def _read_header(path: Path):
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        # pydicom warns about malformed values by quoting them; those values may identify a patient.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return pydicom.dcmread(str(path), stop_before_pixels=True)
    except InvalidDicomError as error:
        raise ImportCaseError(f"{path}: not a DICOM file") from error
    except Exception as error:
        raise ImportCaseError(f"{path}: cannot read DICOM header ({type(error).__name__})") from error


def _required(dataset, keyword: str, path: Path):
    value = dataset.get(keyword)
    if value is None or value == "":
        raise ImportCaseError(f"{path}: DICOM tag {keyword} is missing")
    return value


def _text(dataset, keyword: str) -> str:
    value = dataset.get(keyword)
    return "" if value is None else str(value).strip()


@dataclass(frozen=True)
class SeriesGeometry:
    """Sorted slice order and the RAS affine of a DICOM series."""

    order: list[int]
    affine: np.ndarray
    shape: tuple[int, int, int]


def series_geometry(headers: list, paths: list[Path]) -> SeriesGeometry:
    """Sort slices along the normal and build the RAS affine; reject mixed or irregular series.

    Args:
        headers: pydicom datasets (pixel data not needed).
        paths: their files, for error messages.
    """
    if len(headers) < 2:
        raise ImportCaseError(f"{paths[0] if paths else '?'}: a series needs at least 2 slices, found {len(headers)}")
    first, first_path = headers[0], paths[0]
    # De-identified exports often blank the UIDs; then geometry alone (duplicate positions,
    # orientation, size) has to reveal a mixed folder.
    series_uid = _text(first, "SeriesInstanceUID")
    orientation = np.array([float(v) for v in _required(first, "ImageOrientationPatient", first_path)], dtype=float)
    pixel_spacing = np.array([float(v) for v in _required(first, "PixelSpacing", first_path)], dtype=float)
    rows, columns = int(_required(first, "Rows", first_path)), int(_required(first, "Columns", first_path))
    for header, path in zip(headers, paths):
        if _text(header, "Modality") != "CT":
            raise ImportCaseError(f"{path}: Modality is not CT")
        if int(header.get("NumberOfFrames", 1) or 1) > 1:
            raise ImportCaseError(f"{path}: multi-frame (enhanced) DICOM is not supported; export single-frame slices")
        if _text(header, "SeriesInstanceUID") != series_uid:
            raise ImportCaseError(f"{path}: belongs to another series than {first_path} (mixed series in one folder)")
        if (int(_required(header, "Rows", path)), int(_required(header, "Columns", path))) != (rows, columns):
            raise ImportCaseError(f"{path}: Rows/Columns differ from {first_path}")
        other = np.array([float(v) for v in _required(header, "ImageOrientationPatient", path)])
        if not np.allclose(other, orientation, atol=ORIENTATION_TOLERANCE):
            raise ImportCaseError(f"{path}: ImageOrientationPatient differs from {first_path}")
        if not np.allclose([float(v) for v in _required(header, "PixelSpacing", path)], pixel_spacing, atol=1e-4):
            raise ImportCaseError(f"{path}: PixelSpacing differs from {first_path} (inconsistent spacing)")
    row_cosines, column_cosines = orientation[:3], orientation[3:]
    normal = np.cross(row_cosines, column_cosines)
    positions = np.array([[float(v) for v in _required(h, "ImagePositionPatient", p)] for h, p in zip(headers, paths)])
    order = np.argsort(positions @ normal, kind="stable")
    sorted_positions = positions[order]
    along_normal = sorted_positions @ normal
    for a, b in zip(order[:-1], order[1:]):
        if abs(float((positions[b] - positions[a]) @ normal)) < 1e-6:
            raise ImportCaseError(f"{paths[b]}: same slice position as {paths[a]} (duplicate slice or mixed series)")
    gaps = np.diff(along_normal)
    typical_gap = float(np.median(gaps))
    tolerance = max(POSITION_RELATIVE_TOLERANCE * typical_gap, 1e-3)
    for gap, a, b in zip(gaps, order[:-1], order[1:]):
        if abs(gap - typical_gap) > tolerance:
            raise ImportCaseError(
                f"{paths[b]}: {gap:.4g} mm from the previous slice {paths[a]}, while the series' slice gap is "
                f"{typical_gap:.4g} mm (inconsistent spacing or a missing slice)"
            )
    step = (sorted_positions[-1] - sorted_positions[0]) / (len(order) - 1)
    expected = sorted_positions[0] + np.arange(len(order))[:, None] * step
    deviation = np.linalg.norm(sorted_positions - expected, axis=1)
    if np.any(deviation > tolerance):
        # Regular gaps along the normal but slices shifted in-plane: not one straight stack.
        worst = int(np.argmax(deviation))
        raise ImportCaseError(
            f"{paths[order[worst]]}: slice is shifted {deviation[worst]:.3g} mm in-plane from the series' straight stack"
        )
    # PixelSpacing is (between rows, between columns); column index i moves along the row cosines.
    lps = np.eye(4)
    lps[:3, 0] = row_cosines * pixel_spacing[1]
    lps[:3, 1] = column_cosines * pixel_spacing[0]
    lps[:3, 2] = step
    lps[:3, 3] = sorted_positions[0]
    return SeriesGeometry(order=[int(i) for i in order], affine=LPS_TO_RAS @ lps, shape=(columns, rows, len(order)))


def _series_files(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".") and p.name not in IGNORED_FILE_NAMES
    )


def acquisition_metadata(header) -> dict[str, str]:
    """The whitelisted, non-identifying fields of a series header (see the module docstring)."""
    metadata: dict[str, str] = {}
    sex = _text(header, "PatientSex").upper()
    # DICOM "O" (other) has no F/M group here: it stays Unknown rather than being forced into one.
    metadata["sex"] = sex if sex in {"F", "M"} else ""
    metadata["age"] = _text(header, "PatientAge")
    scanner = " ".join(t for t in (_text(header, "Manufacturer"), _text(header, "ManufacturerModelName")) if t)
    if scanner:
        metadata["scanner"] = scanner
    kvp = _text(header, "KVP")
    if kvp:
        metadata["kvp"] = kvp
    try:
        metadata["phase"] = normalize_phase(_text(header, "ContrastBolusAgent"))
    except ValueError:
        # An agent name ("Omnipaque 350", "APPLIED") says contrast was given, not which phase.
        metadata["phase"] = ""
    return metadata


def load_dicom_series(folder: Path, case_id: str, salt: str | None, patient_id_given: bool) -> LoadedCase:
    """Read one series folder into HU, RAS affine and whitelisted metadata."""
    from pydicom.pixels import apply_rescale

    paths = _series_files(folder)
    if not paths:
        raise ImportCaseError(f"{folder}: no DICOM files")
    headers = [_read_header(path) for path in paths]
    geometry = series_geometry(headers, paths)
    first = headers[geometry.order[0]]
    metadata = acquisition_metadata(first)
    if not patient_id_given:
        dicom_patient_id = _text(first, "PatientID")
        if dicom_patient_id and not salt:
            raise ImportCaseError(
                f"{folder}: the series has a PatientID; give --salt (or {SALT_ENVIRONMENT_VARIABLE}) to pseudonymize it, "
                "or a patient_id for this case in --metadata FILE"
            )
        metadata["patient_id"] = pseudonymous_patient_id(dicom_patient_id, salt) if dicom_patient_id else ""
    import pydicom

    volume = np.empty(geometry.shape, dtype=np.float64)
    for k, index in enumerate(geometry.order):
        path = paths[index]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dataset = pydicom.dcmread(str(path))
                pixels = dataset.pixel_array
        except Exception as error:
            raise ImportCaseError(
                f"{path}: cannot decode pixel data ({type(error).__name__}: {error}); compressed transfer syntaxes may "
                "need 'pip install pylibjpeg pylibjpeg-openjpeg' or Pillow with JPEG 2000"
            ) from error
        if pixels.shape != (geometry.shape[1], geometry.shape[0]):
            raise ImportCaseError(f"{path}: pixel array shape {pixels.shape} does not match Rows/Columns")
        # Rows index j, columns index i: the NIfTI array is (i, j, k), so each slice is transposed.
        volume[:, :, k] = np.asarray(apply_rescale(pixels, dataset), dtype=np.float64).T
    return LoadedCase(ct=to_int16_hu(volume, folder), affine=geometry.affine, masks={}, metadata=metadata)


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
            return _read_header(path)
        except ImportCaseError:
            continue
    return None


def _source_case(src: Path, folder: Path, cohort: str, salt: str | None, patient_ids_given: frozenset[str]) -> SourceCase:
    """One folder as a case; its name checked against the series' identifying fields (module docstring)."""
    relative = folder.relative_to(src)
    names = [src.name] if relative == Path(".") else list(relative.parts)
    case_id = "_".join(names)
    identifying = identifying_fields_in(case_id, _first_header(folder))
    if not identifying and not any(looks_like_date_or_identifier(name) for name in names):
        load = partial(load_dicom_series, folder, case_id, salt, case_id in patient_ids_given)
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
        # A date or an identifier in a folder name: imported under the pseudonym instead.
        load = partial(_private_load, folder, label, pseudonym, salt, pseudonym in patient_ids_given)
    return SourceCase(case_id=pseudonym, source=f"{base}/{label}", load=load, metadata={"cohort": cohort})


def _refuse(message: str) -> LoadedCase:
    raise ImportCaseError(message)


def _private_load(folder: Path, label: str, case_id: str, salt: str | None, patient_id_given: bool) -> LoadedCase:
    """:func:`load_dicom_series` whose error messages show ``label`` instead of the folder's path."""
    try:
        return load_dicom_series(folder, case_id, salt, patient_id_given)
    except Exception as error:
        message = str(error).replace(str(folder), label)
        raise ImportCaseError(message if isinstance(error, ImportCaseError) else f"{type(error).__name__}: {message}") from None
