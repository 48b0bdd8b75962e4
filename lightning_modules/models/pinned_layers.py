"""3D convolutions and group norms whose CPU sums follow neither the machine nor the thread count.

With oneDNN off (:mod:`lightning_modules.config.numerics`) torch runs a CPU ``Conv3d`` as its
reference kernel (``slow_conv3d``: one unfold and product per sample), which is several times
slower than oneDNN for narrow networks on small patches, and its ``GroupNorm`` backward on
contiguous tensors sums in an order that follows the thread count when a group holds few voxels.
:func:`use_pinned_layers` swaps a network's ``nn.Conv3d`` and ``nn.GroupNorm`` modules for
:class:`PinnedConv3d` and :class:`PinnedGroupNorm` (same parameters, same state-dict keys). On CPU
tensors in a pinned process they compute:

- a stride-1 convolution as one matrix product per kernel offset on the zero-padded channels-last
  grid: shifting the flattened grid by an offset is a row offset, so each product reads the input
  in place; the products accumulate in a fixed order into the output (and the input gradient is the
  same sum over the output gradient with the flipped kernel). Strided convolutions gather their
  columns once (one strided copy per kernel offset) and run one product;
- a group norm as ``batch_norm`` over the ``N x groups`` rows (its statistics are reduced row by
  row), then the per-channel scale and shift.

Every sum is then an MKL product under ``MKL_CBWR`` (the same on any thread count) or a reduction
that one thread does alone, so a network trains the same weights whatever the thread count (the
SynthX generator was checked with one to four threads). On GPU, and with ``BENCHX_NATIVE_CPU=1``,
the modules call torch's own kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_modules.config.numerics import native_cpu

__all__ = ["PinnedConv3d", "PinnedGroupNorm", "pinned_conv3d", "use_pinned_layers"]


def _offsets(kernel: tuple[int, int, int]):
    kd, kh, kw = kernel
    return [(a, b, c) for a in range(kd) for b in range(kh) for c in range(kw)]


def _shifted_products(grid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over kernel offsets of ``grid[p + offset] @ weights[offset]`` on a padded N D H W C grid.

    Returns the N D H W O grid of sums; rows whose window leaves the grid are garbage (callers keep the
    valid corner).
    """
    kd, kh, kw, channels, outputs = weights.shape
    n, depth, height, width, _ = grid.shape
    flat = grid.reshape(-1, channels)
    last = (kd - 1) * height * width + (kh - 1) * width + (kw - 1)
    rows = flat.shape[0] - last
    out = torch.zeros((flat.shape[0], outputs), dtype=grid.dtype, device=grid.device)
    accumulator = out[:rows]
    for a, b, c in _offsets((kd, kh, kw)):
        start = a * height * width + b * width + c
        accumulator.addmm_(flat[start:start + rows], weights[a, b, c])
    return out.view(n, depth, height, width, outputs)


def _columns(grid: torch.Tensor, kernel, stride, size) -> torch.Tensor:
    """The strided windows of a padded N D H W C grid as (N * D' * H' * W', offsets * C) rows."""
    (sd, sh, sw), (depth, height, width) = stride, size
    n, channels = grid.shape[0], grid.shape[-1]
    columns = torch.empty((n, depth, height, width, len(_offsets(kernel)), channels), dtype=grid.dtype, device=grid.device)
    for i, (a, b, c) in enumerate(_offsets(kernel)):
        columns[:, :, :, :, i, :] = grid[:, a:a + sd * (depth - 1) + 1:sd, b:b + sh * (height - 1) + 1:sh,
                                         c:c + sw * (width - 1) + 1:sw, :]
    return columns.view(n * depth * height * width, -1)


