"""nnU-Net's planning, apart from its networks (as nnU-Net v2 keeps its planners apart from
``dynamic_network_architectures``): patch size and topology for ``nnunet`` and ``resenc`` recipes
whose topology options are ``auto``.

nnU-Net does not fix the patch or the depth: it plans them from the dataset. This module follows
its published rules (our implementation, not nnU-Net's code):

1. Target spacing: the recipe's (``data.spacing``), or else the median spacing, with the 10th
   percentile for one axis that is more than 3x coarser than the others and has 3x fewer voxels.
2. Median shape of the cases after resampling to that spacing (in RAS axis order, as the
   datamodule orients them). Headers only: no voxel data is read.
3. Initial patch: 256^3 voxels, shaped like a cube in millimetres, clipped to the median shape.
4. Topology: pool (stride 2) the axes whose spacing is within 2x of the finest one, as long as the
   result keeps at least 4 voxels (an axis pooled alone needs 12); an axis gets a 3-wide kernel
   once its spacing comes within 2x of the finest (1 before, for very anisotropic data); the
   patch is rounded up to a multiple of each axis's total stride.
5. Budget: while the network's feature maps at that patch (``compute_conv_feature_map_size`` of
   dynamic_network_architectures, the quantity nnU-Net calibrates) exceed the budget, shrink the
   axis that is largest relative to the median shape by one stride step and re-plan the topology.
   The budget is nnU-Net's calibration: 560 M feature-map voxels per 8 GB for the plain U-Net
   (ExperimentPlanner); for ResEnc the presets of nnU-Net's planners, M 680 M per 8 GB, L 2.1 G per
   24 GB, XL 3.6 G per 40 GB (``model.options.preset``), scaled to ``gpu_memory_gb`` (by default
   the preset's own 8, 24 or 40 GB).

Target spacing: the recipe's ``data.spacing`` (Touchstone's fixed 1.5 mm), or with
``model.options.target_spacing: median`` nnU-Net's rule 1 on the training cases' headers, which
then replaces ``data.spacing`` for training. Cross-checked against nnU-Net's own planners
(nnunetv2) in ``tests/models/test_planning_nnunet.py``.

Not planned here: the batch size (BenchX table 8 fixes 2), 2D and low-resolution cascade
configurations, and the axis transposition nnU-Net applies.

Example::

    plan = plan_nnunet((1.5, 1.5, 1.5), (240, 240, 300), gpu_memory_gb=8)
    net = build_nnunet(3, 1, 3, patch_size=plan["patch_size"], n_stages=plan["n_stages"],
                       strides=plan["strides"], kernel_sizes=plan["kernel_sizes"],
                       features_per_stage=plan["features_per_stage"])
    recipe, plan = resolve_planned_recipe(recipe, case_ids=training_case_ids)  # what training does
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import nibabel as nib
import numpy as np
import torch
from omegaconf import OmegaConf

from lightning_modules.config.recipe import check_values
from lightning_modules.data.cohort import load_cohort
from lightning_modules.models.backbones import check_model_section, get_backbone
from lightning_modules.models.topology import MIN_FEATURE_MAP_EDGE, network_topology, shape_divisors  # noqa: F401 (re-exported)
from lightning_modules.models.backbones.nnunet import (
    RESENC_PRESETS,
    TOPOLOGY_OPTIONS,
    build_nnunet,
    build_resenc,
    is_planned,
)

# nnU-Net's calibration of its feature-map estimate against GPU memory (batch size 2):
# (feature-map voxels, GB it corresponds to). ExperimentPlanner and nnUNetPlannerResEncM/L/XL
# ("resenc" is L, the BenchX setting).
FEATURE_MAP_REFERENCE = {
    "plain": (560e6, 8.0),
    "resenc": (2.1e9, 24.0),
    "resenc_m": (680e6, 8.0),
    "resenc_l": (2.1e9, 24.0),
    "resenc_xl": (3.6e9, 40.0),
}
# Voxels of the initial patch before it is fitted to the budget (nnU-Net: 256^3).
INITIAL_PATCH_VOXELS = 256**3
ANISOTROPY_THRESHOLD = 3.0
BASE_FEATURES = 32
MAX_FEATURES = 320
# The planner's architecture names and the builders they plan for.
PLANNED_BUILDERS = {
    "plain": build_nnunet,
    "resenc": build_resenc,
    "resenc_m": build_resenc,
    "resenc_l": build_resenc,
    "resenc_xl": build_resenc,
}


def features_per_stage(n_stages: int, base: int = BASE_FEATURES, max_features: int = MAX_FEATURES) -> list[int]:
    """nnU-Net's widths: doubling from ``base`` per stage, capped at ``max_features``."""
    return [min(base * 2**i, max_features) for i in range(n_stages)]


