"""Every registered backbone trains on the phantom through the real `train` path and its loss goes down.

Slow (minutes for all 12 on a 2-core CPU): opt in with ``--run-slow``. The fast suite covers each
backbone's forward/backward and optimizer step in tests/test_backbones.py.
"""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from conftest import RECIPES, tiny_overrides
from lightning_modules.models.backbones import BACKBONES
from lightning_modules.recipe import load_recipe
from lightning_modules.workflows.train import train


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_backbone_training_lowers_the_loss_on_the_phantom(name, tiny_phantom, tmp_path):
    root, split = tiny_phantom
    overrides = [o for o in tiny_overrides(root, split, tmp_path, steps=30) if not o.startswith(("data.patch_size", "model.options"))]
    recipe = load_recipe(RECIPES / f"{name}.yaml", [*overrides, "data.patch_size=[32,32,32]", "trainer.val_every_n_steps=30"])
    result = train(recipe)
    history = MlflowClient(recipe.tracking.uri).get_metric_history(result.run_id, "train/loss")
    losses = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert result.global_step == 30 and len(losses) >= 20
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first, f"{name}: mean loss of the last 5 steps {last:.3f} not below the first 5 {first:.3f}"


@pytest.mark.slow
def test_nnunet_auto_topology_is_planned_from_the_cohort_and_logged(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    overrides = [o for o in tiny_overrides(root, split, tmp_path, steps=1) if not o.startswith(("profile", "data.patch_size", "model.options"))]
    recipe = load_recipe(RECIPES / "nnunet.yaml", [*overrides, "model.options.gpu_memory_gb=0.05"])
    result = train(recipe)
    client = MlflowClient(recipe.tracking.uri)
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert "nnunet_plan.json" in artifacts and result.global_step == 1
    plan = json.loads(open(client.download_artifacts(result.run_id, "nnunet_plan.json", str(tmp_path))).read())
    logged = load_recipe(client.download_artifacts(result.run_id, "recipe.yaml", str(tmp_path)), resolved=True)
    assert list(logged.data.patch_size) == list(plan["patch_size"])
    assert logged.model.options.n_stages != "auto", "the logged recipe holds the planned topology"
