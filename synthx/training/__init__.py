"""SynthX generator training: the patch data (:mod:`.dataset`), the LightningModules (:mod:`.modules`)
and the run that ties them to MLflow (:mod:`.run`). The command is ``benchx synthx-train``
(:mod:`synthx.commands.synthx_train`).
"""

from synthx.training.dataset import (
    LesionRegion,
    TumorPatchDataModule,
    TumorPatchDataset,
    build_dataset,
    patch_dataset,
    recipe_training_cases,
    training_tumor_cases,
)
from synthx.training.modules import (
    SynthXAutoencoderModule,
    SynthXTrainingModule,
    build_denoiser,
    drop_conditions,
    load_autoencoder,
)
from synthx.training.run import AutoencoderTrainResult, SynthXTrainResult, recipe_key, train_autoencoder, train_synthx

__all__ = [
    "AutoencoderTrainResult",
    "LesionRegion",
    "SynthXAutoencoderModule",
    "SynthXTrainResult",
    "SynthXTrainingModule",
    "TumorPatchDataModule",
    "TumorPatchDataset",
    "build_dataset",
    "build_denoiser",
    "patch_dataset",
    "recipe_training_cases",
    "drop_conditions",
    "load_autoencoder",
    "recipe_key",
    "train_autoencoder",
    "train_synthx",
    "training_tumor_cases",
]
