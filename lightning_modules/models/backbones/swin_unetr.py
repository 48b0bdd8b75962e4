"""SwinUNETR from MONAI (``monai.networks.nets.SwinUNETR``; Tang et al., CVPR 2022) in three sizes.

One builder; the registry's ``swin_unetr_tiny``, ``swin_unetr_small`` and ``swin_unetr_base`` differ
only in the default ``feature_size`` (12, 24, 48), as in the Touchstone benchmark. All use depths
(2, 2, 2, 2) and heads (3, 6, 12, 24), window 7, instance norm. Full size with 1 input and 3 output
channels: 4.08 M (tiny), 15.70 M (small), 62.19 M (base) parameters.

Patch merging: MONAI 1.5 corrected its ``PatchMerging`` (before, it concatenated the sub-voxels
(0, 1, 0) and (0, 0, 1) twice and left out (1, 1, 0) and (0, 1, 1)). Tang et al.'s self-supervised
weights, the SwinUNETR that Touchstone trained and the Universal Model's and VSmTrans's code all use
the earlier order, so ``patch_merging="legacy"`` (:class:`LegacyPatchMerging`, the default) keeps
it; ``"merging"`` (MONAI >= 1.5) and ``"mergingv2"`` are MONAI's.

Pre-trained encoder: ``pretrained_weights`` names a file in the format of MONAI's self-supervised
Swin encoder weights (``model_swinvit.pt`` from Project-MONAI/research-contributions,
SwinUNETR/Pretrain: ``{"state_dict": {"module.patch_embed.proj.weight": ...,
"module.layers1.0.blocks.0.mlp.fc1.weight": ..., "module.layers1.0.downsample.reduction.weight": ...}}``).
They load into the Swin encoder with MONAI's ``SwinUNETR.load_from``; the decoder stays random.
BenchX table 7 lists SwinUNETR as pre-trained; the weights cannot be shipped or downloaded here,
so without a file the network trains from scratch, and the run's tags say which
(:func:`pretrained_tags`). Tang et al.'s weights are for feature size 48 (Base) and 1 input channel.

Shape rules: 2^3-voxel tokens merged four times, so every patch dimension must be divisible by
2^5 = 32; ``feature_size`` must be divisible by 12 (MONAI's rule); the width of stage i,
``feature_size * 2**i``, must be divisible by its number of heads. With instance norm the
bottleneck (patch / 32) needs more than one voxel, so a 32^3 patch needs another norm (the CPU
profile uses group norm).

Example::

    net = build_swin_unetr(3, 1, 3, patch_size=(32, 32, 32), feature_size=12)
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from monai.networks.nets import SwinUNETR
from monai.networks.nets.swin_unetr import MERGING_MODE, PatchMergingV2
from torch import nn

# Sub-voxel (d, h, w) offsets in the order MONAI < 1.5 concatenated them: (0, 1, 0) and (0, 0, 1)
# appear twice, (1, 1, 0) and (0, 1, 1) never (Project-MONAI/MONAI issue "PatchMerging is not
# correct for 3D"). Pre-trained Swin encoders expect channels in this order.
LEGACY_MERGING_OFFSETS = ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 0), (0, 0, 1), (1, 1, 1))
PATCH_MERGING_CHOICES = ("legacy", *MERGING_MODE)


class LegacyPatchMerging(PatchMergingV2):
    """Swin patch merging (2x2x2 sub-voxels -> LayerNorm -> Linear 8C -> 2C) in MONAI's pre-1.5 order.

    Same parameters as MONAI's ``PatchMergingV2``; only the order (and repetition) of the
    concatenated sub-voxels differs. Inputs ``(B, D, H, W, C)``, odd sizes zero-padded.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 5:
            raise ValueError(f"LegacyPatchMerging expects (B, D, H, W, C), got shape {tuple(x.shape)}")
        d, h, w = x.shape[1:4]
        if d % 2 or h % 2 or w % 2:
            x = torch.nn.functional.pad(x, (0, 0, 0, w % 2, 0, h % 2, 0, d % 2))
        x = torch.cat([x[:, i::2, j::2, k::2, :] for i, j, k in LEGACY_MERGING_OFFSETS], dim=-1)
        return self.reduction(self.norm(x))


