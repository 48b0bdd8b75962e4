"""CLIP-Driven Universal Model (Liu et al., ICCV 2023, "CLIP-Driven Universal Model for Organ
Segmentation and Tumor Detection"), written from the paper.

The model segments each class with its own tiny convolutional head whose weights are generated
from the image and a class embedding:

1. Text branch: one embedding per class. The paper uses frozen CLIP text embeddings of prompts
   such as "A computerized tomography of a [CLS]"; CLIP cannot be downloaded here, so the
   embeddings are learned by default (one row per class, ``text_dim`` wide) or loaded from a file
   of precomputed embeddings (``text_embeddings_path``: ``.npy``, or a tensor saved with
   ``torch.save``, shape ``(n_classes, d)``, rows in the order of the recipe's ``data.classes``),
   then kept frozen as in the paper.
2. Vision encoder-decoder: ``backbone="unet3d"`` (variant a: the Models Genesis 3D U-Net, four
   levels, two 3x3x3 convolutions per level, widths 32-64 / 64-128 / 128-256 / 256-512, 19.07 M
   parameters) or ``backbone="swin"`` (variant b: MONAI's SwinUNETR with feature size 48 and
   its output layer removed, 62.19 M parameters).
3. Text-based controller: the global image feature f (global average pooling of the bottleneck)
   is concatenated with each class embedding w_k, and one linear layer maps [f, w_k] to the
   parameters theta_k of class k's head.
4. Text-driven segmentor: three 1x1x1 convolutions with 8, 8 and 1 output channels (ReLU between
   them) run with theta_k on the decoder's last feature map, which is first brought to 8 channels
   (group norm, ReLU, 1x1x1 convolution: the paper's heads take 8 channels); the output is one
   logit map per class, read with a sigmoid (classes are not mutually exclusive).

Full size, 1 input channel, 2 classes (pancreas, pancreatic lesion): variant a 19.23 M parameters,
variant b 62.38 M (backbone plus projection, controller and learned embeddings).

Shape rules: variant a pools three times, so every patch dimension must be divisible by 8; variant
b follows SwinUNETR (patch embedding 2, four merges) and needs multiples of 32, and with instance
normalization its bottleneck (patch / 32) must keep 2 voxels per axis, so at least 64 (the CPU
profile uses group normalization to run on 32^3 patches).

Output: ``out_channels - 1`` logit channels, one per class, no background (``output="sigmoid"``).

Example::

    net = build_universal_model(3, 1, 3, patch_size=(96, 96, 96), backbone="unet3d")
    net = build_universal_model(3, 1, 3, patch_size=(96, 96, 96), backbone="swin",
                                text_embeddings_path="clip_embeddings.npy")
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from monai.networks.blocks import Convolution
from monai.networks.nets import SwinUNETR
from torch import nn

# The paper's segmentor: three 1x1x1 convolutions with 8, 8 and 1 output channels.
HEAD_CHANNELS = 8
CLIP_TEXT_DIM = 512  # width of CLIP ViT-B text embeddings, the paper's text encoder


def dynamic_head_param_count(head_channels: int = HEAD_CHANNELS) -> int:
    """Parameters of one class's head: two (c x c) layers and one (1 x c) layer, each with bias."""
    return 2 * (head_channels * head_channels + head_channels) + (head_channels + 1)


