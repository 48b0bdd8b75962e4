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
- ``check``: further rules on the options and the patch (per-axis strides, widths divisible by
  heads, ...), called at recipe load with the builder's defaults filled in; raises ValueError.

Example::

    net = build_backbone("unet", in_channels=1, out_channels=3, patch_size=(32, 32, 32), channels=[8, 16, 32, 64])
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

from omegaconf import OmegaConf
from torch import nn

from lightning_modules.config.recipe import DataConfig, ModelConfig, RecipeError, TrainerConfig
from lightning_modules.models.backbones.mednext import build_mednext, check_mednext_options, mednext_divisor
from lightning_modules.models.backbones.nnunet import build_nnunet, build_resenc, check_nnunet_options
from lightning_modules.models.backbones.swin_unetr import (
    SWIN_DIVISOR,
    pretrained_tags,
    build_swin_unetr_base,
    build_swin_unetr_small,
    build_swin_unetr_tiny,
    check_swin_unetr_options,
)
from lightning_modules.models.backbones.stunet import build_stunet, check_stunet_options, stunet_divisor
from lightning_modules.models.backbones.unet import build_unet
from lightning_modules.models.backbones.unetr import UNETR_TOKEN_SIZE, build_unetr, check_unetr_options
from lightning_modules.models.backbones.universal_model import (
    build_universal_model_a,
    build_universal_model_b,
    check_universal_model_options,
    class_embedding_tags,
    universal_model_divisor,
)
from lightning_modules.models.backbones.vsmtrans import build_vsmtrans, check_vsmtrans_options, vsmtrans_divisor


@dataclass(frozen=True)
class BackboneSpec:
    """How to build one backbone and what its outputs mean."""

    builder: Callable[..., nn.Module]
    output: str = "softmax"  # softmax | sigmoid
    deep_supervision: bool = False
    # Each patch dimension must be divisible by this (may depend on options: see `divisor_for`).
    divisor: int | Callable[[dict], int] = 1
    description: str = ""
    # Further shape/option rules: check(options with defaults, patch_size) raises ValueError.
    check: Callable[[dict, tuple[int, ...]], None] | None = None
    # Run tags for user-supplied inputs (pre-trained weights, class embeddings): tags(options) -> dict.
    tags: Callable[[dict], dict[str, str]] | None = None

    def divisor_for(self, options: dict) -> int:
        return self.divisor(options) if callable(self.divisor) else int(self.divisor)


BACKBONES: dict[str, BackboneSpec] = {
    "unet": BackboneSpec(
        build_unet,
        divisor=lambda o: 2 ** len(o.get("strides", (2, 2, 2))),
        description="MONAI UNet (Ronneberger et al. 2015; Kerfoot et al. residual units)",
    ),
    "unetr": BackboneSpec(
        build_unetr,
        divisor=UNETR_TOKEN_SIZE,
        check=check_unetr_options,
        description="MONAI UNETR (Hatamizadeh et al. 2022): ViT encoder, img_size = patch",
    ),
    "swin_unetr_tiny": BackboneSpec(
        build_swin_unetr_tiny,
        divisor=SWIN_DIVISOR,
        check=check_swin_unetr_options,
        tags=pretrained_tags,
        description="MONAI SwinUNETR (Tang et al. 2022), feature size 12",
    ),
    "swin_unetr_small": BackboneSpec(
        build_swin_unetr_small,
        divisor=SWIN_DIVISOR,
        check=check_swin_unetr_options,
        tags=pretrained_tags,
        description="MONAI SwinUNETR (Tang et al. 2022), feature size 24",
    ),
    "swin_unetr_base": BackboneSpec(
        build_swin_unetr_base,
        divisor=SWIN_DIVISOR,
        check=check_swin_unetr_options,
        tags=pretrained_tags,
        description="MONAI SwinUNETR (Tang et al. 2022), feature size 48",
    ),
    "nnunet": BackboneSpec(
        build_nnunet,
        deep_supervision=True,
        check=check_nnunet_options,
        description="nnU-Net PlainConvUNet (Isensee et al. 2021), planned topology (per-axis strides)",
    ),
    "resenc": BackboneSpec(
        build_resenc,
        deep_supervision=True,
        check=check_nnunet_options,
        description="nnU-Net ResEnc L (Isensee et al. 2024), planned topology (per-axis strides)",
    ),
    "mednext": BackboneSpec(
        build_mednext,
        deep_supervision=True,
        divisor=mednext_divisor,
        check=check_mednext_options,
        description="MONAI MedNeXt-L (Roy et al. 2023), kernel 3",
    ),
    "universal_model_a": BackboneSpec(
        build_universal_model_a,
        output="sigmoid",
        divisor=lambda o: universal_model_divisor(o, default_backbone="unet3d"),
        check=check_universal_model_options,
        tags=class_embedding_tags,
        description="CLIP-Driven Universal Model (Liu et al. 2023), Models Genesis 3D U-Net backbone",
    ),
    "universal_model_b": BackboneSpec(
        build_universal_model_b,
        output="sigmoid",
        divisor=lambda o: universal_model_divisor(o, default_backbone="swin"),
        check=check_universal_model_options,
        tags=class_embedding_tags,
        description="CLIP-Driven Universal Model (Liu et al. 2023), SwinUNETR (feature size 48) backbone",
    ),
    "stunet_b": BackboneSpec(
        build_stunet,
        deep_supervision=True,
        divisor=stunet_divisor,
        check=check_stunet_options,
        description="STU-Net-B (Huang et al. 2023): residual nnU-Net, nearest + 1x1x1 upsampling",
    ),
    "vsmtrans": BackboneSpec(
        build_vsmtrans,
        deep_supervision=True,
        divisor=vsmtrans_divisor,
        check=check_vsmtrans_options,
        description="VSmTrans (Liu et al. 2024): variable-shape window attention + parallel convolution",
    ),
}


