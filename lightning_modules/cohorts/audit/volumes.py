"""Reading for the audit: one pass over each CT gives its exact hash, its NCC signatures and its header features.

Exact duplicates: sha256 of the voxel array cast to little-endian float32 (plus its shape), so a
copy re-saved under another name, header, dtype or affine still matches. Near duplicates are
compared on signatures: the volume clipped to the soft-tissue HU window and area-resized to a
16^3 screening grid and a 32^3 confirming grid (:mod:`lightning_modules.cohorts.audit.duplicates`).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from scipy.ndimage import gaussian_filter

from lightning_modules.data.cohort import Cohort
from lightning_modules.data.validation import READ_ERRORS, read_volume

SIGNATURE_SIZE = 16  # 16^3 = 4,096 values per volume for the all-pairs screen
CONFIRM_SIZE = 32  # 32^3 copies confirm the screened candidates
SCREEN_BLUR_CELLS = 1.0
CLIP_PERCENTILES = (0.5, 99.5)
# Touchstone's HU window (recipes/_base.yaml data.hu_window), the intensities training sees.
HU_WINDOW = (-175.0, 250.0)


@dataclass
class AuditedVolume:
    """What one pass over a CT gives the audit: its hash, signatures, header features and label."""

    case_id: str
    sha256: str = ""
    coarse: np.ndarray | None = None
    fine: np.ndarray | None = None
    features: dict = field(default_factory=dict)
    tumor: int = -1
    error: str = ""


def canonical_sha256(data: np.ndarray) -> str:
    """sha256 of a voxel array independent of its file: little-endian float32 values plus the shape."""
    digest = hashlib.sha256(repr(tuple(int(s) for s in data.shape)).encode())
    # Adding +0.0 turns -0.0 into +0.0: the same value must hash the same whatever dtype held it.
    digest.update((np.ascontiguousarray(data, dtype="<f4") + np.float32(0.0)).tobytes())
    return digest.hexdigest()


def _zscore(vector: torch.Tensor) -> torch.Tensor:
    vector = vector - vector.mean()
    norm = vector.norm()
    # A constant volume has no correlation with anything: keep it as zeros (NCC 0).
    return vector / norm if norm > 1e-12 else torch.zeros_like(vector)


def volume_signatures(
    data: np.ndarray,
    coarse_size: int = SIGNATURE_SIZE,
    fine_size: int = CONFIRM_SIZE,
    window: tuple[float, float] | None = HU_WINDOW,
):
    """Zero-mean, unit-norm signatures of a volume: a ``coarse_size^3`` vector and a ``fine_size^3`` grid.

    The dot product of two coarse signatures is their Pearson correlation on that grid; the fine
    grids (float16, to hold thousands in memory) are compared by :func:`shifted_ncc`. Intensities are
    clipped to ``window`` first (HU; ``None``: the volume's 0.5-99.5 percentiles, for non-CT data).
    Without the soft-tissue window the 1,000 HU step between air and body dominates, and any two
    abdomens of similar girth correlate above 0.99; with it, organs and their layout decide. Area
    resizing to a fixed grid then makes volumes of any shape comparable.
    """
    volume = torch.as_tensor(np.asarray(data, dtype=np.float32))[None, None]
    if window is not None:
        volume = volume.clamp(float(window[0]), float(window[1]))
    fine = F.interpolate(volume, size=(fine_size,) * 3, mode="area")
    if window is None:
        low, high = np.percentile(fine.numpy(), CLIP_PERCENTILES)
        fine = fine.clamp(float(low), float(high))
    # Blurring by one fine cell before the screen's downsampling makes the screen about as tolerant
    # of small shifts as the confirming shifted_ncc, so shifted copies are not screened out.
    blurred = torch.as_tensor(gaussian_filter(fine[0, 0].numpy(), SCREEN_BLUR_CELLS, mode="nearest"))[None, None]
    coarse = F.interpolate(blurred, size=(coarse_size,) * 3, mode="area")
    fine = _zscore(fine.flatten()).reshape((fine_size,) * 3)
    return _zscore(coarse.flatten()).numpy(), fine.numpy().astype(np.float16)


def read_case(cohort: Cohort, case_id: str, lesion_class: str, coarse_size: int, fine_size: int) -> AuditedVolume:
    record = AuditedVolume(case_id)
    case = cohort.case(case_id)
    metadata = case.metadata
    try:
        image, data = read_volume(case.ct_path)
        data = np.squeeze(data) if data.ndim > 3 else data
        if data.ndim != 3:
            raise ValueError(f"CT is not a 3D volume (shape {data.shape})")
        record.sha256 = canonical_sha256(data)
        record.coarse, record.fine = volume_signatures(data, coarse_size, fine_size)
        zooms = [float(z) for z in image.header.get_zooms()[:3]]
        record.features = {
            "spacing_x": zooms[0], "spacing_y": zooms[1], "spacing_z": zooms[2],
            "shape_x": data.shape[0], "shape_y": data.shape[1], "shape_z": data.shape[2],
            "file_size": case.ct_path.stat().st_size,
            "dtype": str(image.get_data_dtype()),
            "scanner": str(metadata.get("scanner", "Unknown") or "Unknown"),
            "cohort": str(metadata.get("cohort", "Unknown")),
            "phase": str(metadata.get("phase", "Unknown")),
        }  # fmt: skip
        # Unrecorded labels are derived from the lesion mask, as training does.
        record.tumor = case.tumor_label(lesion_class)
    except READ_ERRORS as error:
        record.error = f"unreadable NIfTI ({error})"
    return record


def read_volumes(
    cohorts: Sequence[Cohort],
    cases: pd.DataFrame,
    lesion_class: str,
    coarse_size: int,
    fine_size: int,
    workers: int | None,
    progress: bool | None = None,
) -> list[AuditedVolume]:
    """Read every audited case once (``cases``: case_id and the index of its cohort in ``cohorts``);
    ``progress``: a bar over the cases (default: when stderr is a terminal)."""
    from tqdm.auto import tqdm

    from lightning_modules.data.validation import show_progress

    workers = workers or min(4, os.cpu_count() or 1)
    bar = dict(total=len(cases), desc="audit: read", unit="scan", disable=not show_progress(progress))
    jobs = [(cohorts[c], case_id) for case_id, c in zip(cases["case_id"], cases["cohort_index"])]

    def read(job):
        return read_case(job[0], job[1], lesion_class, coarse_size, fine_size)

    if workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(tqdm(pool.map(read, jobs), **bar))
    return [read(job) for job in tqdm(jobs, **bar)]


