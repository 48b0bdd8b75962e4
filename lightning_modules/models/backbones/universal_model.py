"""CLIP-Driven Universal Model (Liu et al., ICCV 2023, "CLIP-Driven Universal Model for Organ
Segmentation and Tumor Detection"), written from the paper and following the forward computation
of its reference code (ljwztc/CLIP-Driven-Universal-Model, ``Universal_model``), which is not copied
(its licence forbids derivatives).

Each class is segmented by its own tiny convolutional head whose weights are generated from the
image and a class embedding:

1. Vision encoder-decoder: ``backbone="unet3d"`` (variant a: the Models Genesis 3D U-Net, four
   levels of two 3x3x3 convolutions, widths 32-64 / 64-128 / 128-256 / 256-512, 19.07 M parameters)
   or ``backbone="swin"`` (variant b: SwinUNETR, feature size 48, without its output layer). It
   returns the last decoder features and the bottleneck.
2. Image branch: bottleneck -> GroupNorm -> ReLU -> global average pooling -> 1x1x1 conv to 256.
3. Text branch: with a class-embedding file (Touchstone's "& CLIP" entries: CLIP ViT-B/32 text
   embeddings of "A computerized tomography of a [class]", 512 wide, frozen), each row goes through
   Linear(512 -> 256) -> ReLU; without one (the reference's ``rand_embedding``), each class has a
   learned 256-wide embedding used as it is.
4. Controller: a 1x1x1 convolution maps [image feature, class feature] (512) to the 153 parameters
   of that class's head: weights 8x8, 8x8, 1x8, then biases 8, 8, 1 (the reference's order).
5. Segmentor: the decoder features go through GroupNorm -> ReLU -> 1x1x1 conv to 8 channels; each
   class's head (three 1x1x1 convolutions 8 -> 8 -> 8 -> 1, ReLU between) turns them into one logit
   map, read with a sigmoid (classes are not mutually exclusive).

The class-embedding file (``text_embeddings_path``) is the reference's format: ``torch.save`` of an
``[N, 512]`` tensor (the reference's ``txt_encoding.pth``, rows in the order of its 32 class names,
:data:`REFERENCE_CLASS_NAMES`), or of ``{"embeddings": [N, d] tensor, "names": [N names]}``.
The rows for the recipe's classes are chosen by name: each class of ``class_names`` (the recipe
passes ``${data.classes}``) is looked up through :data:`ABDOMENATLAS_TO_REFERENCE` (override with
``class_prompt_names``). The recipe says how to make such a file with CLIP.

Deliberate differences from the reference:

- Group norms use ``gcd(16, channels)`` groups (16 at every published width; tiny test widths
  would not divide by 16).
- The per-class heads run for the whole batch at once (an einsum per layer) instead of a grouped
  convolution per image; the arithmetic is the same.
- Variant b uses MONAI's SwinUNETR with the pre-1.5 patch merging that the reference's copy of
  SwinUNETR has (:class:`~lightning_modules.models.backbones.swin_unetr.LegacyPatchMerging`).
- Variant a's batch norm always normalizes with the batch's statistics (the reference's
  ``ContBatchNorm3d``), in evaluation too: predictions depend on what else is in the batch (the
  sliding-window batch at inference), as in the reference. Running statistics are kept but unused.

Full size, 1 input channel, 2 classes: variant a 19.42 M parameters with a class-embedding file
(19.29 M with random embeddings), variant b 62.60 M (62.46 M).

Shape rules: variant a pools three times, so every patch dimension must be divisible by 8; variant
b follows SwinUNETR (patch embedding 2, four merges) and needs multiples of 32, and with instance
normalization its bottleneck (patch / 32) must keep 2 voxels per axis, so at least 64 (the CPU
profile uses group normalization to run on 32^3 patches).

Output: ``out_channels - 1`` logit channels, one per class, no background (``output="sigmoid"``).

Example::

    net = build_universal_model(3, 1, 3, patch_size=(96, 96, 96), backbone="unet3d")
    net = build_universal_model(3, 1, 3, patch_size=(96, 96, 96), backbone="swin",
                                text_embeddings_path="clip_embeddings.pt",
                                class_names=["pancreas", "pancreatic_lesion"])
"""

