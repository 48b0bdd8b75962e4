"""U-Net from MONAI (``monai.networks.nets.UNet``), the Touchstone/BenchX U-Net setting.

Full size (BenchX table 7, docs/design.md "Touchstone hyper-parameters"): channels (64, 128, 256, 512), strides (2, 2, 2), plain
convolution blocks (``num_res_units=0``), 7.75 M parameters; every patch dimension must be divisible
by 2**len(strides).
"""

from __future__ import annotations

from typing import Sequence

from monai.networks.nets import UNet
from torch import nn


def build_unet(
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    *,
    patch_size: Sequence[int] = (96, 96, 96),
    channels: Sequence[int] = (64, 128, 256, 512),
    strides: Sequence[int] = (2, 2, 2),
    num_res_units: int = 0,
    norm: str = "instance",
    dropout: float = 0.0,
) -> nn.Module:
    return UNet(
        spatial_dims=spatial_dims,
        in_channels=in_channels,
        out_channels=out_channels,
        channels=tuple(channels),
        strides=tuple(strides),
        num_res_units=num_res_units,
        norm=norm,
        dropout=dropout,
    )
