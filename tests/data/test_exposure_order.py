"""The draw order of the samplers is pinned: the same (real steps S, ratio r, seed) gives the same
indices, epoch by epoch, as the schedules the studies so far were trained on.

The fingerprints are sha256 digests of every index the sampler hands out over the whole training
(epoch after epoch, as Lightning iterates it), followed by the epoch length.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from lightning_modules.data.exposure import ExposureMatchedSampler
from lightning_modules.data.mixing import MixingSampler


def _fingerprint(sampler, epochs: int) -> str:
    drawn = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        drawn.extend(sampler)
    digest = hashlib.sha256(np.asarray(drawn, dtype=np.int64).tobytes())
    digest.update(str(len(sampler)).encode())
    return digest.hexdigest()[:16]


# (n_real, batch, real steps S, ratio r, seed, synthetic cases, sham) -> fingerprint
MATCHED = {
    (13, 2, 20, 0.3, 4, 2, False): "3679b2a88bec2fdb",
    (13, 2, 20, 0.3, 4, 2, True): "d63f5af22cb8489d",
    (7, 3, 11, 0.25, 0, 3, False): "3686ed21d71d0636",
    (20, 4, 5, 1.5, 9, 4, False): "dfb71a0eb57f50a4",
    (9, 2, 8, 0.0, 1, 0, False): "c544f6802a589220",
    (30, 2, 17, 0.7, 123, 5, True): "95f9b9d3f7b8da28",
}


def _matched(n_real, batch, steps, ratio, seed, n_synthetic, sham) -> ExposureMatchedSampler:
    substitutes = [[j % n_real, (3 * j + 1) % n_real] for j in range(n_synthetic)] if sham else None
    return ExposureMatchedSampler(n_real, batch, steps, ratio, seed, n_synthetic=n_synthetic, substitutes=substitutes)


@pytest.mark.parametrize("case", list(MATCHED))
def test_exposure_matched_order_is_unchanged(case):
    sampler = _matched(*case)
    index, _ = sampler.stream()
    epochs = -(-len(index) // len(sampler))
    assert _fingerprint(sampler, epochs) == MATCHED[case]


# (n_real, synthetic cases, ratio r, seed, mode) -> fingerprint
MIXING = {
    (40, 7, 0.3, 3, "add"): "c6e3ea5caad48213",
    (25, 4, 1.5, 0, "add"): "3ce35cc87d6714b7",
    (50, 5, 0.4, 11, "displace"): "82ff4e4ca432ee8f",
    (12, 3, 0.0, 2, "add"): "f3b950b76cd7e14b",
}


@pytest.mark.parametrize("case", list(MIXING))
def test_mixing_order_is_unchanged(case):
    n_real, n_synthetic, ratio, seed, mode = case
    assert _fingerprint(MixingSampler(n_real, n_synthetic, ratio, seed, mode), 3) == MIXING[case]