from __future__ import annotations

import hashlib
import math
from functools import partial
from pathlib import Path
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from monai.networks.layers.utils import get_norm_layer
from monai.networks.nets import SwinUNETR
from torch import nn

from lightning_modules.models.backbones.swin_unetr import LegacyPatchMerging

HEAD_CHANNELS = 8  # the paper's segmentor: 1x1x1 convolutions with 8, 8 and 1 output channels
FEATURE_DIM = 256  # width of the image and text features the controller reads (256 + 256)
CLIP_TEXT_DIM = 512  # CLIP ViT-B/32 text embedding width

# The class order of the reference's txt_encoding.pth (its 32 prompts; "Arota" is its spelling).
REFERENCE_CLASS_NAMES = (
    "Spleen", "Right Kidney", "Left Kidney", "Gall Bladder", "Esophagus", "Liver", "Stomach", "Arota",
    "Postcava", "Portal Vein and Splenic Vein", "Pancreas", "Right Adrenal Gland", "Left Adrenal Gland",
    "Duodenum", "Hepatic Vessel", "Right Lung", "Left Lung", "Colon", "Intestine", "Rectum", "Bladder",
    "Prostate", "Left Head of Femur", "Right Head of Femur", "Celiac Truck", "Kidney Tumor", "Liver Tumor",
    "Pancreas Tumor", "Hepatic Vessel Tumor", "Lung Tumor", "Colon Tumor", "Kidney Cyst",
)

# AbdomenAtlas class names -> the reference's prompt names.
ABDOMENATLAS_TO_REFERENCE = {
    "spleen": "Spleen", "kidney_right": "Right Kidney", "kidney_left": "Left Kidney",
    "gall_bladder": "Gall Bladder", "esophagus": "Esophagus", "liver": "Liver", "stomach": "Stomach",
    "aorta": "Arota", "postcava": "Postcava", "pancreas": "Pancreas", "duodenum": "Duodenum",
    "colon": "Colon", "kidney_lesion": "Kidney Tumor", "liver_lesion": "Liver Tumor",
    "pancreatic_lesion": "Pancreas Tumor", "colon_lesion": "Colon Tumor",
}


def dynamic_head_param_count(head_channels: int = HEAD_CHANNELS) -> int:
    """Parameters of one class's head: two (c x c) layers and one (1 x c) layer, each with bias."""
    return 2 * (head_channels * head_channels + head_channels) + (head_channels + 1)


class BatchStatisticsNorm3d(nn.BatchNorm3d):
    """Batch norm that always normalizes with the current batch's statistics (training and evaluation),
    as the reference's ``ContBatchNorm3d``; running statistics are updated but never used."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, self.momentum, self.eps)


def _norm(norm: str | tuple, channels: int) -> nn.Module:
    if norm == "batch_statistics":
        return BatchStatisticsNorm3d(channels)
    return get_norm_layer(norm, spatial_dims=3, channels=channels)


class ConvNormReLU(nn.Sequential):
    """3x3x3 convolution (bias) -> normalization -> ReLU: one layer of Models Genesis' U-Net."""

    def __init__(self, in_channels: int, out_channels: int, norm: str | tuple) -> None:
        super().__init__(
            nn.Conv3d(in_channels, out_channels, kernel_size=3, padding=1),
            _norm(norm, out_channels),
            nn.ReLU(inplace=True),
        )