def get_backbone(name: str) -> BackboneSpec:
    if name not in BACKBONES:
        raise KeyError(f"unknown backbone {name!r}; available: {', '.join(sorted(BACKBONES))}")
    return BACKBONES[name]


def backbone_tags(name: str, options: dict) -> dict[str, str]:
    """Run tags recording the user-supplied inputs of a backbone (pre-trained weights, class embeddings)."""
    spec = get_backbone(name)
    return spec.tags(dict(options)) if spec.tags is not None else {}


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
    if spec.check is not None:
        with_defaults = signature.bind(spatial_dims, in_channels, out_channels, patch_size=tuple(patch_size), **options)
        with_defaults.apply_defaults()
        positional = ("spatial_dims", "in_channels", "out_channels", "patch_size")
        spec.check(
            {k: v for k, v in with_defaults.arguments.items() if k not in positional},
            tuple(int(p) for p in patch_size),
        )
    return bound


def check_channel_widths(backbone: str, options: dict, source: str = "recipe") -> None:
    """``model.options.channels`` (the width of each level): at least two widths, each an integer >= 1,
    and for a builder with ``strides`` one stride fewer than widths."""
    if "channels" not in options:
        return
    channels = options["channels"]
    widths = list(channels) if isinstance(channels, (list, tuple)) else None
    if not widths or len(widths) < 2 or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths):
        raise RecipeError(f"{source}: model.options.channels must list at least 2 level widths, each an integer >= 1, "
                          f"got {channels!r}")
    try:
        parameters = inspect.signature(get_backbone(backbone).builder).parameters
    except KeyError:
        return  # an unknown backbone is named by check_backbone_config
    if "strides" in parameters:
        strides = options.get("strides", parameters["strides"].default)
        if len(list(strides)) != len(widths) - 1:
            raise RecipeError(f"{source}: model.options.strides needs one stride fewer than model.options.channels "
                              f"({len(widths) - 1} for {widths}), got {list(strides)}")


def check_model_section(model: ModelConfig, data: DataConfig, trainer: TrainerConfig, source: str = "recipe") -> None:
    """The recipe's backbone and its options (``model``) against the builder's signature and shape
    rules, at the training patch (``data.patch_size``) and at the sliding window (``trainer.sw_roi_size``).

    Raises:
        RecipeError: naming ``source`` and what is wrong.
    """
    options = dict(OmegaConf.to_container(model.options, resolve=True))
    check_channel_widths(model.backbone, options, source)
    sizes = [("data.patch_size", data.patch_size)]
    if len(trainer.sw_roi_size):
        sizes.append(("trainer.sw_roi_size", trainer.sw_roi_size))
    for key, size in sizes:
        try:
            check_backbone_config(model.backbone, options, patch_size=tuple(int(p) for p in size), in_channels=1,
                                  out_channels=len(data.classes) + 1)
        except (TypeError, ValueError, KeyError) as error:
            raise RecipeError(f"{source}: model: {str(error).replace('data.patch_size', key)}") from error


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
