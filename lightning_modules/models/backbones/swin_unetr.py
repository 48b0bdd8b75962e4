"""SwinUNETR from MONAI (``monai.networks.nets.SwinUNETR``; Tang et al., CVPR 2022) in three sizes.

One builder; the registry's ``swin_unetr_tiny``, ``swin_unetr_small`` and ``swin_unetr_base`` differ
only in the default ``feature_size`` (12, 24, 48), as in the Touchstone benchmark. All use depths
(2, 2, 2, 2) and heads (3, 6, 12, 24), window 7, instance norm. Full size with 1 input and 3 output
channels: 4.08 M (tiny), 15.70 M (small), 62.19 M (base) parameters.

Shape rules: 2^3-voxel tokens merged four times, so every patch dimension must be divisible by
2^5 = 32; ``feature_size`` must be divisible by 12 (MONAI's rule); the width of stage i,
``feature_size * 2**i``, must be divisible by its number of heads. With instance norm the
bottleneck (patch / 32) needs more than one voxel, so a 32^3 patch needs another norm (the CPU
profile uses group norm).

Example::

    net = build_swin_unetr(3, 1, 3, patch_size=(32, 32, 32), feature_size=12)
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import numpy as np
from monai.networks.nets import SwinUNETR
from torch import nn

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
) -> nn.Module:
    """Build MONAI's SwinUNETR.

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
    """
    check_swin_unetr_options(
        dict(feature_size=feature_size, depths=depths, num_heads=num_heads, norm=norm), tuple(patch_size)
    )
    return SwinUNETR(
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
    )


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
    for stage, n_heads in enumerate(heads):
        width = feature_size * 2**stage
        if width % int(n_heads):
            raise ValueError(f"swin_unetr: stage {stage} has width {width}, not divisible by num_heads {n_heads}")
