"""DICOM CT series to NIfTI cases, keeping only whitelisted, non-identifying acquisition fields.

Read with pydicom. Every folder under ``SRC`` that holds files is one series and one case; the
case id is the folder's path below ``SRC`` with ``/`` replaced by ``_``. Folder and file names are
shown only when proven harmless (:func:`name_is_harmless`), checked against the series' first
readable header when the source is listed:

- a folder path that contains the series' PatientID (also without leading zeros), OtherPatientIDs,
  AccessionNumber, a part of PatientName, OtherPatientNames, PatientBirthName or
  PatientMotherBirthName (transliterated: ``Mueller_Juergen`` matches ``Müller^Jürgen``; any case,
  any separator) or PatientBirthDate in any common spelling (``19520314``, ``1952-03-14``,
  ``14.3.52``, ``14Mar1952``, ``03/14/1952``, ``520314``, ...; :func:`date_spellings`) is refused;
- a folder name that holds the study date, any date, an identifier (6 or more digits in a row) or a
  ``^``, or whose series has no readable header (nothing to check it against), is not refused but
  replaced by a pseudonym.

Either way the case id, the ``source`` column of ``quarantine.csv``, log lines and error messages
carry the pseudonym (``DCM`` + 12 hex digits of HMAC-SHA256(salt, folder path)), never the folder's
name; a ``--metadata`` row for such a folder is keyed by the pseudonym
(:func:`folder_pseudonym`). Without a salt the pseudonym is an unkeyed hash of the path: give
``--salt`` for real data. File names never reach an output; in a pseudonymized series, or one with
any file name that is not harmless (``BROWN_BOB_19600101_003.dcm``), errors call a slice by its
position in name order (``file 3 of 120 (by name)``).

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
  db_name, aux_file empty). Errors name files (by position when a name is not harmless) and tags,
  never values; a pseudonymized folder's errors name its pseudonym instead of its path.

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
import unicodedata
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

import numpy as np

from lightning_modules.cohorts.importers.core import (
    ImportCaseError,
    ImportSourceError,
    LoadedCase,
    SourceCase,
    to_int16_hu,
)
from lightning_modules.data.metadata import normalize_phase

logger = logging.getLogger("lightning_modules.cohorts.importers")

SALT_ENVIRONMENT_VARIABLE = "BENCHX_PSEUDONYM_SALT"
# LPS (DICOM patient coordinates) -> RAS (NIfTI world coordinates).
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])
# Slice positions may deviate from the constant step by 1% of it (DS strings are rounded).
POSITION_RELATIVE_TOLERANCE = 0.01
ORIENTATION_TOLERANCE = 1e-4
IGNORED_FILE_NAMES = frozenset({"DICOMDIR"})
# Header fields whose values must not appear in a folder name: a match refuses the folder.
IDENTIFYING_KEYWORDS = (
    "PatientID",
    "OtherPatientIDs",
    "PatientName",
    "OtherPatientNames",
    "PatientBirthName",
    "PatientMotherBirthName",
    "PatientBirthDate",
    "AccessionNumber",
)
_NAME_KEYWORDS = frozenset({"PatientName", "OtherPatientNames", "PatientBirthName", "PatientMotherBirthName"})
_ID_KEYWORDS = frozenset({"PatientID", "OtherPatientIDs", "AccessionNumber"})
# Dates of the examination: a folder name that spells one is imported under a pseudonym.
STUDY_DATE_KEYWORDS = ("StudyDate", "SeriesDate", "AcquisitionDate", "ContentDate")
# Shorter values (a PatientID "12", a name part "Al") occur inside ordinary names by chance; they
# count only as a whole word of the name.
MIN_TOKEN_LENGTH = 3
# Letters unicodedata does not decompose, and the German convention (Müller -> Mueller, Straße -> Strasse).
_TRANSLITERATION = str.maketrans(
    {"ä": "ae", "ö": "oe", "ü": "ue", "æ": "ae", "œ": "oe", "ø": "oe", "å": "aa", "đ": "d", "ð": "d",
     "ł": "l", "þ": "th", "ı": "i"}
)
_MONTHS = (
    ("january", "jan", "januar", "jaenner", "janvier", "janv"),
    ("february", "feb", "februar", "feber", "fevrier", "fevr", "fev"),
    ("march", "mar", "maerz", "marz", "mrz", "mars"),
    ("april", "apr", "avril", "avr"),
    ("may", "mai"),
    ("june", "jun", "juni", "juin"),
    ("july", "jul", "juli", "juillet", "juil"),
    ("august", "aug", "aout"),
    ("september", "sep", "sept"),
    ("october", "oct", "oktober", "okt", "octobre"),
    ("november", "nov", "novembre"),
    ("december", "dec", "dezember", "dez", "decembre"),
)
_SEPARATOR = r"[^0-9a-z]"
_ANY_MONTH = "|".join(sorted({name for names in _MONTHS for name in names}, key=len, reverse=True))
# Any date: 8 digits (YYYYMMDD, DDMMYYYY, MMDDYYYY), day, month and year with separators, or with a
# month name (14Mar1952, March 14 1952); an identifier: 6+ digits (also YYMMDD).
_DATE_PATTERNS = (
    re.compile(r"(?<!\d)(19|20)\d{2}(0[1-9]|1[0-2])(0[1-9]|[12]\d|3[01])(?!\d)"),
    re.compile(r"(?<!\d)(0[1-9]|[12]\d|3[01])(0[1-9]|1[0-2])(19|20)\d{2}(?!\d)"),
    re.compile(r"(?<!\d)(0[1-9]|1[0-2])(0[1-9]|[12]\d|3[01])(19|20)\d{2}(?!\d)"),
    re.compile(rf"(?<!\d)\d{{1,4}}{_SEPARATOR}+\d{{1,2}}{_SEPARATOR}+\d{{1,4}}(?!\d)"),
    re.compile(
        rf"(?<!\d)\d{{1,4}}(st|nd|rd|th)?{_SEPARATOR}*(?<![a-z])({_ANY_MONTH})(?![a-z]){_SEPARATOR}*\d{{2,4}}(?!\d)"
    ),
    re.compile(rf"(?<![a-z])({_ANY_MONTH})(?![a-z]){_SEPARATOR}*\d{{1,2}}(st|nd|rd|th)?{_SEPARATOR}*\d{{2,4}}(?!\d)"),
)
_IDENTIFIER_PATTERN = re.compile(r"\d{6,}")


def folder_pseudonym(relative_path: str, salt: str | None) -> str:
    """``DCM`` + 12 hex digits of HMAC-SHA256(salt, folder path below the source): a stable case id
    for a folder whose name may identify the patient."""
    key = (salt or "").encode("utf-8")
    return "DCM" + hmac.new(key, relative_path.encode("utf-8"), hashlib.sha256).hexdigest()[:12]


def transliterated(text: str) -> str:
    """Lowercase ASCII of ``text``, separators kept: ``Müller^Jürgen`` -> ``mueller^juergen``,
    ``Łukasz Øster`` -> ``lukasz oester`` (the German convention, then unicodedata's decomposition)."""
    text = unicodedata.normalize("NFC", text).casefold().translate(_TRANSLITERATION)
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).encode("ascii", "ignore").decode()


