"""Cohort validation: list every problem of a cohort on disk in one pass, each problem once.

Checks the metadata table (required columns, unknown categorical values, duplicate or unsafe case
ids, synthetic rows without a source case), then every case's files: folder present, CT and masks
readable to the last byte (a truncated ``.nii.gz`` reads its header fine and fails only on the
data), masks on the CT's grid and affine, masks binary, CT voxels finite, required organ masks
present (a missing lesion file means "no lesion"), the CT's geometry (a singular affine, e.g. a zero
slice spacing) and every file's declared size (checked on the header, before any voxel is read), and the ``tumor`` column agreeing with the
lesion mask (any non-zero voxel is lesion, as :meth:`Cohort.resolve_tumor_labels` reads it, so a
0/255 mask is reported once, as not binary). Training calls :func:`raise_if_invalid` first and
refuses a broken cohort. See ``docs/explanation/data.md "Cohorts on disk"``.

Run::

    benchx validate --root data/phantom
    benchx validate --root data/phantom --classes pancreas pancreatic_lesion --split splits/phantom.csv
"""

from __future__ import annotations

import os
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import nibabel as nib
import numpy as np
from nibabel.filebasedimages import ImageFileError
from nibabel.spatialimages import HeaderDataError

from lightning_modules.data.cohort import Case, Cohort, CohortError, is_lesion_class, load_cohort
from lightning_modules.data.metadata import METADATA_FILE
from lightning_modules.data.problems import Problem
from lightning_modules.data.splits import SplitError, load_split
from lightning_modules.data.volume_checks import geometry_problem, size_problem

DEFAULT_CLASSES = ("pancreas", "pancreatic_lesion")
# Affines written by different tools differ in float rounding; 1e-3 mm is far below any voxel size.
AFFINE_TOLERANCE_MM = 1e-3
# Errors nibabel, gzip and numpy raise on damaged files; anything else is a bug and propagates.
READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, ImageFileError, HeaderDataError)


def _is_unsafe_case_id(case_id: str) -> bool:
    return "/" in case_id or "\\" in case_id or ".." in case_id or case_id in {"", "."}


def read_volume(path: Path) -> tuple[nib.Nifti1Image, np.ndarray]:
    """Load a NIfTI file and its whole voxel array (so truncation surfaces here, not in training)."""
    image = nib.load(str(path))
    return image, np.asanyarray(image.dataobj)


def _default_tumor_class(classes: Sequence[str]) -> str | None:
    lesions = [name for name in classes if is_lesion_class(name)]
    return lesions[0] if lesions else None


@dataclass(frozen=True)
class _CaseCheck:
    """What the checks of one case share: where to report, the CT's grid, the tumor label."""

    case: Case
    classes: Sequence[str]
    check_voxels: bool
    tumor_class: str | None
    affine_tolerance: float
    ct_shape: tuple[int, ...] | None = None
    ct_affine: np.ndarray | None = None

    def problem(self, path: Path, message: str) -> Problem:
        return Problem(self.case.case_id, str(path), message)

    @property
    def recorded_tumor(self) -> int:
        return int(self.case.metadata.get("tumor", -1))


def validate_case(
    cohort: Cohort,
    case: Case,
    classes: Sequence[str] = DEFAULT_CLASSES,
    check_voxels: bool = True,
    tumor_class: str | None = None,
    affine_tolerance: float = AFFINE_TOLERANCE_MM,
) -> list[Problem]:
    """Every problem of one case's files, each once. Each file is opened once.

    Args:
        cohort: the cohort the case belongs to (for its layout).
        case: the case to check.
        classes: mask classes the recipe needs; a missing non-lesion mask is an error.
        check_voxels: read the voxel data (truncation, NaN/inf, binary masks, tumor label); with
            ``False`` only headers are read (shape and affine checks).
        tumor_class: the lesion class whose mask must agree with the ``tumor`` column; defaults to
            the first lesion class in ``classes``.
        affine_tolerance: largest absolute difference (mm) allowed between a mask's and the CT's affine.
    """
    tumor_class = tumor_class if tumor_class is not None else _default_tumor_class(classes)
    check = _CaseCheck(case, classes, check_voxels, tumor_class, affine_tolerance)
    case_dir = cohort.case_dir(case.case_id)
    if not case_dir.is_dir():
        return [check.problem(case_dir, "case folder is missing")]
    problems, ct_shape, ct_affine = _check_ct(check)
    if cohort.layout == "B" and not case.segmentation_dir.parent.is_dir():
        # One problem for the folder, not one per mask it would hold.
        return problems + [check.problem(case.segmentation_dir.parent, "label folder of the case is missing")]
    check = dataclasses.replace(check, ct_shape=ct_shape, ct_affine=ct_affine)
    for class_name in classes:
        problems += _check_mask(check, class_name)
    return problems


