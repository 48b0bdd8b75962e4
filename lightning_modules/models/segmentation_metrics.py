"""Per-class segmentation quality: Dice and normalized surface Dice (NSD) at 1.5 mm (docs/explanation/detection-and-statistics.md "Scan-level detection", Touchstone).

Inputs are integer label volumes of one case (0 = background, k = ``class_names[k - 1]``), e.g.
the argmax of a sliding-window prediction and the stacked ground-truth masks. Both metrics come
from MONAI (``DiceMetric``, ``compute_surface_dice``); the empty cases are decided here, explicitly:

- truth and prediction both empty: 1.0 (a correct "nothing there"; MONAI's ``DiceMetric`` returns
  NaN with its default ``ignore_empty=True`` and 1.0 with ``ignore_empty=False``;
  ``compute_surface_dice`` returns NaN),
- exactly one of them empty: 0.0 (MONAI agrees for both metrics; with ``ignore_empty=True``
  ``DiceMetric`` would return NaN for an empty truth).

Example::

    dice = dice_per_class(prediction, truth, ["pancreas", "pancreatic_lesion"])
    nsd = surface_dice_per_class(prediction, truth, ["pancreas", "pancreatic_lesion"], spacing=(1.5, 1.5, 1.5))
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch
from monai.metrics import DiceMetric, compute_surface_dice
from monai.networks.utils import one_hot

TOUCHSTONE_TOLERANCE_MM = 1.5


def _as_label_tensor(volume, name: str, n_classes: int) -> torch.Tensor:
    tensor = torch.as_tensor(np.asarray(volume) if not isinstance(volume, torch.Tensor) else volume)
    if tensor.dtype.is_floating_point:
        if not torch.equal(tensor, tensor.round()):
            raise ValueError(f"{name} must hold integer labels, got non-integer values")
    elif tensor.dtype == torch.bool:
        tensor = tensor.to(torch.int64)
    tensor = tensor.to(torch.int64)
    if tensor.ndim not in (2, 3):
        raise ValueError(f"{name} must be a 2D or 3D label volume, got shape {tuple(tensor.shape)}")
    if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) > n_classes):
        raise ValueError(
            f"{name} has labels in [{int(tensor.min())}, {int(tensor.max())}], expected 0..{n_classes} "
            f"(0 = background, k = class_names[k-1])"
        )
    return tensor


def _one_hot_pair(pred_labels, true_labels, class_names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both volumes as one-hot (1, 1 + n_classes, *spatial) float tensors, channel 0 = background."""
    if len(class_names) == 0:
        raise ValueError("class_names is empty")
    if len(set(class_names)) != len(class_names):
        raise ValueError(f"class_names has duplicates: {list(class_names)}")
    n_classes = len(class_names)
    pred = _as_label_tensor(pred_labels, "pred_labels", n_classes)
    true = _as_label_tensor(true_labels, "true_labels", n_classes)
    if pred.shape != true.shape:
        raise ValueError(f"pred_labels shape {tuple(pred.shape)} differs from true_labels shape {tuple(true.shape)}")
    pred_hot = one_hot(pred[None, None], num_classes=n_classes + 1, dim=1)
    true_hot = one_hot(true[None, None], num_classes=n_classes + 1, dim=1)
    return pred_hot, true_hot


def _empty_case_values(pred_hot: torch.Tensor, true_hot: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per foreground class: the decided value (1.0, 0.0) where either side is empty, and which need MONAI."""
    spatial = tuple(range(2, pred_hot.ndim))
    pred_present = (pred_hot[0, 1:].sum(dim=tuple(d - 1 for d in spatial)) > 0).numpy()
    true_present = (true_hot[0, 1:].sum(dim=tuple(d - 1 for d in spatial)) > 0).numpy()
    decided = np.where(~pred_present & ~true_present, 1.0, 0.0)
    needs_metric = pred_present & true_present
    return decided, needs_metric


def dice_per_class(pred_labels, true_labels, class_names: Sequence[str]) -> dict[str, float]:
    """Dice of each foreground class, by MONAI's ``DiceMetric``; empty-vs-empty is 1.0.

    Args:
        pred_labels: predicted integer label volume (numpy or torch), 0 = background.
        true_labels: ground-truth label volume of the same shape.
        class_names: name of label k at position k - 1.
    """
    pred_hot, true_hot = _one_hot_pair(pred_labels, true_labels, class_names)
    decided, needs_metric = _empty_case_values(pred_hot, true_hot)
    values = decided.copy()
    if needs_metric.any():
        metric = DiceMetric(include_background=False, reduction="none", ignore_empty=False)
        values[needs_metric] = metric(pred_hot, true_hot)[0].numpy()[needs_metric]
    return {name: float(v) for name, v in zip(class_names, values)}


def surface_dice_per_class(
    pred_labels,
    true_labels,
    class_names: Sequence[str],
    spacing: Sequence[float],
    tolerance_mm: float = TOUCHSTONE_TOLERANCE_MM,
    use_subvoxels: bool = False,
) -> dict[str, float]:
    """Normalized surface Dice of each foreground class at ``tolerance_mm``, by MONAI's ``compute_surface_dice``.

    Distances are in millimetres (MONAI scales by ``spacing``), so the tolerance is too. An
    empty-vs-empty class is 1.0, a class present on one side only 0.0 (see the module docstring);
    MONAI is called only for the classes present on both sides, which also keeps its
    empty-mask warnings out of the logs.

    Args:
        pred_labels: predicted integer label volume, 0 = background.
        true_labels: ground-truth label volume of the same shape.
        class_names: name of label k at position k - 1.
        spacing: voxel size in mm along each axis of the volumes.
        tolerance_mm: accepted boundary deviation (Touchstone: 1.5 mm).
        use_subvoxels: MONAI's option to weight boundary elements by surface area (DeepMind's
            surface-distance definition) instead of counting boundary voxels.
    """
    if not np.isfinite(tolerance_mm) or tolerance_mm < 0:
        raise ValueError(f"tolerance_mm must be a finite number >= 0, got {tolerance_mm}")
    pred_hot, true_hot = _one_hot_pair(pred_labels, true_labels, class_names)
    spacing = [float(s) for s in spacing]
    if len(spacing) != pred_hot.ndim - 2 or any(s <= 0 for s in spacing):
        raise ValueError(f"spacing must give {pred_hot.ndim - 2} positive voxel sizes (mm), got {spacing}")
    decided, needs_metric = _empty_case_values(pred_hot, true_hot)
    values = decided.copy()
    present = np.flatnonzero(needs_metric)
    if len(present):
        channels = torch.as_tensor(present + 1)
        with warnings.catch_warnings():
            # MONAI's own internal call of a deprecated argument; nothing a caller can act on.
            warnings.filterwarnings("ignore", message=".*always_return_as_numpy.*", category=FutureWarning)
            nsd = compute_surface_dice(
                pred_hot[:, channels],
                true_hot[:, channels],
                class_thresholds=[float(tolerance_mm)] * len(present),
                include_background=True,
                spacing=spacing,
                use_subvoxels=use_subvoxels,
            )
        values[present] = nsd[0].numpy()
    return {name: float(v) for name, v in zip(class_names, values)}
