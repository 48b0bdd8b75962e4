"""STU-Net (Huang et al. 2023, "STU-Net: Scalable and Transferable Medical Image Segmentation Models
Empowered by Large-Scale Supervised Pre-training", arXiv:2304.06716), following the reference
implementation (uni-medical/STU-Net, ``STUNet`` and ``BasicResBlock``, Apache-2.0) block by block.

STU-Net is an nnU-Net-shaped encoder-decoder built from residual blocks, scaled by width and depth.
Two choices make its weights transferable between tasks and input sizes: every convolution is
3x3x3 (no plan-dependent kernel sizes), and the decoder upsamples by nearest-neighbour interpolation
plus a 1x1x1 convolution instead of a transposed convolution.

The residual block (the reference's ``BasicResBlock``): conv 3^3 (stride s, bias) -> instance norm
(affine) -> LeakyReLU(0.01) -> conv 3^3 (bias) -> instance norm, plus the shortcut, then LeakyReLU.
The first block of every stage (encoder and decoder) changes width or resolution and its shortcut
is a bare biased 1x1x1 convolution with stride s (no normalization); the other blocks add the input
unchanged. Convolutions are initialized as nnU-Net does (He normal with negative slope 1e-2, zero
biases).

The base model (STU-Net-B, the BenchX/Touchstone setting) has six stages of widths
32*(1, 2, 4, 8, 16, 16), one residual block per stage in the encoder and in the decoder, and deep
supervision: 58.16 M parameters with 1 input channel and 3 classes, as the reference builds it.

Deliberate differences from the reference, each numerically neutral (checked against reference
outputs in ``tests/models/test_reference_outputs.py``):

- The upsampling's 1x1x1 convolution runs before the nearest-neighbour interpolation (the reference
  interpolates first). Both act per voxel, so they commute, and convolving at the coarse resolution
  is 8x cheaper.
- Strides are 2 on every axis (the reference takes them from an nnU-Net plan; Touchstone's 96^3
  patches at isotropic spacing give 2 on every axis).

Shape rules: the encoder halves the resolution len(dims) - 1 times (stride-2 convolution in the
first block of every stage after the first), so every patch dimension must be divisible by
2 ** (len(dims) - 1): 32 at full size. The bottleneck must keep at least 2 voxels per axis for
instance normalization, so the smallest patch is 2 ** len(dims) (64 at full size, 32 for the
five-stage CPU profile).

Outputs: logits ``(B, out_channels, *patch)``; in training mode with ``deep_supervision`` a list of
logits from every decoder stage, full resolution first (``len(dims) - 1`` tensors).

The reference's state dict loads after renaming keys with :func:`reference_key`.

Example::

    net = build_stunet(3, 1, 3, patch_size=(96, 96, 96))               # STU-Net-B
    net = build_stunet(3, 1, 3, patch_size=(32, 32, 32), dims=(8, 16, 32, 64, 64))
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

NEGATIVE_SLOPE = 0.01  # nnU-Net's LeakyReLU, and the slope its He initialization assumes


class ResidualBlock(nn.Module):
    """The reference's residual block (see the module docstring).

    Args:
        in_channels: input width.
        out_channels: output width.
        kernel_size: kernel of both 3^3 convolutions.
        stride: stride of the first convolution and of the shortcut.
        projection: give the shortcut a 1x1x1 convolution (the first block of each stage).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, projection: bool) -> None:
        super().__init__()
        padding = kernel_size // 2
        self.conv1 = nn.Conv3d(in_channels, out_channels, kernel_size, stride=stride, padding=padding)
        self.norm1 = nn.InstanceNorm3d(out_channels, affine=True)
        self.act1 = nn.LeakyReLU(NEGATIVE_SLOPE, inplace=True)
        self.conv2 = nn.Conv3d(out_channels, out_channels, kernel_size, padding=padding)
        self.norm2 = nn.InstanceNorm3d(out_channels, affine=True)
        self.act2 = nn.LeakyReLU(NEGATIVE_SLOPE, inplace=True)
        self.shortcut = nn.Conv3d(in_channels, out_channels, 1, stride=stride) if projection else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm2(self.conv2(self.act1(self.norm1(self.conv1(x)))))
        return self.act2(y + (x if self.shortcut is None else self.shortcut(x)))


class NearestUpsample(nn.Module):
    """1x1x1 convolution, then nearest-neighbour upsampling by 2 (the two commute)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(self.conv(x), scale_factor=2, mode="nearest")


def _stage(in_channels: int, out_channels: int, depth: int, stride: int, kernel_size: int) -> nn.Sequential:
    """``depth`` residual blocks; the first has the projection shortcut (as in the reference, always)."""
    blocks = [ResidualBlock(in_channels, out_channels, kernel_size, stride, projection=True)]
    blocks += [ResidualBlock(out_channels, out_channels, kernel_size, 1, projection=False) for _ in range(depth - 1)]
    return nn.Sequential(*blocks)


def he_initialization(module: nn.Module) -> None:
    """nnU-Net's ``InitWeights_He(1e-2)``: He normal weights for the slope-0.01 LeakyReLU, zero biases."""
    if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
        nn.init.kaiming_normal_(module.weight, a=NEGATIVE_SLOPE)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class STUNet(nn.Module):
    """Residual U-Net with nearest-neighbour + 1x1x1 upsampling and optional deep supervision.

    Args:
        spatial_dims: must be 3.
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
        if spatial_dims != 3:
            raise ValueError(f"STU-Net is volumetric: spatial_dims must be 3, got {spatial_dims}")
        self.deep_supervision = deep_supervision
        inputs = [in_channels, *dims[:-1]]
        # Stage 0 keeps the resolution; every later stage halves it in its first block.
        self.encoder = nn.ModuleList(
            _stage(inputs[i], dims[i], depths[i], 1 if i == 0 else 2, kernel_size) for i in range(len(dims))
        )
        # Decoder stages from the coarsest skip upwards: stage u upsamples dims[-1-u] to dims[-2-u].
        self.upsamplers = nn.ModuleList(NearestUpsample(dims[-1 - u], dims[-2 - u]) for u in range(len(dims) - 1))
        self.decoder = nn.ModuleList(
            _stage(2 * dims[-2 - u], dims[-2 - u], depths[-2 - u], 1, kernel_size) for u in range(len(dims) - 1)
        )
        self.heads = nn.ModuleList(nn.Conv3d(dims[-2 - u], out_channels, 1) for u in range(len(dims) - 1))
        self.apply(he_initialization)

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


# The reference's module names -> this file's (its state dict loads after renaming).
_REFERENCE_NAMES = (
    ("conv_blocks_context.", "encoder."),
    ("conv_blocks_localization.", "decoder."),
    ("upsample_layers.", "upsamplers."),
    ("seg_outputs.", "heads."),
    (".conv3.", ".shortcut."),
)


def reference_key(key: str) -> str:
    """A key of the reference implementation's state dict, renamed to this module's."""
    for old, new in _REFERENCE_NAMES:
        key = key.replace(old, new)
    return key


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
    """Build STU-Net (base size by default), block by block as the reference.

    Deliberate differences from the reference (both numerically neutral): listed in the module
    docstring (1x1x1 convolution before the nearest upsampling; strides 2 on every axis).

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