class _PinnedConv3dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding):
        outputs, channels = weight.shape[:2]
        kernel = tuple(weight.shape[2:])
        (pd, ph, pw) = padding
        grid = F.pad(x.permute(0, 2, 3, 4, 1), (0, 0, pw, pw, ph, ph, pd, pd)).contiguous()
        padded = tuple(grid.shape[1:4])
        size = tuple((p - k) // s + 1 for p, k, s in zip(padded, kernel, stride))
        weights = weight.permute(2, 3, 4, 1, 0).contiguous()  # kd kh kw C O
        if stride == (1, 1, 1):
            out = _shifted_products(grid, weights)[:, :size[0], :size[1], :size[2], :]
            columns = None
        else:
            columns = _columns(grid, kernel, stride, size)
            out = (columns @ weights.view(-1, outputs)).view(x.shape[0], *size, outputs)
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(grid, weight, columns if columns is not None else torch.empty(0))
        ctx.geometry = (tuple(stride), tuple(padding), size, bias is not None, tuple(x.shape))
        return out.permute(0, 4, 1, 2, 3)

    @staticmethod
    def backward(ctx, grad):
        grid, weight, columns = ctx.saved_tensors
        stride, padding, size, has_bias, shape = ctx.geometry
        outputs, channels = weight.shape[:2]
        kernel = tuple(weight.shape[2:])
        n = shape[0]
        grad_grid = grad.permute(0, 2, 3, 4, 1)  # N D' H' W' O
        rows = grad_grid.reshape(-1, outputs)
        grad_x = grad_weight = grad_bias = None
        if has_bias and ctx.needs_input_grad[2]:
            # A product, not a sum: MKL's order does not follow the thread count.
            grad_bias = (torch.ones((1, rows.shape[0]), dtype=rows.dtype, device=rows.device) @ rows).view(-1)
        if ctx.needs_input_grad[1]:
            if stride == (1, 1, 1):
                # Place the output gradient on the padded grid (zero outside the valid corner); each
                # offset's weight gradient is then one product of shifted rows.
                padded = torch.zeros((*grid.shape[:4], outputs), dtype=grad.dtype, device=grad.device)
                padded[:, :size[0], :size[1], :size[2], :] = grad_grid
                _, depth, height, width, _ = grid.shape
                flat, flat_grad = grid.reshape(-1, channels), padded.view(-1, outputs)
                last = (kernel[0] - 1) * height * width + (kernel[1] - 1) * width + (kernel[2] - 1)
                used = flat.shape[0] - last
                per_offset = torch.empty((*kernel, channels, outputs), dtype=grad.dtype, device=grad.device)
                for a, b, c in _offsets(kernel):
                    start = a * height * width + b * width + c
                    torch.mm(flat[start:start + used].t(), flat_grad[:used], out=per_offset[a, b, c])
            else:
                per_offset = (columns.t() @ rows).view(*kernel, channels, outputs)
            grad_weight = per_offset.permute(4, 3, 0, 1, 2)
        if ctx.needs_input_grad[0]:
            (pd, ph, pw) = padding
            if stride == (1, 1, 1):
                # The input gradient: a full correlation of the output gradient with the flipped kernel.
                flipped = weight.flip(2, 3, 4).permute(2, 3, 4, 0, 1).contiguous()  # kd kh kw O C
                kd, kh, kw = kernel
                full = F.pad(grad_grid, (0, 0, kw - 1 - pw, kw - 1 - pw, kh - 1 - ph, kh - 1 - ph,
                                         kd - 1 - pd, kd - 1 - pd)).contiguous()
                grad_x = _shifted_products(full, flipped)[:, :shape[2], :shape[3], :shape[4], :]
            else:
                weights = weight.permute(2, 3, 4, 1, 0).reshape(-1, outputs)
                grad_columns = (rows @ weights.t()).view(n, *size, len(_offsets(kernel)), channels)
                padded_x = torch.zeros_like(grid)
                (sd, sh, sw), (depth, height, width) = stride, size
                for i, (a, b, c) in enumerate(_offsets(kernel)):
                    padded_x[:, a:a + sd * (depth - 1) + 1:sd, b:b + sh * (height - 1) + 1:sh,
                             c:c + sw * (width - 1) + 1:sw, :] += grad_columns[:, :, :, :, i, :]
                grad_x = padded_x[:, pd:padded_x.shape[1] - pd, ph:padded_x.shape[2] - ph, pw:padded_x.shape[3] - pw, :]
            grad_x = grad_x.permute(0, 4, 1, 2, 3)
        return grad_x, grad_weight, grad_bias, None, None


def pinned_conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding) -> torch.Tensor:
    """``F.conv3d`` (zero padding, no dilation, one group) with the sums described in the module text."""
    return _PinnedConv3dFunction.apply(x, weight, bias, tuple(stride), tuple(padding))


def _pinned(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and not native_cpu()


class PinnedConv3d(nn.Conv3d):
    """``nn.Conv3d`` whose CPU sums are :func:`pinned_conv3d`'s in a pinned process."""

    def _conv_forward(self, input, weight, bias):
        if _pinned(input):
            return pinned_conv3d(input, weight, bias, self.stride, self.padding)
        return super()._conv_forward(input, weight, bias)


class PinnedGroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` computed as ``batch_norm`` over ``N x groups`` rows on CPU in a pinned process."""

    def forward(self, input):
        if not _pinned(input):
            return super().forward(input)
        n, channels = input.shape[:2]
        normalized = F.batch_norm(input.reshape(1, n * self.num_groups, -1), None, None, training=True,
                                  momentum=0.0, eps=self.eps).view(input.shape)
        if not self.affine:
            return normalized
        shape = (1, channels) + (1,) * (input.dim() - 2)
        return normalized * self.weight.view(shape) + self.bias.view(shape)


def use_pinned_layers(network: nn.Module) -> nn.Module:
    """Swap ``network``'s ``nn.Conv3d`` and ``nn.GroupNorm`` modules for the pinned ones, in place.

    Raises:
        ValueError: a convolution this module does not compute (dilated, grouped, or padded other than
            with zeros).
    """
    for name, module in network.named_modules():
        if type(module) is nn.Conv3d:
            if module.groups != 1 or module.dilation != (1, 1, 1) or module.padding_mode != "zeros" \
                    or isinstance(module.padding, str):
                raise ValueError(f"{name}: a pinned Conv3d needs one group, no dilation and numeric zero padding")
            module.__class__ = PinnedConv3d
        elif type(module) is nn.GroupNorm:
            module.__class__ = PinnedGroupNorm
    return network
