"""SegmentationModule on a tiny network: loss and deep supervision, training step, per-case records,
record gathering, optimizer and schedule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from monai.data import MetaTensor
from monai.losses import DiceCELoss
from omegaconf import OmegaConf
from torch import nn

from lightning_modules.recipe import load_recipe
from lightning_modules.data.lesions import largest_lesion_extent_mm
from lightning_modules.models.segmentation_module import (
    SegmentationModule,
    build_lr_scheduler,
    deep_supervision_weights,
    lr_lambda,
)

CLASSES = ["pancreas", "pancreatic_lesion"]

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def tiny_module(output: str = "softmax", **kwargs) -> SegmentationModule:
    torch.manual_seed(0)
    network = nn.Conv3d(1, len(CLASSES) + (output == "softmax"), kernel_size=3, padding=1)
    return SegmentationModule(network, CLASSES, "pancreatic_lesion", output=output, patch_size=(8, 8, 8),
                              sw_batch_size=2, sw_overlap=0.25, **kwargs)


def labelled_batch(spacing: float = 2.0):
    """One 8^3 case: pancreas block with a 2x2x2 lesion inside (8 voxels = 64 mm^3 at 2 mm)."""
    labels = torch.zeros(1, 1, 8, 8, 8, dtype=torch.long)
    labels[0, 0, 1:7, 1:7, 1:7] = 1
    labels[0, 0, 3:5, 3:5, 3:5] = 2
    affine = torch.diag(torch.tensor([spacing, spacing, spacing, 1.0], dtype=torch.float64))
    image = MetaTensor(labels.float() / 2, affine=affine)
    image.affine = affine[None]
    return {"image": image, "label": labels, "case_id": ["C1"], "patient_id": ["P1"], "sex": ["F"], "phase": ["venous"],
            "age_band": ["40-60"], "tumor_diameter_mm": torch.tensor([float("nan")], dtype=torch.float64), "tumor": torch.tensor([1])}


def test_deep_supervision_weights_and_schedules():
    assert deep_supervision_weights(1) == [1.0]
    assert deep_supervision_weights(3) == pytest.approx([1 / 1.5, 0.5 / 1.5, 0.0])
    poly = lr_lambda("poly", max_steps=10, power=0.9)
    assert poly(0) == 1.0 and poly(5) == pytest.approx(0.5**0.9) and poly(10) == 0.0
    cosine = lr_lambda("cosine", max_steps=10, warmup_steps=2)
    assert cosine(0) == 0.5 and cosine(1) == 1.0 and cosine(2) == 1.0 and cosine(10) == pytest.approx(0.0)
    assert lr_lambda("constant", 10)(7) == 1.0


def test_optimizer_and_schedule_follow_the_recipe_enums():
    """The recipe's typed choices (OptimizerName, Schedule) and their text (a checkpoint's hparams) act alike."""
    from lightning_modules.config.recipe import OptimizerName, Schedule

    for schedule in Schedule:
        typed, text = lr_lambda(schedule, max_steps=10, warmup_steps=2), lr_lambda(str(schedule), max_steps=10, warmup_steps=2)
        assert [typed(step) for step in range(12)] == [text(step) for step in range(12)]
    assert lr_lambda(Schedule.poly, max_steps=10, power=1.0)(5) == pytest.approx(0.5)
    kinds = {OptimizerName.sgd: torch.optim.SGD, OptimizerName.adamw: torch.optim.AdamW}
    for name, kind in kinds.items():
        module = tiny_module(optim={"name": name, "lr": 1e-2, "schedule": Schedule.cosine, "warmup_steps": 1})
        configured = module.configure_optimizers()
        assert type(configured["optimizer"]) is kind
        assert type(configured["lr_scheduler"]["scheduler"]).__name__ == "WarmupCosineSchedule"
    with pytest.raises(ValueError, match="unknown optimizer 'lbfgs'"):
        tiny_module(optim={"name": "lbfgs"}).configure_optimizers()


def _reference_warmup_cosine(step: int, warmup: int, total: int) -> float:
    """LinearWarmupCosineAnnealingLR's closed form with its defaults (warm-up start and final rate 0), as
    the UNETR, SwinUNETR and Universal Model training code use it: step/(warmup - 1) during the warm-up,
    then cosine over the remaining steps."""
    if step < warmup:
        return step / (warmup - 1)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@pytest.mark.parametrize("name", ["unetr", "swin_unetr_tiny", "swin_unetr_small", "swin_unetr_base",
                                  "universal_model_a", "universal_model_b"])
def test_warm_up_cosine_schedule_first_steps_follow_the_reference(name):
    recipe = load_recipe(RECIPES / f"{name}.yaml", [])
    optim = OmegaConf.to_container(recipe.optim)
    max_steps = int(recipe.trainer.max_steps)
    warmup = int(optim["warmup_steps"])
    assert optim["schedule"] == "cosine" and warmup == max_steps // (100 if name.startswith(("unetr", "swin")) else 20)
    lr = float(optim["lr"])
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = build_lr_scheduler(optimizer, optim, max_steps)
    rates = []
    for _ in range(warmup + 3):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[0] == 0.0  # starts from 0, as the reference
    assert rates[1] == pytest.approx(lr / warmup) and rates[2] == pytest.approx(2 * lr / warmup)
    assert all(b > a for a, b in zip(rates[:warmup], rates[1 : warmup + 1]))  # linear ramp up to lr
    assert rates[warmup] == pytest.approx(lr)
    for step in range(warmup + 3):  # within one warm-up step of the reference's ramp; the cosine part equal
        assert rates[step] == pytest.approx(lr * _reference_warmup_cosine(step, warmup, max_steps), abs=1.001 * lr / warmup)
    for step in (warmup, warmup + 1, warmup + 2):
        assert rates[step] == pytest.approx(lr * _reference_warmup_cosine(step, warmup, max_steps), rel=1e-9)
    # The profile's schedule keeps the same shape: a warm-up well inside the CPU profile's steps.
    cpu = load_recipe(RECIPES / f"{name}.yaml", ["profile=cpu"])
    assert 0 < cpu.optim.warmup_steps < cpu.trainer.max_steps // 10


def test_loss_is_dice_ce_and_deep_supervision_weights_the_scales():
    module = tiny_module()
    labels = labelled_batch()["label"]
    torch.manual_seed(1)
    full = torch.randn(1, 3, 8, 8, 8)
    half = torch.randn(1, 3, 4, 4, 4)
    reference = DiceCELoss(to_onehot_y=True, softmax=True, include_background=False, batch=True)
    assert module.compute_loss(full, labels) == pytest.approx(float(reference(full, labels)), rel=1e-6)
    coarse = nn.functional.interpolate(labels.float(), size=(4, 4, 4), mode="nearest").long()
    weights = deep_supervision_weights(3)
    expected = weights[0] * reference(full, labels) + weights[1] * reference(half, coarse)
    assert module.compute_loss([full, half, torch.randn(1, 3, 2, 2, 2)], labels) == pytest.approx(float(expected), rel=1e-6)


def test_training_step_gives_a_finite_loss_with_gradients():
    module = tiny_module(optim={"name": "adamw", "lr": 1e-2, "schedule": "constant"})
    batch = labelled_batch()
    loss = module.training_step(batch, 0)
    assert torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.network.parameters())
    configured = module.configure_optimizers()
    assert isinstance(configured["optimizer"], torch.optim.AdamW)
    assert configured["lr_scheduler"]["interval"] == "step"


def test_case_records_of_a_perfect_prediction():
    module = tiny_module(small_tumor_mm=20.0)
    batch = labelled_batch(spacing=2.0)
    logits = nn.functional.one_hot(batch["label"][:, 0], 3).permute(0, 4, 1, 2, 3).float() * 20
    (record,) = module.case_records(batch, logits)
    assert record["case_id"] == "C1" and record["sex"] == "F" and record["label"] == 1
    assert record["volume_mm3"] == pytest.approx(8 * 8.0) and record["true_volume_mm3"] == pytest.approx(64.0)
    assert record["max_prob"] == pytest.approx(1.0, abs=1e-6)
    assert record["dice_pancreas"] == pytest.approx(1.0) and record["dice_pancreatic_lesion"] == pytest.approx(1.0)
    # No recorded diameter: derived from the lesion mask by the one lesion-size rule; 2^3 voxels at 2 mm are small.
    lesion = (batch["label"][0, 0] == 2).numpy()
    assert record["tumor_diameter_mm"] == pytest.approx(largest_lesion_extent_mm(lesion, [2.0, 2.0, 2.0]))
    assert 0 < record["tumor_diameter_mm"] <= 20 and record["tumor_size"] == "small"


def test_validation_records_a_negative_case_without_inflating_the_lesion_dice():
    module = tiny_module()
    batch = labelled_batch()
    batch["label"][batch["label"] == 2] = 1
    batch["tumor"] = torch.tensor([0])
    module.on_validation_epoch_start()
    with torch.no_grad():  # as Lightning's validation loop runs it
        (record,) = module.validation_step(batch, 0)
    assert record["label"] == 0 and record["tumor_size"] == ""
    if record["volume_mm3"] == 0:
        assert math.isnan(record["dice_pancreatic_lesion"]), "a class absent from prediction and truth is undefined"
    assert set(record) >= {"surface_dice_pancreas", "volume_mm3", "max_prob", "true_volume_mm3"}


def test_collect_records_keeps_each_case_once():
    module = tiny_module()
    module.on_validation_epoch_start()
    module._records["val"] = [{"case_id": "B", "x": 1}, {"case_id": "A", "x": 2}, {"case_id": "B", "x": 1}]
    table = module.collect_records("val")
    assert list(table["case_id"]) == ["A", "B"]
    assert module.collect_records("val") is table, "cached for the epoch"


def test_sigmoid_backbones_use_one_channel_per_class():
    module = tiny_module(output="sigmoid")
    batch = labelled_batch()
    loss = module.compute_loss(module(batch["image"].as_tensor()), batch["label"])
    assert torch.isfinite(loss)
    logits = module.predict_volume(batch["image"].as_tensor())
    assert logits.shape == (1, 2, 8, 8, 8)
