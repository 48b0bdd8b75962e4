"""The one place that decides which voxels a network predicts as tumor (and as each class).

Softmax backbones output a background channel plus one channel per class (mutually exclusive);
sigmoid backbones (Universal Model) output one independent channel per class. Evaluation,
validation Dice and the scan-level detection read predictions only through these functions, so
both kinds are judged by the same rule:

- softmax: a voxel's label is the argmax over channels;
- sigmoid: a voxel gets class k when its probability exceeds 0.5, later classes in the recipe's
  order (lesions come after their organ) overriding earlier ones; background elsewhere.

A tumor voxel is a voxel whose label is the tumor class, and the tumor probability is the tumor
channel's softmax or sigmoid probability.
"""

from __future__ import annotations

from typing import Sequence

import torch

SIGMOID_THRESHOLD = 0.5

# For multi-label (sigmoid) targets, an organ channel also covers the lesions inside that organ
# (AbdomenAtlas convention: the organ mask includes its lesion).
LESION_ORGANS: dict[str, tuple[str, ...]] = {
    "pancreatic_lesion": ("pancreas",),
    "liver_lesion": ("liver",),
    "kidney_lesion": ("kidney_left", "kidney_right"),
}


def class_probabilities(logits: torch.Tensor, output: str) -> torch.Tensor:
    """Per-channel probabilities: softmax over channels, or independent sigmoids."""
    if output == "softmax":
        return torch.softmax(logits.float(), dim=1)
    if output == "sigmoid":
        return torch.sigmoid(logits.float())
    raise ValueError(f"unknown output kind {output!r} (softmax or sigmoid)")


def predicted_labels(logits: torch.Tensor, output: str) -> torch.Tensor:
    """Integer label map (B, *spatial): 0 background, k for the k-th recipe class (1-based)."""
    if output == "softmax":
        return torch.argmax(logits, dim=1)
    probabilities = class_probabilities(logits, output)
    labels = torch.zeros(probabilities.shape[:1] + probabilities.shape[2:], dtype=torch.long, device=logits.device)
    for channel in range(probabilities.shape[1]):
        labels[probabilities[:, channel] > SIGMOID_THRESHOLD] = channel + 1
    return labels


def tumor_voxels(logits: torch.Tensor, output: str, tumor_label: int) -> torch.Tensor:
    """Boolean (B, *spatial): voxels predicted as the tumor class (label ``tumor_label``, 1-based)."""
    return predicted_labels(logits, output) == tumor_label


def tumor_probability(logits: torch.Tensor, output: str, tumor_label: int) -> torch.Tensor:
    """(B, *spatial) probability of the tumor class."""
    probabilities = class_probabilities(logits, output)
    channel = tumor_label if output == "softmax" else tumor_label - 1
    return probabilities[:, channel]


def multilabel_target(labels: torch.Tensor, classes: Sequence[str]) -> torch.Tensor:
    """One channel per class from an integer label map (B, 1, *spatial), organs including their lesions."""
    if labels.ndim >= 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    channels = []
    for index, name in enumerate(classes, start=1):
        member = labels == index
        for lesion, organs in LESION_ORGANS.items():
            if name in organs and lesion in classes:
                member = member | (labels == classes.index(lesion) + 1)
        channels.append(member)
    return torch.stack(channels, dim=1).float()
