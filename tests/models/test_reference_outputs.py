"""Numerical cross-checks against the reference implementations (MedNeXt, STU-Net, Universal Model,
VSmTrans) and the loaders of user-supplied pre-trained weights (SwinUNETR's ``model_swinvit.pt`` format).

The reference outputs are tensors in ``tests/fixtures/`` (how they were made: tests/fixtures/README.md);
the project's module loads the reference's state dict (keys renamed) and must reproduce its outputs
in float32 within 1e-5. Fixtures of full-width networks (whose state dicts are too large to ship)
hold no state dict: every weight is a seeded function of its name and shape (``seeded_tensor`` of
tests/fixtures/seeded_weights.py), filled into this project's module here and into the reference's,
through the key renaming, by tests/fixtures/make_reference_fixtures.py.

Run: ``OMP_NUM_THREADS=1 .venv/bin/pytest tests/models/test_reference_outputs.py -x -q``
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightning_modules.recipe import RecipeError, load_recipe
from lightning_modules.models.backbones.mednext import build_mednext
from lightning_modules.models.backbones.reference_keys import mednext_key, stunet_key, universal_model_key as universal_key
from lightning_modules.models.backbones.stunet import build_stunet
from lightning_modules.models.backbones.swin_unetr import LEGACY_MERGING_OFFSETS, build_swin_unetr
from lightning_modules.models.backbones.universal_model import build_universal_model
from lightning_modules.models.backbones.vsmtrans import build_vsmtrans
from lightning_modules.tracking import run_tags

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
from seeded_weights import seeded_state  # noqa: E402  (tests/fixtures/seeded_weights.py)
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _reproduces(network: torch.nn.Module, reference: dict) -> None:
    network.train()  # deep supervision on; the reference outputs were taken in training mode
    with torch.no_grad():
        outputs = network(reference["input"])
    assert len(outputs) == len(reference["outputs"])
    for ours, theirs in zip(outputs, reference["outputs"]):
        # Within 1e-5 of the output's scale: float32 sums run in another order on another CPU's kernels
        # (measured: STU-Net's fixture, outputs up to 36, differs by 1.7e-5 on an AMD EPYC host; in
        # float64 the fixture itself is 2.5e-5 off). A wrong block or key mapping differs by O(1).
        scale = max(1.0, float(theirs.abs().max()))
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * scale)


def test_mednext_reproduces_the_reference_outputs():
    reference = torch.load(FIXTURES / "mednext_reference.pt", weights_only=True)
    wrapped = build_mednext(
        3, 1, 3, patch_size=(16, 16, 32), init_filters=2, encoder_expansion_ratio=(2, 3, 4, 5),
        bottleneck_expansion_ratio=6, decoder_expansion_ratio=(5, 4, 3, 2), blocks_down=(1, 1, 2, 1),
        blocks_bottleneck=1, blocks_up=(1, 2, 1, 1),
    )
    wrapped.network.load_state_dict({mednext_key(k): v for k, v in reference["state_dict"].items()}, strict=True)
    _reproduces(wrapped, reference)


def test_mednext_down_blocks_expand_by_the_next_stages_ratio():
    wrapped = build_mednext(3, 1, 3, patch_size=(128, 128, 128))
    ratios = [block.conv2.out_channels // block.conv2.in_channels for block in wrapped.network.down_blocks]
    assert ratios == [4, 8, 8, 8]  # stages 1, 2, 3 and the bottleneck (MONAI's port: 3, 4, 8, 8)
    assert sum(p.numel() for p in wrapped.parameters()) == 61_782_191  # the reference's, minus dummy_tensor


def test_stunet_reproduces_the_reference_outputs():
    reference = torch.load(FIXTURES / "stunet_reference.pt", weights_only=True)
    network = build_stunet(3, 1, 3, patch_size=(16, 16, 16), dims=(2, 4, 8, 8), depths=(1, 2, 2, 1), strides=[2, 2, 2])
    network.load_state_dict({stunet_key(k): v for k, v in reference["state_dict"].items()}, strict=True)
    _reproduces(network, reference)
    assert sum(p.numel() for p in build_stunet(3, 1, 3).parameters()) == 58_160_975  # the reference's STU-Net-B


def _reproduces_subsampled(network: torch.nn.Module, reference: dict, inputs: torch.Tensor) -> None:
    """Outputs too large to ship are stored subsampled (every ``step``-th voxel per axis) with their sums."""
    network.train()
    with torch.no_grad():
        outputs = network(inputs)
    assert len(outputs) == len(reference["outputs"])
    for ours, theirs, step, sums in zip(outputs, reference["outputs"], reference["output_steps"], reference["output_sums"]):
        scale = max(1.0, float(theirs.abs().max()))
        torch.testing.assert_close(ours[..., ::step, ::step, ::step], theirs, rtol=0, atol=1e-5 * scale)
        torch.testing.assert_close(ours.double().sum(dim=(2, 3, 4)), sums, rtol=1e-5, atol=1e-5 * scale * ours[0, 0].numel() ** 0.5)


def test_stunet_plans_its_strides_at_the_patch_as_the_reference_trainer():
    """At BenchX's 96^3 patch (1.5 mm) nnU-Net's plan pools 4 times; the reference pads the fifth stride with 1."""
    reference = torch.load(FIXTURES / "stunet96_reference.pt", weights_only=True)
    network = build_stunet(3, 1, 2, patch_size=(96, 96, 96), dims=(2, 4, 4, 4, 8, 8), spacing=(1.5, 1.5, 1.5))
    assert [list(s) for s in network.strides] == reference["strides"] == [[2, 2, 2]] * 4 + [[1, 1, 1]]
    network.load_state_dict({stunet_key(k): v for k, v in reference["state_dict"].items()}, strict=True)
    inputs = reference["input"].float() * reference["input_scale"]
    _reproduces_subsampled(network, reference, inputs)
    # The bottleneck is 6^3 (the old fixed strides gave 3^3).
    with torch.no_grad():
        features = inputs
        for stage in network.encoder:
            features = stage(features)
    assert features.shape[2:] == (6, 6, 6)
    # With the previous fixed strides of 2 the outputs differ: the fixture sees the strides.
    fixed = build_stunet(3, 1, 2, patch_size=(96, 96, 96), dims=(2, 4, 4, 4, 8, 8), strides=[2] * 5)
    fixed.load_state_dict(network.state_dict())
    with pytest.raises(AssertionError):
        _reproduces_subsampled(fixed, reference, inputs)


def _seed_weights(network: torch.nn.Module, keep: tuple[str, ...] = ()) -> None:
    network.load_state_dict(seeded_state(network, keep), strict=True)


def _reproduces_in_both_modes(network: torch.nn.Module, reference: dict) -> None:
    """Train and eval outputs against the reference's (stored subsampled, with their sums)."""
    inputs = reference["input"].float() * reference["input_scale"]
    for mode in ("train", "eval"):
        network.train(mode == "train")
        with torch.no_grad():
            outputs = network(inputs)
        outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        expected = reference[mode]
        assert len(outputs) == len(expected["outputs"]), mode
        for ours, theirs, step, sums in zip(outputs, expected["outputs"], expected["output_steps"], expected["output_sums"]):
            scale = max(1.0, float(theirs.abs().max()))
            torch.testing.assert_close(ours[..., ::step, ::step, ::step], theirs, rtol=0, atol=1e-5 * scale)
            torch.testing.assert_close(
                ours.double().sum(dim=tuple(range(2, ours.dim()))), sums, rtol=1e-5, atol=1e-5 * scale * ours[0, 0].numel() ** 0.5
            )


