"""Checks of a NIfTI file's header made before its voxels are read: geometry, dimensions and size.

A header can declare what no reader survives: a singular affine (a zero slice spacing), which
resampling cannot invert and which would turn every volume into 0 mm^3; a 2-D or 4-D array where a
3-D CT is expected; or more voxels than this machine can hold (30000^3 voxels is 100 TB as float32).
Each check reads the header only and returns a short reason (None when the header is usable), so
validation, training and prediction name the file and refuse it instead of failing inside a reader.

Example::

    image = nib.load(path)                        # header only, no voxels yet
    reason = header_problem(image, expect_3d=True)
    if reason:
        raise ValueError(f"{path}: {reason}")
"""

from __future__ import annotations

import numpy as np

from lightning_modules.config.memory import available_memory_bytes

SINGULAR_AFFINE = "singular affine / zero spacing"
# A CT of 1024 x 1024 x 2048 voxels is 2^31; nothing this framework reads is larger.
MAX_VOXELS = 1 << 31
# Every volume is read as float32 by the preprocessing, whatever its stored type.
WORKING_BYTES_PER_VOXEL = 4
# The smallest voxel edge (mm) taken as a real spacing; a zero (or 1e-9) edge is a broken header.
MIN_SPACING_MM = 1e-3


def memory_limit_bytes() -> int:
    """The most bytes one volume may take: half the available memory, at most :data:`MAX_VOXELS` float32 voxels."""
    cap = MAX_VOXELS * WORKING_BYTES_PER_VOXEL
    available = available_memory_bytes()
    return cap if available is None else min(cap, available // 2)


def format_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if count < 1000 or unit == "PB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1000
    return f"{count:.1f} PB"


def size_problem(shape, limit_bytes: int | None = None, subject: str = "header declares",
                 consequence: str = "the data was not read", copies: int = 1) -> str | None:
    """Why a volume of this declared shape is too large (None when it fits).

    Args:
        shape: the declared shape.
        limit_bytes: the bound (default :func:`memory_limit_bytes`).
        subject / consequence: the words before the shape and after the bound in the message.
        copies: float32 copies of the volume held at once (e.g. a renderer's working arrays).
    """
    voxels = int(np.prod([int(n) for n in shape], dtype=object)) if len(shape) else 0
    needed = voxels * WORKING_BYTES_PER_VOXEL * int(copies)
    limit = memory_limit_bytes() if limit_bytes is None else int(limit_bytes)
    if voxels > MAX_VOXELS or needed > limit:
        held = "as float32" if copies == 1 else f"as {copies} float32 copies"
        return (f"{subject} {' x '.join(str(int(n)) for n in shape)} = {voxels:,} voxels "
                f"({format_bytes(needed)} {held}), more than the {format_bytes(limit)} one volume may take "
                f"(half the available memory, at most {MAX_VOXELS:,} voxels); {consequence}")
    return None


def geometry_problem(affine) -> str | None:
    """Why a voxel-to-world affine cannot place a volume (None when it can): not finite, or singular."""
    affine = np.asarray(affine, dtype=float)
    if affine.shape != (4, 4) or not np.isfinite(affine).all():
        return f"affine is not a finite 4x4 matrix ({affine.tolist()})"
    spacing = np.sqrt((affine[:3, :3] ** 2).sum(axis=0))
    volume = abs(float(np.linalg.det(affine[:3, :3])))
    if spacing.min() < MIN_SPACING_MM or volume < MIN_SPACING_MM**3:
        shown = ", ".join(f"{s:.4g}" for s in spacing)
        return f"{SINGULAR_AFFINE} (voxel spacing {shown} mm, voxel volume {volume:.3g} mm^3)"
    return None


def header_problem(image, expect_3d: bool = True, limit_bytes: int | None = None) -> str | None:
    """The first problem of a loaded (header-only) NIfTI image: dimensions, declared size, geometry."""
    shape = tuple(int(n) for n in image.shape)
    if expect_3d and len(shape) != 3:
        return f"not a 3D volume (shape {shape})"
    if min(shape, default=0) < 1:
        return f"empty volume (shape {shape})"
    return size_problem(shape, limit_bytes) or geometry_problem(image.affine)
