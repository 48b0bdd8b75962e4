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

Strides follow the reference trainer (``STUNetTrainer_base.build_network_architecture``): it takes
the pooling strides of the nnU-Net plan, keeps at most ``len(dims) - 1`` of them and pads the
missing ones with 1. With ``strides="auto"`` (the default) the plan is nnU-Net's topology rule for
the build ``patch_size`` at ``spacing``
(:func:`lightning_modules.models.planning.network_topology`): at BenchX's 96^3 patch at isotropic
spacing it pools 4 times (96 -> 6, a 6^3 map is too small to pool again), so STU-Net-B's strides are
[2, 2, 2, 2, 1] and its bottleneck is 6^3, not 3^3. A stride-1 stage keeps the resolution and its
upsampling is the identity (the reference interpolates with scale factor 1). Explicit ``strides``
give one entry per stage after the first, an int or one value per axis.

Shape rules: every patch dimension must be divisible by the product of the strides along it (16 at
96^3 with the planned strides), and the bottleneck must keep at least 2 voxels per axis for instance
normalization.

Outputs: logits ``(B, out_channels, *patch)``; in training mode with ``deep_supervision`` a list of
logits from every decoder stage, full resolution first (``len(dims) - 1`` tensors; two of them have
the same size when the last stride is 1, as in the reference).

The reference's state dict loads after renaming keys with :func:`~lightning_modules.models.backbones.reference_keys.stunet_key`.

Example::

    net = build_stunet(3, 1, 3, patch_size=(96, 96, 96))               # STU-Net-B, strides [2, 2, 2, 2, 1]
    net = build_stunet(3, 1, 3, patch_size=(32, 32, 32), dims=(8, 16, 32, 64, 64))
    net = build_stunet(3, 1, 3, patch_size=(16, 16, 16), dims=(2, 4, 8, 8), strides=[2, 2, 2])
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_modules.models.topology import network_topology

AUTO = "auto"

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

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, stride: int | tuple[int, ...], projection: bool
    ) -> None:
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
    """1x1x1 convolution, then nearest-neighbour upsampling by the stage's stride (the two commute)."""

    def __init__(self, in_channels: int, out_channels: int, scale: tuple[int, ...] = (2, 2, 2)) -> None:
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size=1)
        self.scale = tuple(int(s) for s in scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if all(s == 1 for s in self.scale):
            return x
        return F.interpolate(x, scale_factor=self.scale, mode="nearest")


def _stage(
    in_channels: int, out_channels: int, depth: int, stride: int | tuple[int, ...], kernel_size: int
) -> nn.Sequential:
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
        strides: per stage after the first, one stride per axis; 2 on every axis when omitted.
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
        strides: Sequence[Sequence[int]] | None = None,
    ) -> None:
        super().__init__()
        if spatial_dims != 3:
            raise ValueError(f"STU-Net is volumetric: spatial_dims must be 3, got {spatial_dims}")
        self.deep_supervision = deep_supervision
        strides = [tuple(s) for s in strides] if strides is not None else [(2, 2, 2)] * (len(dims) - 1)
        self.strides = strides
        inputs = [in_channels, *dims[:-1]]
        # Stage 0 keeps the resolution; every later stage pools by its stride in its first block.
        stage_strides = [(1, 1, 1), *strides]
        self.encoder = nn.ModuleList(
            _stage(inputs[i], dims[i], depths[i], stage_strides[i], kernel_size) for i in range(len(dims))
        )
        # Decoder stages from the coarsest skip upwards: stage u upsamples dims[-1-u] to dims[-2-u].
        self.upsamplers = nn.ModuleList(
            NearestUpsample(dims[-1 - u], dims[-2 - u], strides[-1 - u]) for u in range(len(dims) - 1)
        )
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
STUNET_B_DIMS = (32, 64, 128, 256, 512, 512)
TOUCHSTONE_SPACING = (1.5, 1.5, 1.5)  # the spacing BenchX resamples to (recipes pass data.spacing)


