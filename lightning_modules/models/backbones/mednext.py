"""MedNeXt (Roy et al., MICCAI 2023) size L, kernel 3, as the reference builds it (MIC-DKFZ/MedNeXt,
``create_mednextv1_large``, Apache-2.0), from MONAI's blocks (``monai.networks.nets.MedNeXt``).

A ConvNeXt-style U-Net. The defaults are MedNeXt-L (init filters 32, expansion ratios
(3, 4, 8, 8) / 8 / (8, 8, 4, 3), blocks (3, 4, 8, 8) / 8 / (8, 8, 4, 3), residual connections in the
blocks and around the up/down blocks, group norm), with kernel 3 and deep supervision as in
Touchstone: 61.78 M parameters with 1 input and 3 output channels, as the reference.

Deliberate differences from MONAI's ``MedNeXt`` and from the reference:

- Down block i (stage i -> i + 1) expands by stage i + 1's ratio (the bottleneck's for the last),
  as the reference does; MONAI's port uses stage i's, which makes size L's down blocks narrower
  (61.73 M). :func:`build_mednext` replaces MONAI's down blocks with MONAI ``MedNeXtDownBlock``\ s
  of the reference's ratio, so the state-dict layout stays MONAI's.
- The reference's ``dummy_tensor`` parameter (a work-around for gradient checkpointing, unused in
  the forward pass) is not built: a never-used parameter breaks DistributedDataParallel.
- MONAI also computes the deep-supervision heads in eval mode and drops them; the outputs are the same.

The reference's state dict (minus ``dummy_tensor``) loads after renaming keys with
:func:`~lightning_modules.models.backbones.reference_keys.mednext_key`; ``tests/models/test_reference_outputs.py`` checks the outputs against the
reference's.

Deep supervision: MONAI returns a tuple (full, 1/2, 1/4, 1/8, 1/16 resolution) in train mode and one
tensor in eval mode; :class:`~lightning_modules.models.backbones.deep_supervision.DeepSupervisionOutput`
turns the tuple into the registry's list.

Shape rules: each encoder stage halves the volume, so every patch dimension must be divisible by
``2 ** len(blocks_down)`` (16 for size L); the encoder and decoder need as many stages each, and the
expansion ratios, when given per stage, one entry per stage.

Example::

    net = build_mednext(3, 1, 3, patch_size=(32, 32, 32), init_filters=8, blocks_down=(1, 1, 1, 1),
                        blocks_bottleneck=1, blocks_up=(1, 1, 1, 1))
"""

from __future__ import annotations

from typing import Sequence

from monai.networks.blocks.mednext_block import MedNeXtDownBlock
from monai.networks.nets import MedNeXt
from torch import nn

from lightning_modules.models.backbones.deep_supervision import DeepSupervisionOutput