def _check_ct(check: _CaseCheck) -> tuple[list[Problem], tuple[int, ...] | None, np.ndarray | None]:
    """The CT's problems, and its shape and affine when its header could be read."""
    path = check.case.ct_path
    if not path.exists():
        return [check.problem(path, "CT file is missing")], None, None
    try:
        image = nib.load(str(path))
    except READ_ERRORS as error:
        return [check.problem(path, f"unreadable or truncated NIfTI: {error}")], None, None
    shape = tuple(image.shape)
    # The header's declared size is checked before any voxel is read (a 30000^3 header is 100 TB).
    too_large = size_problem(shape)
    if too_large:
        return [check.problem(path, too_large)], None, None
    problems = []
    if len(shape) != 3:
        problems.append(check.problem(path, f"CT is not a 3D volume (shape {shape})"))
    geometry = geometry_problem(image.affine)
    if geometry:
        problems.append(check.problem(path, geometry))
    if check.check_voxels:
        try:
            ct = np.asanyarray(image.dataobj)
        except READ_ERRORS as error:
            return [check.problem(path, f"unreadable or truncated NIfTI: {error}")], None, None
        if ct.dtype.kind == "f" and not np.isfinite(ct).all():
            bad = int(np.count_nonzero(~np.isfinite(ct)))
            problems.insert(0, check.problem(path, f"CT has {bad} NaN/inf voxel(s)"))
    return problems, shape, image.affine


def _check_mask(check: _CaseCheck, class_name: str) -> list[Problem]:
    """One mask's problems: presence, readability, grid, binary values, agreement with ``tumor``."""
    path = check.case.mask_path(class_name)
    is_tumor_mask = class_name == check.tumor_class
    if not path.exists():
        if not is_lesion_class(class_name):
            return [check.problem(path, f"required mask '{class_name}' is missing")]
        if is_tumor_mask and check.recorded_tumor == 1:
            return [check.problem(path, "metadata tumor=1 but the lesion mask is missing (no lesion)")]
        return []
    try:
        image = nib.load(str(path))
        too_large = size_problem(tuple(image.shape))
        if too_large:
            return [check.problem(path, too_large)]
        mask = np.asanyarray(image.dataobj) if check.check_voxels else None
    except READ_ERRORS as error:
        return [check.problem(path, f"unreadable or truncated NIfTI: {error}")]
    problems = _grid_problems(check, path, image)
    if mask is None:
        return problems
    non_binary = (mask != 0) & (mask != 1)
    if non_binary.any():
        values = np.unique(mask[non_binary])[:5]
        problems.append(check.problem(path, f"mask is not binary (values such as {values.tolist()})"))
    if is_tumor_mask and check.recorded_tumor in (0, 1):
        # Any non-zero voxel is lesion (as the cohort derives labels), so a 0/255 mask is one
        # problem (not binary), not also "empty".
        lesion_voxels = int(np.count_nonzero(mask))
        if check.recorded_tumor == 1 and lesion_voxels == 0:
            problems.append(check.problem(path, "metadata tumor=1 but the lesion mask is empty"))
        elif check.recorded_tumor == 0 and lesion_voxels:
            problems.append(check.problem(path, f"metadata tumor=0 but the lesion mask has {lesion_voxels} voxel(s)"))
    return problems


def _grid_problems(check: _CaseCheck, path: Path, image: nib.Nifti1Image) -> list[Problem]:
    problems = []
    if check.ct_shape is not None and tuple(image.shape) != check.ct_shape:
        problems.append(check.problem(path, f"mask shape {tuple(image.shape)} differs from CT shape {check.ct_shape}"))
    if check.ct_affine is not None and not np.allclose(
        image.affine, check.ct_affine, rtol=0.0, atol=check.affine_tolerance
    ):
        difference = float(np.abs(image.affine - check.ct_affine).max())
        problems.append(
            check.problem(path, f"mask affine differs from the CT affine (largest difference {difference:.4g} mm)")
        )
    return problems