def merging_module(name: str) -> type[nn.Module]:
    """The patch-merging class for ``patch_merging`` (see the module docstring)."""
    if name == "legacy":
        return LegacyPatchMerging
    if name not in MERGING_MODE:
        raise ValueError(f"patch_merging must be one of {', '.join(PATCH_MERGING_CHOICES)}, got {name!r}")
    return MERGING_MODE[name]


def load_self_supervised_encoder(network: SwinUNETR, path: str | Path) -> None:
    """Load MONAI's self-supervised Swin encoder weights (``model_swinvit.pt`` format) into ``network``.

    Raises:
        ValueError: the file is unreadable, lacks ``state_dict``, misses a tensor the encoder
            needs, or holds tensors of other shapes (e.g. another feature size); the message names
            the file and the tensor.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"swin_unetr: pretrained_weights {path} does not exist")
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # any unreadable file gets the same clear message
        raise ValueError(f"swin_unetr: cannot read pretrained_weights {path}: {error}") from error
    if not isinstance(weights, dict) or not isinstance(weights.get("state_dict"), dict):
        raise ValueError(
            f"swin_unetr: {path} is not in model_swinvit.pt format: expected a dict with a 'state_dict' "
            "of 'module.patch_embed...', 'module.layers1.0.blocks.0...' tensors"
        )
    try:
        network.load_from(weights)
    except KeyError as error:
        raise ValueError(f"swin_unetr: {path} has no tensor {error} that the Swin encoder needs") from None
    except RuntimeError as error:
        raise ValueError(
            f"swin_unetr: {path} does not fit this encoder (feature_size, depths, window or in_channels differ): {error}"
        ) from None


def pretrained_tags(options: dict) -> dict[str, str]:
    """Run tags saying whether the encoder started from pre-trained weights (and which file)."""
    path = options.get("pretrained_weights")
    if not path:
        return {"pretrained_weights": "none (trained from scratch)"}
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return {"pretrained_weights": f"{Path(path).name} sha256:{digest}"}

# Input dimensions must be divisible by token_size ** 5 (MONAI SwinUNETR._check_input_size).
SWIN_TOKEN_SIZE = 2
SWIN_DIVISOR = SWIN_TOKEN_SIZE**5


def build_swin_unetr(
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    *,
    patch_size: Sequence[int] = (96, 96, 96),
    feature_size: int = 48,
    depths: Sequence[int] = (2, 2, 2, 2),
    num_heads: Sequence[int] = (3, 6, 12, 24),
    window_size: int = 7,
    norm: str | Sequence = "instance",
    drop_rate: float = 0.0,
    attn_drop_rate: float = 0.0,
    dropout_path_rate: float = 0.0,
    use_checkpoint: bool = False,
    patch_merging: str = "legacy",
    pretrained_weights: str | None = None,
) -> nn.Module:
    """Build MONAI's SwinUNETR (the library class itself), with the legacy patch merging by default.

    Args:
        spatial_dims: 3 for CT volumes.
        in_channels: image channels.
        out_channels: background + classes.
        patch_size: the training patch (checked against the shape rules; the network itself accepts
            any input whose dimensions are divisible by 32).
        feature_size: embedding width of the first Swin stage (12 tiny, 24 small, 48 base).
        depths: Swin blocks per stage.
        num_heads: attention heads per stage.
        window_size: attention window edge, in tokens.
        norm: normalization of the convolutional blocks: a MONAI norm name, or ``[name, {args}]``
            such as ``["group", {"num_groups": 4}]``.
        drop_rate: dropout after the patch embedding and in the MLPs.
        attn_drop_rate: attention dropout.
        dropout_path_rate: stochastic depth rate.
        use_checkpoint: gradient checkpointing (less memory, slower).
        patch_merging: ``legacy`` (MONAI < 1.5's order, what pre-trained weights need), ``merging``
            or ``mergingv2``.
        pretrained_weights: a ``model_swinvit.pt``-format file for the Swin encoder, or None
            (from scratch).
    """
    check_swin_unetr_options(
        dict(
            feature_size=feature_size, depths=depths, num_heads=num_heads, norm=norm, patch_merging=patch_merging,
            pretrained_weights=pretrained_weights,
        ),
        tuple(patch_size),
    )
    network = SwinUNETR(
        in_channels=in_channels,
        out_channels=out_channels,
        patch_size=SWIN_TOKEN_SIZE,
        depths=tuple(depths),
        num_heads=tuple(num_heads),
        window_size=window_size,
        feature_size=feature_size,
        norm_name=norm if isinstance(norm, str) else (norm[0], dict(norm[1])),
        drop_rate=drop_rate,
        attn_drop_rate=attn_drop_rate,
        dropout_path_rate=dropout_path_rate,
        use_checkpoint=use_checkpoint,
        spatial_dims=spatial_dims,
        downsample=merging_module(patch_merging),
    )
    if pretrained_weights:
        load_self_supervised_encoder(network, pretrained_weights)
    return network


build_swin_unetr_tiny = partial(build_swin_unetr, feature_size=12)
build_swin_unetr_small = partial(build_swin_unetr, feature_size=24)
build_swin_unetr_base = partial(build_swin_unetr, feature_size=48)


def check_swin_unetr_options(options: dict, patch_size: tuple[int, ...]) -> None:
    """Shape rules of SwinUNETR, checked at recipe load (see the module docstring)."""
    bad = [int(p) for p in patch_size if int(p) % SWIN_DIVISOR]
    if bad:
        raise ValueError(
            f"swin_unetr merges {SWIN_TOKEN_SIZE}^3-voxel tokens four times: every patch dimension must be "
            f"divisible by {SWIN_DIVISOR}; data.patch_size is {list(patch_size)}"
        )
    feature_size = int(options["feature_size"])
    if feature_size % 12:
        raise ValueError(f"swin_unetr: feature_size must be divisible by 12 (MONAI SwinUNETR), got {feature_size}")
    depths, heads = list(options["depths"]), list(options["num_heads"])
    if len(depths) != 4 or len(heads) != 4:
        raise ValueError(f"swin_unetr: depths and num_heads need 4 stages each, got {depths} and {heads}")
    norm = options["norm"]
    norm_name = norm if isinstance(norm, str) else norm[0]
    bottleneck = [int(p) // SWIN_DIVISOR for p in patch_size]
    if str(norm_name).lower() == "instance" and int(np.prod(bottleneck)) <= 1:
        raise ValueError(
            f"swin_unetr: with instance norm the bottleneck (patch / {SWIN_DIVISOR} = {bottleneck}) needs more than "
            f"one voxel; use a larger data.patch_size or model.options.norm: [group, {{num_groups: 4}}]"
        )
    merging = options.get("patch_merging", "legacy")
    if merging not in PATCH_MERGING_CHOICES:
        raise ValueError(f"swin_unetr: patch_merging must be one of {', '.join(PATCH_MERGING_CHOICES)}, got {merging!r}")
    weights = options.get("pretrained_weights")
    if weights and not Path(weights).is_file():
        raise ValueError(f"swin_unetr: pretrained_weights {weights} does not exist")
    if weights and merging != "legacy":
        raise ValueError(
            f"swin_unetr: pretrained_weights were trained with MONAI < 1.5's patch merging; "
            f"use patch_merging: legacy (got {merging!r})"
        )
    for stage, n_heads in enumerate(heads):
        width = feature_size * 2**stage
        if width % int(n_heads):
            raise ValueError(f"swin_unetr: stage {stage} has width {width}, not divisible by num_heads {n_heads}")