class ModelsGenesisUNet3D(nn.Module):
    """The 3D U-Net of Models Genesis (Zhou et al. 2019), after Cicek et al. 2016, without output layer.

    Each encoder level runs two 3x3x3 convolutions (the second doubles the width) and max-pools
    (all but the last level); each decoder level upsamples with a 2x2x2 transposed convolution
    that keeps the width, concatenates the skip and runs two 3x3x3 convolutions.

    Args:
        spatial_dims: 3 for volumes.
        in_channels: input channels.
        channels: width at the end of each level (64, 128, 256, 512 in the paper).
        norm: MONAI norm name (Models Genesis: batch).
        act: MONAI activation name (Models Genesis: relu).
    """

    def __init__(
        self, spatial_dims: int, in_channels: int, channels: Sequence[int], norm: str | tuple, act: str
    ) -> None:
        super().__init__()

        def conv(cin: int, cout: int) -> Convolution:
            return Convolution(spatial_dims, cin, cout, kernel_size=3, norm=norm, act=act)

        self.encoder = nn.ModuleList()
        previous = in_channels
        for width in channels:
            self.encoder.append(nn.Sequential(conv(previous, width // 2), conv(width // 2, width)))
            previous = width
        self.pool = nn.MaxPool3d(2)
        self.upsamplers = nn.ModuleList()
        self.decoder = nn.ModuleList()
        for level in reversed(range(len(channels) - 1)):
            deeper = channels[level + 1]
            self.upsamplers.append(
                Convolution(
                    spatial_dims, deeper, deeper, strides=2, kernel_size=2, padding=0, output_padding=0,
                    is_transposed=True, conv_only=True,
                )
            )
            width = channels[level]
            self.decoder.append(nn.Sequential(conv(deeper + width, width), conv(width, width)))
        self.out_channels = channels[0]
        self.bottleneck_channels = channels[-1]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        skips = []
        for index, level in enumerate(self.encoder):
            x = level(x)
            if index < len(self.encoder) - 1:
                skips.append(x)
                x = self.pool(x)
        bottleneck = x
        for upsample, level in zip(self.upsamplers, self.decoder):
            x = level(torch.cat([upsample(x), skips.pop()], dim=1))
        return x, bottleneck


class SwinUNETRFeatures(nn.Module):
    """MONAI's SwinUNETR without its output layer: returns the last decoder features and the bottleneck.

    Args:
        spatial_dims: 3 for volumes.
        in_channels: input channels.
        feature_size: SwinUNETR's feature size (48 in the Universal Model).
        depths: Swin blocks per stage (2, 2, 2, 2).
        norm: norm of the convolutional blocks (SwinUNETR: instance).
    """

    def __init__(
        self, spatial_dims: int, in_channels: int, feature_size: int, depths: Sequence[int], norm: str | tuple
    ) -> None:
        super().__init__()
        self.net = SwinUNETR(
            in_channels=in_channels,
            out_channels=1,
            feature_size=feature_size,
            depths=tuple(depths),
            norm_name=norm,
            spatial_dims=spatial_dims,
        )
        # The class heads replace the output layer; an unused layer would also break DDP.
        self.net.out = nn.Identity()
        self.out_channels = feature_size
        self.bottleneck_channels = 16 * feature_size

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # SwinUNETR.forward's wiring, kept so that the bottleneck (encoder10's output) is exposed.
        net = self.net
        hidden = net.swinViT(x, net.normalize)
        enc0 = net.encoder1(x)
        enc1 = net.encoder2(hidden[0])
        enc2 = net.encoder3(hidden[1])
        enc3 = net.encoder4(hidden[2])
        bottleneck = net.encoder10(hidden[4])
        dec3 = net.decoder5(bottleneck, hidden[3])
        dec2 = net.decoder4(dec3, enc3)
        dec1 = net.decoder3(dec2, enc2)
        dec0 = net.decoder2(dec1, enc1)
        return net.decoder1(dec0, enc0), bottleneck


def load_text_embeddings(path: str | Path, n_classes: int) -> torch.Tensor:
    """Read precomputed class embeddings ``(n_classes, d)`` from ``.npy`` or a ``torch.save`` file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Universal Model: text_embeddings_path {path} does not exist")
    try:
        if path.suffix == ".npy":
            array = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            array = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # any unreadable file gets the same clear message
        raise ValueError(f"Universal Model: cannot read text embeddings from {path}: {error}") from error
    if not isinstance(array, torch.Tensor):
        raise ValueError(
            f"Universal Model: {path} holds a {type(array).__name__}, expected one tensor of shape ({n_classes}, d)"
        )
    if array.ndim != 2 or array.shape[0] != n_classes or array.shape[1] < 1:
        raise ValueError(
            f"Universal Model: {path} holds embeddings of shape {tuple(array.shape)}, expected ({n_classes}, d): "
            f"one row per class (out_channels - 1 = {n_classes}, in the order of data.classes)"
        )
    if not torch.is_floating_point(array) or not torch.isfinite(array).all():
        raise ValueError(f"Universal Model: {path} must hold finite floating-point embeddings (dtype {array.dtype})")
    return array.float()


class UniversalModel(nn.Module):
    """Encoder-decoder + class embeddings + controller + per-class dynamic heads (sigmoid outputs).

    Args:
        backbone: the encoder-decoder, returning ``(decoder_features, bottleneck)``.
        n_classes: number of classes (output channels).
        text_dim: width of learned class embeddings (ignored when ``text_embeddings`` is given).
        text_embeddings: frozen precomputed embeddings ``(n_classes, d)``, or None to learn them.
        head_channels: width of the dynamic heads (8 in the paper).
    """

    def __init__(
        self,
        backbone: nn.Module,
        n_classes: int,
        text_dim: int = CLIP_TEXT_DIM,
        text_embeddings: torch.Tensor | None = None,
        head_channels: int = HEAD_CHANNELS,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.n_classes = n_classes
        self.head_channels = head_channels
        if text_embeddings is None:
            # N(0, 1) like nn.Embedding, so classes differ from the first step.
            self.class_embeddings = nn.Parameter(torch.randn(n_classes, text_dim))
        else:
            self.register_buffer("class_embeddings", text_embeddings.clone())
        text_dim = self.class_embeddings.shape[1]
        groups = math.gcd(16, backbone.out_channels)
        self.head_input = nn.Sequential(
            nn.GroupNorm(groups, backbone.out_channels),
            nn.ReLU(inplace=True),
            nn.Conv3d(backbone.out_channels, head_channels, kernel_size=1),
        )
        self.params_per_class = dynamic_head_param_count(head_channels)
        self.controller = nn.Linear(backbone.bottleneck_channels + text_dim, self.params_per_class)

    def class_parameters(self, bottleneck: torch.Tensor) -> torch.Tensor:
        """theta_k for every image and class: ``(B, n_classes, params_per_class)``."""
        global_feature = bottleneck.flatten(2).mean(dim=2)
        batch = global_feature.shape[0]
        pairs = torch.cat(
            [
                global_feature[:, None, :].expand(batch, self.n_classes, -1),
                self.class_embeddings[None].expand(batch, -1, -1),
            ],
            dim=2,
        )
        return self.controller(pairs)

    def _split(self, theta: torch.Tensor) -> list[torch.Tensor]:
        c = self.head_channels
        sizes = [c * c, c, c * c, c, c, 1]
        w1, b1, w2, b2, w3, b3 = torch.split(theta, sizes, dim=2)
        batch, classes = theta.shape[:2]
        return [
            w1.reshape(batch, classes, c, c), b1,
            w2.reshape(batch, classes, c, c), b2,
            w3.reshape(batch, classes, 1, c), b3,
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features, bottleneck = self.backbone(x)
        features = self.head_input(features)
        batch, channels = features.shape[:2]
        spatial = features.shape[2:]
        flat = features.reshape(batch, channels, -1)
        w1, b1, w2, b2, w3, b3 = self._split(self.class_parameters(bottleneck))
        # Each image's own heads: einsum over (image, class) replaces a grouped 1x1x1 convolution.
        hidden = F.relu(torch.einsum("bkoc,bcn->bkon", w1, flat) + b1[..., None])
        hidden = F.relu(torch.einsum("bkoc,bkcn->bkon", w2, hidden) + b2[..., None])
        logits = torch.einsum("bkoc,bkcn->bkon", w3, hidden) + b3[..., None]
        return logits.reshape(batch, self.n_classes, *spatial)


SWIN_DIVISOR = 32  # SwinUNETR: patch embedding 2, then four 2x merges


def universal_model_divisor(options: dict, default_backbone: str = "unet3d") -> int:
    """8 for the 3D U-Net (three poolings), 32 for SwinUNETR (patch embedding 2, four merges)."""
    if options.get("backbone", default_backbone) == "swin":
        return SWIN_DIVISOR
    return 2 ** (len(options.get("channels", (64, 128, 256, 512))) - 1)


def check_universal_model_options(options: dict, patch_size: Sequence[int]) -> None:
    """Shape and option rules (the builder's keyword options with defaults); ValueError names the problem."""
    backbone = options["backbone"]
    if backbone not in ("unet3d", "swin"):
        raise ValueError(f"Universal Model: backbone must be 'unet3d' or 'swin', got {backbone!r}")
    divisor = universal_model_divisor(options)
    if any(int(p) % divisor for p in patch_size):
        raise ValueError(
            f"Universal Model ({backbone}) needs every patch dimension divisible by {divisor}; "
            f"patch_size is {list(patch_size)}"
        )
    if backbone == "unet3d":
        channels = list(options["channels"])
        if len(channels) < 2 or any(int(c) < 2 or int(c) % 2 for c in channels):
            raise ValueError(
                f"Universal Model: 3D U-Net channels need >= 2 levels of even widths (each level's first "
                f"convolution is half width), got {channels}"
            )
    else:
        if int(options["feature_size"]) % 12:
            raise ValueError(
                f"Universal Model: SwinUNETR feature_size must be divisible by 12 (MONAI), got {options['feature_size']}"
            )
        depths = list(options["depths"])
        if len(depths) != 4 or any(int(d) < 1 for d in depths):
            raise ValueError(f"Universal Model: SwinUNETR needs 4 stages of at least one block, got depths={depths}")
        norm = options["norm"] or "instance"
        norm_name = norm if isinstance(norm, str) else norm[0]
        if str(norm_name).lower() == "instance" and any(int(p) // SWIN_DIVISOR < 2 for p in patch_size):
            raise ValueError(
                f"Universal Model (swin): patch_size {list(patch_size)} leaves a 1-voxel bottleneck (patch / 32), "
                "which instance normalization cannot normalize; use patches of at least 64 or norm: [group, {num_groups: 4}]"
            )
    for name in ("text_dim", "head_channels"):
        if int(options[name]) < 1:
            raise ValueError(f"Universal Model: {name} must be a positive integer, got {options[name]}")
    path = options.get("text_embeddings_path")
    if path and not Path(path).is_file():
        raise ValueError(f"Universal Model: text_embeddings_path {path} does not exist")


def build_universal_model(
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    *,
    patch_size: Sequence[int] = (96, 96, 96),
    backbone: str = "unet3d",
    channels: Sequence[int] = (64, 128, 256, 512),
    feature_size: int = 48,
    depths: Sequence[int] = (2, 2, 2, 2),
    norm: str | Sequence | None = None,
    text_dim: int = CLIP_TEXT_DIM,
    text_embeddings_path: str | None = None,
    head_channels: int = HEAD_CHANNELS,
) -> nn.Module:
    """Build the Universal Model with a 3D U-Net (variant a) or SwinUNETR (variant b) backbone.

    Args:
        spatial_dims: must be 3.
        in_channels: input channels.
        out_channels: classes + 1 (the registry convention); the model returns ``out_channels - 1``.
        patch_size: the training patch, checked against the shape rules.
        backbone: ``"unet3d"`` (a) or ``"swin"`` (b).
        channels: 3D U-Net widths per level (variant a only).
        feature_size: SwinUNETR feature size (variant b only).
        depths: Swin blocks per stage (variant b only; 2, 2, 2, 2 in SwinUNETR).
        norm: normalization of the backbone's convolutions; defaults to batch (a, as Models Genesis)
            and instance (b, as SwinUNETR). ``[name, {args}]`` passes arguments, e.g.
            ``[group, {num_groups: 4}]``.
        text_dim: width of learned class embeddings (CLIP ViT-B: 512).
        text_embeddings_path: ``.npy`` / ``torch.save`` file with frozen embeddings ``(n_classes, d)``.
        head_channels: width of the per-class dynamic heads (8 in the paper).
    """
    if spatial_dims != 3:
        raise ValueError(f"Universal Model is volumetric: spatial_dims must be 3, got {spatial_dims}")
    if out_channels < 2:
        raise ValueError(f"Universal Model needs out_channels = classes + 1 >= 2, got {out_channels}")
    options = dict(
        backbone=backbone, channels=channels, feature_size=feature_size, depths=depths, norm=norm, text_dim=text_dim,
        text_embeddings_path=text_embeddings_path, head_channels=head_channels,
    )
    check_universal_model_options(options, patch_size)
    if isinstance(norm, (list, tuple)):
        norm = (norm[0], dict(norm[1])) if len(norm) > 1 else norm[0]
    if backbone == "unet3d":
        features: nn.Module = ModelsGenesisUNet3D(
            spatial_dims, in_channels, tuple(channels), norm or "batch", act="relu"
        )
    else:
        features = SwinUNETRFeatures(spatial_dims, in_channels, feature_size, depths, norm or "instance")
    n_classes = out_channels - 1
    embeddings = load_text_embeddings(text_embeddings_path, n_classes) if text_embeddings_path else None
    return UniversalModel(features, n_classes, text_dim, embeddings, head_channels)


# The registry's two variants: one builder, the backbone fixed per entry.
build_universal_model_a = partial(build_universal_model, backbone="unet3d")
build_universal_model_b = partial(build_universal_model, backbone="swin")