def _folded(text: str) -> str:
    # Letters and digits only, and ae/oe/ue read as a/o/u: "Mueller", "Müller" and "Muller" all
    # become "muller", whichever spelling the header or the folder uses.
    return re.sub(r"([aou])e", r"\1", re.sub(r"[^0-9a-z]", "", transliterated(text)))


def _words(text: str) -> set[str]:
    # Words split at separators and between letters and digits ("Ng2" -> "ng", "2").
    parts = re.split(r"[^0-9a-z]+|(?<=[a-z])(?=\d)|(?<=\d)(?=[a-z])", transliterated(text))
    return {_folded(word) for word in parts if word}


def looks_like_date_or_identifier(name: str) -> bool:
    """True when a name holds a date in any common spelling (``19520314``, ``14.03.1952``,
    ``14Mar1952``, ...), a run of 6+ digits (a record or accession number, ``520314``) or a DICOM
    person name separator (``^``)."""
    text = transliterated(name)
    return "^" in name or bool(_IDENTIFIER_PATTERN.search(text)) or any(p.search(text) for p in _DATE_PATTERNS)


def _date_parts(value: str) -> tuple[int, int, int] | None:
    digits = re.sub(r"\D", "", value)
    if len(digits) != 8:
        return None
    year, month, day = int(digits[:4]), int(digits[4:6]), int(digits[6:])
    return (year, month, day) if 1 <= month <= 12 and 1 <= day <= 31 else None


