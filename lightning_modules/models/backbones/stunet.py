"""STU-Net (Huang et al. 2023, "STU-Net: Scalable and Transferable Medical Image Segmentation Models
Empowered by Large-Scale Supervised Pre-training", arXiv:2304.06716), written from the paper.

STU-Net is an nnU-Net-shaped encoder-decoder built from residual blocks, scaled by width and depth.
Two choices make its weights transferable between tasks and input sizes, and both are kept here:
every convolution is 3x3x3 (no plan-dependent kernel sizes), and the decoder upsamples by
nearest-neighbour interpolation plus a 1x1x1 convolution instead of a transposed convolution.

The base model (STU-Net-B, the BenchX/Touchstone setting) has six stages of widths
32*(1, 2, 4, 8, 16, 16), one residual block per stage in the encoder and in the decoder, and deep
supervision. With 1 input channel and 3 classes it has 58.16 M parameters, the paper's 58.26 M within
0.2 %: that count is reached with 3x3x3 kernels in every stage and one block per stage, which is
what this file builds.

Shape rules: the encoder halves the resolution len(dims) - 1 times (stride-2 convolution in the
first block of every stage after the first), so every patch dimension must be divisible by
2 ** (len(dims) - 1): 32 at full size. The bottleneck must keep at least 2 voxels per axis for
instance normalization, so the smallest patch is 2 ** len(dims) (64 at full size, 32 for the
five-stage CPU profile).

Outputs: logits ``(B, out_channels, *patch)``; in training mode with ``deep_supervision`` a list of
logits from every decoder stage, full resolution first (``len(dims) - 1`` tensors).

Example::

    net = build_stunet(3, 1, 3, patch_size=(96, 96, 96))               # STU-Net-B
    net = build_stunet(3, 1, 3, patch_size=(32, 32, 32), dims=(8, 16, 32, 64, 64))
"""

from __future__ import annotations

from typing import Sequence

import torch
from monai.networks.blocks import Convolution, UnetOutBlock, UnetResBlock, UpSample
from torch import nn

# nnU-Net's normalization and nonlinearity, which STU-Net keeps.
_NORM = ("instance", {"affine": True})
_ACT = ("leakyrelu", {"negative_slope": 0.01, "inplace": True})


def _residual_stage(
    spatial_dims: int, in_channels: int, out_channels: int, depth: int, stride: int, kernel_size: int
) -> nn.Sequential:
    """``depth`` residual blocks; the first changes width and resolution (1x1x1 projection shortcut)."""
    blocks = [
        UnetResBlock(spatial_dims, in_channels, out_channels, kernel_size, stride, norm_name=_NORM, act_name=_ACT)
    ]
    blocks += [
        UnetResBlock(spatial_dims, out_channels, out_channels, kernel_size, 1, norm_name=_NORM, act_name=_ACT)
        for _ in range(depth - 1)
    ]
    return nn.Sequential(*blocks)


