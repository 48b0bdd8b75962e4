"""Cohort validation: list every problem of a cohort on disk in one pass (DESIGN.md section 1).

Checks the metadata table (required columns, unknown categorical values, duplicate or unsafe case
ids, synthetic rows without a source case), then every case's files: folder present, CT and masks
readable to the last byte (a truncated ``.nii.gz`` reads its header fine and fails only on the
data), masks on the CT's grid and affine, masks binary, CT voxels finite, required organ masks
present (a missing lesion file means "no lesion"), and the ``tumor`` column agreeing with the
lesion mask. Training calls :func:`raise_if_invalid` first and refuses a broken cohort.

Run::

    benchx validate --root data/phantom
    benchx validate --root data/phantom --classes pancreas pancreatic_lesion --split splits/phantom.csv
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import nibabel as nib
import numpy as np
from nibabel.filebasedimages import ImageFileError
from nibabel.spatialimages import HeaderDataError

from lightning_modules.data.cohort import (
    METADATA_FILE,
    Case,
    Cohort,
    CohortError,
    is_lesion_class,
    load_cohort,
)

DEFAULT_CLASSES = ("pancreas", "pancreatic_lesion")
# Affines written by different tools differ in float rounding; 1e-3 mm is far below any voxel size.
AFFINE_TOLERANCE_MM = 1e-3
# Errors nibabel, gzip and numpy raise on damaged files; anything else is a bug and propagates.
READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, ImageFileError, HeaderDataError)


@dataclass(frozen=True)
class Problem:
    """One problem: which case, which file, what is wrong."""

    case_id: str
    file: str
    message: str

    def __str__(self) -> str:
        return f"{self.case_id}: {self.file}: {self.message}"


def _is_unsafe_case_id(case_id: str) -> bool:
    return "/" in case_id or "\\" in case_id or ".." in case_id or case_id in {"", "."}


def read_volume(path: Path) -> tuple[nib.Nifti1Image, np.ndarray]:
    """Load a NIfTI file and its whole voxel array (so truncation surfaces here, not in training)."""
    image = nib.load(str(path))
    return image, np.asanyarray(image.dataobj)


def _default_tumor_class(classes: Sequence[str]) -> str | None:
    lesions = [name for name in classes if is_lesion_class(name)]
    return lesions[0] if lesions else None


def validate_case(
    cohort: Cohort,
    case: Case,
    classes: Sequence[str] = DEFAULT_CLASSES,
    check_voxels: bool = True,
    tumor_class: str | None = None,
    affine_tolerance: float = AFFINE_TOLERANCE_MM,
) -> list[Problem]:
    """Every problem of one case's files. Each file is opened once.

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
    case_id = case.case_id
    problems: list[Problem] = []
    tumor_class = tumor_class if tumor_class is not None else _default_tumor_class(classes)

    case_dir = cohort.case_dir(case_id)
    if not case_dir.is_dir():
        problems.append(Problem(case_id, str(case_dir), "case folder is missing"))
        return problems
    if cohort.layout == "B" and not case.segmentation_dir.parent.is_dir():
        problems.append(Problem(case_id, str(case.segmentation_dir.parent), "label folder of the case is missing"))

    ct_shape, ct_affine = None, None
    if not case.ct_path.exists():
        problems.append(Problem(case_id, str(case.ct_path), "CT file is missing"))
    else:
        try:
            if check_voxels:
                ct_image, ct = read_volume(case.ct_path)
                if ct.dtype.kind == "f" and not np.isfinite(ct).all():
                    bad = int(np.count_nonzero(~np.isfinite(ct)))
                    problems.append(Problem(case_id, str(case.ct_path), f"CT has {bad} NaN/inf voxel(s)"))
            else:
                ct_image = nib.load(str(case.ct_path))
            ct_shape, ct_affine = tuple(ct_image.shape), ct_image.affine
            if len(ct_shape) != 3:
                problems.append(Problem(case_id, str(case.ct_path), f"CT is not a 3D volume (shape {ct_shape})"))
        except READ_ERRORS as error:
            problems.append(Problem(case_id, str(case.ct_path), f"unreadable or truncated NIfTI: {error}"))

    recorded_tumor = int(case.metadata.get("tumor", -1))
    for class_name in classes:
        path = case.mask_path(class_name)
        if not path.exists():
            if not is_lesion_class(class_name):
                problems.append(Problem(case_id, str(path), f"required mask '{class_name}' is missing"))
            elif class_name == tumor_class and recorded_tumor == 1:
                problems.append(
                    Problem(case_id, str(path), "metadata tumor=1 but the lesion mask is missing (no lesion)")
                )
            continue
        try:
            if check_voxels:
                mask_image, mask = read_volume(path)
            else:
                mask_image, mask = nib.load(str(path)), None
        except READ_ERRORS as error:
            problems.append(Problem(case_id, str(path), f"unreadable or truncated NIfTI: {error}"))
            continue
        if ct_shape is not None and tuple(mask_image.shape) != ct_shape:
            problems.append(
                Problem(case_id, str(path), f"mask shape {tuple(mask_image.shape)} differs from CT shape {ct_shape}")
            )
        if ct_affine is not None and not np.allclose(mask_image.affine, ct_affine, rtol=0.0, atol=affine_tolerance):
            difference = float(np.abs(mask_image.affine - ct_affine).max())
            problems.append(
                Problem(
                    case_id,
                    str(path),
                    f"mask affine differs from the CT affine (largest difference {difference:.4g} mm)",
                )
            )
        if mask is None:
            continue
        non_binary = (mask != 0) & (mask != 1)
        if non_binary.any():
            values = np.unique(mask[non_binary])[:5]
            problems.append(Problem(case_id, str(path), f"mask is not binary (values such as {values.tolist()})"))
        if class_name == tumor_class and recorded_tumor in (0, 1):
            has_lesion = bool(np.any(mask == 1))
            if recorded_tumor == 1 and not has_lesion:
                problems.append(Problem(case_id, str(path), "metadata tumor=1 but the lesion mask is empty"))
            elif recorded_tumor == 0 and has_lesion:
                problems.append(
                    Problem(
                        case_id,
                        str(path),
                        f"metadata tumor=0 but the lesion mask has {int(np.count_nonzero(mask == 1))} voxel(s)",
                    )
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
            return None, [Problem("<cohort>", str(root), str(p)) for p in error.problems]
        except (ValueError, OSError) as error:
            # pandas raises ParserError (a ValueError) on a malformed CSV.
            return None, [Problem("<cohort>", str(root / METADATA_FILE), f"cannot read metadata: {error}")]
    problems = [
        Problem(p.case_id, str(cohort.root / METADATA_FILE), f"column '{p.column}': {p.message}")
        for p in cohort.problems
    ]
    return cohort, problems


def validate_cohort(
    cohort_or_root: Cohort | Path | str,
    classes: Sequence[str] = DEFAULT_CLASSES,
    check_voxels: bool = True,
    tumor_class: str | None = None,
    workers: int | None = None,
) -> list[Problem]:
    """List every problem of a cohort at once: metadata first, then each case's files.

    Args:
        cohort_or_root: a loaded :class:`Cohort` or a cohort folder (read with ``strict=False`` so
            metadata problems are listed instead of raised).
        classes: the mask classes the recipe trains on.
        check_voxels: read voxel data, not only headers (see :func:`validate_case`).
        tumor_class: lesion class checked against the ``tumor`` column (default: first lesion class).
        workers: threads reading files (gzip inflation releases the GIL); default up to 4.
    """
    cohort, problems = _load_for_validation(cohort_or_root)
    if cohort is None:
        return problems
    cases = [case for case in cohort.cases() if not _is_unsafe_case_id(case.case_id)]
    workers = workers or min(4, os.cpu_count() or 1)

    def check(case: Case) -> list[Problem]:
        return validate_case(cohort, case, classes, check_voxels, tumor_class)

    if workers > 1 and len(cases) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            per_case = list(pool.map(check, cases))
    else:
        per_case = [check(case) for case in cases]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchx validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="cohort folder (layout A or B) with metadata.csv")
    parser.add_argument("--classes", nargs="+", default=list(DEFAULT_CLASSES), help="mask classes the recipe needs")
    parser.add_argument("--tumor-class", default=None, help="lesion class checked against the tumor column")
    parser.add_argument("--split", default=None, help="also check a split CSV against the cohort")
    parser.add_argument("--headers-only", action="store_true", help="read NIfTI headers only (faster, fewer checks)")
    parser.add_argument("--workers", type=int, default=None, help="reader threads (default: up to 4)")
    args = parser.parse_args(argv)

    cohort, problems = _load_for_validation(args.root)
    if cohort is not None:
        # Given a loaded cohort, validate_cohort lists its metadata problems first, then the files'.
        problems = validate_cohort(cohort, args.classes, not args.headers_only, args.tumor_class, args.workers)
        if args.split:
            from lightning_modules.data.splits import SplitError, load_split

            try:
                load_split(args.split, cohort)
            except SplitError as error:
                problems.extend(error.problems)
    for problem in problems:
        print(problem)
    cases = len(cohort) if cohort is not None else 0
    affected = len({p.case_id for p in problems})
    if problems:
        print(f"{len(problems)} problem(s) in {affected} case(s) of {args.root} ({cases} case(s) read)")
        return 1
    print(f"{args.root}: {cases} case(s), no problems")
    return 0


if __name__ == "__main__":
    sys.exit(main())