def estimate_feature_map_voxels(
    architecture: str,
    patch_size: Sequence[int],
    topology: dict,
    features: Sequence[int],
    in_channels: int = 1,
    out_channels: int = 3,
) -> int:
    """The feature-map size nnU-Net's memory calibration is in, for the network our builder makes.

    The network is built on the meta device: shapes without weights, a 100 M-parameter net in
    milliseconds.
    """
    builder = PLANNED_BUILDERS[architecture]
    with torch.device("meta"):
        network = builder(
            len(patch_size),
            in_channels,
            out_channels,
            patch_size=tuple(int(p) for p in patch_size),
            n_stages=topology["n_stages"],
            strides=topology["strides"],
            kernel_sizes=topology["kernel_sizes"],
            features_per_stage=list(features),
        )
    inner = getattr(network, "network", network)
    return int(inner.compute_conv_feature_map_size(tuple(int(p) for p in patch_size)))


def feature_map_budget(architecture: str, gpu_memory_gb: float) -> float:
    """nnU-Net's calibrated feature-map budget for a GPU memory target."""
    if architecture not in FEATURE_MAP_REFERENCE:
        raise ValueError(f"architecture must be one of {sorted(FEATURE_MAP_REFERENCE)}, got {architecture!r}")
    if gpu_memory_gb <= 0:
        raise ValueError(f"gpu_memory_gb must be positive, got {gpu_memory_gb}")
    voxels, gigabytes = FEATURE_MAP_REFERENCE[architecture]
    return voxels * gpu_memory_gb / gigabytes


def plan_nnunet(
    median_spacing: Sequence[float],
    median_shape: Sequence[float],
    *,
    architecture: str = "plain",
    gpu_memory_gb: float = 8.0,
    feature_map_budget_voxels: float | None = None,
    max_features: int = MAX_FEATURES,
    in_channels: int = 1,
    out_channels: int = 3,
) -> dict:
    """Plan patch size and topology from a dataset's (target) spacing and median shape (rules 3-5).

    Args:
        median_spacing: the spacing the cases are resampled to (mm per axis).
        median_shape: the median shape of the cases at that spacing (voxels per axis).
        architecture: ``plain`` (nnunet) or ``resenc``.
        gpu_memory_gb: GPU memory to fit; converted with nnU-Net's calibration.
        feature_map_budget_voxels: a feature-map budget given directly (overrides ``gpu_memory_gb``).
        max_features: the cap on channels per stage.
        in_channels: image channels.
        out_channels: background + classes.

    Returns:
        ``patch_size``, ``n_stages``, ``strides``, ``kernel_sizes``, ``features_per_stage`` (ready
        as builder options), and for the record ``spacing``, ``median_shape``, ``architecture``,
        ``feature_map_voxels`` (the estimate at the planned patch) and ``feature_map_budget``.
    """
    spacing = [float(s) for s in median_spacing]
    shape = [float(s) for s in median_shape]
    if len(spacing) != len(shape) or len(spacing) not in (2, 3):
        raise ValueError(f"median_spacing {spacing} and median_shape {shape} need 2 or 3 values each")
    if min(spacing) <= 0 or min(shape) < 1:
        raise ValueError(f"spacing must be positive and the shape at least 1 voxel: {spacing}, {shape}")
    if architecture not in FEATURE_MAP_REFERENCE:
        raise ValueError(f"architecture must be one of {sorted(FEATURE_MAP_REFERENCE)}, got {architecture!r}")
    budget = float(feature_map_budget_voxels) if feature_map_budget_voxels else feature_map_budget(architecture, gpu_memory_gb)

    # Rule 3: a patch that is a cube in millimetres, INITIAL_PATCH_VOXELS voxels, clipped to the median shape.
    inverse = 1.0 / np.asarray(spacing)
    scale = (INITIAL_PATCH_VOXELS / np.prod(inverse)) ** (1.0 / len(spacing))
    patch = [int(min(round(v * scale), s)) for v, s in zip(inverse, shape)]

    cache: dict[tuple, int] = {}

    def estimate(topology: dict) -> int:
        key = (tuple(topology["patch_size"]), str(topology["strides"]))
        if key not in cache:
            features = features_per_stage(topology["n_stages"], max_features=max_features)
            cache[key] = estimate_feature_map_voxels(
                architecture, topology["patch_size"], topology, features, in_channels, out_channels
            )
        return cache[key]

    topology = network_topology(spacing, patch)
    if topology["n_stages"] < 2:
        raise ValueError(
            f"median shape {shape} is too small to pool even once (an axis needs {2 * MIN_FEATURE_MAP_EDGE} voxels)"
        )
    while estimate(topology) > budget:
        topology = _shrink_step(topology, spacing, shape)
        if topology["n_stages"] < 2:
            raise ValueError(
                f"no U-Net with at least one pooling fits a feature-map budget of {budget:.3g} voxels "
                f"({architecture}, spacing {spacing}); raise gpu_memory_gb"
            )

    return dict(
        architecture=architecture,
        spacing=spacing,
        median_shape=[round(s, 1) for s in shape],
        patch_size=topology["patch_size"],
        n_stages=topology["n_stages"],
        strides=topology["strides"],
        kernel_sizes=topology["kernel_sizes"],
        features_per_stage=features_per_stage(topology["n_stages"], max_features=max_features),
        feature_map_voxels=estimate(topology),
        feature_map_budget=budget,
    )


