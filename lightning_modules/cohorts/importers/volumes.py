"""Reading images on their own grid: 3D NIfTI loading with a clear error, grid comparisons (masks are
never resampled), CT values as int16 HU, and the voxel spacing of an affine."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np

from lightning_modules.cohorts.importers.source_cases import ImportCaseError

# Affines are compared to a thousandth of a millimetre: NIfTI stores them as float32, so files of
# one grid written by different tools differ by far less, and any real misregistration by far more.
GRID_ATOL_MM = 1e-3
INT16_RANGE = (np.iinfo(np.int16).min, np.iinfo(np.int16).max)


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
