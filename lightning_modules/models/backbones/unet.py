"""U-Net from MONAI (``monai.networks.nets.UNet``, Kerfoot et al. 2018's implementation), the
project's U-Net for the BenchX row that cites Ronneberger et al. 2015.

Which network this is: BenchX cites Ronneberger et al. (2015) for its U-Net and gives no architecture
(table 7: hyper-parameters "Pre-defined"; table 8: 96^3 patches, batch 2, SGD 1e-2 poly). This is
not Ronneberger's 2D U-Net (two 3x3 convolutions per level, max pooling, 64-1024 channels) nor
Cicek et al.'s 3D U-Net (2016: two 3x3x3 convolutions per level, max pooling, 32-512 channels):
MONAI's UNet with ``num_res_units=0`` has ONE convolution per level, strided (stride 2) instead of
pooled, and a transposed convolution followed by one convolution per decoder level. It reproduces
no published network exactly; it is MONAI's standard U-Net at the widths of a four-level 3D U-Net.

Full size (docs/explanation/training.md "Touchstone hyper-parameters"): channels (64, 128, 256, 512), strides
(2, 2, 2), instance norm, PReLU, ``num_res_units=0``. The 7.75 M figure is this configuration's own
parameter count (7,754,697 with 1 input channel and 3 classes, counted from the built module and
checked in tests/models/test_backbones.py), not a number from the BenchX or Touchstone papers.

Shape rule: every patch dimension must be divisible by 2**len(strides).
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