def _shrink_step(topology: dict, spacing: Sequence[float], shape: Sequence[float]) -> dict:
    """Rule 5's step: shrink the axis largest relative to the median shape, and re-plan the topology
    (``n_stages`` 0 when nothing is left)."""
    patch = list(topology["patch_size"])
    # nnU-Net takes the last of np.argsort: among tied axes (equal ratios), the highest index.
    axis = int(np.argsort([p / s for p, s in zip(patch, shape)])[-1])
    # Shrink by the step that applies after shrinking: a shorter axis may need fewer poolings and
    # so admit finer sizes (256 -> 224 rather than 192 when the divisor drops from 64 to 32).
    trial = list(patch)
    trial[axis] -= topology["divisors"][axis]
    step = network_topology(spacing, trial)["divisors"][axis] if trial[axis] > 0 else topology["divisors"][axis]
    patch[axis] -= step
    return network_topology(spacing, patch) if patch[axis] >= 1 else dict(n_stages=0)


def target_spacing(spacings: np.ndarray, shapes: np.ndarray) -> list[float]:
    """Rule 1: the median spacing, except for one axis that is far coarser and shorter than the others.

    Such an axis (thick slices) gets the 10th percentile of its spacings instead, so the many
    thin-slice scans are not blurred to the median; never finer than the other axes.
    """
    target = np.median(spacings, axis=0)
    median_shape = np.median(shapes, axis=0)
    coarse = int(np.argmax(target))
    others = [a for a in range(len(target)) if a != coarse]
    anisotropic_spacing = target[coarse] > ANISOTROPY_THRESHOLD * max(target[others])
    anisotropic_voxels = median_shape[coarse] * ANISOTROPY_THRESHOLD < min(median_shape[others])
    if anisotropic_spacing and anisotropic_voxels:
        target[coarse] = max(np.percentile(spacings[:, coarse], 10), max(target[others]))
    return [float(s) for s in target]


def read_ct_geometry(path: Path) -> tuple[list[float], list[int]]:
    """Spacing and shape of a CT in RAS axis order, from its NIfTI header only."""
    image = nib.load(str(path))
    shape = image.header.get_data_shape()[:3]
    zooms = image.header.get_zooms()[:3]
    if len(shape) != 3 or min(shape) < 1 or min(zooms) <= 0:
        raise ValueError(f"{path}: not a 3D volume with positive spacing (shape {shape}, spacing {zooms})")
    # The datamodule reorients to RAS, which may permute axes; plan in that order.
    ras_axis = nib.io_orientation(image.affine)[:, 0].astype(int)
    ras_shape, ras_zooms = [0] * 3, [0.0] * 3
    for axis in range(3):
        ras_shape[ras_axis[axis]] = int(shape[axis])
        ras_zooms[ras_axis[axis]] = float(zooms[axis])
    return ras_zooms, ras_shape


