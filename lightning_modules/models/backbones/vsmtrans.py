"""VSmTrans (Liu, Bai, Torigian, Tong, Udupa, Medical Image Analysis 98, 2024, "VSmTrans: A hybrid
paradigm integrating self-attention and convolution for 3D medical image segmentation"), written
from the paper and following the forward computation of its reference code (qingze-bai/VSmTrans,
``VSmixTUnet``), which is not copied (the repository has no licence).

A Swin-like hierarchical encoder whose blocks mix two paradigms in parallel, and a SwinUNETR-style
convolutional decoder:

- Patch embedding: a stride-2 convolution, then layer normalization over channels.
- Variable-shape window self-attention: the 3C outputs of the shared q/k/v projection are cut into
  four contiguous groups (each its own q, k and v of C/4 channels), one per window shape: a cube of
  side ``window_size`` and three stripes that span the whole feature map along one axis (H, W or D)
  with a cross-section of ``split_sizes[stage]`` x ``split_sizes[stage]`` voxels. Each group runs
  ``num_heads[stage]`` heads of width d = C / (4 * num_heads); a head takes every
  ``num_heads``-th channel of its group (the reference's interleaved layout). Scores are scaled by
  1 / (2 sqrt(d)) (the reference computes its scale from C / num_heads, four times the head width).
  Odd blocks shift their windows by half a window (Swin), except along an axis a window already spans.
- Parallel convolution on the same q/k/v: GELU -> Linear(3C -> C) -> LayerNorm -> Conv 3^3 ->
  BatchNorm -> LeakyReLU(0.01).
- The two are combined as ``alpha * attention + beta * convolution`` with learnable scalars
  (0.5 each at initialization), then dropout.
- Skip features: the hidden state of every stage and after the last merge, group-normalized with
  12 groups and no affine parameters, feed the SwinUNETR-style decoder (residual UNETR blocks on the
  input and on each stage, the last merged stage feeding the first up-block). Patch merging uses the
  pre-1.5 MONAI order of sub-voxels (:class:`~lightning_modules.models.backbones.swin_unetr.LegacyPatchMerging`),
  as the reference does.
- Dropout, attention dropout and stochastic depth 0.1 (the reference's defaults); deep supervision
  adds 1x1x1 heads on the decoder stages at 1/2 .. 1/16 (the recipe trains with it, as the reference).

Full size (BenchX/Touchstone): feature size 48, depths (2, 2, 2, 2), heads (3, 6, 12, 24), window 6,
split sizes (1, 2, 3, 4), patch embedding 2, 128^3 patches.

Deliberate differences from the reference:

- Stripe lengths are the stage's extent at the build ``patch_size`` and every window is clamped to
  the feature map at run time (the reference fixes windows at build time), so inputs other than the
  build patch also work; at the build patch the windows are the reference's.
- The reference builds a fifth deep-supervision head (on the last merged stage) that its forward
  never uses; it is left out (a never-used parameter breaks DistributedDataParallel).
- Attention runs through ``scaled_dot_product_attention`` with the bias (and shift mask) as an
  additive mask: the same arithmetic, fused kernels where PyTorch has them.

Shape rules: every patch dimension must be divisible by ``patch_embed_size * 2 ** 4`` (32 at full
size). Each stage's width ``feature_size * 2 ** i`` must be divisible by ``4 * num_heads[i]`` (four
window shapes, equal heads), and ``feature_size`` by 12 (the skip features' group norm); depths,
heads and split sizes need one value per stage (four stages); window and split sizes must be
positive. Violations raise ValueError (RecipeError at recipe load).

Example::

    net = build_vsmtrans(3, 1, 3, patch_size=(128, 128, 128))
    net = build_vsmtrans(3, 1, 3, patch_size=(32, 32, 32), feature_size=12, num_heads=(1, 1, 2, 3))
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch
import torch.nn.functional as F
from monai.networks.blocks import MLPBlock, UnetOutBlock, UnetrBasicBlock, UnetrUpBlock
from monai.networks.blocks.patchembedding import PatchEmbed
from monai.networks.layers import DropPath, trunc_normal_
from monai.networks.nets.swin_unetr import compute_mask, window_partition, window_reverse
from torch import nn

from lightning_modules.models.backbones.swin_unetr import LegacyPatchMerging

N_STAGES = 4  # the SwinUNETR-style decoder has one skip per encoder stage
N_WINDOW_SHAPES = 4  # cube, stripe along H, stripe along W, stripe along D
SKIP_NORM_GROUPS = 12  # the reference group-normalizes every skip feature with 12 groups
DROP_RATE = 0.1  # the reference's dropout, attention dropout and stochastic depth


def window_shapes(extent: Sequence[int], window_size: int, split_size: int) -> list[tuple[int, int, int]]:
    """The four window shapes (D, H, W) of a stage whose feature map is ``extent``, clamped to it (as the reference)."""
    d, h, w = (int(e) for e in extent)
    s = int(split_size)
    shapes = [(window_size,) * 3, (s, h, s), (s, s, w), (d, s, s)]
    return [tuple(min(n, e) for n, e in zip(shape, (d, h, w))) for shape in shapes]


@lru_cache(maxsize=256)
def _relative_position_index(window: tuple[int, int, int], table_window: tuple[int, int, int]) -> torch.Tensor:
    """Index into a bias table sized for ``table_window`` of every token pair of a (smaller) ``window``."""
    coords = torch.stack(torch.meshgrid(*(torch.arange(n) for n in window), indexing="ij")).flatten(1)
    relative = coords[:, :, None] - coords[:, None, :]
    span_h, span_w = 2 * table_window[1] - 1, 2 * table_window[2] - 1
    return (
        (relative[0] + table_window[0] - 1) * span_h * span_w
        + (relative[1] + table_window[1] - 1) * span_w
        + (relative[2] + table_window[2] - 1)
    ).reshape(-1)


class WindowShapeAttention(nn.Module):
    """Multi-head self-attention of one channel group within windows of one (nominal) shape.

    Args:
        num_heads: heads of this group.
        window: nominal window (D, H, W); clamped to the feature map at run time.
        attn_drop: dropout on the attention weights.
    """

    def __init__(self, num_heads: int, window: tuple[int, int, int], attn_drop: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.window = tuple(int(w) for w in window)
        self.attn_drop = attn_drop
        table_size = (2 * self.window[0] - 1) * (2 * self.window[1] - 1) * (2 * self.window[2] - 1)
        self.relative_position_bias = nn.Parameter(torch.zeros(table_size, num_heads))
        trunc_normal_(self.relative_position_bias, std=0.02)
        # Index of the nominal window, kept on the module's device; clamped windows compute theirs.
        self.register_buffer(
            "relative_position_index", _relative_position_index(self.window, self.window).clone(), persistent=False
        )

    def forward(self, qkv: torch.Tensor, shifted: bool) -> torch.Tensor:
        """``qkv``: ``(B, D, H, W, 3c)`` (q, k, v concatenated); returns ``(B, D, H, W, c)``."""
        batch, depth, height, width, three_c = qkv.shape
        extent = (depth, height, width)
        # Clamp to the feature map; no shift along an axis the window covers (Swin's rule).
        window = tuple(min(w, e) for w, e in zip(self.window, extent))
        shift = tuple(w // 2 if shifted and e > w else 0 for w, e in zip(window, extent))
        pads = [(-e) % w for e, w in zip(extent, window)]
        if any(pads):
            qkv = F.pad(qkv, (0, 0, 0, pads[2], 0, pads[1], 0, pads[0]))
        padded = tuple(e + p for e, p in zip(extent, pads))
        if any(shift):
            qkv = torch.roll(qkv, shifts=tuple(-s for s in shift), dims=(1, 2, 3))

        tokens = window[0] * window[1] * window[2]
        head_dim = three_c // (3 * self.num_heads)
        windows = window_partition(qkv, window)  # (B * nW, N, 3c)
        n_windows = windows.shape[0] // batch
        # Head h takes channels h, h + heads, h + 2 heads, ... of q, k and v (the reference's layout).
        q, k, v = windows.reshape(batch, n_windows, tokens, 3, head_dim, self.num_heads).permute(3, 0, 1, 5, 2, 4)

        if window == self.window:
            index = self.relative_position_index
        else:
            index = _relative_position_index(window, self.window).to(qkv.device)
        bias = self.relative_position_bias[index].reshape(tokens, tokens, self.num_heads).permute(2, 0, 1)
        if any(shift):
            # (B, nW, heads, N, N) scores: the per-window mask broadcasts over the batch without a copy.
            mask = compute_mask(padded, window, shift, qkv.device)  # (nW, N, N), -100 across regions
            attn_mask = bias[None] + mask[:, None]
        else:
            # One bias for every window: 4-D inputs keep PyTorch's fused attention kernels eligible.
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
            attn_mask = bias
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask.to(q.dtype), dropout_p=self.attn_drop if self.training else 0.0,
            scale=(N_WINDOW_SHAPES * head_dim) ** -0.5,  # the reference's 1 / (2 sqrt(d)) for four shapes
        )
        out = out.reshape(batch, n_windows, self.num_heads, tokens, head_dim)
        out = out.permute(0, 1, 3, 4, 2).reshape(batch * n_windows, tokens, three_c // 3)
        out = window_reverse(out, window, [batch, *padded])
        if any(shift):
            out = torch.roll(out, shifts=shift, dims=(1, 2, 3))
        return out[:, :depth, :height, :width].contiguous()


class VariableShapeMixer(nn.Module):
    """Variable-shape window attention and a convolution in parallel, on one shared q/k/v projection.

    Args:
        dim: channels C.
        num_heads: heads per window shape.
        windows: the four nominal window shapes.
        qkv_bias: bias of the q/k/v projection.
        attn_drop: dropout on attention weights.
        drop: dropout after the attention's projection and on the mixed output.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        windows: Sequence[tuple[int, int, int]],
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        drop: float = 0.0,
    ) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attentions = nn.ModuleList(WindowShapeAttention(num_heads, window, attn_drop) for window in windows)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)
        self.fuse = nn.Sequential(nn.GELU(), nn.Linear(3 * dim, dim), nn.LayerNorm(dim, eps=1e-6))
        self.conv = nn.Sequential(
            nn.Conv3d(dim, dim, kernel_size=3, padding=1),
            nn.BatchNorm3d(dim),
            nn.LeakyReLU(0.01, inplace=True),
        )
        nn.init.zeros_(self.conv[0].bias)
        self.alpha = nn.Parameter(torch.tensor(0.5))
        self.beta = nn.Parameter(torch.tensor(0.5))
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, shifted: bool) -> torch.Tensor:
        """``x``: ``(B, D, H, W, C)`` channels-last."""
        qkv = self.qkv(x)
        # Group g reads the g-th contiguous quarter of the 3C q/k/v channels as its own q, k, v.
        groups = qkv.chunk(len(self.attentions), dim=-1)
        attended = torch.cat([attention(group, shifted) for attention, group in zip(self.attentions, groups)], dim=-1)
        attended = self.proj_drop(self.proj(attended))
        local = self.conv(self.fuse(qkv).permute(0, 4, 1, 2, 3)).permute(0, 2, 3, 4, 1)
        return self.drop(self.alpha * attended + self.beta * local)


