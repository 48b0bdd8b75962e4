"""The backbone registry: one builder per architecture, one signature, one hand-written dict.

Every builder is ``build_x(spatial_dims, in_channels, out_channels, *, patch_size, **options)`` and
returns an ``nn.Module`` that maps ``(B, in_channels, *patch)`` to logits ``(B, out_channels, *patch)``.
Conventions every backbone keeps (the SegmentationModule relies on them):

- ``output="softmax"``: channel 0 is background, channel k is class k (mutually exclusive labels).
  ``output="sigmoid"`` (Universal Model): one independent channel per class, no background channel;
  such a builder is called with ``out_channels = number of classes + 1`` like the others and
  returns ``out_channels - 1`` channels.
- Deep supervision: in training mode a backbone with ``deep_supervision=True`` may return a list
  of tensors, full resolution first then coarser scales; in eval mode it always returns one tensor.
- ``divisor``: every patch dimension must be divisible by it (checked at recipe load).

Example::

    net = build_backbone("unet", in_channels=1, out_channels=3, patch_size=(32, 32, 32), channels=[8, 16, 32, 64])
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

from torch import nn

from lightning_modules.backbones.unet import build_unet


@dataclass(frozen=True)
class BackboneSpec:
    """How to build one backbone and what its outputs mean."""

    builder: Callable[..., nn.Module]
    output: str = "softmax"  # softmax | sigmoid
    deep_supervision: bool = False
    # Each patch dimension must be divisible by this (may depend on options: see `divisor_for`).
    divisor: int | Callable[[dict], int] = 1
    description: str = ""

    def divisor_for(self, options: dict) -> int:
        return self.divisor(options) if callable(self.divisor) else int(self.divisor)


BACKBONES: dict[str, BackboneSpec] = {
    "unet": BackboneSpec(
        build_unet,
        divisor=lambda o: 2 ** len(o.get("strides", (2, 2, 2, 2))),
        description="MONAI UNet (Ronneberger et al. 2015; Kerfoot et al. residual units)",
    ),
}


def get_backbone(name: str) -> BackboneSpec:
    if name not in BACKBONES:
        raise KeyError(f"unknown backbone {name!r}; available: {', '.join(sorted(BACKBONES))}")
    return BACKBONES[name]


def check_backbone_config(
    name: str,
    options: dict,
    patch_size: Sequence[int],
    in_channels: int = 1,
    out_channels: int = 3,
    spatial_dims: int = 3,
) -> inspect.BoundArguments:
    """Bind the options to the builder's signature and check the shape rules, without building weights."""
    spec = get_backbone(name)
    signature = inspect.signature(spec.builder)
    try:
        bound = signature.bind(spatial_dims, in_channels, out_channels, patch_size=tuple(patch_size), **options)
    except TypeError as error:
        accepted = [p for p in signature.parameters if p not in ("spatial_dims", "in_channels", "out_channels")]
        raise TypeError(f"backbone {name!r}: {error}; accepted options: {', '.join(accepted)}") from None
    divisor = spec.divisor_for(options)
    bad = [p for p in patch_size if int(p) % divisor]
    if bad:
        raise ValueError(
            f"backbone {name!r} needs every patch dimension divisible by {divisor}; data.patch_size is {list(patch_size)}"
        )
    return bound


def build_backbone(
    name: str,
    in_channels: int,
    out_channels: int,
    patch_size: Sequence[int],
    spatial_dims: int = 3,
    **options,
) -> nn.Module:
    """Build a registered backbone after checking its options and shape rules."""
    check_backbone_config(name, options, patch_size, in_channels, out_channels, spatial_dims)
    return get_backbone(name).builder(spatial_dims, in_channels, out_channels, patch_size=tuple(patch_size), **options)
