"""Architecture-specific checks of the backbones written from their papers: Universal Model a/b,
STU-Net-B and VSmTrans (the registry-wide checks live in tests/test_backbones.py).

Tiny builds on 32^3 inputs check output shapes, deep-supervision scales, determinism, the
Universal Model's text-embedding file and controller, VSmTrans's windows (against MONAI's Swin
window attention) and its option rules, and the full-size parameter counts.

Run: ``OMP_NUM_THREADS=1 .venv/bin/pytest tests/test_backbone_architectures.py -x -q``
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from monai.networks.nets.swin_unetr import SwinTransformerBlock, compute_mask
from omegaconf import OmegaConf

from lightning_modules.models.backbones import build_backbone
from lightning_modules.models.backbones.stunet import build_stunet
from lightning_modules.models.backbones.universal_model import (
    REFERENCE_CLASS_NAMES,
    BatchStatisticsNorm3d,
    build_universal_model,
    dynamic_head_param_count,
    load_class_embeddings,
)
from lightning_modules.models.backbones.vsmtrans import WindowShapeAttention, build_vsmtrans, window_shapes
from lightning_modules.recipe import RecipeError, load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
PATCH = (32, 32, 32)
N_CLASSES = 2  # pancreas, pancreatic lesion
OUT_CHANNELS = N_CLASSES + 1
MINE = ("universal_model_a", "universal_model_b", "stunet_b", "vsmtrans")


def image(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn((batch, 1, *PATCH), generator=torch.Generator().manual_seed(seed))


def tiny(name: str, **overrides) -> torch.nn.Module:
    """The backbone of a recipe's CPU profile, with options overridden."""
    recipe = load_recipe(RECIPES / f"{name}.yaml", ["profile=cpu"])
    options = {**OmegaConf.to_container(recipe.model.options, resolve=True), **overrides}
    return build_backbone(name, 1, OUT_CHANNELS, PATCH, **options)


def tiny_universal(backbone: str = "unet3d", **options) -> torch.nn.Module:
    if backbone == "unet3d":
        defaults = dict(channels=(8, 16, 32, 64))
    else:
        defaults = dict(feature_size=12, depths=(1, 1, 1, 1), norm=("group", {"num_groups": 4}))
    return build_universal_model(3, 1, OUT_CHANNELS, patch_size=PATCH, backbone=backbone, **{**defaults, **options})


# ----------------------------------------------------------------------------------------------
# Universal Model


