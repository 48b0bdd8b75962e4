"""nnU-Net's networks: PlainConvUNet ("nnunet") and ResidualEncoderUNet ("resenc").

The networks come from ``dynamic_network_architectures`` (the library nnU-Net v2 builds them with),
configured as nnU-Net does: 3^3 (or anisotropic) convolutions, instance norm, LeakyReLU, features
``min(32 * 2**i, 320)``, transposed-convolution upsampling, deep supervision. ``nnunet``: 2
convolutions per stage in encoder and decoder (Isensee et al., Nature Methods 2021); 6 stages give
31.2 M parameters with 1 input and 3 output channels. ``resenc``: residual encoder blocks
(1, 3, 4, 6, 6, 6) and 1 convolution per decoder stage, the ResEnc L preset (Isensee et al., MICCAI
2024, "nnU-Net revisited"); 6 stages give 102.4 M parameters.

nnU-Net plans the patch and the depth from the dataset; that planner lives apart from the networks
(as in nnU-Net v2), in :mod:`lightning_modules.models.planning`. Recipes select planning with
``auto`` topology options; :func:`lightning_modules.models.planning.resolve_planned_recipe` (called
by training) fills them in along with ``data.patch_size``.

Shape rules: each patch dimension must be divisible by the product of the strides along it;
``strides``, ``kernel_sizes`` and ``features_per_stage`` need ``n_stages`` entries each, and the
first stride is 1 (the first stage works at full resolution).

Example::

    net = build_nnunet(3, 1, 3, patch_size=(128, 128, 128), n_stages=6,
                       strides=[1, 2, 2, 2, 2, 2], kernel_sizes=[3] * 6,
                       features_per_stage=[32, 64, 128, 256, 320, 320])
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from torch import nn

from lightning_modules.models.backbones.deep_supervision import DeepSupervisionOutput
from lightning_modules.models.topology import shape_divisors

AUTO = "auto"
TOPOLOGY_OPTIONS = ("n_stages", "strides", "kernel_sizes", "features_per_stage")

# ResEnc presets: residual blocks per encoder stage; stages beyond the sixth get 6 as well.
RESENC_BLOCKS = (1, 3, 4, 6, 6, 6)
# The ResEnc presets of "nnU-Net revisited" (nnUNetPlannerResEncM/L/XL): the GPU memory each plans
# for. The network is the same; the planner fits a larger patch to a larger budget.
RESENC_PRESETS = {"M": 8.0, "L": 24.0, "XL": 40.0}
# Where planning takes the target spacing from: the recipe's data.spacing, or the cohort's median
# spacing as nnU-Net does (planning.target_spacing).
TARGET_SPACINGS = ("recipe", "median")


# ----------------------------------------------------------------------------------------------
# Builders


def build_nnunet(
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    *,
    patch_size: Sequence[int] = (128, 128, 128),
    n_stages: int | str = AUTO,
    strides: Sequence[Any] | str = AUTO,
    kernel_sizes: Sequence[Any] | str = AUTO,
    features_per_stage: Sequence[int] | str = AUTO,
    n_conv_per_stage: int = 2,
    n_conv_per_stage_decoder: int = 2,
    deep_supervision: bool = True,
    gpu_memory_gb: float = 8.0,
    target_spacing: str = "recipe",
) -> nn.Module:
    """Build nnU-Net's PlainConvUNet from an explicit (planned or written-out) topology.

    Args:
        spatial_dims: 3 for CT volumes.
        in_channels: image channels.
        out_channels: background + classes.
        patch_size: the training patch (checked against the strides).
        n_stages: resolution stages, the first at full resolution.
        strides: per stage, an int or one stride per axis (the first is 1).
        kernel_sizes: per stage, an int or one kernel size per axis.
        features_per_stage: channels per stage.
        n_conv_per_stage: convolutions per encoder stage.
        n_conv_per_stage_decoder: convolutions per decoder stage.
        deep_supervision: a segmentation head per decoder stage in train mode.
        gpu_memory_gb: the memory the planner fits the patch to; used only when the topology is
            ``auto`` (by :func:`lightning_modules.models.planning.resolve_planned_recipe`), not by the network.
        target_spacing: ``recipe`` (plan at ``data.spacing``) or ``median`` (plan at the cohort's
            median spacing as nnU-Net does, and train at it); planning only.
    """
    from dynamic_network_architectures.architectures.unet import PlainConvUNet

    topology = _explicit_topology(
        "nnunet", spatial_dims, n_stages, strides, kernel_sizes, features_per_stage, patch_size
    )
    return _build_network(
        PlainConvUNet, spatial_dims, in_channels, out_channels, topology, n_conv_per_stage,
        n_conv_per_stage_decoder, deep_supervision,
    )


def build_resenc(
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    *,
    patch_size: Sequence[int] = (128, 128, 128),
    n_stages: int | str = AUTO,
    strides: Sequence[Any] | str = AUTO,
    kernel_sizes: Sequence[Any] | str = AUTO,
    features_per_stage: Sequence[int] | str = AUTO,
    n_blocks_per_stage: Sequence[int] | str = AUTO,
    n_conv_per_stage_decoder: int = 1,
    deep_supervision: bool = True,
    gpu_memory_gb: float | None = None,
    preset: str = "L",
    target_spacing: str = "recipe",
) -> nn.Module:
    """Build nnU-Net's ResidualEncoderUNet (ResEnc) from an explicit topology.

    Args:
        spatial_dims: 3 for CT volumes.
        in_channels: image channels.
        out_channels: background + classes.
        patch_size: the training patch (checked against the strides).
        n_stages: resolution stages, the first at full resolution.
        strides: per stage, an int or one stride per axis (the first is 1).
        kernel_sizes: per stage, an int or one kernel size per axis.
        features_per_stage: channels per stage.
        n_blocks_per_stage: residual blocks per encoder stage; ``auto``: the ResEnc preset
            (1, 3, 4, 6, 6, 6, 6, ...) cut to ``n_stages``.
        n_conv_per_stage_decoder: convolutions per decoder stage.
        deep_supervision: a segmentation head per decoder stage in train mode.
        gpu_memory_gb: the memory the planner fits the patch to; ``None``: the preset's (M 8,
            L 24, XL 40); used only when the topology is ``auto``.
        preset: ``M``, ``L`` or ``XL``: nnU-Net's ResEnc planner whose feature-map calibration and
            memory target the planner uses (planning only; the network is the same).
        target_spacing: ``recipe`` or ``median`` (see :func:`build_nnunet`); planning only.
    """
    from dynamic_network_architectures.architectures.unet import ResidualEncoderUNet

    topology = _explicit_topology(
        "resenc", spatial_dims, n_stages, strides, kernel_sizes, features_per_stage, patch_size
    )
    return _build_network(
        ResidualEncoderUNet, spatial_dims, in_channels, out_channels, topology,
        resenc_blocks(topology["n_stages"], n_blocks_per_stage), n_conv_per_stage_decoder, deep_supervision,
    )


def _build_network(
    network_class: type[nn.Module],
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    topology: dict,
    encoder_depth: int | list[int],
    n_conv_per_stage_decoder: int,
    deep_supervision: bool,
) -> nn.Module:
    """One of dynamic_network_architectures' U-Nets with nnU-Net's layers and initialization.

    ``encoder_depth`` is what the class takes per encoder stage: convolutions (PlainConvUNet) or
    residual blocks (ResidualEncoderUNet).
    """
    network = network_class(
        in_channels,
        topology["n_stages"],
        topology["features_per_stage"],
        _conv_op(spatial_dims),
        topology["kernel_sizes"],
        topology["strides"],
        encoder_depth,
        out_channels,
        n_conv_per_stage_decoder,
        deep_supervision=deep_supervision,
        **_nnunet_layers(spatial_dims),
    )
    network.apply(network.initialize)
    return DeepSupervisionOutput(network, _set_decoder_deep_supervision) if deep_supervision else network


def resenc_blocks(n_stages: int, n_blocks_per_stage: Sequence[int] | str = AUTO) -> list[int]:
    """Residual blocks per encoder stage: the ResEnc preset for ``auto``, else the given list."""
    if n_blocks_per_stage == AUTO:
        return [RESENC_BLOCKS[min(i, len(RESENC_BLOCKS) - 1)] for i in range(n_stages)]
    blocks = [int(b) for b in n_blocks_per_stage]
    if len(blocks) != n_stages:
        raise ValueError(f"resenc: n_blocks_per_stage {blocks} needs one entry per stage ({n_stages})")
    return blocks


def _conv_op(spatial_dims: int) -> type[nn.Module]:
    if spatial_dims not in (2, 3):
        raise ValueError(f"nnU-Net networks are 2D or 3D, got spatial_dims={spatial_dims}")
    return nn.Conv3d if spatial_dims == 3 else nn.Conv2d


def _nnunet_layers(spatial_dims: int) -> dict:
    """nnU-Net's layer choices (the same for both networks)."""
    return dict(
        conv_bias=True,
        norm_op=nn.InstanceNorm3d if spatial_dims == 3 else nn.InstanceNorm2d,
        norm_op_kwargs={"eps": 1e-5, "affine": True},
        nonlin=nn.LeakyReLU,
        nonlin_kwargs={"inplace": True},
    )