def _load_for_validation(cohort_or_root: Cohort | Path | str) -> tuple[Cohort | None, list[Problem]]:
    if isinstance(cohort_or_root, Cohort):
        cohort = cohort_or_root
    else:
        root = Path(cohort_or_root)
        try:
            cohort = load_cohort(root, strict=False)
        except CohortError as error:
            return None, list(error.problems)
        except (ValueError, OSError) as error:
            # pandas raises ParserError (a ValueError) on a malformed CSV.
            return None, [Problem("<cohort>", str(root / METADATA_FILE), f"cannot read metadata: {error}")]
    problems = [dataclasses.replace(p, file=str(cohort.root / METADATA_FILE)) for p in cohort.problems]
    return cohort, problems


def show_progress(progress: bool | None) -> bool:
    """An explicit choice, else a bar only when stderr is a terminal (not in logs or tests)."""
    return sys.stderr.isatty() if progress is None else bool(progress)


def validate_cohort(
    cohort_or_root: Cohort | Path | str,
    classes: Sequence[str] = DEFAULT_CLASSES,
    check_voxels: bool = True,
    tumor_class: str | None = None,
    workers: int | None = None,
    progress: bool | None = None,
) -> list[Problem]:
    """List every problem of a cohort at once: metadata first, then each case's files.

    Args:
        cohort_or_root: a loaded :class:`Cohort` or a cohort folder (read with ``strict=False`` so
            metadata problems are listed instead of raised).
        classes: the mask classes the recipe trains on.
        check_voxels: read voxel data, not only headers (see :func:`validate_case`).
        tumor_class: lesion class checked against the ``tumor`` column (default: first lesion class).
        workers: threads reading files (gzip inflation releases the GIL); default up to 4.
        progress: a progress bar over the cases (default: when stderr is a terminal).
    """
    from tqdm.auto import tqdm

    cohort, problems = _load_for_validation(cohort_or_root)
    if cohort is None:
        return problems
    cases = [case for case in cohort.cases() if not _is_unsafe_case_id(case.case_id)]
    workers = workers or min(4, os.cpu_count() or 1)

    def check(case: Case) -> list[Problem]:
        return validate_case(cohort, case, classes, check_voxels, tumor_class)

    bar = dict(total=len(cases), desc="validate", unit="case", disable=not show_progress(progress))
    if workers > 1 and len(cases) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            per_case = list(tqdm(pool.map(check, cases), **bar))
    else:
        per_case = [check(case) for case in tqdm(cases, **bar)]
    for case_problems in per_case:
        problems.extend(case_problems)
    return problems


def raise_if_invalid(
    cohort_or_root: Cohort | Path | str,
    classes: Sequence[str] = DEFAULT_CLASSES,
    check_voxels: bool = True,
    tumor_class: str | None = None,
    workers: int | None = None,
) -> Cohort:
    """Validate a cohort and return it (read strictly); raise :class:`CohortError` listing every problem."""
    problems = validate_cohort(cohort_or_root, classes, check_voxels, tumor_class, workers)
    root = cohort_or_root.root if isinstance(cohort_or_root, Cohort) else Path(cohort_or_root)
    if problems:
        raise CohortError(problems, root)
    return cohort_or_root if isinstance(cohort_or_root, Cohort) else load_cohort(root, strict=True)


@dataclass(frozen=True)
class ValidationReport:
    """What ``benchx validate`` found: every problem, and how many cases were read."""

    root: Path
    problems: list[Problem]
    cases: int

    @property
    def affected_cases(self) -> int:
        return len({p.case_id for p in self.problems})


def validate(
    root: Path | str,
    classes: Sequence[str] = DEFAULT_CLASSES,
    check_voxels: bool = True,
    tumor_class: str | None = None,
    workers: int | None = None,
    split: Path | str | None = None,
) -> ValidationReport:
    """Validate a cohort folder and, optionally, a split file against it (what ``benchx validate`` runs).

    Args:
        root: the cohort folder.
        classes / check_voxels / tumor_class / workers: see :func:`validate_cohort`.
        split: a split CSV whose problems (see :func:`lightning_modules.data.splits.load_split`) are
            listed after the cohort's.
    """
    cohort, problems = _load_for_validation(root)
    if cohort is not None:
        # Given a loaded cohort, validate_cohort lists its metadata problems first, then the files'.
        problems = validate_cohort(cohort, classes, check_voxels, tumor_class, workers)
        if split:
            try:
                load_split(split, cohort)
            except SplitError as error:
                problems.extend(error.problems)
    return ValidationReport(Path(root), problems, len(cohort) if cohort is not None else 0)
