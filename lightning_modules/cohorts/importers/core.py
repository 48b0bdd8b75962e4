"""The import engine shared by every source format: class maps, grid checks, resumable writes, quarantine.

A source module (``nifti``, ``dicom``) lists its cases as :class:`SourceCase` objects whose ``load``
reads one case into a :class:`LoadedCase` (CT in HU on its own grid, binary masks by AbdomenAtlas
class name, metadata it found). :func:`run_import` writes them into a cohort in layout A
(``docs/design.md "Cohorts on disk"``) with :func:`lightning_modules.data.cohort.write_case`, which assembles each case in
a hidden folder and renames it into place, so a case is complete or absent:

- a case already on disk whose files check out and that has a ``metadata.csv`` row is skipped, so a
  rerun after a kill only does the remainder;
- a case that fails is listed in ``<out>/quarantine.csv`` (case id, source, reason) and leaves
  nothing in the cohort; a later run retries it and drops it from the list once it imports;
- ``metadata.csv`` is rewritten atomically after every case, merging rows already there.

Example::

    report = run_import(cases, Path("data/msd_pancreas"))
    print(report.summary())
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import nibabel as nib
import numpy as np
import pandas as pd
from tqdm.auto import tqdm
from nibabel.filebasedimages import ImageFileError

from lightning_modules.data.cohort import (
    CT_FILE,
    LESION_CLASSES,
    ORGAN_CLASSES,
    METADATA_FILE,
    SEGMENTATION_DIR,
    atomic_write_csv,
    write_case,
    write_metadata,
)
from lightning_modules.data.metadata import (
    UNKNOWN,
    canonical_column,
    normalize_age,
    normalize_metadata,
    normalize_phase,
    normalize_race,
    normalize_sex,
)
from lightning_modules.data.validation import show_progress
from lightning_modules.run_folder import LOCK_FILE, RunFolderLock

logger = logging.getLogger("lightning_modules.cohorts.importers")

QUARANTINE_FILE = "quarantine.csv"
QUARANTINE_COLUMNS = ("case_id", "source", "reason")

# The AbdomenAtlas classes this framework knows (docs/design.md "Cohorts on disk"). A class map that targets
# anything else is rejected, so a typo ("pancreatic_tumor") cannot create a class nobody reads.
ATLAS_CLASSES = ORGAN_CLASSES + LESION_CLASSES

# TotalSegmentator's label values for the classes used here, read from the class_map in
# totalsegmentator/map_to_binary.py ("total" task for v2, "total_v1" for v1) of the 2.4.0 release.
TOTALSEGMENTATOR_V2_LABELS = {
    1: "spleen",
    2: "kidney_right",
    3: "kidney_left",
    4: "gallbladder",
    5: "liver",
    6: "stomach",
    7: "pancreas",
    52: "aorta",
    63: "inferior_vena_cava",
}
TOTALSEGMENTATOR_V1_LABELS = {
    1: "spleen",
    2: "kidney_right",
    3: "kidney_left",
    4: "gallbladder",
    5: "liver",
    6: "stomach",
    7: "aorta",
    8: "inferior_vena_cava",
    10: "pancreas",
}
BUILTIN_LABEL_TABLES = {"totalseg-v2": TOTALSEGMENTATOR_V2_LABELS, "totalseg-v1": TOTALSEGMENTATOR_V1_LABELS}

# Source class names (TotalSegmentator, nnU-Net / MSD dataset.json) -> AbdomenAtlas names.
SOURCE_NAME_TO_ATLAS = {
    **{name: name for name in ATLAS_CLASSES},
    "gallbladder": "gall_bladder",
    "inferior_vena_cava": "postcava",
    "ivc": "postcava",
}
# Generic lesion names (MSD "cancer", nnU-Net "tumor") become the lesion class of the one organ
# the same dataset labels; with no such organ, or several, the user must say which in a class map.
LESION_SYNONYMS = frozenset({"tumor", "tumour", "tumors", "tumours", "cancer", "lesion", "lesions", "mass"})
LESION_OF_ORGAN = {"pancreas": "pancreatic_lesion", "liver": "liver_lesion"}

# Affines are compared to a thousandth of a millimetre: NIfTI stores them as float32, so files of
# one grid written by different tools differ by far less, and any real misregistration by far more.
GRID_ATOL_MM = 1e-3
INT16_RANGE = (np.iinfo(np.int16).min, np.iinfo(np.int16).max)

ClassValues = dict[str, frozenset[int]]


class ImportCaseError(ValueError):
    """One case cannot be imported; the message names the case, the file and what is wrong."""


class ImportSourceError(ValueError):
    """The source as a whole cannot be imported (unreadable dataset.json, unmapped labels, ...)."""


@dataclass(frozen=True)
class LoadedCase:
    """One case read from its source: CT in HU (int16) with its affine, masks on the same grid."""

    ct: np.ndarray
    affine: np.ndarray
    masks: Mapping[str, np.ndarray]
    metadata: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class SourceCase:
    """A case as listed by a source, before anything heavy is read.

    Args:
        case_id: the dataset's own case id (the folder name written in the cohort).
        source: where it comes from, for logs and ``quarantine.csv`` (a path, never header values).
        load: reads the case; raises :class:`ImportCaseError` (or any error) when it cannot.
        expected_classes: the masks the case will have, used to check a case left by an earlier run.
        metadata: metadata known from the listing (cohort, meta.csv values, ...).
    """

    case_id: str
    source: str
    load: Callable[[], LoadedCase]
    expected_classes: tuple[str, ...] = ()
    metadata: Mapping[str, object] = field(default_factory=dict)


@dataclass
class ImportReport:
    """What one import run did."""

    out: Path
    imported: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    quarantined: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        text = (
            f"{self.out}: {len(self.imported)} imported, {len(self.skipped)} already complete (skipped), "
            f"{len(self.quarantined)} quarantined"
        )
        if self.quarantined:
            text += f" (reasons in {self.out / QUARANTINE_FILE})"
        return text


# ----------------------------------------------------------------------------------------------
# Class maps


@dataclass(frozen=True)
class UserClassMap:
    """A user's class map: label value -> AbdomenAtlas classes, and source name -> classes.

    An empty target list means "deliberately not imported".
    """

    by_value: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    by_name: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    path: str = ""


def _targets(raw, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    items = raw if isinstance(raw, (list, tuple)) else str(raw).replace(";", ",").split(",")
    targets = tuple(str(item).strip() for item in items if str(item).strip())
    unknown = [t for t in targets if t not in ATLAS_CLASSES]
    if unknown:
        raise ImportSourceError(
            f"{where}: unknown AbdomenAtlas class(es) {unknown}; known: {', '.join(ATLAS_CLASSES)}"
        )
    return targets


def load_class_map(path: Path | str) -> UserClassMap:
    """Read a class map from JSON, YAML or CSV.

    Keys are label values (``"2"``) for multilabel volumes or source class names (``"cancer"``,
    ``"gallbladder"``) for dataset.json labels and per-class files. Values are an AbdomenAtlas class
    name, a list of them (``[pancreas, pancreatic_lesion]``) or empty/null to leave a label out. A
    CSV has the header ``label,class`` and may repeat a label to give it several classes.

    Args:
        path: the class map file (``.json``, ``.yaml``/``.yml`` or ``.csv``).
    """
    path = Path(path)
    if not path.is_file():
        raise ImportSourceError(f"class map {path}: file does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            raw = json.loads(path.read_text())
        elif suffix in {".yaml", ".yml"}:
            import yaml

            raw = yaml.safe_load(path.read_text())
        elif suffix == ".csv":
            table = pd.read_csv(path, dtype=str, keep_default_na=False)
            if list(table.columns) != ["label", "class"]:
                raise ImportSourceError(f"class map {path}: CSV header must be 'label,class', got {list(table.columns)}")
            raw = {}
            for label, target in zip(table["label"], table["class"]):
                raw.setdefault(label.strip(), [])
                if target.strip():
                    raw[label.strip()].append(target.strip())
        else:
            raise ImportSourceError(f"class map {path}: unsupported extension {suffix!r} (use .json, .yaml or .csv)")
    except (json.JSONDecodeError, ValueError) as error:
        if isinstance(error, ImportSourceError):
            raise
        raise ImportSourceError(f"class map {path}: cannot parse: {error}") from error
    if not isinstance(raw, dict) or not raw:
        raise ImportSourceError(f"class map {path}: expected a non-empty mapping of label -> class")
    by_value: dict[int, tuple[str, ...]] = {}
    by_name: dict[str, tuple[str, ...]] = {}
    for key, value in raw.items():
        key_text = str(key).strip()
        targets = _targets(value, f"class map {path}, label {key_text!r}")
        if re.fullmatch(r"\d+", key_text):
            if int(key_text) == 0 and targets:
                raise ImportSourceError(f"class map {path}: label 0 is background and cannot map to {targets}")
            by_value[int(key_text)] = targets
        else:
            by_name[key_text.lower()] = targets
    return UserClassMap(by_value=by_value, by_name=by_name, path=str(path))


def builtin_class_map(name: str) -> UserClassMap:
    """A built-in label table (``totalseg-v2``, ``totalseg-v1``) as a class map."""
    if name not in BUILTIN_LABEL_TABLES:
        raise ImportSourceError(f"unknown built-in class map {name!r}; known: {', '.join(BUILTIN_LABEL_TABLES)}")
    table = BUILTIN_LABEL_TABLES[name]
    return UserClassMap(by_value={value: (SOURCE_NAME_TO_ATLAS[src],) for value, src in table.items()}, path=name)


def class_map_from_argument(argument: str | None, default: str | None = None) -> UserClassMap | None:
    """``--class-map``: a file, or the name of a built-in table; ``default`` when not given."""
    if argument is None:
        return builtin_class_map(default) if default else None
    if argument in BUILTIN_LABEL_TABLES:
        return builtin_class_map(argument)
    return load_class_map(argument)


def resolve_class_values(
    labels: Sequence[tuple[str, frozenset[int]]],
    user_map: UserClassMap | None,
    where: str,
    exclusive: bool = True,
) -> ClassValues:
    """AbdomenAtlas class -> label values, from a source's declared labels.

    Args:
        labels: (source name, label values) for each non-background label a source declares
            (nnU-Net region labels have several values).
        user_map: the user's class map; it wins over the built-in name table.
        where: the file that declared the labels, for error messages.
        exclusive: True for single-label volumes, where a lesion voxel carries only the lesion value:
            the organ then gets the lesion's values too, because AbdomenAtlas organ masks include
            their tumors (the pancreas mask covers the pancreatic lesion).

    Raises:
        ImportSourceError: listing every label that maps to no class, with how to map it.
    """
    mapped: list[tuple[str, tuple[str, ...], frozenset[int]]] = []
    pending_lesions: list[tuple[str, frozenset[int]]] = []
    unmapped: list[str] = []
    for name, values in labels:
        key = name.strip().lower()
        if user_map is not None and key in user_map.by_name:
            mapped.append((name, user_map.by_name[key], values))
        elif user_map is not None and len(values) == 1 and next(iter(values)) in user_map.by_value:
            mapped.append((name, user_map.by_value[next(iter(values))], values))
        elif key in SOURCE_NAME_TO_ATLAS:
            mapped.append((name, (SOURCE_NAME_TO_ATLAS[key],), values))
        elif key in LESION_SYNONYMS:
            pending_lesions.append((name, values))
        else:
            unmapped.append(f"{name!r} (value {sorted(values)})")
    organs_with_lesion_class = sorted({t for _, targets, _ in mapped for t in targets if t in LESION_OF_ORGAN})
    for name, values in pending_lesions:
        if len(organs_with_lesion_class) == 1:
            mapped.append((name, (LESION_OF_ORGAN[organs_with_lesion_class[0]],), values))
        else:
            unmapped.append(f"{name!r} (value {sorted(values)}: lesion of which organ?)")
    if unmapped:
        raise ImportSourceError(
            f"{where}: label(s) {', '.join(unmapped)} map to no AbdomenAtlas class. Give --class-map FILE, e.g. "
            '{"2": ["pancreas", "pancreatic_lesion"]} or {"tumor": "pancreatic_lesion"}; map a label to [] to leave it out.'
        )
    class_values: dict[str, set[int]] = {}
    for _, targets, values in mapped:
        for target in targets:
            class_values.setdefault(target, set()).update(values)
    if exclusive:
        for organ, lesion in LESION_OF_ORGAN.items():
            if organ in class_values and lesion in class_values:
                class_values[organ] |= class_values[lesion]
    return {name: frozenset(values) for name, values in sorted(class_values.items())}


def class_values_from_user_map(user_map: UserClassMap, exclusive: bool = True) -> ClassValues:
    """Class values for a multilabel volume described only by a value-keyed class map."""
    labels = [(f"label {value}", frozenset({value})) for value in sorted(user_map.by_value)]
    if user_map.by_name and not user_map.by_value:
        raise ImportSourceError(
            f"class map {user_map.path}: a multilabel volume needs label values as keys (e.g. \"7\": pancreas)"
        )
    return resolve_class_values(labels, user_map, f"class map {user_map.path}", exclusive=exclusive)


def masks_from_label_volume(
    labels: np.ndarray,
    class_values: ClassValues,
    path: Path,
    declared_values: Iterable[int] | None = None,
) -> dict[str, np.ndarray]:
    """Binary masks (uint8) per class from one label volume.

    Args:
        labels: the label volume.
        class_values: AbdomenAtlas class -> label values (see :func:`resolve_class_values`).
        path: the label file, for error messages.
        declared_values: every value the dataset declares; a voxel value outside them is an error.
            None for sources whose other labels are simply not imported (TotalSegmentator's 117).
    """
    if labels.dtype.kind == "f":
        if not np.all(np.isfinite(labels)) or not np.array_equal(labels, np.round(labels)):
            raise ImportCaseError(f"{path}: label volume has non-integer values (not a label map)")
    labels = labels.astype(np.int64, copy=False)
    if declared_values is not None:
        present = set(np.unique(labels).tolist())
        undeclared = sorted(present - set(declared_values) - {0})
        if undeclared:
            raise ImportCaseError(f"{path}: label value(s) {undeclared} are not declared in the dataset's labels")
    return {name: np.isin(labels, sorted(values)).astype(np.uint8) for name, values in class_values.items()}


# ----------------------------------------------------------------------------------------------
# NIfTI reading on the image's own grid


def load_nifti(path: Path, what: str) -> nib.Nifti1Image:
    """Load a 3D NIfTI image (header only until the data is read), with a clear error."""
    path = Path(path)
    if not path.is_file():
        raise ImportCaseError(f"{path}: {what} file is missing")
    try:
        image = nib.load(str(path))
    except Exception as error:  # nibabel raises several types for corrupt files
        raise ImportCaseError(f"{path}: cannot read {what} as NIfTI: {error}") from error
    shape = image.shape
    if len(shape) == 4 and shape[3] == 1:
        image = image.slicer[..., 0]
    if len(image.shape) != 3:
        raise ImportCaseError(f"{path}: {what} has shape {shape}, expected a 3D volume")
    return image


def same_grid(shape_a, affine_a, shape_b, affine_b) -> bool:
    return tuple(shape_a) == tuple(shape_b) and np.allclose(affine_a, affine_b, rtol=0, atol=GRID_ATOL_MM)


def require_same_grid(image: nib.Nifti1Image, reference: nib.Nifti1Image, path: Path, reference_path: Path) -> None:
    """Masks are never resampled: a mask on another grid than its CT is an error naming both files."""
    if tuple(image.shape) != tuple(reference.shape):
        raise ImportCaseError(
            f"{path}: mask shape {tuple(image.shape)} differs from the CT {reference_path} shape {tuple(reference.shape)} "
            "(masks are never resampled)"
        )
    if not np.allclose(image.affine, reference.affine, rtol=0, atol=GRID_ATOL_MM):
        difference = float(np.abs(image.affine - reference.affine).max())
        raise ImportCaseError(
            f"{path}: mask affine differs from the CT {reference_path} affine by up to {difference:.4g} mm "
            "(a mask on another grid; masks are never resampled)"
        )


def to_int16_hu(values: np.ndarray, path: Path | str) -> np.ndarray:
    """CT values as int16 HU (the cohort's storage type); rounds fractional HU, rejects NaN and overflow."""
    values = np.asarray(values)
    if values.dtype.kind == "f":
        if not np.all(np.isfinite(values)):
            raise ImportCaseError(f"{path}: CT has NaN or infinite values")
        values = np.rint(values)
    low, high = float(values.min()), float(values.max())
    if low < INT16_RANGE[0] or high > INT16_RANGE[1]:
        raise ImportCaseError(f"{path}: CT values {low:g}..{high:g} do not fit int16 HU")
    return values.astype(np.int16)


def spacing_text(affine: np.ndarray) -> str:
    """Voxel spacing in mm from an affine, as ``0.781x0.781x3``."""
    zooms = np.linalg.norm(np.asarray(affine)[:3, :3], axis=0)
    return "x".join(f"{z:.4g}" for z in zooms)


# ----------------------------------------------------------------------------------------------
# Metadata rows


def read_metadata_overrides(path: Path | str | None) -> dict[str, dict[str, str]]:
    """``--metadata FILE``: a CSV keyed by case_id whose non-empty values replace what a source gives.

    This is how known values a source format cannot carry (patient ids, phase from a dataset's
    description, sex and age from a clinical table) reach ``metadata.csv``; nothing is inferred.
    """
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise ImportSourceError(f"metadata file {path}: does not exist")
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    table = table.rename(columns={c: canonical_column(c) for c in table.columns})
    if "case_id" not in table.columns:
        raise ImportSourceError(f"metadata file {path}: needs a case_id column, has {list(table.columns)}")
    duplicated = sorted(set(table.loc[table["case_id"].duplicated(), "case_id"]))
    if duplicated:
        raise ImportSourceError(f"metadata file {path}: case id(s) {duplicated} appear more than once")
    overrides = {}
    for record in table.to_dict("records"):
        case_id = record.pop("case_id").strip()
        overrides[case_id] = {k: v.strip() for k, v in record.items() if str(v).strip() != ""}
    return overrides


def _format_age(age: float) -> str:
    return "" if math.isnan(age) else f"{age:g}"


def build_row(case_id: str, metadata: Mapping[str, object], source: str) -> dict[str, object]:
    """A ``metadata.csv`` row with the standard columns; Unknown where nothing was recorded.

    Raises:
        ImportCaseError: when a recorded value is unreadable (e.g. sex ``X``), naming the column.
    """
    row: dict[str, object] = {
        "case_id": case_id,
        "patient_id": "",
        "cohort": UNKNOWN,
        "age": "",
        "sex": UNKNOWN,
        "race": UNKNOWN,
        "phase": UNKNOWN,
        # Left empty so the cohort derives it from the lesion mask of the class a recipe uses.
        "tumor": "",
        "synthetic": 0,
    }
    for key, value in metadata.items():
        row[canonical_column(key)] = value
    try:
        row["sex"] = normalize_sex(row["sex"])
        row["phase"] = normalize_phase(row["phase"])
        row["race"] = normalize_race(row["race"])
        row["age"] = _format_age(normalize_age(row["age"]))
    except ValueError as error:
        raise ImportCaseError(f"{case_id} ({source}): metadata: {error}") from error
    _, problems = normalize_metadata(pd.DataFrame([{k: "" if v is None else str(v) for k, v in row.items()}]))
    if problems:
        raise ImportCaseError(f"{case_id} ({source}): metadata: " + "; ".join(str(p) for p in problems))
    return row


def _read_rows(path: Path) -> dict[str, dict[str, object]]:
    if not path.exists():
        return {}
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    if "case_id" not in table.columns:
        raise ImportSourceError(f"{path}: existing file has no case_id column; refusing to overwrite it")
    return {record["case_id"]: record for record in table.to_dict("records")}


def _rows_table(rows: Mapping[str, Mapping[str, object]], leading: Sequence[str]) -> pd.DataFrame:
    columns = list(leading)
    for row in rows.values():
        columns += [c for c in row if c not in columns]
    # Sorted by case id, so the file does not depend on the order in which runs finished cases.
    ordered = [rows[case_id] for case_id in sorted(rows)]
    return pd.DataFrame([{c: row.get(c, "") for c in columns} for row in ordered], columns=columns)


# ----------------------------------------------------------------------------------------------
# Resumable, quarantining import


def case_is_complete(out: Path, case_id: str, expected_classes: Iterable[str]) -> bool:
    """True when a case folder from an earlier run has its CT and every expected mask on the CT's grid.

    Headers only: write_case renames a case into place whole, so a folder that exists holds
    complete files; what can differ is a changed class map or a foreign folder of the same name.
    """
    case_dir = out / case_id
    try:
        ct = nib.load(str(case_dir / CT_FILE))
        for name in expected_classes:
            mask = nib.load(str(case_dir / SEGMENTATION_DIR / f"{name}.nii.gz"))
            if not same_grid(mask.shape, mask.affine, ct.shape, ct.affine):
                return False
    except (OSError, EOFError, ValueError, ImageFileError):
        return False
    return len(ct.shape) == 3


def _remove_staging_leftovers(out: Path, case_id: str) -> None:
    # A process killed inside write_case leaves its hidden staging folder behind.
    for leftover in out.glob(f".{case_id}.*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)


def _validate_case_ids(cases: Sequence[SourceCase]) -> None:
    seen: dict[str, str] = {}
    problems = []
    for case in cases:
        case_id = case.case_id
        if not case_id or "/" in case_id or "\\" in case_id or ".." in case_id or case_id.startswith("."):
            problems.append(f"{case.source}: unsafe case id {case.case_id!r}")
        elif case.case_id in seen:
            problems.append(f"{case.source}: case id {case.case_id!r} also comes from {seen[case.case_id]}")
        else:
            seen[case.case_id] = case.source
    if problems:
        raise ImportSourceError("case ids:\n  - " + "\n  - ".join(problems))


def run_import(
    cases: Sequence[SourceCase],
    out: Path | str,
    metadata_overrides: Mapping[str, Mapping[str, str]] | None = None,
) -> ImportReport:
    """Write every case into ``out`` (layout A), resumably; quarantine the ones that fail.

    A refused import (bad case ids, an unreadable existing ``metadata.csv``) raises before anything
    is written; a folder this run created is removed again when nothing was written into it.

    Args:
        cases: the source's cases (see the ``list_*`` functions of the source modules).
        out: the cohort root; an existing ``metadata.csv`` there is merged, not replaced.
        metadata_overrides: per-case values that replace what the source gives (``--metadata``).
    """
    out = Path(out)
    _validate_case_ids(cases)
    overrides = dict(metadata_overrides or {})
    unused = sorted(set(overrides) - {case.case_id for case in cases})
    if unused:
        logger.warning("metadata overrides for %d case id(s) not in this source are not used: %s", len(unused), unused[:10])
    created = not out.exists()
    report = ImportReport(out=out)
    try:
        # One import per cohort folder at a time (a second one is refused, naming this one).
        with RunFolderLock(out, "benchx import") as lock:
            if lock.takeover_note:
                logger.warning("%s", lock.takeover_note)
            state = _ImportState(out, _read_rows(out / METADATA_FILE), _read_rows(out / QUARANTINE_FILE))
            bar = tqdm(cases, desc="import", unit="case", disable=not show_progress(None))
            for index, case in enumerate(bar, start=1):
                _import_case(case, f"[{index}/{len(cases)}]", state, overrides.get(case.case_id, {}), report)
    finally:
        lock_files = {LOCK_FILE, f"{LOCK_FILE}.guard"}
        if created and out.is_dir() and all(path.name in lock_files for path in out.iterdir()):
            shutil.rmtree(out, ignore_errors=True)
    logger.info("%s", report.summary())
    return report


@dataclass
class _ImportState:
    """The cohort's metadata rows and quarantine entries, rewritten after every case."""

    out: Path
    rows: dict[str, dict[str, object]]
    quarantine: dict[str, dict[str, object]]

    def save(self) -> None:
        # Also rewritten when the last row was dropped (a stale case that now fails).
        if self.rows or (self.out / METADATA_FILE).exists():
            write_metadata(self.out, _rows_table(self.rows, ("case_id",)))
        path = self.out / QUARANTINE_FILE
        if self.quarantine:
            atomic_write_csv(_rows_table(self.quarantine, QUARANTINE_COLUMNS), path)
        elif path.exists():
            path.unlink()


def _import_case(
    case: SourceCase, progress: str, state: _ImportState, overrides: Mapping[str, str], report: ImportReport
) -> None:
    """Skip a complete case, or import it, or quarantine it with its reason; then save the state."""
    out = state.out
    if case.case_id in state.rows and case_is_complete(out, case.case_id, case.expected_classes):
        report.skipped.append(case.case_id)
        if state.quarantine.pop(case.case_id, None) is not None:
            state.save()
        return
    _remove_staging_leftovers(out, case.case_id)
    try:
        loaded, row = _load_and_write(case, out, overrides)
    except Exception as error:  # any failure of one case is reported and quarantined, the run goes on
        expected_error = isinstance(error, (ImportCaseError, ImportSourceError))
        reason = str(error) if expected_error else f"{type(error).__name__}: {error}"
        # A stale, incomplete folder of this case from an earlier run must not stay in the cohort.
        if (out / case.case_id).exists():
            shutil.rmtree(out / case.case_id, ignore_errors=True)
        state.rows.pop(case.case_id, None)
        state.quarantine[case.case_id] = {"case_id": case.case_id, "source": case.source, "reason": reason}
        report.quarantined[case.case_id] = reason
        logger.warning("%s %s quarantined: %s", progress, case.case_id, reason)
        state.save()
        return
    state.rows[case.case_id] = row
    state.quarantine.pop(case.case_id, None)
    report.imported.append(case.case_id)
    logger.info("%s %s imported (%s)", progress, case.case_id, ", ".join(sorted(loaded.masks)) or "image only")
    state.save()


def _load_and_write(case: SourceCase, out: Path, overrides: Mapping[str, str]) -> tuple[LoadedCase, dict]:
    loaded = case.load()
    metadata = {**case.metadata, **loaded.metadata, **overrides}
    row = build_row(case.case_id, metadata, case.source)
    row.setdefault("spacing", spacing_text(loaded.affine))
    missing = sorted(set(case.expected_classes) - set(loaded.masks))
    if missing:
        raise ImportCaseError(f"{case.case_id} ({case.source}): expected mask(s) {missing} were not produced")
    header = nib.Nifti1Header()
    header.set_xyzt_units("mm")
    write_case(out, case.case_id, loaded.ct, loaded.affine, loaded.masks, header=header)
    return loaded, row