@pytest.mark.parametrize("backbone", ["unet3d", "swin"])
def test_universal_model_returns_one_sigmoid_channel_per_class(backbone):
    torch.manual_seed(0)
    network = tiny_universal(backbone).train()
    logits = network(image())
    assert logits.shape == (2, N_CLASSES, *PATCH)  # no background channel
    logits.mean().backward()
    grads = {name: p.grad for name, p in network.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["class_embeddings.weight"].abs().sum() > 0  # learned embeddings get trained


def test_universal_model_branches_and_controller_follow_the_reference():
    """Image branch GN-ReLU-pool-1x1 to 256, controller 1x1 conv 512 -> 153, segmentor input GN-ReLU-1x1 to 8."""
    assert dynamic_head_param_count(8) == 153  # (64 + 8) + (64 + 8) + (8 + 1)
    network = tiny_universal().eval()
    assert [type(m) for m in network.image_branch] == [
        torch.nn.GroupNorm, torch.nn.ReLU, torch.nn.AdaptiveAvgPool3d, torch.nn.Conv3d
    ]
    assert network.image_branch[3].out_channels == 256 and network.image_branch[0].num_channels == 64
    assert [type(m) for m in network.head_input] == [torch.nn.GroupNorm, torch.nn.ReLU, torch.nn.Conv3d]
    assert network.head_input[2].out_channels == 8
    assert isinstance(network.controller, torch.nn.Conv3d)
    assert (network.controller.in_channels, network.controller.out_channels) == (512, 153)
    assert network.controller.kernel_size == (1, 1, 1)
    assert network.class_embeddings.weight.shape == (N_CLASSES, 256)  # the reference's rand_embedding
    _, bottleneck = network.backbone(image())
    theta = network.class_parameters(bottleneck)
    assert theta.shape == (2, N_CLASSES, 153)
    assert not torch.allclose(theta[:, 0], theta[:, 1])  # each class gets its own head


def test_unet3d_variant_normalizes_with_batch_statistics_in_eval():
    network = tiny_universal().eval()
    norms = [m for m in network.backbone.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert norms and all(isinstance(m, BatchStatisticsNorm3d) for m in norms)
    x = torch.randn(4, 3, 4, 4, 4) * 5 + 2
    y = norms[0].__class__(3).eval()(x)
    torch.testing.assert_close(y.mean(dim=(0, 2, 3, 4)), torch.zeros(3), atol=1e-5, rtol=0)  # not running stats
    with torch.no_grad():
        alone = network(image(1))
        in_batch = network(torch.cat([image(1), image(1, seed=3)]))[:1]
    assert not torch.allclose(alone, in_batch)  # the reference's behaviour: depends on the batch


def test_dynamic_heads_agree_with_per_class_conv3d():
    """The batched einsum equals the reference's split (weights 64, 64, 8 then biases 8, 8, 1) run as conv3d."""
    torch.manual_seed(0)
    network = tiny_universal().eval()
    x = image()
    with torch.no_grad():
        logits = network(x)
        features, bottleneck = network.backbone(x)
        head_input = network.head_input(features)
        theta = network.class_parameters(bottleneck)
    c = network.head_channels
    for b in range(2):
        for k in range(N_CLASSES):
            w1, w2, w3, b1, b2, b3 = torch.split(theta[b, k], [c * c, c * c, c, c, c, 1])
            h = F.relu(F.conv3d(head_input[b : b + 1], w1.reshape(c, c, 1, 1, 1), b1))
            h = F.relu(F.conv3d(h, w2.reshape(c, c, 1, 1, 1), b2))
            expected = F.conv3d(h, w3.reshape(1, c, 1, 1, 1), b3)[0, 0]
            torch.testing.assert_close(logits[b, k], expected, rtol=1e-4, atol=1e-5)


def test_class_embedding_steers_only_its_own_channel():
    torch.manual_seed(0)
    network = tiny_universal()
    x = image()
    with torch.no_grad():
        network.train()  # batch statistics in both modes: compare like with like
        before = network(x)
        network.class_embeddings.weight[1] += 1.0
        after = network(x)
    torch.testing.assert_close(before[:, 0], after[:, 0])
    assert not torch.allclose(before[:, 1], after[:, 1])


def test_reference_format_embedding_file_rows_are_chosen_by_name(tmp_path):
    """A bare [32, 512] tensor in the reference's class order (its txt_encoding.pth): rows by name."""
    table = torch.randn(len(REFERENCE_CLASS_NAMES), 512, generator=torch.Generator().manual_seed(0)).half()
    path = tmp_path / "txt_encoding.pth"
    torch.save(table, path)
    rows = load_class_embeddings(path, ["pancreas", "pancreatic_lesion"])
    pancreas, tumor = REFERENCE_CLASS_NAMES.index("Pancreas"), REFERENCE_CLASS_NAMES.index("Pancreas Tumor")
    torch.testing.assert_close(rows, table[[pancreas, tumor]].float())
    network = tiny_universal(text_embeddings_path=str(path), class_names=["pancreas", "pancreatic_lesion"])
    torch.testing.assert_close(network.text_embeddings, rows)
    assert "text_embeddings" not in dict(network.named_parameters())  # frozen, as CLIP's are in the paper
    assert "text_embeddings" in network.state_dict()  # saved with checkpoints
    assert (network.text_branch.in_features, network.text_branch.out_features) == (512, 256)
    assert not hasattr(network, "class_embeddings")
    assert network(image(1)).shape == (1, N_CLASSES, *PATCH)


def test_named_embedding_file_and_recipe_tags(tmp_path):
    names = ["Liver", "Pancreas Tumor", "Pancreas"]
    table = torch.randn(3, 512)
    path = tmp_path / "clip_embeddings.pt"
    torch.save({"embeddings": table, "names": names}, path)
    torch.testing.assert_close(load_class_embeddings(path, ["pancreas", "pancreatic_lesion"]), table[[2, 1]])
    recipe = load_recipe(RECIPES / "universal_model_a.yaml", ["profile=cpu", f"model.options.text_embeddings_path={path}"])
    assert list(OmegaConf.to_container(recipe.model.options, resolve=True)["class_names"]) == list(recipe.data.classes)
    from lightning_modules.tracking import run_tags

    assert run_tags(recipe, "sha")["class_embeddings"].startswith("clip_embeddings.pt sha256:")
    plain = load_recipe(RECIPES / "universal_model_a.yaml", ["profile=cpu"])
    assert run_tags(plain, "sha")["class_embeddings"].startswith("random")


@pytest.mark.parametrize(
    "content, message",
    [
        (torch.zeros(3, 512), "3 embedding rows but 32 class names"),
        ({"embeddings": torch.zeros(2, 512), "names": ["Liver", "Spleen"]}, "class 'pancreas' .*no row"),
        ({"embeddings": torch.full((2, 8), float("nan")), "names": ["Pancreas", "Pancreas Tumor"]}, "finite"),
        ({"rows": torch.zeros(2, 8)}, "expected 'embeddings' and 'names'"),
    ],
)
def test_bad_embedding_files_are_refused_with_the_file_named(tmp_path, content, message):
    path = tmp_path / "clip.pt"
    torch.save(content, path)
    with pytest.raises(ValueError, match=message) as error:
        load_class_embeddings(path, ["pancreas", "pancreatic_lesion"])
    assert str(path) in str(error.value)


def test_missing_text_embeddings_file_fails_at_recipe_load(tmp_path):
    missing = tmp_path / "absent.pt"
    with pytest.raises(RecipeError, match="text_embeddings_path .*absent.pt does not exist"):
        option = f"model.options.text_embeddings_path={missing}"
        load_recipe(RECIPES / "universal_model_a.yaml", ["profile=cpu", option])


def test_universal_model_b_swin_backbone_has_no_output_layer_and_legacy_merging():
    network = tiny_universal("swin")
    assert isinstance(network.backbone.net.out, torch.nn.Identity)
    assert network.backbone.bottleneck_channels == 16 * 12
    assert network.image_branch[0].num_channels == 16 * 12
    assert type(network.backbone.net.swinViT.layers1[0].downsample).__name__ == "LegacyPatchMerging"


# ----------------------------------------------------------------------------------------------
# STU-Net


def test_stunet_deep_supervision_scales_and_eval_output():
    torch.manual_seed(0)
    network = tiny("stunet_b").train()
    outputs = network(image())
    assert [tuple(o.shape) for o in outputs] == [(2, OUT_CHANNELS, 32 >> i, 32 >> i, 32 >> i) for i in range(4)]
    network.eval()
    with torch.no_grad():
        assert network(image()).shape == (2, OUT_CHANNELS, *PATCH)
    without = build_stunet(3, 1, OUT_CHANNELS, patch_size=PATCH, dims=(8, 16, 32, 64, 64), deep_supervision=False)
    without.train()
    assert without(image()).shape == (2, OUT_CHANNELS, *PATCH)


def test_stunet_upsamples_by_nearest_interpolation_and_1x1_conv():
    torch.manual_seed(0)
    network = tiny("stunet_b")
    assert not any(isinstance(m, torch.nn.ConvTranspose3d) for m in network.modules())
    kernels = {m.kernel_size for m in network.modules() if isinstance(m, torch.nn.Conv3d)}
    assert kernels == {(3, 3, 3), (1, 1, 1)}  # 3x3x3 everywhere; 1x1x1 only for shortcuts, upsampling and heads
    # The CPU profile's planned strides at 32^3: [2, 2, 2, 1]; the coarsest upsampling keeps the resolution.
    assert network.upsamplers[0].scale == (1, 1, 1) and network.upsamplers[1].scale == (2, 2, 2)
    for upsample, scale in ((network.upsamplers[0], 1), (network.upsamplers[1], 2)):
        x = torch.randn(1, upsample.conv.in_channels, 2, 2, 2)
        with torch.no_grad():
            expected = upsample.conv(F.interpolate(x, scale_factor=scale, mode="nearest"))  # the reference's order
            torch.testing.assert_close(upsample(x), expected, rtol=1e-5, atol=1e-6)


def test_stunet_block_is_the_reference_block():
    """conv-IN-LReLU-conv-IN + shortcut, LReLU; the first block of a stage has a bare biased 1x1 shortcut."""
    network = tiny("stunet_b")
    first, = network.encoder[1]
    assert [type(m) for m in first.children()] == [
        torch.nn.Conv3d, torch.nn.InstanceNorm3d, torch.nn.LeakyReLU, torch.nn.Conv3d, torch.nn.InstanceNorm3d,
        torch.nn.LeakyReLU, torch.nn.Conv3d,
    ]
    assert first.shortcut.kernel_size == (1, 1, 1) and first.shortcut.stride == (2, 2, 2)
    assert first.shortcut.bias is not None and first.conv1.bias is not None and first.conv2.bias is not None
    assert first.act1.negative_slope == first.act2.negative_slope == 0.01
    deeper = build_stunet(3, 1, 3, patch_size=PATCH, dims=(8, 16, 32, 64, 64), depths=(2, 1, 1, 1, 1))
    assert deeper.encoder[0][1].shortcut is None  # later blocks add their input unchanged
    # He initialization (negative slope 1e-2) with zero biases, as nnU-Net's InitWeights_He.
    torch.manual_seed(0)
    wide = build_stunet(3, 1, 3, patch_size=(64, 64, 64), dims=(64, 128, 256, 256, 256, 256))
    conv = wide.encoder[3][0].conv2
    fan_in = conv.weight[0].numel()
    expected_std = (2 / (1 + 0.01**2) / fan_in) ** 0.5
    assert conv.weight.std().item() == pytest.approx(expected_std, rel=0.02)
    assert conv.bias.abs().max().item() == 0


def test_stunet_b_has_one_residual_block_per_stage():
    with torch.device("meta"):
        network = build_stunet(3, 1, OUT_CHANNELS, patch_size=(96, 96, 96))
    assert [len(stage) for stage in network.encoder] == [1] * 6
    assert [len(stage) for stage in network.decoder] == [1] * 5
    assert [stage[0].conv2.out_channels for stage in network.encoder] == [32, 64, 128, 256, 512, 512]


# ----------------------------------------------------------------------------------------------
# VSmTrans


def test_vsmtrans_deep_supervision_scales_and_eval_output():
    torch.manual_seed(0)
    network = tiny("vsmtrans", deep_supervision=True).train()
    outputs = network(image())
    assert [tuple(o.shape) for o in outputs] == [(2, OUT_CHANNELS, 32 >> i, 32 >> i, 32 >> i) for i in range(5)]
    sum(o.mean() for o in outputs).backward()
    assert all(p.grad is not None for p in network.parameters())
    network.eval()
    with torch.no_grad():
        assert network(image()).shape == (2, OUT_CHANNELS, *PATCH)
    plain = tiny("vsmtrans", deep_supervision=False).train()
    assert plain(image()).shape == (2, OUT_CHANNELS, *PATCH)


def test_vsmtrans_window_shapes_are_a_cube_and_three_stripes():
    assert window_shapes((64, 64, 64), 6, 1) == [(6, 6, 6), (1, 64, 1), (1, 1, 64), (64, 1, 1)]
    assert window_shapes((4, 4, 8), 6, 2) == [(4, 4, 6), (2, 4, 2), (2, 2, 8), (4, 2, 2)]  # clamped, as the reference
    network = build_vsmtrans(3, 1, OUT_CHANNELS, patch_size=(32, 32, 32), feature_size=12, num_heads=(1, 1, 2, 3))
    first_stage = network.stages[0][0].mixer.attentions
    assert [a.window for a in first_stage] == [(6, 6, 6), (1, 16, 1), (1, 1, 16), (16, 1, 1)]
    last_stage = network.stages[3][0].mixer.attentions
    assert [a.window for a in last_stage] == [(2, 2, 2), (2, 2, 2), (2, 2, 2), (2, 2, 2)]
    assert [network.stages[0][i].shifted for i in range(2)] == [False, True]


@pytest.mark.parametrize("shifted", [False, True])
def test_cube_window_attention_is_swin_attention_with_interleaved_heads_and_the_reference_scale(shifted):
    """One window shape: MONAI's Swin window attention once the heads' channels are interleaved
    (head h takes channels h, h + heads, ...) and the scores scaled by 1 / (2 sqrt(d))."""
    torch.manual_seed(0)
    dim, heads, window = 16, 2, (4, 4, 4)
    head_dim = dim // heads
    shift = tuple(w // 2 for w in window) if shifted else (0, 0, 0)
    swin = SwinTransformerBlock(dim, heads, window, shift).eval()
    swin.norm1 = torch.nn.Identity()
    swin.attn.scale = (4 * head_dim) ** -0.5
    torch.nn.init.normal_(swin.attn.relative_position_bias_table, std=0.5)
    mine = WindowShapeAttention(heads, window).eval()
    # Swin's channel j of head h is channel j * heads + h here.
    order = torch.tensor([j * heads + h for h in range(heads) for j in range(head_dim)])
    to_mine = torch.cat([order + part * dim for part in range(3)])
    with torch.no_grad():
        mine.relative_position_bias.copy_(swin.attn.relative_position_bias_table)
        x = torch.randn(2, 8, 8, 8, dim)
        mask = compute_mask((8, 8, 8), window, shift, x.device) if shifted else None
        expected = swin.forward_part1(x, mask)
        qkv = torch.empty(2, 8, 8, 8, 3 * dim)
        qkv[..., to_mine] = swin.attn.qkv(x)
        attended = mine(qkv, shifted)
        actual = swin.attn.proj(attended[..., order])
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def test_stripe_window_attention_stays_within_its_stripe():
    """A perturbed token changes outputs only in its own (1 x 8 x 2) stripe, padded axis included."""
    torch.manual_seed(0)
    attention = WindowShapeAttention(num_heads=2, window=(1, 8, 2)).eval()
    qkv = torch.randn(1, 3, 8, 5, 3 * 8)  # W = 5 is padded to 6 for stripes of width 2
    perturbed = qkv.clone()
    perturbed[0, 1, 2, 2] += 3.0
    with torch.no_grad():
        changed = (attention(perturbed, shifted=False) - attention(qkv, shifted=False)).abs().sum(-1)[0] > 0
    expected = torch.zeros(3, 8, 5, dtype=torch.bool)
    expected[1, :, 2:4] = True  # d = 1, the whole H axis, w in the stripe {2, 3}
    assert torch.equal(changed, expected)


def test_vsmtrans_blocks_follow_the_reference():
    """Conv branch GELU -> Linear(3C -> C) -> LayerNorm -> Conv 3^3 -> BatchNorm -> LeakyReLU; LN after the
    patch embedding; 12-group skip norm; drop rates 0.1; learnable mixing weights at 0.5."""
    network = tiny("vsmtrans")
    mixer = network.stages[0][0].mixer
    assert [type(m) for m in mixer.fuse] == [torch.nn.GELU, torch.nn.Linear, torch.nn.LayerNorm]
    assert mixer.fuse[1].in_features == 3 * mixer.fuse[1].out_features and mixer.fuse[2].eps == 1e-6
    assert [type(m) for m in mixer.conv] == [torch.nn.Conv3d, torch.nn.BatchNorm3d, torch.nn.LeakyReLU]
    assert mixer.conv[0].kernel_size == (3, 3, 3) and mixer.conv[0].groups == 1
    assert mixer.alpha.item() == mixer.beta.item() == 0.5
    assert isinstance(network.patch_embed.norm, torch.nn.LayerNorm)
    assert mixer.drop.p == mixer.proj_drop.p == 0.1 and mixer.attentions[0].attn_drop == 0.1
    assert network.stages[3][1].drop_path.drop_prob == pytest.approx(0.1)
    assert type(network.mergers[0]).__name__ == "LegacyPatchMerging"
    hidden = network.encode(image(1))
    for h in hidden:  # group norm, 12 groups, no affine: each group has zero mean
        groups = h.reshape(1, 12, -1)
        torch.testing.assert_close(groups.mean(-1), torch.zeros(1, 12), atol=1e-4, rtol=0)
    recipe = load_recipe(RECIPES / "vsmtrans.yaml", [])
    assert recipe.model.options.deep_supervision is True


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.options.num_heads=[2,1,2,3]"],
            r"stage 0 has 12 channels .* divisible by 4 window shapes x num_heads\[0\]=2",
        ),
        (["model.options.split_sizes=[1,2,3]"], "split_sizes needs one value per stage"),
        (["model.options.split_sizes=[0,2,3,4]"], "every value of split_sizes must be a positive integer"),
        (["model.options.window_size=0"], "window_size must be a positive integer"),
        (["model.options.depths=[2,2,2,2,2]"], "depths needs one value per stage"),
        (["model.options.patch_embed_size=0"], "patch_embed_size must be a positive integer"),
        (["data.patch_size=[48,48,48]"], "divisible by 32"),
        (["model.options.patch_embed_size=4"], "divisible by 64"),
    ],
)
def test_vsmtrans_option_rules_give_recipe_error(overrides, message):
    path = RECIPES / "vsmtrans.yaml"
    with pytest.raises(RecipeError, match=message) as error:
        load_recipe(path, ["profile=cpu", *overrides])
    assert str(path) in str(error.value)