def stunet_strides(
    n_stages: int, patch_size: Sequence[int], spacing: Sequence[float] = TOUCHSTONE_SPACING, strides=AUTO
) -> list[list[int]]:
    """The pooling strides of the stages after the first, one list per stage and one value per axis.

    ``strides="auto"``: nnU-Net's plan at ``patch_size`` and ``spacing``, as the reference trainer
    uses it: the plan's strides after the first stage, at most ``n_stages - 1`` of them, padded with 1.
    Explicit strides (an int or one value per axis per stage) are returned as lists.
    """
    dims = len(patch_size)
    if isinstance(strides, str):
        if strides != AUTO:
            raise ValueError(f"STU-Net strides must be 'auto' or one stride per stage, got {strides!r}")
        planned = network_topology(spacing, patch_size)["strides"][1:]
        planned = [list(s) for s in planned[: n_stages - 1]]
        return planned + [[1] * dims for _ in range(n_stages - 1 - len(planned))]
    result = []
    for stride in strides:
        per_axis = [int(stride)] * dims if isinstance(stride, (int, float)) else [int(s) for s in stride]
        result.append(per_axis)
    return result


def stunet_divisor(options: dict) -> int:
    """Checked per axis against the strides by :func:`check_stunet_options` (they depend on the patch)."""
    return 1


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
    spacing = options.get("spacing", TOUCHSTONE_SPACING)
    if len(spacing) != len(patch_size) or any(float(s) <= 0 for s in spacing):
        raise ValueError(f"STU-Net needs a positive spacing per axis, got spacing={list(spacing)}")
    strides = stunet_strides(len(dims), patch_size, spacing, options.get("strides", AUTO))
    if len(strides) != len(dims) - 1 or any(len(s) != len(patch_size) or min(s) < 1 for s in strides):
        raise ValueError(
            f"STU-Net with {len(dims)} stages needs {len(dims) - 1} strides (one per stage after the first, "
            f"positive, an int or one per axis), got strides={options.get('strides')}"
        )
    divisors = [math.prod(s[axis] for s in strides) for axis in range(len(patch_size))]
    if any(int(p) % d or int(p) // d < 2 for p, d in zip(patch_size, divisors)):
        raise ValueError(
            f"STU-Net with strides {strides} needs every patch dimension divisible by {divisors} (per axis) and "
            f"at least twice that (instance norm needs 2 voxels per axis at the bottleneck); patch_size is "
            f"{list(patch_size)}"
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
    strides: Sequence[int | Sequence[int]] | str = AUTO,
    spacing: Sequence[float] = TOUCHSTONE_SPACING,
) -> nn.Module:
    """Build STU-Net (base size by default), block by block as the reference.

    Deliberate difference from the reference (numerically neutral): the 1x1x1 convolution runs
    before the nearest upsampling (module docstring).

    Args:
        spatial_dims: 3 for volumes.
        in_channels: input channels.
        out_channels: classes including background.
        patch_size: the training patch: the strides are planned for it, and it is checked against them.
        dims: width of each stage (STU-Net-B: 32, 64, 128, 256, 512, 512).
        depths: residual blocks per stage; one per stage when omitted (STU-Net-B).
        kernel_size: convolution kernel in every stage.
        deep_supervision: return the logits of every decoder stage in training mode.
        strides: ``auto`` (nnU-Net's plan at ``patch_size`` and ``spacing``, padded with 1 as the
            reference trainer does) or one stride per stage after the first (an int or one per axis).
        spacing: the spacing the patch is at (mm per axis; the recipe passes ``data.spacing``).
    """
    check_stunet_options(
        dict(dims=dims, depths=depths, kernel_size=kernel_size, strides=strides, spacing=spacing), patch_size
    )
    depths = tuple(depths) if depths is not None else (1,) * len(dims)
    planned = stunet_strides(len(dims), patch_size, spacing, strides)
    return STUNet(
        spatial_dims, in_channels, out_channels, tuple(dims), depths, kernel_size, deep_supervision, planned
    )
