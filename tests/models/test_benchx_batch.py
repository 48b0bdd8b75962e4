"""Patches per optimizer step in every full-size recipe equal BenchX table 8's batch.

Run: ``.venv/bin/pytest tests/models/test_benchx_batch.py -q``
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_modules.recipe import load_recipe
from lightning_modules.models.backbones import BACKBONES

RECIPES = Path(__file__).resolve().parents[2] / "recipes"

# BenchX table 8, "batch" column (patches per optimizer step; on one device, see recipes/_base.yaml).
TABLE_8_BATCH = {
    "unet": 2, "unetr": 2, "swin_unetr_tiny": 2, "swin_unetr_small": 2, "swin_unetr_base": 2,
    "universal_model_a": 2, "universal_model_b": 2, "nnunet": 2, "resenc": 2, "stunet_b": 2,
    "mednext": 8, "vsmtrans": 4,
}


def test_table_covers_every_backbone():
    assert set(TABLE_8_BATCH) == set(BACKBONES)


@pytest.mark.parametrize("name", sorted(TABLE_8_BATCH))
def test_full_size_patches_per_step_equal_table_8(name):
    recipe = load_recipe(RECIPES / f"{name}.yaml", [])
    assert recipe.profile == "full"
    assert int(recipe.data.batch_size) * int(recipe.data.samples_per_volume) == TABLE_8_BATCH[name]