class VariableShapeMixedBlock(nn.Module):
    """Pre-norm transformer block: x + mixer(LN(x)), then x + MLP(LN(x)).

    Args:
        dim: channels.
        num_heads: heads per window shape.
        windows: the four nominal window shapes.
        shifted: shift the windows by half (odd blocks).
        mlp_ratio: MLP hidden width / dim.
        qkv_bias: bias of the q/k/v projection.
        drop: dropout.
        attn_drop: attention dropout.
        drop_path: stochastic depth rate.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        windows: Sequence[tuple[int, int, int]],
        shifted: bool,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        self.shifted = shifted
        self.norm1 = nn.LayerNorm(dim)
        self.mixer = VariableShapeMixer(dim, num_heads, windows, qkv_bias, attn_drop, drop)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLPBlock(dim, int(dim * mlp_ratio), dropout_rate=drop, act="GELU", dropout_mode="swin")
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.mixer(self.norm1(x), self.shifted))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class VSmTrans(nn.Module):
    """VSmTrans encoder (patch embedding, four stages of mixed blocks + patch merging) and decoder.

    Args:
        in_channels: input channels.
        out_channels: classes including background.
        patch_size: the training patch (sets the stripe lengths).
        feature_size: width C of the first stage.
        depths: blocks per stage.
        num_heads: heads per window shape, per stage.
        window_size: side of the cubic windows.
        split_sizes: stripe cross-section per stage.
        patch_embed_size: stride of the patch embedding.
        mlp_ratio: MLP hidden width / C.
        qkv_bias: bias of the q/k/v projections.
        drop_rate: dropout.
        attn_drop_rate: attention dropout.
        drop_path_rate: stochastic depth, rising linearly to this over the blocks.
        norm: normalization of the decoder's convolutional blocks.
        deep_supervision: in training mode, also return logits at 1/2 .. 1/16.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        patch_size: Sequence[int],
        feature_size: int,
        depths: Sequence[int],
        num_heads: Sequence[int],
        window_size: int,
        split_sizes: Sequence[int],
        patch_embed_size: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = DROP_RATE,
        attn_drop_rate: float = DROP_RATE,
        drop_path_rate: float = DROP_RATE,
        norm: str | tuple = "instance",
        deep_supervision: bool = True,
    ) -> None:
        super().__init__()
        self.deep_supervision = deep_supervision
        self.patch_embed = PatchEmbed(patch_embed_size, in_channels, feature_size, norm_layer=nn.LayerNorm, spatial_dims=3)
        self.pos_drop = nn.Dropout(drop_rate)
        rates = torch.linspace(0, drop_path_rate, sum(depths)).tolist()
        self.stages = nn.ModuleList()
        self.mergers = nn.ModuleList()
        extent = [int(p) // patch_embed_size for p in patch_size]
        for stage, (depth, heads, split) in enumerate(zip(depths, num_heads, split_sizes)):
            dim = feature_size * 2**stage
            windows = window_shapes(extent, window_size, split)
            first = sum(depths[:stage])
            self.stages.append(
                nn.ModuleList(
                    VariableShapeMixedBlock(
                        dim, heads, windows, shifted=block % 2 == 1, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                        drop=drop_rate, attn_drop=attn_drop_rate, drop_path=rates[first + block],
                    )
                    for block in range(depth)
                )
            )
            self.mergers.append(LegacyPatchMerging(dim, norm_layer=nn.LayerNorm, spatial_dims=3))
            extent = [(e + 1) // 2 for e in extent]

        f = feature_size
        self.encoder0 = UnetrBasicBlock(3, in_channels, f, kernel_size=3, stride=1, norm_name=norm, res_block=True)
        self.encoders = nn.ModuleList(
            UnetrBasicBlock(3, f * 2**i, f * 2**i, kernel_size=3, stride=1, norm_name=norm, res_block=True)
            for i in range(N_STAGES)
        )
        # decoders[i] upsamples from stage i + 1's width to stage i's and joins encoders[i]'s skip.
        self.decoders = nn.ModuleList(
            UnetrUpBlock(
                3, f * 2 ** (i + 1), f * 2**i, kernel_size=3, upsample_kernel_size=2, norm_name=norm, res_block=True
            )
            for i in range(N_STAGES)
        )
        self.decoder0 = UnetrUpBlock(
            3, f, f, kernel_size=3, upsample_kernel_size=patch_embed_size, norm_name=norm, res_block=True
        )
        self.out = UnetOutBlock(3, f, out_channels)
        self.deep_heads = None
        if deep_supervision:
            self.deep_heads = nn.ModuleList(UnetOutBlock(3, f * 2**i, out_channels) for i in range(N_STAGES))

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Group-normalized (12 groups, no affine) hidden states after each stage and the last merge, channels-first."""
        x = self.pos_drop(self.patch_embed(x)).permute(0, 2, 3, 4, 1)
        hidden = []
        for blocks, merge in zip(self.stages, self.mergers):
            for block in blocks:
                x = block(x)
            hidden.append(x)
            x = merge(x)
        hidden.append(x)
        return [F.group_norm(h.permute(0, 4, 1, 2, 3), SKIP_NORM_GROUPS) for h in hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        hidden = self.encode(x)
        skips = [encoder(h) for encoder, h in zip(self.encoders, hidden[:N_STAGES])]
        decoded = hidden[N_STAGES]
        stage_outputs = []
        for decoder, skip in zip(reversed(self.decoders), reversed(skips)):
            decoded = decoder(decoded, skip)
            stage_outputs.append(decoded)
        logits = self.out(self.decoder0(decoded, self.encoder0(x)))
        if self.training and self.deep_supervision:
            # stage_outputs run from 1/16 to 1/2; heads are indexed by level (0: 1/2).
            coarse = [head(out) for head, out in zip(self.deep_heads, reversed(stage_outputs))]
            return [logits, *coarse]
        return logits


def vsmtrans_divisor(options: dict) -> int:
    """patch_embed_size * 2 ** 4: the patch embedding, then one 2x merge per stage."""
    patch_embed_size = options.get("patch_embed_size", 2)
    if not isinstance(patch_embed_size, int) or patch_embed_size < 1:
        raise ValueError(f"VSmTrans: patch_embed_size must be a positive integer, got {patch_embed_size!r}")
    return patch_embed_size * 2**N_STAGES


def check_vsmtrans_options(options: dict, patch_size: Sequence[int]) -> None:
    """Shape and option rules (the builder's keyword options with defaults); ValueError names the problem."""
    divisor = vsmtrans_divisor(options)
    for name in ("depths", "num_heads", "split_sizes"):
        values = list(options[name])
        if len(values) != N_STAGES:
            raise ValueError(f"VSmTrans: {name} needs one value per stage ({N_STAGES} stages), got {values}")
        if any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"VSmTrans: every value of {name} must be a positive integer, got {values}")
    window_size = options["window_size"]
    if not isinstance(window_size, int) or window_size < 1:
        raise ValueError(f"VSmTrans: window_size must be a positive integer, got {window_size!r}")
    feature_size = int(options["feature_size"])
    if feature_size % SKIP_NORM_GROUPS:
        raise ValueError(
            f"VSmTrans: feature_size must be divisible by {SKIP_NORM_GROUPS} (the skip features' group norm), got {feature_size}"
        )
    for stage, heads in enumerate(options["num_heads"]):
        dim = feature_size * 2**stage
        if dim % (N_WINDOW_SHAPES * heads):
            raise ValueError(
                f"VSmTrans: stage {stage} has {dim} channels (feature_size {feature_size} * 2**{stage}), which must be "
                f"divisible by {N_WINDOW_SHAPES} window shapes x num_heads[{stage}]={heads} = {N_WINDOW_SHAPES * heads}"
            )
    if any(int(p) % divisor for p in patch_size):
        raise ValueError(
            f"VSmTrans needs every patch dimension divisible by {divisor}; patch_size is {list(patch_size)}"
        )


def build_vsmtrans(
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    *,
    patch_size: Sequence[int] = (128, 128, 128),
    feature_size: int = 48,
    depths: Sequence[int] = (2, 2, 2, 2),
    num_heads: Sequence[int] = (3, 6, 12, 24),
    window_size: int = 6,
    split_sizes: Sequence[int] = (1, 2, 3, 4),
    patch_embed_size: int = 2,
    mlp_ratio: float = 4.0,
    qkv_bias: bool = True,
    drop_rate: float = DROP_RATE,
    attn_drop_rate: float = DROP_RATE,
    drop_path_rate: float = DROP_RATE,
    norm: str | Sequence = "instance",
    deep_supervision: bool = True,
) -> nn.Module:
    """Build VSmTrans (the BenchX/Touchstone setting by default), following the reference's forward pass.

    Deliberate differences from the reference: listed in the module docstring (windows clamped at
    run time for other input sizes, no unused fifth deep-supervision head, fused attention kernel).

    Args:
        spatial_dims: must be 3.
        in_channels: input channels.
        out_channels: classes including background.
        patch_size: the training patch; sets the stripe lengths and is checked against the shape rules.
        feature_size: width of the first stage (48).
        depths: blocks per stage (2, 2, 2, 2).
        num_heads: heads per window shape, per stage (3, 6, 12, 24).
        window_size: side of the cubic windows (6).
        split_sizes: stripe cross-section per stage (1, 2, 3, 4).
        patch_embed_size: stride of the patch embedding (2).
        mlp_ratio: MLP hidden width / stage width.
        qkv_bias: bias of the q/k/v projections.
        drop_rate: dropout.
        attn_drop_rate: attention dropout.
        drop_path_rate: maximum stochastic-depth rate.
        norm: normalization of the decoder's convolutional blocks (MONAI name, or ``[name, {args}]``).
        deep_supervision: in training mode, return logits at full resolution and at 1/2 .. 1/16.
    """
    if spatial_dims != 3:
        raise ValueError(f"VSmTrans is volumetric: spatial_dims must be 3, got {spatial_dims}")
    options = dict(
        feature_size=feature_size, depths=depths, num_heads=num_heads, window_size=window_size,
        split_sizes=split_sizes, patch_embed_size=patch_embed_size,
    )
    check_vsmtrans_options(options, patch_size)
    if isinstance(norm, (list, tuple)):
        norm = (norm[0], dict(norm[1])) if len(norm) > 1 else norm[0]
    return VSmTrans(
        in_channels, out_channels, patch_size, feature_size, tuple(depths), tuple(num_heads), int(window_size),
        tuple(split_sizes), int(patch_embed_size), mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, drop_path_rate,
        norm, deep_supervision,
    )