def plan_from_cohort(
    root: str | Path,
    spacing: Sequence[float] | None = None,
    *,
    case_ids: Sequence[str] | None = None,
    architecture: str = "plain",
    gpu_memory_gb: float = 8.0,
    max_features: int = MAX_FEATURES,
    in_channels: int = 1,
    out_channels: int = 3,
) -> dict:
    """Plan from a cohort's CT headers (rules 1-5): the plan of :func:`plan_nnunet` plus ``n_cases``.

    Args:
        root: the cohort folder (layout A or B).
        spacing: the spacing training resamples to (``data.spacing``); ``None``: nnU-Net's target
            spacing (rule 1).
        case_ids: the cases to plan from (the training split); ``None``: every case.
        architecture: ``plain`` (nnunet) or ``resenc``.
        gpu_memory_gb: GPU memory to fit.
        max_features: the cap on channels per stage.
        in_channels: image channels.
        out_channels: background + classes.
    """
    cohort = load_cohort(root)
    ids = list(case_ids) if case_ids is not None else cohort.case_ids
    if not ids:
        raise ValueError(f"cohort {root}: no cases to plan from")
    spacings, shapes, problems = [], [], []
    for case_id in ids:
        try:
            case = cohort.case(case_id)
        except KeyError as error:
            problems.append(str(error))
            continue
        if not case.ct_path.exists():
            problems.append(f"case {case_id}: CT file {case.ct_path} is missing")
            continue
        try:
            case_spacing, case_shape = read_ct_geometry(case.ct_path)
        except Exception as error:  # nibabel raises several types for unreadable headers
            problems.append(f"case {case_id}: cannot read the header of {case.ct_path}: {error}")
            continue
        spacings.append(case_spacing)
        shapes.append(case_shape)
    if problems:
        raise ValueError(f"cohort {root}: cannot plan nnU-Net:\n" + "\n".join(f"  - {p}" for p in problems))
    spacings_arr, shapes_arr = np.asarray(spacings), np.asarray(shapes, dtype=float)
    target = [float(s) for s in spacing] if spacing is not None else target_spacing(spacings_arr, shapes_arr)
    resampled = shapes_arr * spacings_arr / np.asarray(target)
    plan = plan_nnunet(
        target,
        np.median(resampled, axis=0),
        architecture=architecture,
        gpu_memory_gb=gpu_memory_gb,
        max_features=max_features,
        in_channels=in_channels,
        out_channels=out_channels,
    )
    plan["n_cases"] = len(ids)
    return plan


def resolve_planned_recipe(recipe, case_ids: Sequence[str] | None = None):
    """Plan a recipe whose nnunet/resenc topology is ``auto``; other recipes come back unchanged.

    Training calls this before building the backbone and logs the plan.

    Args:
        recipe: a loaded recipe (``lightning_modules.recipe.load_recipe``).
        case_ids: the training cases to plan from; ``None``: the whole cohort.

    Returns:
        ``(recipe, plan)``: a copy with ``data.patch_size`` and the topology options filled in and
        re-checked, and the plan dict; or ``(recipe, None)`` when nothing is planned.
    """
    builder = get_backbone(recipe.model.backbone).builder
    architecture = next((name for name, b in PLANNED_BUILDERS.items() if b is builder), None)
    options = OmegaConf.to_container(recipe.model.options, resolve=True)
    if architecture is None or not is_planned(options):
        return recipe, None
    if architecture != "plain":
        preset = str(options.get("preset", "L")).upper()
        architecture = f"resenc_{preset.lower()}"
        default_memory = RESENC_PRESETS[preset]
    else:
        default_memory = 8.0
    median = options.get("target_spacing", "recipe") == "median"
    memory = options.get("gpu_memory_gb")
    plan = plan_from_cohort(
        recipe.data.root,
        None if median else list(recipe.data.spacing),
        case_ids=case_ids,
        architecture=architecture,
        gpu_memory_gb=float(memory if memory is not None else default_memory),
        out_channels=len(recipe.data.classes) + 1,
    )
    resolved = copy.deepcopy(recipe)
    resolved.data.patch_size = list(plan["patch_size"])
    if median:
        resolved.data.spacing = [round(float(s), 4) for s in plan["spacing"]]
    for key in TOPOLOGY_OPTIONS:
        resolved.model.options[key] = plan[key]
    # What planning changed: the patch and spacing values, and the topology against the builder.
    check_values(resolved, source=f"{recipe.name} (planned)")
    check_model_section(resolved.model, resolved.data, resolved.trainer, source=f"{recipe.name} (planned)")
    return resolved, plan