@pytest.mark.parametrize(
    "fixture, backbone, text",
    [
        ("universal_model_a_reference.pt", "unet3d", False),
        ("universal_model_a_text_reference.pt", "unet3d", True),
        ("universal_model_b_reference.pt", "swin", False),
    ],
)
def test_universal_model_reproduces_the_reference_outputs(fixture, backbone, text, tmp_path):
    """Full-width variants a and b (random and text class embeddings), batch statistics and per-image heads."""
    reference = torch.load(FIXTURES / fixture, weights_only=True)
    size = reference["input"].shape[-1]
    options = {}
    if text:
        path = tmp_path / "text.pt"
        torch.save({"embeddings": reference["text_embeddings"], "names": ["Pancreas", "Pancreas Tumor"]}, path)
        options = dict(text_embeddings_path=str(path), class_names=["pancreas", "pancreatic_lesion"])
    network = build_universal_model(3, 1, 3, patch_size=(size,) * 3, backbone=backbone, **options)
    _seed_weights(network, keep=("text_embeddings",))
    _reproduces_in_both_modes(network, reference)


def test_vsmtrans_reproduces_the_reference_outputs():
    """Four window shapes with interleaved heads, the parallel convolution (batch norm: batch statistics in
    training, running ones in evaluation), deep supervision on; dropout off so that training mode is
    deterministic."""
    reference = torch.load(FIXTURES / "vsmtrans_reference.pt", weights_only=True)
    network = build_vsmtrans(
        3, 1, 2, patch_size=(32, 32, 32), feature_size=12, depths=(2, 2, 2, 2), num_heads=(1, 1, 2, 3), window_size=2,
        split_sizes=(1, 1, 2, 2), drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0, deep_supervision=True,
    )
    _seed_weights(network)
    _reproduces_in_both_modes(network, reference)