# ----------------------------------------------------------------------------------------------
# All four


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("universal_model_a", ["data.patch_size=[36,36,36]"], "divisible by 8"),
        ("universal_model_a", ["model.options.channels=[8,15,32,64]"], "even widths"),
        ("universal_model_b", ["data.patch_size=[48,48,48]"], "divisible by 32"),
        ("universal_model_b", ["model.options.norm=instance"], "1-voxel bottleneck"),
        ("universal_model_b", ["model.options.feature_size=16"], "divisible by 12"),
        # Planned strides adapt to the patch: 36 pools three times (36 -> 5 rounded up), so 8 must divide it.
        ("stunet_b", ["data.patch_size=[36,36,36]"], r"divisible by \[8, 8, 8\]"),
        ("stunet_b", ["data.patch_size=[16,16,16]", "model.options.strides=[2,2,2,2]"], "at least twice that"),
        ("stunet_b", ["model.options.strides=[2,2,2]"], "needs 4 strides"),
        ("stunet_b", ["model.options.depths=[1,1,1]"], "one entry per stage"),
        ("vsmtrans", ["data.patch_size=[32,32,40]"], "divisible by 32"),
    ],
)
def test_bad_patch_or_options_give_recipe_error(name, overrides, message):
    path = RECIPES / f"{name}.yaml"
    with pytest.raises(RecipeError, match=message) as error:
        load_recipe(path, ["profile=cpu", *overrides])
    assert str(path) in str(error.value)


