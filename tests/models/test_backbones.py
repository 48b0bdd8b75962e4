"""Registry-wide backbone tests, parametrized over ``BACKBONES``: a backbone without a recipe or a full-size
target fails here. Also the nnU-Net planner, the deep-supervision wrapper and the recipe-load shape rules.

Run: ``OMP_NUM_THREADS=1 .venv/bin/pytest tests/test_backbones.py -x -q``
"""

from __future__ import annotations

import inspect
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from lightning_modules.models.backbones import BACKBONES, build_backbone, get_backbone
from lightning_modules.models.backbones.deep_supervision import DeepSupervisionOutput
from lightning_modules.models.backbones.nnunet import TOPOLOGY_OPTIONS, build_nnunet
from lightning_modules.models.planning import (
    estimate_feature_map_voxels,
    feature_map_budget,
    network_topology,
    plan_from_cohort,
    plan_nnunet,
    read_ct_geometry,
    resolve_planned_recipe,
    target_spacing,
)
from lightning_modules.data.cohort import write_case, write_metadata
from lightning_modules.recipe import RecipeError, load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
NAMES = sorted(BACKBONES)
PATCH = (32, 32, 32)
OUT_CHANNELS = 3  # background, pancreas, pancreatic lesion

# Full-size parameter counts in millions, 1 input and 3 output channels (the reference implementations;
# BenchX/Touchstone configurations). Measured values are within 2%.
FULL_SIZE_MILLIONS = {
    "unet": 7.76,
    "unetr": 92.7,
    "swin_unetr_tiny": 4.08,
    "swin_unetr_small": 15.70,
    "swin_unetr_base": 62.19,
    "nnunet": 31.2,
    "resenc": 102.4,
    "mednext": 61.78,
    "universal_model_a": 19.1,  # backbone; class heads, controller and embeddings add ~0.15 M
    "universal_model_b": 62.2,
    "stunet_b": 58.2,
    "vsmtrans": 50.0,
}
# A typical abdominal CT at the Touchstone 1.5 mm resampling (512 x 512 x 300 voxels of
# 0.78 x 0.78 x 1.5 mm): what the planned backbones are sized for at full size.
TYPICAL_CT_SPACING = (1.5, 1.5, 1.5)
TYPICAL_CT_SHAPE = (266, 266, 300)


def recipe_path(name: str):
    return RECIPES / f"{name}.yaml"


def cpu_network(name: str) -> torch.nn.Module:
    recipe = load_recipe(recipe_path(name), ["profile=cpu"])
    options = OmegaConf.to_container(recipe.model.options, resolve=True)
    return build_backbone(name, 1, len(recipe.data.classes) + 1, tuple(recipe.data.patch_size), **options)


def expected_channels(name: str) -> int:
    return OUT_CHANNELS if get_backbone(name).output == "softmax" else OUT_CHANNELS - 1