def date_spellings(value: str) -> re.Pattern | None:
    """A pattern for every common spelling of a DICOM date (``YYYYMMDD``) in a transliterated name:
    compact (19520314, 14031952, 03141952, 520314, 140352), with separators and optional zeros
    (1952-03-14, 14.3.1952, 3/14/52) and with a month name (14Mar1952, March 14th 1952, 1952mar14)."""
    parts = _date_parts(value)
    if parts is None:
        return None
    year, month, day = parts
    years = (f"{year:04d}", f"{year % 100:02d}")
    alternatives = []
    for y in years:
        mm, dd = f"{month:02d}", f"{day:02d}"
        alternatives += [y + mm + dd, dd + mm + y, mm + dd + y]
    y_any, m_num, d_num = rf"(?:{year // 100:02d})?{year % 100:02d}", rf"0?{month}", rf"0?{day}(?:st|nd|rd|th)?"
    m_name = rf"(?<![a-z])(?:{'|'.join(sorted(_MONTHS[month - 1], key=len, reverse=True))})(?![a-z])"
    separated = rf"{_SEPARATOR}+"
    for a, b, c in ((y_any, m_num, d_num), (d_num, m_num, y_any), (m_num, d_num, y_any)):
        alternatives.append(separated.join((a, b, c)))
    loose = rf"{_SEPARATOR}*"
    for a, b, c in ((d_num, m_name, y_any), (m_name, d_num, y_any), (y_any, m_name, d_num)):
        alternatives.append(loose.join((a, b, c)))
    return re.compile("|".join(rf"(?<!\d)(?:{alternative})(?!\d)" for alternative in alternatives))


def _values(header, keyword: str) -> list[str]:
    from pydicom.multival import MultiValue

    value = header.get(keyword) if header is not None else None
    if value is None:
        return []
    # A multi-valued element (OtherPatientIDs "A\\B") is a MultiValue; a PersonName iterates characters.
    values = [str(v) for v in value] if isinstance(value, (MultiValue, list, tuple)) else [str(value)]
    return [v for v in values if v.strip()]


def identifying_fields_in(name: str, header) -> list[str]:
    """The keywords of :data:`IDENTIFYING_KEYWORDS` whose value occurs in ``name``.

    Names are compared transliterated (``Mueller_Juergen`` matches ``Müller^Jürgen``), case- and
    separator-insensitive, part by part; ids also without leading zeros; the birth date in every
    spelling of :func:`date_spellings`. Values never leave this function.
    """
    folded, words, text = _folded(name), _words(name), transliterated(name)
    found = []
    for keyword in IDENTIFYING_KEYWORDS:
        for value in _values(header, keyword):
            if keyword == "PatientBirthDate":
                pattern = date_spellings(value)
                hit = pattern is not None and bool(pattern.search(text))
            else:
                if keyword in _NAME_KEYWORDS:
                    tokens = {_folded(t) for t in re.split(r"[\^=\s,\-]+", value)} | {_folded(value)}
                else:
                    tokens = {_folded(value), _folded(value).lstrip("0")}
                tokens.discard("")
                hit = any(t in folded if len(t) >= MIN_TOKEN_LENGTH else t in words for t in tokens)
            if hit:
                found.append(keyword)
                break
    return found


def study_date_in(name: str, header) -> bool:
    """True when ``name`` spells one of the series' examination dates (:data:`STUDY_DATE_KEYWORDS`)."""
    text = transliterated(name)
    patterns = (date_spellings(value) for keyword in STUDY_DATE_KEYWORDS for value in _values(header, keyword))
    return any(pattern is not None and pattern.search(text) for pattern in patterns)


def name_is_harmless(name: str, header) -> bool:
    """A folder or file name may be shown only when the series' header could be read and the name
    holds none of its identifying values or dates, no date in any spelling, no long number and no
    person-name separator. In doubt, it is not harmless (and is pseudonymized)."""
    return (
        header is not None
        and not identifying_fields_in(name, header)
        and not study_date_in(name, header)
        and not looks_like_date_or_identifier(name)
    )


def pseudonymous_patient_id(patient_id: str, salt: str) -> str:
    """``P`` + 16 hex digits of HMAC-SHA256(salt, PatientID): stable per salt, not reversible without it."""
    digest = hmac.new(salt.encode("utf-8"), patient_id.strip().encode("utf-8"), hashlib.sha256).hexdigest()
    return "P" + digest[:16]


