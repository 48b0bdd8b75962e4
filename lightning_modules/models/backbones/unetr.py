"""UNETR from MONAI (``monai.networks.nets.UNETR``; Hatamizadeh et al., WACV 2022), the Touchstone setting.

A ViT encoder (12 layers, 16^3-voxel tokens) with a convolutional decoder. Full size (BenchX table 8,
docs/explanation/training.md "Touchstone hyper-parameters"): image 96^3, feature size 16, hidden size 768, MLP 3072,
12 heads, instance norm, residual blocks: 92.8 M parameters with 1 input and 3 output channels.

Shape rules: the ViT's position embeddings are sized for one input shape, so the network's
``img_size`` is the training patch (sliding-window inference uses the same window); every patch
dimension must be divisible by 16, the token size; ``hidden_size`` must be divisible by ``num_heads``.

Example::

    net = build_unetr(3, 1, 3, patch_size=(32, 32, 32), feature_size=8, hidden_size=96, mlp_dim=192, num_heads=4)
"""

from __future__ import annotations

from typing import Sequence

from monai.networks.nets import UNETR
from torch import nn

# MONAI's UNETR cuts the image into 16^3 tokens (fixed in its ViT).
UNETR_TOKEN_SIZE = 16


def build_unetr(
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    *,
    patch_size: Sequence[int] = (96, 96, 96),
    feature_size: int = 16,
    hidden_size: int = 768,
    mlp_dim: int = 3072,
    num_heads: int = 12,
    norm: str = "instance",
    res_block: bool = True,
    dropout: float = 0.0,
) -> nn.Module:
    """Build MONAI's UNETR for the given training patch.

    Args:
        spatial_dims: 3 for CT volumes.
        in_channels: image channels.
        out_channels: background + classes.
        patch_size: the training patch, used as the ViT's ``img_size``.
        feature_size: width of the convolutional decoder's first stage.
        hidden_size: ViT embedding width.
        mlp_dim: ViT feed-forward width.
        num_heads: ViT attention heads.
        norm: decoder normalization (``instance`` in Touchstone).
        res_block: residual convolution blocks in the decoder.
        dropout: ViT dropout rate.
    """
    check_unetr_options(dict(hidden_size=hidden_size, num_heads=num_heads), tuple(patch_size))
    network = UNETR(
        in_channels=in_channels,
        out_channels=out_channels,
        img_size=tuple(int(p) for p in patch_size),
        feature_size=feature_size,
        hidden_size=hidden_size,
        mlp_dim=mlp_dim,
        num_heads=num_heads,
        proj_type="conv",
        norm_name=norm,
        res_block=res_block,
        dropout_rate=dropout,
        spatial_dims=spatial_dims,
    )
    # MONAI builds a cross-attention LayerNorm in every ViT block even without cross-attention; it
    # never gets a gradient, which DistributedDataParallel (find_unused_parameters=False) refuses.
    # Freezing it rather than removing it keeps MONAI's state-dict layout, so checkpoints still load.
    for block in network.vit.blocks:
        if not block.with_cross_attention:
            block.norm_cross_attn.requires_grad_(False)
    return network


def check_unetr_options(options: dict, patch_size: tuple[int, ...]) -> None:
    """Shape rules of UNETR, checked at recipe load (see the module docstring)."""
    bad = [int(p) for p in patch_size if int(p) % UNETR_TOKEN_SIZE]
    if bad:
        raise ValueError(
            f"unetr uses the patch as its img_size and cuts it into {UNETR_TOKEN_SIZE}^3 tokens: every patch "
            f"dimension must be divisible by {UNETR_TOKEN_SIZE}; data.patch_size is {list(patch_size)}"
        )
    if int(options["hidden_size"]) % int(options["num_heads"]):
        raise ValueError(
            f"unetr: hidden_size {options['hidden_size']} must be divisible by num_heads {options['num_heads']}"
        )
