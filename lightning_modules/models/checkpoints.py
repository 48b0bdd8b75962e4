"""How a trained segmentation model is rebuilt: its module from a recipe, its weights from a checkpoint.

Where the recipe and checkpoint come from (a training run, a registered model, a file) is the
tracking adapter's part: :func:`lightning_modules.tracking.artifacts.resolve_model_source`.

A checkpoint written by ``benchx train`` also carries what the model was trained on
(:data:`PROVENANCE_KEY`: its training case and patient ids, the split file's sha256, the cases the
generator of its synthetic data learned from, its training scans' content signatures and its
training run), put there by :class:`RecordProvenance`; a copy of the file evaluated on its own is
checked against it (docs/explanation/data.md "Split files").

Example::

    recipe, checkpoint = resolve_model_source(run_id="3f2a...", folder=tmp)
    module = load_module_from_checkpoint(recipe, checkpoint)
    provenance = checkpoint_provenance(checkpoint)  # None for a checkpoint written before it was recorded
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf

from lightning_modules.models.backbones import build_backbone, get_backbone
from lightning_modules.models.segmentation_module import SegmentationModule


# The pyfunc artifacts of a registered model (lightning_modules/tracking/pyfunc.py logs them).
CHECKPOINT_ARTIFACT = "checkpoint"
RECIPE_ARTIFACT = "recipe"
# The checkpoint dict's entry that says what the model was trained on.
PROVENANCE_KEY = "benchx_training_provenance"


class ModelSourceError(ValueError):
    """A run or checkpoint that does not name a usable trained model."""


def build_module(recipe: DictConfig) -> SegmentationModule:
    """The SegmentationModule for a recipe: its backbone, loss, optimizer and inference settings."""
    spec = get_backbone(recipe.model.backbone)
    options = OmegaConf.to_container(recipe.model.options, resolve=True)
    network = build_backbone(
        recipe.model.backbone,
        in_channels=1,
        out_channels=len(recipe.data.classes) + 1,
        patch_size=tuple(int(p) for p in recipe.data.patch_size),
        **options,
    )
    return SegmentationModule(
        network,
        classes=list(recipe.data.classes),
        tumor_class=recipe.data.tumor_class,
        output=spec.output,
        patch_size=tuple(int(p) for p in recipe.data.patch_size),
        optim=OmegaConf.to_container(recipe.optim, resolve=True, enum_to_str=True),
        max_steps=int(recipe.trainer.max_steps),
        loss=OmegaConf.to_container(recipe.loss, resolve=True, enum_to_str=True),
        sw_batch_size=int(recipe.trainer.sw_batch_size),
        sw_overlap=float(recipe.trainer.sw_overlap),
        small_tumor_mm=float(recipe.detection.small_tumor_mm),
        sw_roi_size=[int(v) for v in recipe.trainer.sw_roi_size] or None,
        min_component_mm3=float(recipe.detection.min_component_mm3),
    )


def load_module_from_checkpoint(recipe: DictConfig, checkpoint: str | Path) -> SegmentationModule:
    """Rebuild the recipe's module and load a checkpoint's weights into it."""
    import torch

    module = build_module(recipe)
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    module.load_state_dict(state["state_dict"])
    return module


class RecordProvenance(Callback):
    """Writes what the model is trained on into every checkpoint the trainer saves (:data:`PROVENANCE_KEY`).

    ``provenance`` holds plain types and tensors only (so the checkpoint still loads with
    ``weights_only``): ``training_cases`` and ``patient_ids`` (parallel lists), ``split_sha256``,
    ``generator_cases`` and ``generator_patient_ids``, ``synthetic_cohort`` ("" without one),
    ``scan_signatures`` (:meth:`lightning_modules.cohorts.audit.signatures.ScanSignatures.to_payload`)
    and ``training_run_id``.
    """

    def __init__(self, provenance: dict | None):
        self.provenance = provenance

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.provenance is not None:
            checkpoint[PROVENANCE_KEY] = self.provenance


def checkpoint_provenance(checkpoint: str | Path) -> dict | None:
    """What a checkpoint's model was trained on (see :class:`RecordProvenance`), or None when it does not say.

    Raises:
        ModelSourceError: the file is not a readable checkpoint (naming it).
    """
    import pickle

    import torch

    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as error:
        raise ModelSourceError(f"checkpoint {checkpoint}: not a readable checkpoint ({error})") from error
    provenance = state.get(PROVENANCE_KEY) if isinstance(state, dict) else None
    return provenance if isinstance(provenance, dict) else None