def _read_header(path: Path, shown: str):
    """The header of ``path``; errors call the file ``shown``."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        # pydicom warns about malformed values by quoting them; those values may identify a patient.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return pydicom.dcmread(str(path), stop_before_pixels=True)
    except InvalidDicomError as error:
        raise ImportCaseError(f"{shown}: not a DICOM file") from error
    except Exception as error:
        raise ImportCaseError(f"{shown}: cannot read DICOM header ({type(error).__name__})") from error


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


def series_geometry(headers: list, paths: Sequence[Path | str]) -> SeriesGeometry:
    """Sort slices along the normal and build the RAS affine; reject mixed or irregular series.

    Args:
        headers: pydicom datasets (pixel data not needed).
        paths: their files, or what error messages call them (a pseudonymized series' slices are
            called by position, never by name).
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


def load_dicom_series(
    folder: Path,
    case_id: str,
    salt: str | None,
    patient_id_given: bool,
    folder_label: str | None = None,
    hide_file_names: bool = False,
) -> LoadedCase:
    """Read one series folder into HU, RAS affine and whitelisted metadata.

    Args:
        folder: the series folder.
        case_id: the case it becomes.
        salt: secret of the pseudonymous patient id.
        patient_id_given: the patient id comes from ``--metadata`` (no salt needed).
        folder_label: what errors call the folder (its pseudonym); default its path.
        hide_file_names: errors call a slice "file 3 of 120 (by name)" instead of by its name.
    """
    from pydicom.pixels import apply_rescale

    shown_folder = folder_label or str(folder)
    paths = _series_files(folder)
    if not paths:
        raise ImportCaseError(f"{shown_folder}: no DICOM files")
    if hide_file_names:
        shown = [f"{shown_folder} file {i} of {len(paths)} (by name)" for i in range(1, len(paths) + 1)]
    else:
        shown = [str(Path(shown_folder) / path.name) for path in paths]
    headers = [_read_header(path, name) for path, name in zip(paths, shown)]
    geometry = series_geometry(headers, shown)
    first = headers[geometry.order[0]]
    metadata = acquisition_metadata(first)
    if not patient_id_given:
        dicom_patient_id = _text(first, "PatientID")
        if dicom_patient_id and not salt:
            raise ImportCaseError(
                f"{shown_folder}: the series has a PatientID; give --salt (or {SALT_ENVIRONMENT_VARIABLE}) to "
                "pseudonymize it, or a patient_id for this case in --metadata FILE"
            )
        metadata["patient_id"] = pseudonymous_patient_id(dicom_patient_id, salt) if dicom_patient_id else ""
    import pydicom

    volume = np.empty(geometry.shape, dtype=np.float64)
    for k, index in enumerate(geometry.order):
        path, name = paths[index], shown[index]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dataset = pydicom.dcmread(str(path))
                pixels = dataset.pixel_array
        except Exception as error:
            detail = f"{type(error).__name__}: {error}"
            if hide_file_names:  # pydicom's message may quote the file's path
                detail = _without_names(detail, [(path, name)], folder, shown_folder)
            raise ImportCaseError(
                f"{name}: cannot decode pixel data ({detail}); compressed transfer syntaxes may "
                "need 'pip install pylibjpeg pylibjpeg-openjpeg' or Pillow with JPEG 2000"
            ) from error
        if pixels.shape != (geometry.shape[1], geometry.shape[0]):
            raise ImportCaseError(f"{name}: pixel array shape {pixels.shape} does not match Rows/Columns")
        # Rows index j, columns index i: the NIfTI array is (i, j, k), so each slice is transposed.
        volume[:, :, k] = np.asarray(apply_rescale(pixels, dataset), dtype=np.float64).T
    return LoadedCase(ct=to_int16_hu(volume, shown_folder), affine=geometry.affine, masks={}, metadata=metadata)


def _without_names(text: str, names: list[tuple[Path, str]], folder: Path, shown_folder: str) -> str:
    """``text`` with each file's path, name and stem replaced by what errors show for it, and the
    folder's path by ``shown_folder`` (one pass, longest first, so no replacement is replaced again)."""
    replacements = {str(folder): shown_folder}
    for path, shown in names:
        replacements[str(path)] = shown
        replacements.update({part: shown for part in (path.name, path.stem) if len(part) >= MIN_TOKEN_LENGTH})
    pattern = re.compile("|".join(re.escape(key) for key in sorted(replacements, key=len, reverse=True)))
    return pattern.sub(lambda match: replacements[match.group(0)], text)


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
