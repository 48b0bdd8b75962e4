"""Tumor-patch features from a trained detector's encoder, for the Frechet distance of :mod:`synthx.analysis.realism`.

The detector's view of a tumor is what matters for whether synthetic tumors teach it what real ones
would: the features are the activations of the network's bottleneck (a forward hook), averaged over
space, for a patch centred on each tumor, normalized as the detector's recipe normalizes its input.
The bottleneck is found by running one patch through the network: the last module to finish whose
5D output has the fewest voxels (the deepest encoder level, just before the decoder upsamples), so
the same rule serves every backbone of ``lightning_modules/models/backbones``.

Patches are cut at the CT's own spacing (no resampling), ``patch_size`` voxels per axis.

Example::

    module = load_module_from_checkpoint(recipe, "best.ckpt")
    embed = encoder_embedder(module.network, recipe.data)
    vectors = embed([(ct, tumor), ...])          # (n tumors, channels)
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from lightning_modules.data.intensity import intensity_transforms


def centred_cube(volume: np.ndarray, centre: Sequence[int], size: Sequence[int]) -> np.ndarray:
    """The box of ``size`` voxels centred on ``centre``, edge-padded where it leaves the volume."""
    size = [int(s) for s in size]
    pad = [(s // 2 + 1, s // 2 + 1) for s in size]
    padded = np.pad(volume, pad, mode="edge")
    start = [int(c) + 1 for c in centre]  # shifted by the padding, minus half the size, plus one
    return padded[tuple(slice(s, s + n) for s, n in zip(start, size))]


def find_bottleneck(network: torch.nn.Module, example: torch.Tensor) -> str:
    """The name of the submodule whose 5D output has the fewest voxels, the last such to finish in a forward pass."""
    finished: list[tuple[str, int]] = []
    handles = []
    for name, module in network.named_modules():
        if not name:
            continue

        def hook(_module, _inputs, output, name=name):
            if isinstance(output, torch.Tensor) and output.ndim == 5:
                finished.append((name, int(np.prod(output.shape[2:]))))

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            network(example)
    finally:
        for handle in handles:
            handle.remove()
    if not finished:
        raise ValueError("the network produced no 5D activation to take features from")
    smallest = min(voxels for _, voxels in finished)
    return [name for name, voxels in finished if voxels == smallest][-1]


def encoder_features(network: torch.nn.Module, patches: torch.Tensor, layer: str, batch_size: int = 4) -> np.ndarray:
    """Space-averaged activations of ``layer`` (a submodule name) for each patch (N, 1, D, H, W): (N, channels)."""
    module = dict(network.named_modules())[layer]
    captured: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda _m, _i, output: captured.append(output.detach().float().mean(dim=(2, 3, 4))))
    try:
        with torch.no_grad():
            for start in range(0, len(patches), batch_size):
                network(patches[start : start + batch_size])
    finally:
        handle.remove()
    return torch.cat(captured).cpu().numpy()


def encoder_embedder(network: torch.nn.Module, data, patch_size: Sequence[int] | None = None,
                     device: str = "cpu") -> Callable[[Sequence[tuple[np.ndarray, np.ndarray]]], np.ndarray]:
    """A function from (CT in HU, tumor mask) pairs to the detector's bottleneck features.

    Args:
        network: the detector's network (``SegmentationModule.network``), put in eval mode here.
        data: the detector recipe's ``data`` section (normalization, hu_window, patch_size).
        patch_size: voxels per axis of the patch around each tumor (default: ``data.patch_size``).
        device: where the network runs.
    """
    network = network.eval().to(device)
    transforms, _ = intensity_transforms(data)
    size = [int(s) for s in (patch_size or data.patch_size)]
    layer: list[str] = []

    def embed(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        if not pairs:
            return np.zeros((0, 0))
        patches = []
        for ct, tumor in pairs:
            centre = np.round(np.argwhere(tumor).mean(axis=0)).astype(int)
            item = {"image": centred_cube(np.asarray(ct, dtype=np.float32), centre, size)[None]}
            for transform in transforms:
                item = transform(item)
            patches.append(torch.as_tensor(np.asarray(item["image"]), dtype=torch.float32))
        batch = torch.stack(patches).to(device)
        if not layer:
            layer.append(find_bottleneck(network, batch[:1]))
        return encoder_features(network, batch, layer[0])

    return embed