class ModelsGenesisUNet3D(nn.Module):
    """The 3D U-Net of Models Genesis (Zhou et al. 2019), after Cicek et al. 2016, without output layer.

    Each encoder level runs two 3x3x3 convolutions (the second doubles the width) and max-pools
    (all but the last level); each decoder level upsamples with a 2x2x2 transposed convolution
    that keeps the width, concatenates the skip and runs two 3x3x3 convolutions.

    Args:
        in_channels: input channels.
        channels: width at the end of each level (64, 128, 256, 512 in the paper).
        norm: ``batch_statistics`` (the reference) or a MONAI norm name / ``(name, args)``.
    """

    def __init__(self, in_channels: int, channels: Sequence[int], norm: str | tuple) -> None:
        super().__init__()
        self.encoder = nn.ModuleList()
        previous = in_channels
        for width in channels:
            self.encoder.append(nn.Sequential(ConvNormReLU(previous, width // 2, norm), ConvNormReLU(width // 2, width, norm)))
            previous = width
        self.pool = nn.MaxPool3d(2)
        self.upsamplers = nn.ModuleList()
        self.decoder = nn.ModuleList()
        for level in reversed(range(len(channels) - 1)):
            deeper, width = channels[level + 1], channels[level]
            self.upsamplers.append(nn.ConvTranspose3d(deeper, deeper, kernel_size=2, stride=2))
            self.decoder.append(nn.Sequential(ConvNormReLU(deeper + width, width, norm), ConvNormReLU(width, width, norm)))
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
    """MONAI's SwinUNETR without its output layer: returns the last decoder features and the bottleneck
    (``encoder10``'s output, 16 x feature_size channels), with the pre-1.5 patch merging.

    Args:
        in_channels: input channels.
        feature_size: SwinUNETR's feature size (48 in the Universal Model).
        depths: Swin blocks per stage (2, 2, 2, 2).
        norm: norm of the convolutional blocks (SwinUNETR: instance).
    """

    def __init__(self, in_channels: int, feature_size: int, depths: Sequence[int], norm: str | tuple) -> None:
        super().__init__()
        self.net = SwinUNETR(
            in_channels=in_channels,
            out_channels=1,
            feature_size=feature_size,
            depths=tuple(depths),
            norm_name=norm,
            spatial_dims=3,
            downsample=LegacyPatchMerging,
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


def _read_embedding_file(path: Path) -> tuple[torch.Tensor, list[str]]:
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # any unreadable file gets the same clear message
        raise ValueError(f"Universal Model: cannot read class embeddings from {path}: {error}") from error
    if isinstance(content, Mapping):
        if set(content) != {"embeddings", "names"}:
            raise ValueError(f"Universal Model: {path} holds a dict with keys {sorted(content)}; expected 'embeddings' and 'names'")
        embeddings, names = content["embeddings"], [str(n) for n in content["names"]]
    else:
        embeddings, names = content, list(REFERENCE_CLASS_NAMES)
    if not isinstance(embeddings, torch.Tensor) or embeddings.ndim != 2:
        shape = tuple(embeddings.shape) if isinstance(embeddings, torch.Tensor) else type(embeddings).__name__
        raise ValueError(f"Universal Model: {path} must hold an [N, d] tensor of class embeddings, got {shape}")
    if embeddings.shape[0] != len(names):
        raise ValueError(
            f"Universal Model: {path} has {embeddings.shape[0]} embedding rows but {len(names)} class names "
            f"(a bare tensor must have the reference's {len(REFERENCE_CLASS_NAMES)} rows, in its class order)"
        )
    if not torch.is_floating_point(embeddings) or not torch.isfinite(embeddings).all():
        raise ValueError(f"Universal Model: {path} must hold finite floating-point embeddings (dtype {embeddings.dtype})")
    return embeddings.float(), names


def load_class_embeddings(
    path: str | Path, class_names: Sequence[str], class_prompt_names: Mapping[str, str] | None = None
) -> torch.Tensor:
    """The rows of a class-embedding file for ``class_names``, chosen by name: ``(len(class_names), d)``.

    Args:
        path: ``torch.save`` of an ``[N, d]`` tensor in the reference's class order, or of
            ``{"embeddings": [N, d], "names": [...]}``.
        class_names: the recipe's classes (AbdomenAtlas names), in output-channel order.
        class_prompt_names: AbdomenAtlas name -> the file's name, on top of :data:`ABDOMENATLAS_TO_REFERENCE`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Universal Model: text_embeddings_path {path} does not exist")
    embeddings, names = _read_embedding_file(path)
    lookup = {**ABDOMENATLAS_TO_REFERENCE, **dict(class_prompt_names or {})}
    rows = []
    for name in class_names:
        wanted = lookup.get(name, name)
        matches = [i for i, n in enumerate(names) if n.lower() == wanted.lower()]
        if not matches:
            raise ValueError(
                f"Universal Model: class {name!r} (looked up as {wanted!r}) has no row in {path}; its names are "
                f"{', '.join(names)}. Map it with model.options.class_prompt_names"
            )
        rows.append(matches[0])
    return embeddings[rows]


class UniversalModel(nn.Module):
    """Encoder-decoder + image and text branches + controller + per-class dynamic heads (sigmoid outputs).

    Args:
        backbone: the encoder-decoder, returning ``(decoder_features, bottleneck)``.
        n_classes: number of classes (output channels).
        text_embeddings: frozen class embeddings ``(n_classes, d)``, or None for learned random ones.
        head_channels: width of the dynamic heads (8 in the paper).
    """

    def __init__(
        self, backbone: nn.Module, n_classes: int, text_embeddings: torch.Tensor | None = None, head_channels: int = HEAD_CHANNELS
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.n_classes = n_classes
        self.head_channels = head_channels
        features, bottleneck = backbone.out_channels, backbone.bottleneck_channels
        self.head_input = nn.Sequential(
            nn.GroupNorm(math.gcd(16, features), features), nn.ReLU(inplace=True), nn.Conv3d(features, head_channels, 1)
        )
        self.image_branch = nn.Sequential(
            nn.GroupNorm(math.gcd(16, bottleneck), bottleneck),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool3d(1),
            nn.Conv3d(bottleneck, FEATURE_DIM, 1),
        )
        if text_embeddings is None:
            self.class_embeddings = nn.Embedding(n_classes, FEATURE_DIM)
            self.text_branch = None
        else:
            self.register_buffer("text_embeddings", text_embeddings.clone())
            self.text_branch = nn.Linear(text_embeddings.shape[1], FEATURE_DIM)
        self.controller = nn.Conv3d(2 * FEATURE_DIM, dynamic_head_param_count(head_channels), 1)

    def class_features(self) -> torch.Tensor:
        """One 256-wide feature per class: ReLU(Linear(text embedding)), or the learned embedding."""
        if self.text_branch is None:
            return self.class_embeddings.weight
        return F.relu(self.text_branch(self.text_embeddings))

    def class_parameters(self, bottleneck: torch.Tensor) -> torch.Tensor:
        """theta_k for every image and class: ``(B, n_classes, params_per_class)``."""
        image = self.image_branch(bottleneck).flatten(1)  # (B, 256)
        text = self.class_features()  # (K, 256)
        batch = image.shape[0]
        pairs = torch.cat(
            [image[:, None].expand(batch, self.n_classes, -1), text[None].expand(batch, -1, -1)], dim=2
        )
        return self.controller(pairs.reshape(batch * self.n_classes, -1, 1, 1, 1)).reshape(batch, self.n_classes, -1)

    def _split(self, theta: torch.Tensor) -> list[torch.Tensor]:
        c = self.head_channels
        w1, w2, w3, b1, b2, b3 = torch.split(theta, [c * c, c * c, c, c, c, 1], dim=2)
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
        _check_swin(options, patch_size)
    if int(options["head_channels"]) < 1:
        raise ValueError(f"Universal Model: head_channels must be a positive integer, got {options['head_channels']}")
    path = options.get("text_embeddings_path")
    if path and not Path(path).is_file():
        raise ValueError(f"Universal Model: text_embeddings_path {path} does not exist")
    if path and not options.get("class_names"):
        raise ValueError(
            "Universal Model: text_embeddings_path needs class_names (the recipe's data.classes) to choose its rows by name"
        )


def _check_swin(options: dict, patch_size: Sequence[int]) -> None:
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


def class_embedding_tags(options: dict) -> dict[str, str]:
    """Run tags saying which class embeddings the model used: a file (name, hash) or learned random ones."""
    path = options.get("text_embeddings_path")
    if not path:
        return {"class_embeddings": "random (learned, reference rand_embedding)"}
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return {"class_embeddings": f"{Path(path).name} sha256:{digest}"}


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
    text_embeddings_path: str | None = None,
    class_names: Sequence[str] | None = None,
    class_prompt_names: Mapping[str, str] | None = None,
    head_channels: int = HEAD_CHANNELS,
) -> nn.Module:
    """Build the Universal Model with a 3D U-Net (variant a) or SwinUNETR (variant b) backbone.

    Deliberate differences from the reference: listed in the module docstring (gcd group counts,
    batched heads, MONAI's SwinUNETR with the legacy merging, class rows chosen by name).

    Args:
        spatial_dims: must be 3.
        in_channels: input channels.
        out_channels: classes + 1 (the registry convention); the model returns ``out_channels - 1``.
        patch_size: the training patch, checked against the shape rules.
        backbone: ``"unet3d"`` (a) or ``"swin"`` (b).
        channels: 3D U-Net widths per level (variant a only).
        feature_size: SwinUNETR feature size (variant b only).
        depths: Swin blocks per stage (variant b only; 2, 2, 2, 2 in SwinUNETR).
        norm: normalization of the backbone's convolutions; defaults to ``batch_statistics`` (a, the
            reference's batch norm) and ``instance`` (b, as SwinUNETR). ``[name, {args}]`` passes
            arguments, e.g. ``[group, {num_groups: 4}]``.
        text_embeddings_path: class-embedding file (see the module docstring); None: learned random
            embeddings.
        class_names: the classes in output-channel order (the recipe passes ``${data.classes}``);
            needed with ``text_embeddings_path``.
        class_prompt_names: AbdomenAtlas name -> name in the embedding file, for classes that
            :data:`ABDOMENATLAS_TO_REFERENCE` does not map.
        head_channels: width of the per-class dynamic heads (8 in the paper).
    """
    if spatial_dims != 3:
        raise ValueError(f"Universal Model is volumetric: spatial_dims must be 3, got {spatial_dims}")
    if out_channels < 2:
        raise ValueError(f"Universal Model needs out_channels = classes + 1 >= 2, got {out_channels}")
    options = dict(
        backbone=backbone, channels=channels, feature_size=feature_size, depths=depths, norm=norm,
        text_embeddings_path=text_embeddings_path, class_names=class_names, head_channels=head_channels,
    )
    check_universal_model_options(options, patch_size)
    n_classes = out_channels - 1
    if class_names is not None and len(class_names) != n_classes:
        raise ValueError(f"Universal Model: {len(class_names)} class_names for {n_classes} output classes")
    if isinstance(norm, (list, tuple)):
        norm = (norm[0], dict(norm[1])) if len(norm) > 1 else norm[0]
    if backbone == "unet3d":
        features: nn.Module = ModelsGenesisUNet3D(in_channels, tuple(channels), norm or "batch_statistics")
    else:
        features = SwinUNETRFeatures(in_channels, feature_size, depths, norm or "instance")
    embeddings = None
    if text_embeddings_path:
        embeddings = load_class_embeddings(text_embeddings_path, list(class_names), class_prompt_names)
    return UniversalModel(features, n_classes, embeddings, head_channels)


# The registry's two variants: one builder, the backbone fixed per entry.
build_universal_model_a = partial(build_universal_model, backbone="unet3d")
build_universal_model_b = partial(build_universal_model, backbone="swin")
