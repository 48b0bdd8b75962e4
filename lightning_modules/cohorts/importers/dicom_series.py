"""Reading one DICOM CT series: headers, slice order and the RAS affine, HU, whitelisted metadata.

Geometry: slices are sorted by ImagePositionPatient projected on the slice normal (row x column
direction cosines of ImageOrientationPatient); the positions must advance by one constant step
(a missing, duplicated or misplaced slice is an error naming the file). Voxel ``(i, j, k)`` = (column,
row, slice) lies at ``IPP_0 + i * col_spacing * row_cosines + j * row_spacing * col_cosines + k * step``
in LPS; the NIfTI affine is that matrix with its x and y rows negated (LPS -> RAS). Pixel values
become HU with each slice's RescaleSlope/RescaleIntercept (pydicom's modality LUT).

Errors name files (by position when a name is not harmless, see
:mod:`~lightning_modules.cohorts.importers.dicom_privacy`) and tags, never values.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from lightning_modules.cohorts.importers.dicom_privacy import (
    SALT_ENVIRONMENT_VARIABLE,
    _without_names,
    pseudonymous_patient_id,
)
from lightning_modules.cohorts.importers.source_cases import ImportCaseError, LoadedCase
from lightning_modules.cohorts.importers.volumes import to_int16_hu
from lightning_modules.data.metadata import normalize_phase

# LPS (DICOM patient coordinates) -> RAS (NIfTI world coordinates).
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])
# Slice positions may deviate from the constant step by 1% of it (DS strings are rounded).
POSITION_RELATIVE_TOLERANCE = 0.01
ORIENTATION_TOLERANCE = 1e-4
IGNORED_FILE_NAMES = frozenset({"DICOMDIR"})


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
