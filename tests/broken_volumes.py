"""NIfTI files that no reader survives, written without their voxels where they are huge: a CT with a
zero slice spacing (a singular affine) and a header declaring 30000^3 voxels."""

from __future__ import annotations

import gzip
from pathlib import Path

import nibabel as nib
import numpy as np


def write_zero_spacing_ct(path: Path, voxels: np.ndarray, affine: np.ndarray) -> Path:
    """Save ``voxels`` with ``affine`` whose slice axis has zero length (sform only: nibabel cannot
    build a qform from a singular matrix); the file reads fine, its geometry does not."""
    singular = np.array(affine, dtype=float)
    singular[:3, 2] = 0.0
    header = nib.Nifti1Header()
    header.set_data_shape(voxels.shape)
    header.set_data_dtype(voxels.dtype)
    header.set_sform(singular, code=1)
    header.set_qform(None, code=0)
    header["pixdim"][1:4] = [*np.sqrt((singular[:3, :2] ** 2).sum(axis=0)), 0.0]
    image = nib.Nifti1Image(voxels, None, header)
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(image, str(path))
    return path


def write_huge_header(path: Path, shape=(30000, 30000, 30000)) -> Path:
    """A gzipped NIfTI whose header declares ``shape`` int16 voxels and which holds 1 KB of them."""
    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(np.int16)
    header.set_sform(np.eye(4), code=1)
    header.set_qform(np.eye(4), code=1)
    header["vox_offset"] = 352
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wb") as handle:
        handle.write(header.binaryblock)
        handle.write(b"\x00" * 4)  # no extensions
        handle.write(b"\x00" * 1024)
    return path
