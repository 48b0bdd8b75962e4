"""Train the SynthX generator (or its latent-mode autoencoder) from a recipe: one MLflow run, resumable, DDP-ready.

Steps of :func:`train_synthx`: seed, training cases, data (each rank loads its share), model, run
folder (resumed when it holds a checkpoint of the same recipe), logger, trainer, fit, pipeline.
Under DDP (``trainer.strategy=ddp``, ``trainer.devices``, ``trainer.num_nodes``; Lightning's
launcher, torchrun or Slurm) only rank 0 creates or resumes the MLflow run and writes files; every
rank learns the run id by broadcast. The run holds the resolved recipe, the training case list,
and the saved pipeline (EMA weights, the recipe's sampling scheduler, ``synthx_provenance.json``)
under artifact path ``pipeline``.

Run folder: ``<tracking.output_dir>/synthx-<variant>-<fingerprint>`` unless given; a rerun of the
same recipe (also inside the study) continues from ``checkpoints/last.ckpt`` into the same MLflow
run. A folder holding a run of another recipe is refused unless ``resume=False`` (``--fresh``).

Example::

    recipe = load_synthx_recipe("recipes/generator/synthx.yaml", ["profile=cpu"])
    result = train_synthx(recipe)
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig, OmegaConf

from lightning_modules.data.cohort import load_cohort
from lightning_modules.data.splits import load_split, split_sha256
from lightning_modules.infrastructure.run_folder import RunFolderLock, content_key
from lightning_modules.trainer import build_trainer, global_rank
from lightning_modules.infrastructure.monitoring import system_callbacks
from lightning_modules.infrastructure.process import git_commit
from lightning_modules.tracking import experiment_id, flatten, tracking_uri
from synthx.config import recipe_to_yaml
from synthx.generator.provenance import GeneratorProvenance
from synthx.training.dataset import TumorPatchDataModule, recipe_training_cases
from synthx.training.modules import SynthXAutoencoderModule, SynthXTrainingModule

RUN_ID_FILE = "mlflow_run_id.txt"
RECIPE_KEY_FILE = "recipe_key.txt"


@dataclass
class SynthXTrainResult:
    run_id: str
    output_dir: Path
    pipeline_dir: Path
    steps: int
    case_ids: list[str]
    mean_step_seconds: float


@dataclass
class AutoencoderTrainResult:
    run_id: str
    output_dir: Path
    autoencoder_dir: Path
    steps: int
    scaling_factor: float


def recipe_key(recipe: DictConfig) -> str:
    """A short hash of what the trained weights depend on: the resolved recipe without tracking,
    profiles, step counts (so a longer run of the same recipe continues the shorter one) and the
    quality filter, which is applied to generated cases after training."""
    container = OmegaConf.to_container(recipe, resolve=True, enum_to_str=True)
    for key in ("tracking", "profiles", "quality_filter"):
        container.pop(key, None)
    container["trainer"].pop("max_steps", None)
    container["autoencoder"].pop("max_steps", None)
    return content_key(container)


def run_folder(recipe: DictConfig, output_dir: str | Path | None, variant: str, resume: bool) -> tuple[Path, str | None]:
    """The run folder and, when it is resumed, the MLflow run id recorded in it.

    Raises:
        ValueError: the folder holds a checkpoint of another recipe and ``resume`` is set.
    """
    key = recipe_key(recipe)
    folder = Path(output_dir) if output_dir else Path(recipe.tracking.output_dir) / f"synthx-{variant}-{key}"
    last, id_path, key_path = folder / "checkpoints" / "last.ckpt", folder / RUN_ID_FILE, folder / RECIPE_KEY_FILE
    if not (resume and last.exists() and id_path.exists()):
        return folder, None
    previous = key_path.read_text().strip() if key_path.exists() else "unknown"
    if previous != key:
        raise ValueError(
            f"{folder} holds a SynthX {variant} run of another recipe (key {previous}, this recipe {key}); "
            "rerun with --fresh to start over there, or give another --out"
        )
    return folder, id_path.read_text().strip()


class RankZeroRun(Callback):
    """Rank 0 creates or resumes the MLflow run once the processes are up; every rank learns its id.

    Args:
        logger: the run's MLFlowLogger (its run id is None on ranks above 0).
        folder: the run folder (run id and recipe key are written there by rank 0).
        key: the recipe key (:func:`recipe_key`).
        resumed: the run id was read from the folder.
        describe: logs a new run's recipe, case list and counts, ``describe(logger, trainer)`` (rank 0).
    """

    def __init__(self, logger: MLFlowLogger, folder: Path, key: str, resumed: bool, describe: Callable[[MLFlowLogger, pl.Trainer], None]):
        self.logger, self.folder, self.key, self.resumed, self.describe = logger, folder, key, resumed, describe
        self.run_id: str | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        run_id = None
        if trainer.is_global_zero:
            run_id = self.logger.run_id
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / RUN_ID_FILE).write_text(run_id)
            (self.folder / RECIPE_KEY_FILE).write_text(self.key)
            if self.resumed:
                self.logger.experiment.set_tag(run_id, "resumed", "true")
            else:
                self.describe(self.logger, trainer)
        self.run_id = trainer.strategy.broadcast(run_id, src=0)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.is_global_zero and self.run_id:
            self.logger.experiment.set_terminated(self.run_id, "FAILED")


def _logger(recipe: DictConfig, variant: str, run_id: str | None) -> MLFlowLogger:
    uri = tracking_uri(recipe.tracking.uri)
    experiment = str(recipe.tracking.experiment)
    experiment_id(experiment, uri)
    tags = {
        "recipe": str(recipe.name),
        "profile": str(recipe.profile),
        "variant": variant,
        "split_sha256": split_sha256(recipe.data.split),
        "git_commit": git_commit(),
        **{str(k): str(v) for k, v in dict(recipe.tracking.tags).items()},
    }
    return MLFlowLogger(
        experiment_name=experiment,
        tracking_uri=uri,
        run_name=recipe.tracking.run_name or f"synthx-train-{variant}-{recipe.name}",
        run_id=run_id,
        tags=tags if run_id is None else None,
        log_model=False,
    )


def _describer(recipe: DictConfig, case_ids: list[str], datamodule: TumorPatchDataModule, extra: dict):
    def describe(logger: MLFlowLogger, trainer: pl.Trainer) -> None:
        run_id, client = logger.run_id, logger.experiment
        logger.log_hyperparams(flatten(OmegaConf.to_container(recipe, resolve=True, enum_to_str=True)))
        client.log_text(run_id, recipe_to_yaml(recipe), "recipe.yaml")
        client.log_text(run_id, "case_id\n" + "\n".join(case_ids) + "\n", "training_cases.csv")
        for key, value in {"n_training_cases": len(case_ids), "n_training_lesions": datamodule.total_lesions, **extra}.items():
            client.log_param(run_id, key, value)

    return describe


def _trainer(recipe: DictConfig, max_steps: int, folder: Path, logger: MLFlowLogger, run: RankZeroRun, progress: bool | None) -> pl.Trainer:
    checkpoints = ModelCheckpoint(
        dirpath=folder / "checkpoints",
        save_top_k=0,
        save_last=True,
        every_n_train_steps=max(1, int(recipe.trainer.checkpoint_every_n_steps)),
        enable_version_counter=False,
    )
    return build_trainer(
        recipe.trainer,
        folder,
        logger=logger,
        callbacks=[run, checkpoints, *system_callbacks(recipe.trainer.accelerator, 10 * int(recipe.trainer.log_every_n_steps))],
        max_steps=max_steps,
        # Each rank already holds its own share of the cases (TumorPatchDataModule).
        use_distributed_sampler=False,
        enable_progress_bar=sys.stderr.isatty() if progress is None else progress,
    )


def _fit(recipe: DictConfig, module: pl.LightningModule, variant: str, max_steps: int, output_dir, resume: bool, progress,
         extra: dict, held: contextlib.ExitStack):
    """Data, run folder (its lock entered into ``held``), logger, trainer and fit, shared by the
    generator and the autoencoder."""
    cohort = load_cohort(recipe.data.root)
    case_ids = recipe_training_cases(recipe.data, cohort, load_split(recipe.data.split, cohort))
    datamodule = TumorPatchDataModule(recipe.data, recipe.seed, case_ids)
    folder, run_id = run_folder(recipe, output_dir, variant, resume)
    if global_rank() == 0:
        # One training per folder, until the caller has logged the result (the other ranks of this
        # training share rank 0's lock).
        lock = held.enter_context(RunFolderLock(folder, f"benchx synthx-train ({variant})"))
        if lock.takeover_note:
            print(lock.takeover_note)
    logger = _logger(recipe, variant, run_id)
    run = RankZeroRun(logger, folder, recipe_key(recipe), run_id is not None, _describer(recipe, case_ids, datamodule, extra))
    trainer = _trainer(recipe, max_steps, folder, logger, run, progress)
    last = folder / "checkpoints" / "last.ckpt"
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if run_id else None)
    # The end state too, so a rerun with more steps continues from here (every rank takes part).
    trainer.save_checkpoint(last)
    return trainer, run, logger, folder, case_ids, datamodule


def train_synthx(
    recipe: DictConfig, output_dir: str | Path | None = None, resume: bool = True, enable_progress_bar: bool | None = None
) -> SynthXTrainResult:
    """Train the generator of a loaded recipe and log it (with its pipeline and provenance) as one MLflow run.

    Args:
        recipe: from :func:`synthx.config.load_synthx_recipe`.
        output_dir: run folder (default ``<tracking.output_dir>/synthx-generator-<recipe key>``).
        resume: continue from ``<output_dir>/checkpoints/last.ckpt`` into its MLflow run when present.
        enable_progress_bar: Lightning's progress bar (default: when stderr is a terminal).
    """
    pl.seed_everything(int(recipe.seed), workers=True)
    module = SynthXTrainingModule.from_recipe(recipe)
    extra = {"denoiser_parameters": sum(p.numel() for p in module.denoiser.parameters())}
    with contextlib.ExitStack() as held:
        trainer, run, logger, folder, case_ids, _ = _fit(
            recipe, module, "generator", int(recipe.trainer.max_steps), output_dir, resume, enable_progress_bar, extra, held
        )
        return _log_generator(recipe, module, trainer, run, logger, folder, case_ids)


def _log_generator(recipe, module, trainer, run, logger, folder: Path, case_ids) -> SynthXTrainResult:
    pipeline_dir = folder / "pipeline"
    # The first steps include one-off setup; the steady-state time is what a user plans with.
    steady = module.step_seconds[min(5, len(module.step_seconds) - 1) :] if module.step_seconds else [math.nan]
    mean_step = float(np.mean(steady))
    if trainer.is_global_zero:
        module.pipeline(str(recipe.sampling.scheduler)).save_pretrained(str(pipeline_dir))
        GeneratorProvenance(
            training_cases=case_ids,
            split_sha256=split_sha256(recipe.data.split),
            generator_run_id=run.run_id,
            condition_dropout_all=float(recipe.condition_dropout.all),
        ).write(pipeline_dir)
        logger.experiment.log_artifacts(run.run_id, str(pipeline_dir), artifact_path="pipeline")
        from synthx.serving.pyfunc import log_generator_model

        log_generator_model(run.run_id, tracking_uri(recipe.tracking.uri), pipeline_dir)
        if math.isfinite(mean_step):
            logger.experiment.log_metric(run.run_id, "perf/mean_step_seconds", mean_step)
        logger.finalize("success")
    return SynthXTrainResult(run.run_id, folder, pipeline_dir, trainer.global_step, case_ids, mean_step)


def train_autoencoder(
    recipe: DictConfig, output_dir: str | Path | None = None, resume: bool = True, enable_progress_bar: bool | None = None
) -> AutoencoderTrainResult:
    """Train the latent-mode autoencoder on the generator's patches and log it (artifact ``autoencoder``).

    Use the saved folder as ``model.vae_path`` with ``model.latent=true`` to train the generator in latent space.
    """
    pl.seed_everything(int(recipe.seed), workers=True)
    module = SynthXAutoencoderModule.from_recipe(recipe)
    with contextlib.ExitStack() as held:
        trainer, run, logger, folder, _, datamodule = _fit(
            recipe, module, "autoencoder", int(recipe.autoencoder.max_steps), output_dir, resume, enable_progress_bar, {},
            held,
        )
        return _log_autoencoder(module, trainer, run, logger, folder, datamodule)


def _log_autoencoder(module, trainer, run, logger, folder: Path, datamodule) -> AutoencoderTrainResult:
    scaling = module.latent_scaling_factor(datamodule.train_dataloader())
    autoencoder = module.autoencoder.cpu().eval()
    autoencoder.register_to_config(scaling_factor=scaling)
    autoencoder_dir = folder / "autoencoder"
    if trainer.is_global_zero:
        autoencoder.save_pretrained(str(autoencoder_dir))
        logger.experiment.log_artifacts(run.run_id, str(autoencoder_dir), artifact_path="autoencoder")
        logger.experiment.log_metric(run.run_id, "latent_scaling_factor", scaling)
        logger.finalize("success")
    return AutoencoderTrainResult(run.run_id, folder, autoencoder_dir, trainer.global_step, scaling)