def test_universal_model_reference_keys_cover_the_module():
    """Every key of the reference's names maps onto one of this module's (the fixtures rely on the renaming)."""
    names = [f"backbone.down_tr{w}.ops.{i}.{layer}.{p}" for w in (64, 128, 256, 512) for i in (0, 1)
             for layer, p in (("conv1", "weight"), ("conv1", "bias"), ("bn1", "weight"), ("bn1", "bias"))]
    names += [f"backbone.up_tr{w}.{part}" for w in (256, 128, 64) for part in ("up_conv.weight", "up_conv.bias")]
    names += [f"backbone.up_tr{w}.ops.{i}.{layer}.{p}" for w in (256, 128, 64) for i in (0, 1)
              for layer, p in (("conv1", "weight"), ("conv1", "bias"), ("bn1", "weight"), ("bn1", "bias"))]
    names += ["precls_conv.0.weight", "precls_conv.2.bias", "GAP.0.weight", "GAP.3.weight", "controller.weight",
              "organ_embedding.weight"]
    ours = build_universal_model(3, 1, 3, patch_size=(16, 16, 16), backbone="unet3d").state_dict()
    mapped = [universal_key(n) for n in names]
    assert len(set(mapped)) == len(mapped) and all(k in ours for k in mapped)


def _model_swinvit_file(network, path: Path) -> dict:
    """A file in model_swinvit.pt's format: 'module.'-prefixed encoder keys, MLP layers named fc1/fc2."""
    state = {}
    for key, value in network.swinViT.state_dict().items():
        key = key.replace("mlp.linear1", "mlp.fc1").replace("mlp.linear2", "mlp.fc2")
        state[f"module.{key}"] = value.clone()
    torch.save({"epoch": 100, "state_dict": state}, path)
    return state


def test_swin_unetr_loads_self_supervised_encoder_weights(tmp_path):
    options = dict(patch_size=(64, 64, 64), feature_size=12, depths=(1, 1, 1, 1), window_size=4)
    torch.manual_seed(1)
    pretrained = build_swin_unetr(3, 1, 3, **options)
    path = tmp_path / "model_swinvit.pt"
    state = _model_swinvit_file(pretrained, path)
    assert "module.layers1.0.blocks.0.mlp.fc1.weight" in state and "module.layers4.0.downsample.reduction.weight" in state
    torch.manual_seed(2)
    loaded = build_swin_unetr(3, 1, 3, pretrained_weights=str(path), **options)
    for key, value in pretrained.swinViT.state_dict().items():
        torch.testing.assert_close(loaded.swinViT.state_dict()[key], value, rtol=0, atol=0)
    torch.manual_seed(2)
    scratch = build_swin_unetr(3, 1, 3, **options)
    assert not torch.equal(scratch.swinViT.patch_embed.proj.weight, loaded.swinViT.patch_embed.proj.weight)
    torch.testing.assert_close(scratch.out.conv.conv.weight, loaded.out.conv.conv.weight)  # decoder stays random

    recipe = load_recipe(RECIPES / "swin_unetr_tiny.yaml", [f"model.options.pretrained_weights={path}"])
    assert run_tags(recipe, "sha")["pretrained_weights"].startswith("model_swinvit.pt sha256:")
    assert run_tags(load_recipe(RECIPES / "swin_unetr_tiny.yaml", []), "sha")["pretrained_weights"].startswith("none")


def test_swin_unetr_weights_of_another_size_or_format_are_refused(tmp_path):
    small = build_swin_unetr(3, 1, 3, patch_size=(64, 64, 64), feature_size=24, depths=(1, 1, 1, 1), window_size=4)
    path = tmp_path / "model_swinvit.pt"
    _model_swinvit_file(small, path)
    with pytest.raises(ValueError, match=r"model_swinvit.pt does not fit this encoder"):
        build_swin_unetr(3, 1, 3, patch_size=(64, 64, 64), feature_size=12, depths=(1, 1, 1, 1), window_size=4,
                         pretrained_weights=str(path))
    torch.save({"model": {}}, path)
    with pytest.raises(ValueError, match="not in model_swinvit.pt format"):
        build_swin_unetr(3, 1, 3, patch_size=(64, 64, 64), feature_size=12, pretrained_weights=str(path))
    with pytest.raises(RecipeError, match="patch_merging: legacy"):
        load_recipe(RECIPES / "swin_unetr_tiny.yaml",
                    [f"model.options.pretrained_weights={path}", "model.options.patch_merging=merging"])


def test_legacy_patch_merging_uses_monai_before_1_5_sub_voxel_order():
    network = build_swin_unetr(3, 1, 3, patch_size=(64, 64, 64), feature_size=12)
    merging = network.swinViT.layers1[0].downsample
    x = torch.randn(1, 4, 4, 4, 12)
    parts = [x[:, i::2, j::2, k::2, :] for i, j, k in LEGACY_MERGING_OFFSETS]
    with torch.no_grad():
        expected = merging.reduction(merging.norm(torch.cat(parts, -1)))
        torch.testing.assert_close(merging(x), expected)
    assert LEGACY_MERGING_OFFSETS.count((0, 1, 0)) == 2 and (1, 1, 0) not in LEGACY_MERGING_OFFSETS