def build_mednext(
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    *,
    patch_size: Sequence[int] = (128, 128, 128),
    init_filters: int = 32,
    kernel_size: int = 3,
    encoder_expansion_ratio: Sequence[int] | int = (3, 4, 8, 8),
    decoder_expansion_ratio: Sequence[int] | int = (8, 8, 4, 3),
    bottleneck_expansion_ratio: int = 8,
    blocks_down: Sequence[int] = (3, 4, 8, 8),
    blocks_bottleneck: int = 8,
    blocks_up: Sequence[int] = (8, 8, 4, 3),
    use_residual_connection: bool = True,
    norm_type: str = "group",
    deep_supervision: bool = True,
) -> nn.Module:
    """Build MedNeXt as the reference (defaults: size L, kernel 3, deep supervision) from MONAI's blocks.

    Deliberate differences from the reference and from MONAI's port: listed in the module docstring
    (down-block expansion ratios as the reference, no ``dummy_tensor``).

    Args:
        spatial_dims: 3 for CT volumes.
        in_channels: image channels.
        out_channels: background + classes.
        patch_size: the training patch (checked against the shape rules).
        init_filters: width of the first stage; stage i has ``init_filters * 2**i`` channels.
        kernel_size: depthwise convolution kernel (3 in Touchstone; MedNeXt also trains 5 by UpKern).
        encoder_expansion_ratio: inverted-bottleneck expansion per encoder stage.
        decoder_expansion_ratio: expansion per decoder stage.
        bottleneck_expansion_ratio: expansion in the bottleneck.
        blocks_down: MedNeXt blocks per encoder stage.
        blocks_bottleneck: blocks in the bottleneck.
        blocks_up: blocks per decoder stage.
        use_residual_connection: residual connections in the blocks (on in every published size).
        norm_type: ``group`` or ``layer``.
        deep_supervision: heads at 1/2 ... 1/16 resolution in train mode.

    Note: returns the network wrapped in :class:`DeepSupervisionOutput` when ``deep_supervision``
    (its MedNeXt is ``.network``).
    """
    options = dict(
        encoder_expansion_ratio=encoder_expansion_ratio,
        decoder_expansion_ratio=decoder_expansion_ratio,
        blocks_down=blocks_down,
        blocks_up=blocks_up,
    )
    check_mednext_options(options, tuple(patch_size))
    network = MedNeXt(
        spatial_dims=spatial_dims,
        init_filters=init_filters,
        in_channels=in_channels,
        out_channels=out_channels,
        encoder_expansion_ratio=_as_tuple(encoder_expansion_ratio),
        decoder_expansion_ratio=_as_tuple(decoder_expansion_ratio),
        bottleneck_expansion_ratio=bottleneck_expansion_ratio,
        kernel_size=kernel_size,
        deep_supervision=deep_supervision,
        use_residual_connection=use_residual_connection,
        blocks_down=tuple(blocks_down),
        blocks_bottleneck=blocks_bottleneck,
        blocks_up=tuple(blocks_up),
        norm_type=norm_type,
    )
    _use_reference_down_ratios(network, init_filters, kernel_size, encoder_expansion_ratio,
                               bottleneck_expansion_ratio, len(blocks_down), use_residual_connection, norm_type)
    return DeepSupervisionOutput(network) if deep_supervision else network


def _use_reference_down_ratios(
    network: MedNeXt,
    init_filters: int,
    kernel_size: int,
    encoder_expansion_ratio: Sequence[int] | int,
    bottleneck_expansion_ratio: int,
    n_stages: int,
    use_residual_connection: bool,
    norm_type: str,
) -> None:
    """Rebuild down block i with stage i + 1's expansion ratio (the bottleneck's for the last), as the reference."""
    encoder = [encoder_expansion_ratio] * n_stages if isinstance(encoder_expansion_ratio, int) else list(encoder_expansion_ratio)
    next_stage_ratio = [*encoder[1:], bottleneck_expansion_ratio]
    network.down_blocks = nn.ModuleList(
        MedNeXtDownBlock(
            in_channels=init_filters * 2**i,
            out_channels=init_filters * 2 ** (i + 1),
            expansion_ratio=int(next_stage_ratio[i]),
            kernel_size=kernel_size,
            use_residual_connection=use_residual_connection,
            norm_type=norm_type,
            dim="3d",
        )
        for i in range(n_stages)
    )


def mednext_divisor(options: dict) -> int:
    """Every patch dimension must be divisible by this: one halving per encoder stage."""
    return 2 ** len(options.get("blocks_down", (3, 4, 8, 8)))


def check_mednext_options(options: dict, patch_size: tuple[int, ...]) -> None:
    """Stage-count rules of MedNeXt, checked at recipe load (the divisor is checked by the registry)."""
    blocks_down, blocks_up = list(options["blocks_down"]), list(options["blocks_up"])
    if len(blocks_down) != len(blocks_up):
        raise ValueError(
            f"mednext: blocks_down {blocks_down} and blocks_up {blocks_up} need the same number of stages"
        )
    divisor = 2 ** len(blocks_down)
    bad = [int(p) for p in patch_size if int(p) % divisor]
    if bad:
        raise ValueError(
            f"mednext halves the volume in each of its {len(blocks_down)} encoder stages: every patch dimension "
            f"must be divisible by {divisor}; data.patch_size is {list(patch_size)}"
        )
    for key, stages in (("encoder_expansion_ratio", blocks_down), ("decoder_expansion_ratio", blocks_up)):
        ratio = options[key]
        if not isinstance(ratio, int) and len(list(ratio)) != len(stages):
            raise ValueError(f"mednext: {key} {list(ratio)} needs one entry per stage ({len(stages)})")


def _as_tuple(value: Sequence[int] | int) -> tuple[int, ...] | int:
    return value if isinstance(value, int) else tuple(int(v) for v in value)
