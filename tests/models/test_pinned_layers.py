"""The pinned Conv3d and GroupNorm (lightning_modules.models.pinned_layers): torch's values and gradients,
and a generator that trains the same weights whatever the thread count, where torch's own layers do not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import REPO_ROOT
from lightning_modules.models.pinned_layers import PinnedConv3d, PinnedGroupNorm, pinned_conv3d, use_pinned_layers


@pytest.mark.parametrize("kernel, stride, padding", [(3, 1, 1), (3, 2, 1), (1, 1, 0), (3, 1, 0), (3, 2, 0), (2, 2, 0)])
def test_the_convolution_has_torchs_values_and_gradients(kernel, stride, padding):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 6, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 3, kernel, kernel, kernel, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)
    strides, paddings = (stride,) * 3, (padding,) * 3
    ours = pinned_conv3d(x, weight, bias, strides, paddings)
    theirs = F.conv3d(x, weight, bias, strides, paddings)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs)
    assert torch.autograd.gradcheck(lambda *a: pinned_conv3d(*a, strides, paddings), (x, weight, bias))


def test_the_group_norm_has_torchs_values_and_gradients():
    torch.manual_seed(0)
    theirs = nn.GroupNorm(4, 8).double()
    nn.init.normal_(theirs.weight)
    nn.init.normal_(theirs.bias)
    ours = PinnedGroupNorm(4, 8).double()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 8, 5, 4, 3, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(ours(x), theirs(x))
    assert torch.autograd.gradcheck(ours, (x,))


def test_swapping_keeps_parameters_and_refuses_what_it_cannot_compute():
    network = nn.Sequential(nn.Conv3d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Conv3d(8, 8, 3, stride=2, padding=1))
    keys = list(network.state_dict())
    use_pinned_layers(network)
    assert [type(m) for m in network] == [PinnedConv3d, PinnedGroupNorm, PinnedConv3d]
    assert list(network.state_dict()) == keys
    with pytest.raises(ValueError, match="dilation"):
        use_pinned_layers(nn.Sequential(nn.Conv3d(1, 2, 3, dilation=2)))
    with pytest.raises(ValueError, match="one group"):
        use_pinned_layers(nn.Sequential(nn.Conv3d(2, 2, 3, groups=2)))


def test_the_generator_uses_the_pinned_layers():
    from synthx.generator.model import SynthXDenoiser

    denoiser = SynthXDenoiser(channels=(8, 16), attention_levels=(False, True), norm_num_groups=8, num_head_channels=8)
    kinds = {type(m) for m in denoiser.modules()}
    assert nn.Conv3d not in kinds and nn.GroupNorm not in kinds
    assert PinnedConv3d in kinds and PinnedGroupNorm in kinds


TRAIN_GENERATOR = """
import hashlib, json, sys
import lightning_modules, lightning_modules.models
import torch
from torch import nn
from synthx.config import load_synthx_recipe
from synthx.generator.model import CONDITION_NAMES
from synthx.training.modules import SynthXTrainingModule

torch.set_num_threads(int(sys.argv[2]))
torch.manual_seed(0)
recipe = load_synthx_recipe(sys.argv[1], ["profile=cpu"])
module = SynthXTrainingModule.from_recipe(recipe)
if sys.argv[3] == "torch":  # torch's own layers back in place
    for m in module.denoiser.modules():
        if isinstance(m, nn.Conv3d):
            m.__class__ = nn.Conv3d
        elif isinstance(m, nn.GroupNorm):
            m.__class__ = nn.GroupNorm
module.on_fit_start()
optimizer = torch.optim.AdamW(module.denoiser.parameters(), lr=1e-3)
size, batch = [int(v) for v in recipe.data.patch_size], int(recipe.data.batch_size)
draw = torch.Generator().manual_seed(1)
for _ in range(4):
    data = {"image": torch.rand((batch, 1, *size), generator=draw) * 2 - 1,
            "region": (torch.rand((batch, 1, *size), generator=draw) > 0.8).float()}
    conditions = {name: torch.zeros(batch, dtype=torch.long) for name in CONDITION_NAMES}
    loss = module.loss(data, torch.randint(0, 1000, (batch,), generator=draw), conditions)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
state = module.denoiser.state_dict()
print(json.dumps({"weights": hashlib.sha256(b"".join(state[k].contiguous().numpy().tobytes() for k in sorted(state))).hexdigest(),
                  "threads": torch.get_num_threads()}))
"""


def _train_generator(threads: int, layers: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "BENCHX_NATIVE_CPU")}
    environment["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", TRAIN_GENERATOR, str(REPO_ROOT / "recipes/generator/synthx.yaml"),
                             str(threads), layers], env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_generator_trains_the_same_weights_on_one_thread_and_three():
    one, three = _train_generator(1, "pinned"), _train_generator(3, "pinned")
    assert (one["threads"], three["threads"]) == (1, 3)
    assert one["weights"] == three["weights"]
    # torch's own layers, same steps: the thread count changes the weights (what the pinned layers remove).
    assert _train_generator(1, "torch")["weights"] != _train_generator(3, "torch")["weights"]