class STUNet(nn.Module):
    """Residual U-Net with nearest-neighbour + 1x1x1 upsampling and optional deep supervision.

    Args:
        spatial_dims: 3 for volumes.
        in_channels: input channels (CT: 1).
        out_channels: classes including background.
        dims: width of each stage, shallowest first.
        depths: residual blocks per stage (used for the encoder stage and its decoder mirror).
        kernel_size: every convolution's kernel (3 in the paper, for transferability).
        deep_supervision: in training mode, return the logits of every decoder stage.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        out_channels: int,
        dims: Sequence[int],
        depths: Sequence[int],
        kernel_size: int = 3,
        deep_supervision: bool = True,
    ) -> None:
        super().__init__()
        self.deep_supervision = deep_supervision
        # Stage 0 keeps the resolution; every later stage halves it in its first block.
        inputs = [in_channels, *dims[:-1]]
        self.encoder = nn.ModuleList(
            _residual_stage(spatial_dims, inputs[i], dims[i], depths[i], 1 if i == 0 else 2, kernel_size)
            for i in range(len(dims))
        )
        self.upsamplers = nn.ModuleList()
        self.decoder = nn.ModuleList()
        self.heads = nn.ModuleList()
        # Decoder stages from the coarsest skip upwards: stage i upsamples from dims[i + 1] to dims[i].
        for i in reversed(range(len(dims) - 1)):
            # The 1x1x1 convolution runs before the interpolation: the two commute (both act per
            # voxel or replicate voxels), and convolving at the coarse resolution is 8x cheaper.
            self.upsamplers.append(
                UpSample(
                    spatial_dims,
                    dims[i + 1],
                    dims[i],
                    scale_factor=2,
                    mode="nontrainable",
                    pre_conv=Convolution(spatial_dims, dims[i + 1], dims[i], kernel_size=1, conv_only=True),
                    interp_mode="nearest",
                    align_corners=None,
                )
            )
            self.decoder.append(_residual_stage(spatial_dims, 2 * dims[i], dims[i], depths[i], 1, kernel_size))
            self.heads.append(UnetOutBlock(spatial_dims, dims[i], out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        skips = []
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        x = skips.pop()
        with_all_scales = self.training and self.deep_supervision
        outputs = []
        for index, (upsample, stage, head) in enumerate(zip(self.upsamplers, self.decoder, self.heads)):
            x = stage(torch.cat([upsample(x), skips.pop()], dim=1))
            if with_all_scales or index == len(self.decoder) - 1:
                outputs.append(head(x))
        if with_all_scales:
            return outputs[::-1]
        return outputs[-1]


STUNET_B_DIMS = (32, 64, 128, 256, 512, 512)


def stunet_divisor(options: dict) -> int:
    """Every patch dimension must be divisible by 2 ** (number of stages - 1)."""
    return 2 ** (len(options.get("dims", STUNET_B_DIMS)) - 1)


def check_stunet_options(options: dict, patch_size: Sequence[int]) -> None:
    """Shape and option rules (the builder's keyword options with defaults); ValueError names the problem."""
    dims = list(options["dims"])
    depths = list(options["depths"]) if options.get("depths") is not None else [1] * len(dims)
    if len(dims) < 2 or len(depths) != len(dims):
        raise ValueError(
            f"STU-Net needs dims and depths with one entry per stage (>= 2 stages), got dims={dims} depths={depths}"
        )
    if any(int(d) < 1 for d in depths) or any(int(c) < 1 for c in dims):
        raise ValueError(
            f"STU-Net needs positive widths and at least one residual block per stage, got dims={dims} depths={depths}"
        )
    if int(options["kernel_size"]) % 2 == 0:
        raise ValueError(f"STU-Net needs an odd kernel_size (same padding), got {options['kernel_size']}")
    divisor = 2 ** (len(dims) - 1)
    if any(int(p) % divisor or int(p) // divisor < 2 for p in patch_size):
        raise ValueError(
            f"STU-Net with {len(dims)} stages needs every patch dimension divisible by {divisor} and at least "
            f"{2 * divisor} (instance norm needs 2 voxels per axis at the bottleneck); patch_size is {list(patch_size)}"
        )


def build_stunet(
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    *,
    patch_size: Sequence[int] = (96, 96, 96),
    dims: Sequence[int] = STUNET_B_DIMS,
    depths: Sequence[int] | None = None,
    kernel_size: int = 3,
    deep_supervision: bool = True,
) -> nn.Module:
    """Build STU-Net (base size by default).

    Args:
        spatial_dims: 3 for volumes.
        in_channels: input channels.
        out_channels: classes including background.
        patch_size: the training patch, checked against the shape rules.
        dims: width of each stage (STU-Net-B: 32, 64, 128, 256, 512, 512).
        depths: residual blocks per stage; one per stage when omitted (STU-Net-B).
        kernel_size: convolution kernel in every stage.
        deep_supervision: return the logits of every decoder stage in training mode.
    """
    check_stunet_options(dict(dims=dims, depths=depths, kernel_size=kernel_size), patch_size)
    depths = tuple(depths) if depths is not None else (1,) * len(dims)
    return STUNet(spatial_dims, in_channels, out_channels, tuple(dims), depths, kernel_size, deep_supervision)
