"""nnU-Net's topology rule (rule 4 of ``lightning_modules.models.planning``): the strides and kernel
sizes of a U-Net for a patch at a spacing. Pure: it imports nothing of the project, so the planner
and the backbones that derive their strides from a plan (STU-Net) both use it without a cycle.

Example::

    network_topology((1.5, 1.5, 1.5), (96, 96, 96))["strides"]  # [[1,1,1], [2,2,2] x 4]
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

# The smallest edge a pooled feature map keeps (nnU-Net: 4 voxels).
MIN_FEATURE_MAP_EDGE = 4


def shape_divisors(strides: Sequence[Sequence[int]]) -> list[int]:
    """Per axis, the product of the strides: each patch dimension must be a multiple of it."""
    return [int(np.prod([stage[axis] for stage in strides])) for axis in range(len(strides[0]))]


def network_topology(
    spacing: Sequence[float], patch_size: Sequence[int], min_edge: int = MIN_FEATURE_MAP_EDGE
) -> dict:
    """Strides, kernel sizes and the rounded-up patch for a patch at a spacing (rule 4 of the docstring).

    Returns:
        ``n_stages``, ``strides`` and ``kernel_sizes`` (one list per stage, one value per axis),
        ``patch_size`` rounded up to a multiple of ``divisors`` (the total stride per axis).
    """
    dims = len(spacing)
    spacing_now = [float(s) for s in spacing]
    size_now = [int(p) for p in patch_size]
    kernel = [1] * dims
    strides: list[list[int]] = [[1] * dims]
    kernels: list[list[int]] = []
    while True:
        # An axis can be pooled while the pooled map keeps at least `min_edge` voxels.
        poolable = [a for a in range(dims) if size_now[a] >= 2 * min_edge]
        if not poolable:
            break
        finest = min(spacing_now[a] for a in poolable)
        # Pool only axes close to the finest spacing, so anisotropic voxels become isotropic first.
        poolable = [a for a in poolable if spacing_now[a] / finest < 2]
        # Pooling one axis alone only pays while it is still long.
        if len(poolable) == 1 and size_now[poolable[0]] < 3 * min_edge:
            break
        overall_finest = min(spacing_now)
        for axis in range(dims):
            if kernel[axis] == 1 and spacing_now[axis] / overall_finest < 2:
                kernel[axis] = 3
        kernels.append(list(kernel))
        stride = [2 if a in poolable else 1 for a in range(dims)]
        for axis in poolable:
            spacing_now[axis] *= 2
            size_now[axis] = math.ceil(size_now[axis] / 2)
        strides.append(stride)
    # The bottleneck always gets full kernels.
    kernels.append([3] * dims)
    divisors = shape_divisors(strides)
    rounded = [math.ceil(int(p) / d) * d for p, d in zip(patch_size, divisors)]
    return dict(n_stages=len(strides), strides=strides, kernel_sizes=kernels, patch_size=rounded, divisors=divisors)
