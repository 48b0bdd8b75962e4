"""How CT intensities reach the network: Touchstone's HU window, or nnU-Net's CT normalisation.

``data.normalization`` chooses (docs/explanation/data.md "Intensity normalisation"):

- ``window`` (default, BenchX/Touchstone): HU clipped to ``data.hu_window`` and scaled to [0, 1].
- ``ct`` (nnU-Net's ``CTNormalization``): HU clipped to the 0.5th and 99.5th percentiles of the
  training cases' foreground voxels, then z-scored with their mean and standard deviation. The
  statistics (``data.ct_intensity``) are measured once from the training cases' labelled voxels
  (:func:`ct_intensity_properties`) when training starts, written into the resolved recipe the run
  logs, and so applied unchanged by evaluation, ``predict`` and the registered model.

Clipping to [lo, hi] and then z-scoring is one clipped linear map, so both schemes are MONAI's
``ScaleIntensityRanged`` with different end points (:func:`intensity_transforms`).

Foreground statistics follow nnU-Net's fingerprint: every case contributes a sample of its
foreground voxels (label > 0 on the CT grid, before resampling), drawn with replacement by a
generator seeded 1234, of 10^8 / n_cases voxels per case at most (all of them when fewer).

Example::

    stats = ct_intensity_properties(load_cohort("data/phantom"), training_case_ids, ["pancreas", "pancreatic_lesion"])
    # {"mean": 61.2, "std": 38.9, "percentile_00_5": -52.0, "percentile_99_5": 170.0}
"""

from __future__ import annotations

from typing import Mapping, Sequence

import nibabel as nib
import numpy as np
from monai.transforms import ScaleIntensityRanged

from lightning_modules.data.cohort import Cohort

CT_INTENSITY_KEYS = ("mean", "std", "percentile_00_5", "percentile_99_5")
# nnU-Net's fingerprint: 10^8 foreground samples over the dataset, seeded.
FOREGROUND_SAMPLES_TOTAL = 10**8
FOREGROUND_SEED = 1234
STD_EPSILON = 1e-8


def foreground_intensities(cohort: Cohort, case_ids: Sequence[str], classes: Sequence[str]) -> np.ndarray:
    """The sampled HU of the labelled voxels (any of ``classes``) of each case, concatenated."""
    rng = np.random.default_rng(FOREGROUND_SEED)
    per_case = max(FOREGROUND_SAMPLES_TOTAL // max(len(case_ids), 1), 1)
    samples = []
    for case_id in case_ids:
        case = cohort.case(case_id)
        ct = np.asanyarray(nib.load(case.ct_path).dataobj)
        foreground = np.zeros(ct.shape, dtype=bool)
        for name in classes:
            path = case.mask_path(name)
            if path.exists():
                foreground |= np.asanyarray(nib.load(path).dataobj) > 0
        values = ct[foreground].astype(np.float64)
        if values.size > per_case:
            values = rng.choice(values, per_case, replace=True)
        samples.append(values)
    return np.concatenate(samples) if samples else np.zeros(0)


def ct_intensity_properties(cohort: Cohort, case_ids: Sequence[str], classes: Sequence[str]) -> dict[str, float]:
    """Mean, standard deviation and 0.5th/99.5th percentiles of the training foreground (HU).

    Raises:
        ValueError: no case has a labelled voxel (nothing to measure).
    """
    values = foreground_intensities(cohort, case_ids, classes)
    if values.size == 0:
        raise ValueError(f"data.normalization=ct: no labelled voxel in the {len(case_ids)} training cases of "
                         f"{cohort.root} (classes {list(classes)}); the foreground statistics cannot be measured")
    low, high = np.percentile(values, [0.5, 99.5])
    return {"mean": float(values.mean()), "std": float(values.std()), "percentile_00_5": float(low),
            "percentile_99_5": float(high)}


def intensity_transforms(data, key: str = "image") -> tuple[list, object]:
    """The intensity transform of ``data`` (the recipe's ``data`` section) and the foreground
    selector for the crop that follows it: the voxels above the clipped minimum (for the window,
    above 0: MONAI's default).

    Raises:
        ValueError: ``ct`` without measured statistics (``data.ct_intensity``).
    """
    if str(data.normalization) == "window":
        low, high = (float(v) for v in data.hu_window)
        target = (0.0, 1.0)
    else:
        stats = ct_statistics(data)
        low, high = stats["percentile_00_5"], stats["percentile_99_5"]
        scale = max(stats["std"], STD_EPSILON)
        target = ((low - stats["mean"]) / scale, (high - stats["mean"]) / scale)
    scaling = ScaleIntensityRanged(keys=[key], a_min=low, a_max=high, b_min=target[0], b_max=target[1], clip=True)
    return [scaling], Above(target[0])


class Above:
    """Foreground for ``CropForegroundd``: voxels above a value (MONAI's default is above 0, the
    clipped minimum of the HU window; z-scored CT is clipped at a negative value)."""

    def __init__(self, value: float):
        self.value = float(value)

    def __call__(self, image):
        return image > self.value


def ct_statistics(data) -> Mapping[str, float]:
    """``data.ct_intensity`` as floats; refused when it has not been measured."""
    stats = data.get("ct_intensity") if hasattr(data, "get") else getattr(data, "ct_intensity", None)
    if stats is None or any(stats.get(k) is None for k in CT_INTENSITY_KEYS):
        raise ValueError("data.normalization=ct needs data.ct_intensity (mean, std, percentile_00_5, percentile_99_5): "
                         "training measures it from the training cases; a recipe used elsewhere must carry it")
    return {k: float(stats[k]) for k in CT_INTENSITY_KEYS}
