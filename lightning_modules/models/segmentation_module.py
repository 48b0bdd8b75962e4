"""One LightningModule for all 12 backbones: loss, validation, per-case records, optimizer and schedule.

The network comes in as a plain argument (lightning-hydra-template style); the module owns:

- the loss: Dice + cross-entropy from MONAI (``DiceCELoss``; sigmoid + BCE for multi-label
  backbones), deep-supervision outputs weighted per scale as nnU-Net does (1/2^i, the coarsest
  scale dropped, normalized);
- validation and test by sliding-window inference on whole volumes (MONAI inferer), producing one
  record per case (Dice per class, predicted tumor volume in mm^3, max tumor probability, the true
  scan-level label and the case's subgroup attributes) that the evaluation callback turns into
  subgroup metrics; under DDP the records of all processes are gathered and de-duplicated by case id
  (DistributedSampler pads with repeated cases);
- the optimizer (SGD or AdamW) and a per-step schedule (poly, cosine or constant, optional warmup).
"""

from __future__ import annotations

import math
from typing import Sequence

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.optimizers import WarmupCosineSchedule
from torch import nn

from lightning_modules.config.recipe import OptimizerName, Schedule
from lightning_modules.data.lesions import largest_lesion_extent_mm, pancreas_location, tumor_size_group
from lightning_modules.data.metadata import RECORD_COLUMNS, UNKNOWN
from lightning_modules.models.segmentation_metrics import dice_per_class, surface_dice_per_class
from lightning_modules.models.tumor_outputs import (
    multilabel_target,
    predicted_labels,
    tumor_probability,
    tumor_scan_scores,
)


def deep_supervision_weights(n_outputs: int, decay: float = 0.5) -> list[float]:
    """nnU-Net's scale weights: decay**i per scale, the coarsest dropped when there are several, summing to 1."""
    weights = [decay**i for i in range(n_outputs)]
    if n_outputs > 1:
        weights[-1] = 0.0
    total = sum(weights)
    return [w / total for w in weights]