@pytest.mark.parametrize("name", MINE)
def test_eval_forward_is_deterministic_for_a_seed(name):
    outputs = []
    for _ in range(2):
        torch.manual_seed(7)
        network = tiny(name).eval()
        with torch.no_grad():
            outputs.append((network(image()), network(image())))
    (first, repeat), (rebuilt, _) = outputs
    torch.testing.assert_close(first, repeat, rtol=0, atol=0)  # same weights, same input
    torch.testing.assert_close(first, rebuilt, rtol=0, atol=0)  # same seed, same weights


# Full size, 1 input channel and 3 output channels.
FULL_SIZE = {
    "universal_model_a": ({}, (96, 96, 96), 19.29, 19.07),
    "universal_model_b": ({}, (96, 96, 96), 62.46, 62.19),
    "stunet_b": ({}, (96, 96, 96), 58.16, None),  # the reference: 58,160,975
    "vsmtrans": ({}, (128, 128, 128), 50.17, None),  # the reference: 50,166,607 without its unused fifth head
}


@pytest.mark.parametrize("name", MINE)
def test_full_size_parameter_counts(name):
    options, patch, total_millions, backbone_millions = FULL_SIZE[name]
    network = build_backbone(name, 1, OUT_CHANNELS, patch, **options)
    assert sum(p.numel() for p in network.parameters()) / 1e6 == pytest.approx(total_millions, abs=0.005)
    if backbone_millions is not None:
        backbone = sum(p.numel() for p in network.backbone.parameters()) / 1e6
        assert backbone == pytest.approx(backbone_millions, abs=0.005)


def test_vsmtrans_runs_on_inputs_other_than_its_build_patch():
    """Windows clamp to smaller feature maps and tile larger ones (stripes keep their build length)."""
    torch.manual_seed(0)
    network = build_vsmtrans(
        3, 1, OUT_CHANNELS, patch_size=(64, 64, 64), feature_size=12, depths=(2, 1, 1, 1), num_heads=(1, 1, 2, 3)
    ).eval()
    assert network.stages[0][0].mixer.attentions[1].window == (1, 32, 1)
    with torch.no_grad():
        assert network(image(1)).shape == (1, OUT_CHANNELS, *PATCH)
        assert network(torch.randn(1, 1, 32, 64, 96)).shape == (1, OUT_CHANNELS, 32, 64, 96)