def fixed_batch(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A bright 'organ' sphere with a darker 'lesion' inside, on noise: labels 0/1/2."""
    generator = torch.Generator().manual_seed(0)
    grid = torch.stack(torch.meshgrid(*[torch.arange(s, dtype=torch.float32) for s in PATCH], indexing="ij"))
    distance = (grid - 15.5).pow(2).sum(0).sqrt()
    labels = torch.zeros(PATCH, dtype=torch.long)
    labels[distance < 10] = 1
    labels[distance < 4] = 2
    image = 0.1 * torch.randn((batch, 1, *PATCH), generator=generator)
    image = image + 0.8 * (labels == 1).float() + 0.4 * (labels == 2).float()
    return image, labels.expand(batch, 1, *PATCH).clone()


# ----------------------------------------------------------------------------------------------
# Registry-wide


@pytest.mark.parametrize("name", NAMES)
def test_recipe_loads_full_and_cpu(name):
    path = recipe_path(name)
    assert path.exists(), f"backbone {name!r} is registered but {path} is missing"
    text = path.read_text()
    assert text.startswith("#") and f"benchx train --recipe recipes/{name}.yaml" in text, (
        f"{path} must start with a comment showing the command that runs it"
    )
    for overrides in ([], ["profile=cpu"]):
        recipe = load_recipe(path, overrides)  # binds the options to the builder and checks shape rules
        assert recipe.model.backbone == name
    cpu = load_recipe(path, ["profile=cpu"])
    assert list(cpu.data.patch_size) == list(PATCH)


@pytest.mark.parametrize("name", NAMES)
def test_cpu_forward_backward_and_output_modes(name):
    torch.manual_seed(0)
    network = cpu_network(name)
    image, _ = fixed_batch()
    channels = expected_channels(name)

    network.train()
    outputs = network(image)
    if get_backbone(name).deep_supervision:
        assert isinstance(outputs, list) and len(outputs) >= 2, f"{name}: train mode must return a list of scales"
        assert outputs[0].shape == (2, channels, *PATCH), "full resolution first"
        for finer, coarser in zip(outputs, outputs[1:]):
            assert coarser.shape[:2] == (2, channels)
            assert all(c <= f for c, f in zip(coarser.shape[2:], finer.shape[2:]))
            assert np.prod(coarser.shape[2:]) < np.prod(finer.shape[2:])
    else:
        assert isinstance(outputs, torch.Tensor)
        assert outputs.shape == (2, channels, *PATCH)
        outputs = [outputs]
    sum(o.float().mean() for o in outputs).backward()
    unused = [n for n, p in network.named_parameters() if p.requires_grad and p.grad is None]
    assert not unused, f"{name}: parameters without gradient (breaks DDP): {unused[:5]}"
    assert all(torch.isfinite(p.grad).all() for p in network.parameters() if p.grad is not None)

    network.eval()
    with torch.no_grad():
        logits = network(image)
    assert isinstance(logits, torch.Tensor), f"{name}: eval mode must return one tensor"
    assert logits.shape == (2, channels, *PATCH)


@pytest.mark.parametrize("name", NAMES)
def test_recipe_optimizer_lowers_loss_on_fixed_batch(name):
    """A few steps of the recipe's optimizer (SegmentationModule's Dice+CE, deep supervision included)."""
    from lightning_modules.models.checkpoints import build_module

    torch.manual_seed(0)
    # At the recipe's learning rate: a warm-up schedule starts from 0 (tested in test_segmentation_module.py).
    recipe = load_recipe(recipe_path(name), ["profile=cpu", "optim.warmup_steps=0"])
    module = build_module(recipe)
    optimizer = module.configure_optimizers()["optimizer"]
    image, labels = fixed_batch()
    module.train()
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = module.compute_loss(module(image), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().item())
    with torch.no_grad():
        final = float(module.compute_loss(module(image), labels))
    assert np.isfinite(losses).all()
    assert final < losses[0], f"{name}: loss {losses[0]:.4f} -> {final:.4f} ({recipe.optim.name}, lr {recipe.optim.lr})"


def full_size_options(name: str) -> tuple[dict, tuple[int, ...]]:
    recipe = load_recipe(recipe_path(name))
    options = OmegaConf.to_container(recipe.model.options, resolve=True)
    patch = tuple(int(p) for p in recipe.data.patch_size)
    if all(options.get(key) == "auto" for key in TOPOLOGY_OPTIONS):
        architecture = "plain" if name == "nnunet" else "resenc"
        plan = plan_nnunet(
            TYPICAL_CT_SPACING, TYPICAL_CT_SHAPE, architecture=architecture, gpu_memory_gb=options["gpu_memory_gb"] or 24.0
        )
        options.update({key: plan[key] for key in TOPOLOGY_OPTIONS})
        patch = tuple(plan["patch_size"])
    return options, patch


@pytest.mark.parametrize("name", NAMES)
def test_full_size_parameter_count(name):
    assert name in FULL_SIZE_MILLIONS, f"backbone {name!r} has no full-size parameter target in this test"
    options, patch = full_size_options(name)
    network = build_backbone(name, 1, OUT_CHANNELS, patch, **options)
    millions = sum(p.numel() for p in network.parameters()) / 1e6
    assert millions == pytest.approx(FULL_SIZE_MILLIONS[name], rel=0.02), f"{name}: {millions:.2f} M"


# ----------------------------------------------------------------------------------------------
# Shape rules at recipe load


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("swin_unetr_tiny", ["data.patch_size=[48,48,48]"], "divisible by 32"),
        ("swin_unetr_small", ["model.options.feature_size=16"], "divisible by 12"),
        ("swin_unetr_base", ["model.options.num_heads=[5,6,12,24]"], "num_heads"),
        ("unetr", ["data.patch_size=[40,40,40]"], "divisible by 16"),
        ("unetr", ["model.options.hidden_size=98"], "num_heads"),
        ("mednext", ["data.patch_size=[40,40,40]"], "divisible by 16"),
        ("mednext", ["model.options.blocks_up=[1,1,1]"], "same number of stages"),
        ("nnunet", ["data.patch_size=[32,32,20]"], "axis 2: 20 not divisible by 8"),
        ("nnunet", ["model.options.strides=auto"], "planned together"),
        ("nnunet", ["model.options.kernel_sizes=[3,3,3]"], "n_stages is 4"),
        ("resenc", ["model.options.n_blocks_per_stage=[1,2,2]"], "one entry per stage"),
        ("resenc", ["model.options.depth=3"], "accepted options"),
    ],
)
def test_shape_rules_give_recipe_error(name, overrides, message):
    with pytest.raises(RecipeError, match=message) as error:
        load_recipe(recipe_path(name), ["profile=cpu", *overrides])
    assert str(recipe_path(name)) in str(error.value)


def test_anisotropic_strides_accept_per_axis_patch():
    """Per-axis strides need per-axis divisibility only: a 32 x 32 x 16 patch with in-plane-only pooling."""
    strides = "[[1,1,1],[2,2,1],[2,2,2],[2,2,2]]"
    recipe = load_recipe(
        recipe_path("nnunet"),
        ["profile=cpu", "data.patch_size=[32,32,16]", f"model.options.strides={strides}"],
    )
    options = OmegaConf.to_container(recipe.model.options, resolve=True)
    network = build_backbone("nnunet", 1, OUT_CHANNELS, (32, 32, 16), **options).train()
    outputs = network(torch.zeros(1, 1, 32, 32, 16))
    assert [tuple(o.shape[2:]) for o in outputs] == [(32, 32, 16), (16, 16, 16), (8, 8, 8), (4, 4, 4)][:len(outputs)]


# ----------------------------------------------------------------------------------------------
# Deep supervision


def test_deep_supervision_wrapper_switches_heads_of_dynamic_network_architectures():
    network = build_nnunet(
        3, 1, 3, patch_size=PATCH, n_stages=3, strides=[1, 2, 2], kernel_sizes=[3, 3, 3], features_per_stage=[4, 8, 16]
    )
    assert isinstance(network, DeepSupervisionOutput)
    decoder = network.network.decoder
    network.eval()
    assert decoder.deep_supervision is False  # eval mode does not compute the coarse heads
    network.train()
    assert decoder.deep_supervision is True
    # A parent module's train()/eval() reaches the wrapper too (Lightning calls it on the LightningModule).
    parent = torch.nn.Sequential(network)
    parent.eval()
    assert decoder.deep_supervision is False


def test_deep_supervision_wrapper_refuses_single_tensor_in_train_mode():
    wrapped = DeepSupervisionOutput(torch.nn.Conv3d(1, 3, 1)).train()
    with pytest.raises(RuntimeError, match="heads are off"):
        wrapped(torch.zeros(1, 1, 4, 4, 4))


def test_deep_supervision_weights_are_shared_between_modes():
    """Eval output equals the first train-mode output for the same weights (no dropout, instance norm)."""
    torch.manual_seed(0)
    network = cpu_network("nnunet")
    image, _ = fixed_batch(1)
    network.train()
    with torch.no_grad():
        train_full = network(image)[0]
    network.eval()
    with torch.no_grad():
        eval_full = network(image)
    torch.testing.assert_close(train_full, eval_full)


# ----------------------------------------------------------------------------------------------
# The nnU-Net planner


def test_topology_isotropic_stops_pooling_below_eight_voxels():
    topology = network_topology((1.5, 1.5, 1.5), (128, 128, 128))
    assert topology["n_stages"] == 6
    assert topology["strides"] == [[1, 1, 1]] + [[2, 2, 2]] * 5
    assert topology["kernel_sizes"] == [[3, 3, 3]] * 6
    bottleneck = [p // d for p, d in zip(topology["patch_size"], topology["divisors"])]
    assert bottleneck == [4, 4, 4]  # 8 -> 4 was the last pooling; 4 < 8 stops it


def test_topology_anisotropic_pools_in_plane_first_with_in_plane_kernels():
    topology = network_topology((0.8, 0.8, 2.5), (256, 256, 80))
    assert topology["strides"][1] == [2, 2, 1]  # z (2.5 mm) is more than 2x coarser: not pooled yet
    assert topology["kernel_sizes"][0] == [3, 3, 1]  # and no context along z at full resolution
    assert topology["strides"][2] == [2, 2, 2]  # after one in-plane pooling (1.6 mm) z is within 2x
    assert topology["kernel_sizes"][-1] == [3, 3, 3]
    for size, divisor in zip(topology["patch_size"], topology["divisors"]):
        assert size % divisor == 0 and size // divisor >= 4


def test_topology_rounds_patch_up_to_its_divisors():
    topology = network_topology((1.0, 1.0, 1.0), (100, 90, 70))
    assert all(p % d == 0 for p, d in zip(topology["patch_size"], topology["divisors"]))
    assert all(0 <= p - q < d for p, q, d in zip(topology["patch_size"], (100, 90, 70), topology["divisors"]))


def test_plan_fits_budget_and_grows_with_memory():
    plans = {gb: plan_nnunet(TYPICAL_CT_SPACING, TYPICAL_CT_SHAPE, gpu_memory_gb=gb) for gb in (4, 8, 16)}
    for gb, plan in plans.items():
        assert plan["feature_map_budget"] == pytest.approx(feature_map_budget("plain", gb))
        assert plan["feature_map_voxels"] <= plan["feature_map_budget"]
        assert plan["features_per_stage"] == [min(32 * 2**i, 320) for i in range(plan["n_stages"])]
        assert len(plan["strides"]) == len(plan["kernel_sizes"]) == plan["n_stages"]
        # the estimate reported is the one for the planned network
        estimate = estimate_feature_map_voxels("plain", plan["patch_size"], plan, plan["features_per_stage"])
        assert plan["feature_map_voxels"] == estimate
    volumes = [np.prod(plans[gb]["patch_size"]) for gb in (4, 8, 16)]
    assert volumes == sorted(volumes) and volumes[0] < volumes[-1]
    assert plans[8]["n_stages"] == 6  # the 6-stage nnU-Net of the full-size target


def test_plan_keeps_small_datasets_whole_and_refuses_impossible_budgets():
    plan = plan_nnunet((1.5, 1.5, 1.5), (40, 48, 32))
    assert plan["patch_size"] == [40, 48, 32]  # fits: the median shape, rounded to the divisors
    with pytest.raises(ValueError, match="raise gpu_memory_gb"):
        plan_nnunet((1.5, 1.5, 1.5), (64, 64, 64), feature_map_budget_voxels=1000)
    with pytest.raises(ValueError, match="too small to pool"):
        plan_nnunet((1.5, 1.5, 1.5), (6, 6, 6))


def test_plan_shrinks_axis_largest_relative_to_median_shape():
    # A long z axis at isotropic spacing: the patch is cut along z, which is largest relative to the median shape.
    plan = plan_nnunet((1.0, 1.0, 1.0), (160, 160, 1000), gpu_memory_gb=8)
    assert plan["patch_size"][2] > plan["patch_size"][0]
    ratios = [p / s for p, s in zip(plan["patch_size"], (160, 160, 1000))]
    assert ratios[2] < ratios[0]


def test_target_spacing_uses_tenth_percentile_for_thick_slices():
    spacings = np.array([[0.8, 0.8, 5.0]] * 6 + [[0.8, 0.8, 1.0]] * 4)
    shapes = np.array([[512, 512, 60]] * 10)
    target = target_spacing(spacings, shapes)
    assert target[:2] == [0.8, 0.8]
    assert target[2] == pytest.approx(np.percentile(spacings[:, 2], 10))
    isotropic = target_spacing(np.array([[1.0, 1.0, 1.5]] * 3), np.array([[300, 300, 200]] * 3))
    assert isotropic == [1.0, 1.0, 1.5]


def _write_header_cohort(root, cases):
    """Cases of (shape, affine): zero volumes, only headers matter to the planner."""
    root.mkdir(parents=True, exist_ok=True)
    for index, (shape, affine) in enumerate(cases):
        write_case(root, f"C{index:02d}", np.zeros(shape, dtype=np.int16), affine, {})
    write_metadata(root, pd.DataFrame({"case_id": [f"C{i:02d}" for i in range(len(cases))]}))


def test_read_ct_geometry_agrees_with_nibabel_canonical_orientation(tmp_path):
    # voxel axis 0 runs along S (3 mm), axis 1 along R (2 mm), axis 2 along A (1.5 mm)
    affine = np.array([[0, 2.0, 0, 0], [0, 0, 1.5, 0], [3.0, 0, 0, 0], [0, 0, 0, 1]])
    _write_header_cohort(tmp_path / "cohort", [((10, 12, 14), affine)])
    path = tmp_path / "cohort" / "C00" / "ct.nii.gz"
    spacing, shape = read_ct_geometry(path)
    canonical = nib.as_closest_canonical(nib.load(path))
    assert shape == list(canonical.shape)
    assert spacing == pytest.approx(canonical.header.get_zooms()[:3])


def test_plan_from_cohort_and_resolved_recipe_build(tmp_path):
    root = tmp_path / "cohort"
    cases = [((16, 16, 10), np.diag([2.25, 2.25, 2.4, 1.0])), ((18, 16, 12), np.diag([2.0, 2.25, 2.0, 1.0]))]
    _write_header_cohort(root, cases)
    plan = plan_from_cohort(root, spacing=(1.5, 1.5, 1.5))
    resampled = np.median(
        [[16 * 2.25 / 1.5, 16 * 2.25 / 1.5, 10 * 2.4 / 1.5], [18 * 2.0 / 1.5, 16 * 2.25 / 1.5, 12 * 2.0 / 1.5]], axis=0
    )
    assert plan["n_cases"] == 2
    assert plan["median_shape"] == pytest.approx(resampled.round(1).tolist())
    assert plan == {**plan_nnunet((1.5, 1.5, 1.5), resampled), "n_cases": 2}

    recipe = load_recipe(recipe_path("nnunet"), [f"data.root={root}"])
    resolved, resolved_plan = resolve_planned_recipe(recipe)
    assert resolved_plan == plan
    assert list(resolved.data.patch_size) == plan["patch_size"]
    assert list(recipe.data.patch_size) == [128, 128, 128]  # the input recipe is not modified
    options = OmegaConf.to_container(resolved.model.options, resolve=True)
    network = build_backbone("nnunet", 1, 3, tuple(plan["patch_size"]), **options).eval()
    with torch.no_grad():
        assert network(torch.zeros(1, 1, *plan["patch_size"])).shape == (1, 3, *plan["patch_size"])

    unplanned = load_recipe(recipe_path("nnunet"), ["profile=cpu"])
    assert resolve_planned_recipe(unplanned) == (unplanned, None)

    # target_spacing median: nnU-Net's target spacing (the median here) replaces data.spacing.
    median_recipe = load_recipe(recipe_path("resenc"), [f"data.root={root}", "model.options.target_spacing=median",
                                                        "model.options.preset=M"])
    median_resolved, median_plan = resolve_planned_recipe(median_recipe)
    assert list(median_resolved.data.spacing) == pytest.approx([2.125, 2.25, 2.2])
    assert median_plan["spacing"] == pytest.approx([2.125, 2.25, 2.2])
    assert median_plan["architecture"] == "resenc_m" and median_plan["feature_map_budget"] == pytest.approx(680e6)


def test_plan_from_cohort_names_the_case_with_a_missing_ct(tmp_path):
    root = tmp_path / "cohort"
    _write_header_cohort(root, [((8, 8, 8), np.eye(4)), ((8, 8, 8), np.eye(4))])
    (root / "C01" / "ct.nii.gz").unlink()
    with pytest.raises(ValueError, match="case C01: CT file .*ct.nii.gz is missing"):
        plan_from_cohort(root)


def test_unplanned_auto_topology_is_refused_at_build():
    with pytest.raises(ValueError, match="resolve_planned_recipe"):
        build_nnunet(3, 1, 3, patch_size=PATCH)


def test_builders_share_the_registry_signature():
    for name in NAMES:
        parameters = list(inspect.signature(get_backbone(name).builder).parameters.values())
        assert [p.name for p in parameters[:3]] == ["spatial_dims", "in_channels", "out_channels"], name
        keyword_only = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert "patch_size" in keyword_only, name