def _set_decoder_deep_supervision(network: nn.Module, enabled: bool) -> None:
    # dynamic_network_architectures returns a list whenever this flag is on, whatever the mode;
    # switching it off in eval mode also skips the coarse heads.
    network.decoder.deep_supervision = enabled


# ----------------------------------------------------------------------------------------------
# Shape rules


def is_planned(options: dict) -> bool:
    """True when the topology options are ``auto`` (to be planned from the cohort)."""
    return any(options.get(key, AUTO) == AUTO for key in TOPOLOGY_OPTIONS)


def check_nnunet_options(options: dict, patch_size: tuple[int, ...]) -> None:
    """Shape rules for nnunet/resenc, checked at recipe load (options with the builder's defaults)."""
    if "preset" in options and str(options["preset"]).upper() not in RESENC_PRESETS:
        raise ValueError(f"resenc preset must be one of {', '.join(RESENC_PRESETS)}, got {options['preset']!r}")
    if options.get("target_spacing", "recipe") not in TARGET_SPACINGS:
        raise ValueError(
            f"target_spacing must be one of {', '.join(TARGET_SPACINGS)}, got {options.get('target_spacing')!r}"
        )
    values = [options.get(key, AUTO) for key in TOPOLOGY_OPTIONS]
    planned = [key for key, value in zip(TOPOLOGY_OPTIONS, values) if value == AUTO]
    if planned and len(planned) != len(TOPOLOGY_OPTIONS):
        given = [key for key in TOPOLOGY_OPTIONS if key not in planned]
        raise ValueError(
            f"nnU-Net topology options are planned together: {', '.join(given)} given but "
            f"{', '.join(planned)} 'auto'; set all of {', '.join(TOPOLOGY_OPTIONS)} or none"
        )
    if planned:
        return
    topology = normalize_topology(len(patch_size), *values)
    if "n_blocks_per_stage" in options:
        resenc_blocks(topology["n_stages"], options["n_blocks_per_stage"])
    divisors = shape_divisors(topology["strides"])
    bad = [(axis, int(p), d) for axis, (p, d) in enumerate(zip(patch_size, divisors)) if int(p) % d]
    if bad:
        details = ", ".join(f"axis {axis}: {p} not divisible by {d}" for axis, p, d in bad)
        raise ValueError(
            f"the strides {topology['strides']} need each patch dimension divisible by its total stride "
            f"{divisors}; data.patch_size is {list(patch_size)} ({details})"
        )