def lr_lambda(schedule: Schedule, max_steps: int, warmup_steps: int = 0, power: float = 0.9):
    """Learning-rate multiplier per optimizer step."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        if schedule == Schedule.poly:
            return (1.0 - progress) ** power
        if schedule == Schedule.cosine:
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim: dict, max_steps: int):
    """The per-step learning-rate scheduler of a recipe's ``optim`` section.

    ``cosine`` with ``warmup_steps``: MONAI's ``WarmupCosineSchedule`` (linear warm-up from 0, then
    cosine to 0), the schedule of the UNETR, SwinUNETR and Universal Model reference training code
    (``LinearWarmupCosineAnnealingLR`` with its defaults, warm-up start and final learning rate 0): the
    cosine part is identical, and the warm-up ramp reaches the full rate one step later (step
    ``warmup_steps`` rather than ``warmup_steps - 1``). Every other schedule: :func:`lr_lambda`.
    """
    schedule = optim.get("schedule", Schedule.constant)
    warmup_steps = int(optim.get("warmup_steps", 0))
    if schedule == Schedule.cosine and warmup_steps > 0:
        return WarmupCosineSchedule(optimizer, warmup_steps=warmup_steps, t_total=max_steps, end_lr=0.0, cycles=0.5)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(schedule, max_steps, warmup_steps, float(optim.get("poly_power", 0.9)))
    )


class SegmentationModule(pl.LightningModule):
    """Train and evaluate any registered backbone.

    Args:
        network: the backbone (``lightning_modules.models.backbones.build_backbone``).
        classes: recipe class names in label order (label k = classes[k-1]).
        tumor_class: the class whose voxels make a scan positive.
        output: ``softmax`` or ``sigmoid`` (the backbone's registry entry).
        patch_size: sliding-window size for whole-volume inference.
        optim: ``name, lr, weight_decay, momentum, nesterov, schedule, warmup_steps, poly_power``.
        max_steps: schedule length (optimizer steps).
        loss: ``dice_weight, ce_weight, deep_supervision_decay``.
        sw_batch_size / sw_overlap: sliding-window inference settings.
        sw_roi_size: inference window (default: ``patch_size``).
        min_component_mm3: predicted tumor components below this size are removed before the
            scan-level score (:func:`lightning_modules.models.tumor_outputs.tumor_scan_scores`).
        small_tumor_mm: the 'small' tumor-size boundary for the records (``docs/explanation/data.md "Lesion size and location"``).
    """

    def __init__(
        self,
        network: nn.Module,
        classes: Sequence[str],
        tumor_class: str,
        output: str = "softmax",
        patch_size: Sequence[int] = (96, 96, 96),
        optim: dict | None = None,
        max_steps: int = 1000,
        loss: dict | None = None,
        sw_batch_size: int = 4,
        sw_overlap: float = 0.5,
        small_tumor_mm: float = 20.0,
        sw_roi_size: Sequence[int] | None = None,
        min_component_mm3: float = 0.0,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["network"])
        self.network = network
        self.classes = list(classes)
        self.tumor_label = self.classes.index(tumor_class) + 1
        self.output = output
        self.optim = dict(optim or {})
        loss = dict(loss or {})
        self.ds_decay = float(loss.get("deep_supervision_decay", 0.5))
        # As nnU-Net: Dice over foreground classes only and over the whole batch ("batch Dice"), so a
        # small lesion's Dice term is not diluted by background and is defined whenever any patch
        # of the batch holds the lesion; cross-entropy over all channels.
        self.criterion = DiceCELoss(
            to_onehot_y=output == "softmax",
            softmax=output == "softmax",
            sigmoid=output == "sigmoid",
            include_background=output != "softmax",
            batch=bool(loss.get("batch_dice", True)),
            lambda_dice=float(loss.get("dice_weight", 1.0)),
            lambda_ce=float(loss.get("ce_weight", 1.0)),
        )
        self._records: dict[str, list[dict]] = {"val": [], "test": []}
        self._gathered: dict[str, pd.DataFrame | None] = {"val": None, "test": None}

    # ------------------------------------------------------------------------------------------
    # Training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def _target(self, labels: torch.Tensor) -> torch.Tensor:
        if self.output == "sigmoid":
            return multilabel_target(labels, self.classes)
        return labels

    def compute_loss(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        """Dice + CE, weighted over deep-supervision scales when the network returns several."""
        if isinstance(outputs, torch.Tensor):
            return self.criterion(outputs, self._target(labels))
        outputs = list(outputs)
        weights = deep_supervision_weights(len(outputs), self.ds_decay)
        total = outputs[0].new_zeros(())
        for weight, output in zip(weights, outputs):
            if weight == 0.0:
                continue
            scaled = labels if output.shape[2:] == labels.shape[2:] else F.interpolate(
                labels.float(), size=output.shape[2:], mode="nearest"
            ).to(labels.dtype)
            total = total + weight * self.criterion(output, self._target(scaled))
        return total

    def training_step(self, batch, batch_idx):
        outputs = self.network(batch["image"])
        loss = self.compute_loss(outputs, batch["label"].long())
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["image"].shape[0])
        return loss

    # ------------------------------------------------------------------------------------------
    # Whole-volume inference and per-case records

    def predict_volume(self, image: torch.Tensor) -> torch.Tensor:
        """Logits for whole volumes by sliding-window inference (full-resolution output only)."""
        patch = tuple(int(p) for p in (self.hparams.sw_roi_size or self.hparams.patch_size))
        return sliding_window_inference(
            image,
            roi_size=patch,
            sw_batch_size=int(self.hparams.sw_batch_size),
            predictor=self.network,
            overlap=float(self.hparams.sw_overlap),
            mode="gaussian",
        )

    def case_records(self, batch, logits: torch.Tensor) -> list[dict]:
        """One record per case of an evaluation batch (see module docstring)."""
        labels_pred = predicted_labels(logits, self.output)
        tumor_prob = tumor_probability(logits, self.output, self.tumor_label)
        truth = batch["label"].long()[:, 0]
        records = []
        for i in range(logits.shape[0]):
            affine = batch["image"].affine[i] if hasattr(batch["image"], "affine") and batch["image"].affine.ndim == 3 else batch["image"].affine
            voxel_mm3 = float(abs(torch.linalg.det(torch.as_tensor(affine, dtype=torch.float64)[:3, :3])))
            spacing = torch.linalg.norm(torch.as_tensor(affine, dtype=torch.float64)[:3, :3], dim=0).tolist()
            pred_tumor = labels_pred[i] == self.tumor_label
            true_tumor = truth[i] == self.tumor_label
            record = {key: _item(batch[key], i) for key in _META_KEYS if key in batch}
            recorded = int(record.pop("tumor", -1))
            label = recorded if recorded in (0, 1) else int(true_tumor.any())
            record.update(
                label=label,
                **tumor_scan_scores(pred_tumor, voxel_mm3, float(self.hparams.get("min_component_mm3", 0.0)), true_tumor),
                max_prob=float(tumor_prob[i].max()),
                true_volume_mm3=float(true_tumor.sum()) * voxel_mm3,
            )
            diameter = _as_float(record.get("tumor_diameter_mm"))
            if label == 1 and math.isnan(diameter) and bool(true_tumor.any()):
                diameter = largest_lesion_extent_mm(true_tumor.cpu().numpy(), spacing)
            record["tumor_diameter_mm"] = diameter
            record["tumor_size"] = tumor_size_group(diameter, label, float(self.hparams.small_tumor_mm))
            record["tumor_location"] = self._tumor_location(record.get("tumor_location", ""), label, truth[i], affine)
            record.update(segmentation_scores(labels_pred[i], truth[i], self.classes, spacing))
            records.append(record)
        return records

    def _tumor_location(self, recorded, label: int, truth: torch.Tensor, affine) -> str:
        """The recorded tumor location; for a positive without one, derived from its pancreas and
        lesion masks (:func:`lightning_modules.data.lesions.pancreas_location`), else Unknown."""
        recorded = "" if recorded is None or str(recorded).strip().lower() in ("", "nan", "unknown") else str(recorded)
        if label != 1 or recorded:
            return recorded
        lesion = truth == self.tumor_label
        if self.classes[self.tumor_label - 1] != "pancreatic_lesion" or "pancreas" not in self.classes or not lesion.any():
            return UNKNOWN
        pancreas = truth == self.classes.index("pancreas") + 1
        affine = torch.as_tensor(affine, dtype=torch.float64).cpu().numpy()
        return pancreas_location(pancreas.cpu().numpy(), lesion.cpu().numpy(), affine)

    def _evaluation_step(self, batch, stage: str) -> list[dict]:
        logits = self.predict_volume(batch["image"])
        records = self.case_records(batch, logits)
        self._records[stage].extend(records)
        return records

    def validation_step(self, batch, batch_idx):
        return self._evaluation_step(batch, "val")

    def test_step(self, batch, batch_idx):
        return self._evaluation_step(batch, "test")

    def on_validation_epoch_start(self) -> None:
        self._records["val"], self._gathered["val"] = [], None

    def on_test_epoch_start(self) -> None:
        self._records["test"], self._gathered["test"] = [], None

    def collect_records(self, stage: str) -> pd.DataFrame:
        """This epoch's records from every process, each case exactly once (cached per epoch)."""
        if self._gathered[stage] is not None:
            return self._gathered[stage]
        records = self._records[stage]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, records)
            records = [r for part in gathered for r in part]
        table = pd.DataFrame(records)
        if len(table):
            # DistributedSampler pads the last batch with repeated cases: keep each case once.
            table = table.drop_duplicates(subset="case_id", keep="first").sort_values("case_id").reset_index(drop=True)
        self._gathered[stage] = table
        return table

    def _log_dice(self, stage: str) -> None:
        table = self.collect_records(stage)
        if not len(table):
            return
        means = []
        for name in self.classes:
            values = table[f"dice_{name}"].dropna()
            # Always logged (NaN when no case has the class) so checkpointing can monitor it.
            value = float(values.mean()) if len(values) else math.nan
            self.log(f"{stage}/dice/{name}", value, rank_zero_only=True, sync_dist=False)
            if len(values):
                means.append(value)
            surface = table[f"surface_dice_{name}"].dropna()
            if len(surface):
                self.log(f"{stage}/surface_dice/{name}", float(surface.mean()), rank_zero_only=True, sync_dist=False)
        if means:
            self.log(f"{stage}/dice_mean", float(np.mean(means)), rank_zero_only=True, sync_dist=False)

    def on_validation_epoch_end(self) -> None:
        self._log_dice("val")

    def on_test_epoch_end(self) -> None:
        self._log_dice("test")

    # ------------------------------------------------------------------------------------------
    # Optimizer

    def configure_optimizers(self):
        optim = self.optim
        name = optim.get("name", OptimizerName.sgd)
        lr = float(optim.get("lr", 1e-2))
        weight_decay = float(optim.get("weight_decay", 0.0))
        if name == OptimizerName.sgd:
            optimizer = torch.optim.SGD(
                self.network.parameters(),
                lr=lr,
                momentum=float(optim.get("momentum", 0.99)),
                nesterov=bool(optim.get("nesterov", True)),
                weight_decay=weight_decay,
            )
        elif name == OptimizerName.adamw:
            optimizer = torch.optim.AdamW(self.network.parameters(), lr=lr, weight_decay=weight_decay)
        else:
            raise ValueError(f"unknown optimizer {name!r}")
        schedule = build_lr_scheduler(optimizer, optim, int(self.hparams.max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


# The case metadata carried into each record (the datamodule's columns plus the recorded tumor label).
_META_KEYS = (*RECORD_COLUMNS, "tumor")


def _item(value, index: int):
    if isinstance(value, (list, tuple)):
        value = value[index]
    elif isinstance(value, torch.Tensor):
        value = value[index].item() if value.ndim else value.item()
    return value


def _as_float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def segmentation_scores(pred: torch.Tensor, truth: torch.Tensor, classes: Sequence[str], spacing) -> dict[str, float]:
    """Dice and normalized surface Dice at 1.5 mm per class (MONAI, via segmentation_metrics).

    A class absent from both prediction and truth is undefined for this case (NaN, left out of the
    means) rather than a perfect 1.0, so negative scans do not inflate the lesion Dice.
    """
    pred = pred.cpu()
    truth = truth.cpu()
    dice = dice_per_class(pred, truth, classes)
    surface = surface_dice_per_class(pred, truth, classes, spacing=[float(s) for s in spacing])
    scores = {}
    for index, name in enumerate(classes, start=1):
        present = bool((pred == index).any()) or bool((truth == index).any())
        scores[f"dice_{name}"] = float(dice[name]) if present else math.nan
        scores[f"surface_dice_{name}"] = float(surface[name]) if present else math.nan
    return scores