def normalize_topology(
    spatial_dims: int,
    n_stages: int,
    strides: Sequence[Any],
    kernel_sizes: Sequence[Any],
    features_per_stage: Sequence[int],
) -> dict:
    """Check an explicit topology and give every stride and kernel as one value per axis."""
    n_stages = int(n_stages)

    def per_axis(name: str, entries: Sequence[Any]) -> list[list[int]]:
        entries = list(entries)
        if len(entries) != n_stages:
            raise ValueError(f"{name} has {len(entries)} entries but n_stages is {n_stages}: {entries}")
        out = []
        for entry in entries:
            axes = [int(entry)] * spatial_dims if isinstance(entry, (int, np.integer)) else [int(v) for v in entry]
            if len(axes) != spatial_dims or min(axes) < 1:
                raise ValueError(f"{name}: each entry needs {spatial_dims} positive values, got {entry}")
            out.append(axes)
        return out

    if n_stages < 2:
        raise ValueError(f"n_stages must be at least 2, got {n_stages}")
    strides = per_axis("strides", strides)
    if any(s != 1 for s in strides[0]):
        raise ValueError(f"the first stage works at full resolution: strides[0] must be 1, got {strides[0]}")
    kernel_sizes = per_axis("kernel_sizes", kernel_sizes)
    features = [int(f) for f in features_per_stage]
    if len(features) != n_stages:
        raise ValueError(f"features_per_stage has {len(features)} entries but n_stages is {n_stages}: {features}")
    return dict(n_stages=n_stages, strides=strides, kernel_sizes=kernel_sizes, features_per_stage=features)


def _explicit_topology(name, spatial_dims, n_stages, strides, kernel_sizes, features_per_stage, patch_size) -> dict:
    values = (n_stages, strides, kernel_sizes, features_per_stage)
    if any(value == AUTO for value in values):
        raise ValueError(
            f"{name}: the topology is 'auto' and has not been planned; call "
            "lightning_modules.models.planning.resolve_planned_recipe(recipe) first (benchx train does), "
            "or give n_stages, strides, kernel_sizes and features_per_stage"
        )
    options = dict(zip(TOPOLOGY_OPTIONS, values))
    check_nnunet_options(options, tuple(int(p) for p in patch_size))
    return normalize_topology(spatial_dims, *values)
