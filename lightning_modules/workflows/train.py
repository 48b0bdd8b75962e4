"""Train a backbone from a recipe on a cohort + split, tracked in MLflow, resumable, on one or many processes.

Before the first step the cohort is validated and the split audited for patient overlap and
duplicates; a broken cohort or a leaking split is refused with the full list of problems (the
leakage check can be overridden with ``data.allow_leakage=true``, which is recorded in MLflow).

Each run has an output folder, by default ``<tracking.output_dir>/<recipe name>-<fingerprint>``
(the fingerprint is a hash of the resolved recipe), holding ``checkpoints/`` and ``run.json`` (the
MLflow run id and the recipe it was started with). One process at a time writes a folder (a lock
naming the holder). Running the same command again after an interruption resumes from the newest
good checkpoint into the same MLflow run, at the same step; a rerun with another recipe is refused
with the keys that differ. The MLflow run ends FINISHED, FAILED or KILLED (SIGTERM, Ctrl+C).

Every checkpoint carries what the model was trained on (training case and patient ids, the split's
sha256, the generator's cases, the training scans' content signatures: see
:mod:`lightning_modules.workflows.training_overlap`), so evaluating a copy of it still refuses its
training cases; the run logs the signatures as ``training_scan_signatures.npz``.

Distributed (``trainer.devices=2 trainer.strategy=ddp``, torchrun, srun): rank 0 takes the lock and
creates or resumes the run; every process gets its id and checkpoint (see
:func:`lightning_modules.trainer.share_from_rank_zero`); only rank 0 writes to MLflow and the folder.

Example::

    result = train(load_recipe("recipes/unet.yaml", ["profile=cpu"]))
    result = train(recipe, TrainSettings(output_dir="outputs/mine", resume=False))
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from lightning_modules.cohorts.audit import check_split_leakage
from lightning_modules.config.recipe import Normalization
from lightning_modules.data.cohort import CohortError, load_cohort
from lightning_modules.data.datamodule import CohortDataModule, default_cache_dir
from lightning_modules.data.intensity import ct_intensity_properties
from lightning_modules.data.mixing import mixing_datamodule
from lightning_modules.data.splits import load_split, split_sha256
from lightning_modules.data.validation import validate_cohort
from lightning_modules.evaluation.callback import SubgroupEvaluation
from lightning_modules.infrastructure.files import atomic_write_bytes
from lightning_modules.infrastructure.monitoring import system_callbacks
from lightning_modules.infrastructure.process import deferred_signals
from lightning_modules.infrastructure.run_folder import (
    check_same_recipe,
    CHECKPOINT_NAMES,
    recipe_fingerprint,
    resume_checkpoint,
    RunFolderError,
    RunFolderLock,
    RunRecord,
)
from lightning_modules.models.checkpoints import build_module, RecordProvenance
from lightning_modules.models.planning import resolve_planned_recipe
from lightning_modules.recipe import recipe_to_yaml, recipe_variant
from lightning_modules.tracking import ended_run, flatten, run_status, run_tags, start_run, tracking_uri
from lightning_modules.tracking.datasets import log_dataset_inputs, log_exposures, resolve_synthetic_cohort
from lightning_modules.tracking.provenance import log_training_cases
from lightning_modules.tracking.pyfunc import log_segmentation_model
from lightning_modules.tracking.recorder import logger_recorder
from lightning_modules.trainer import (
    build_trainer,
    FailWithLaunchedProcesses,
    global_rank,
    memory_advice,
    PeriodicCheckpoint,
    RunLogger,
    share_from_rank_zero,
)
from lightning_modules.workflows.training_overlap import (
    log_training_signatures,
    signature_cache,
    SIGNATURES_ARTIFACT,
    training_provenance,
)


__all__ = ["TrainResult", "TrainSettings", "default_output_dir", "recipe_fingerprint", "train"]

log = logging.getLogger(__name__)


@dataclass
class TrainSettings:
    """How a training runs, beyond its recipe.

    Args:
        output_dir: run folder (default: :func:`default_output_dir`).
        callbacks: extra Lightning callbacks (e.g. the subgroup evaluation, an Optuna pruner).
        datamodule: a prepared datamodule (default: the recipe's cohort and split).
        resume: continue the folder's run from its newest good checkpoint when there is one;
            False starts a new run in the folder (its old checkpoints are removed).
        variant: ``baseline`` or ``synthx`` (default: from ``synthx.ratio``).
        extra_tags: more MLflow tags (e.g. a parent run id, an Optuna trial number).
        after_run_start: called on rank 0 with the logger once a new MLflow run exists.
        trainer_overrides: keyword arguments of ``pl.Trainer`` over the recipe's.
        evaluation: add the SubgroupEvaluation callback (subgroup detection metrics at each validation).
        run_id: log a new run into this existing MLflow run (``benchx train`` passes the run that
            ``mlflow run`` opened, ``MLFLOW_RUN_ID``); default: a new run.
    """

    output_dir: str | Path | None = None
    callbacks: Sequence[Callback] = ()
    datamodule: CohortDataModule | None = None
    resume: bool = True
    variant: str | None = None
    extra_tags: dict[str, str] | None = None
    after_run_start: Callable[[MLFlowLogger], None] | None = None
    trainer_overrides: dict | None = None
    evaluation: bool = True
    run_id: str | None = None


@dataclass
class TrainResult:
    """What a training run leaves behind."""

    run_id: str
    output_dir: Path
    best_checkpoint: Path | None
    last_checkpoint: Path
    metrics: dict[str, float] = field(default_factory=dict)
    global_step: int = 0


@dataclass
class RunStart:
    """Rank 0's decision, shared with every process: which run, from which checkpoint."""

    run_id: str
    uri: str
    new_run: bool
    resume_from: str | None = None
    finished_at: int | None = None
    leakage_overridden: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def default_output_dir(recipe: DictConfig) -> Path:
    return Path(recipe.tracking.output_dir) / f"{recipe.name}-{recipe_fingerprint(recipe)}"


def train(recipe: DictConfig, settings: TrainSettings | None = None, **options) -> TrainResult:
    """Train the recipe's backbone; resume the output folder's run when it is the same recipe.

    Args:
        recipe: a loaded recipe.
        settings: how to run (default: ``TrainSettings(**options)``).
        options: the fields of :class:`TrainSettings`, as a shorthand.
    """
    settings = settings or TrainSettings(**options)
    pl.seed_everything(int(recipe.seed), workers=True)
    recipe, plan, datamodule = prepare_data(recipe, settings.datamodule)
    output_dir = Path(settings.output_dir) if settings.output_dir else default_output_dir(recipe)
    checkpoint_dir = output_dir / "checkpoints"
    with contextlib.ExitStack() as held:
        start = RunStart(**share_from_rank_zero(
            lambda: asdict(claim_run(recipe, settings, output_dir, datamodule, held)), str(recipe.trainer.accelerator)
        ))
        for note in start.notes:
            log.warning(note)
        if start.finished_at is not None:
            return finished_result(start, output_dir)
        held.enter_context(ended_run(start.uri, start.run_id, writer=global_rank() == 0))
        logger = RunLogger(experiment_name=str(recipe.tracking.experiment), tracking_uri=start.uri, run_id=start.run_id)
        provenance = None
        if global_rank() == 0:
            record_run_start(logger, recipe, plan, datamodule, start, settings)
            provenance = record_provenance(logger, recipe, datamodule, start)
        module = build_module(recipe)
        best, periodic = checkpoint_callbacks(recipe, checkpoint_dir)
        evaluation = [SubgroupEvaluation.from_detection(recipe.detection, recorder=logger_recorder)] if settings.evaluation else []
        trainer = build_trainer(
            recipe.trainer,
            output_dir,
            logger=logger,
            callbacks=[best, periodic, RecordProvenance(provenance), LearningRateMonitor(logging_interval="step"),
                       *evaluation, *settings.callbacks,
                       *system_callbacks(recipe.trainer.accelerator, 10 * int(recipe.trainer.log_every_n_steps)),
                       FailWithLaunchedProcesses(start.uri, start.run_id)],
            max_steps=int(recipe.trainer.max_steps),
            val_every_n_steps=int(recipe.trainer.val_every_n_steps),
            **(settings.trainer_overrides or {}),
        )
        with deferred_signals(), memory_advice(recipe), expected_checkpoint_warnings(recipe, best):
            trainer.fit(module, datamodule=datamodule, ckpt_path=start.resume_from)
        best_path = Path(best.best_model_path) if best.best_model_path else None
        if trainer.is_global_zero:
            log_exposures(logger.experiment, start.run_id, datamodule, int(trainer.global_step))
            log_checkpoints(logger, [best_path, checkpoint_dir / "last.ckpt"])
            model_checkpoint = best_path if best_path and best_path.exists() else checkpoint_dir / "last.ckpt"
            log_segmentation_model(start.run_id, start.uri, recipe, model_checkpoint, recipe_to_yaml(recipe))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    return TrainResult(start.run_id, output_dir, best_path, checkpoint_dir / "last.ckpt", metrics, trainer.global_step)


# ------------------------------------------------------------------------------------------------
# The steps of train()


def prepare_data(recipe: DictConfig, datamodule: CohortDataModule | None = None) -> tuple[DictConfig, dict | None, CohortDataModule]:
    """Plan an ``auto`` nnU-Net/ResEnc topology from the training cases and load the datamodule.

    Planning is deterministic, so a resumed run (and every process of a distributed one) plans the
    same network. Returns the (planned) recipe, the plan (None when nothing was planned) and the
    datamodule.
    """
    split = datamodule.split if datamodule is not None and datamodule.split is not None else None
    if split is None:
        split = load_split(recipe.data.split)
    train_ids = list(split.loc[split["split"] == "train", "case_id"])
    recipe, plan = resolve_planned_recipe(recipe, case_ids=train_ids)
    recipe = measured_intensity(recipe, train_ids)
    if datamodule is not None:
        datamodule.data = recipe.data
    datamodule = datamodule or recipe_datamodule(recipe, resolve_synthetic_cohort(recipe))
    datamodule.load()
    return recipe, plan, datamodule


def recipe_datamodule(recipe: DictConfig, synthetic_root: Path | None = None) -> CohortDataModule:
    """The data layer of a recipe: its data and mixing sections (the synthesis ratio, and with
    ``synthx.real_steps`` the exposure-matched schedule), seed, and the disk cache's default folder
    under ``tracking.output_dir``."""
    return mixing_datamodule(
        recipe.data, recipe.synthx, seed=recipe.seed,
        synthetic_root=synthetic_root, cache_dir=default_cache_dir(recipe.tracking.output_dir),
    )


def measured_intensity(recipe: DictConfig, train_ids: list[str]) -> DictConfig:
    """With ``data.normalization: ct`` and no ``data.ct_intensity`` yet: the training cases'
    foreground statistics (:func:`lightning_modules.data.intensity.ct_intensity_properties`) written
    into the recipe, which the run logs, so evaluation and the registered model apply the same."""
    if recipe.data.normalization != Normalization.ct or recipe.data.ct_intensity is not None:
        return recipe
    stats = ct_intensity_properties(load_cohort(recipe.data.root), train_ids, list(recipe.data.classes))
    return recipe_variant(recipe, {"data": {"ct_intensity": stats}}, source=f"{recipe.name} (CT intensities measured)")


def claim_run(
    recipe: DictConfig, settings: TrainSettings, output_dir: Path, datamodule: CohortDataModule, held: contextlib.ExitStack
) -> RunStart:
    """On rank 0: check the data, lock the folder, and resume its run or start a new one.

    The lock is entered into ``held`` and so kept until the run ends.

    Raises:
        CohortError: a broken cohort or a leaking split.
        RunFolderError: the folder is locked, belongs to another recipe, or its checkpoints are damaged.
    """
    overridden = check_data(recipe, datamodule.cohort, datamodule.split)
    lock = held.enter_context(RunFolderLock(output_dir, "benchx train"))
    notes = [lock.takeover_note] if lock.takeover_note else []
    uri = tracking_uri(recipe.tracking.uri)
    checkpoint_dir = output_dir / "checkpoints"
    record = RunRecord.read(output_dir) if settings.resume else None
    if record is not None:
        return resume_run(recipe, output_dir, record, uri, notes)
    if settings.resume and any((checkpoint_dir / name).exists() for name in CHECKPOINT_NAMES):
        raise RunFolderError(
            f"{output_dir} has checkpoints but no run.json (from an older version, or another tool): "
            "start a new run with --fresh (replaces them) or write to another folder"
        )
    for name in CHECKPOINT_NAMES:
        (checkpoint_dir / name).unlink(missing_ok=True)
    tags = {**run_tags(recipe, split_sha256(recipe.data.split), settings.variant), **(settings.extra_tags or {})}
    # The arm first: the UI cuts long names at the end, and arms differ in their first word.
    run_name = recipe.tracking.run_name or f"{tags['variant']}-train-{recipe.name}"
    run_id = settings.run_id or start_run(uri, str(recipe.tracking.experiment), run_name, tags)
    if settings.run_id:
        for key, value in tags.items():
            MlflowClient(tracking_uri=uri).set_tag(run_id, key, value)
    RunRecord.for_recipe(recipe, run_id, uri).write(output_dir)
    return RunStart(run_id, uri, new_run=True, leakage_overridden=overridden, notes=notes)


def resume_run(recipe: DictConfig, output_dir: Path, record: RunRecord, uri: str, notes: list[str]) -> RunStart:
    """The folder's run, when the recipe and the tracking store are the ones it was started with."""
    check_same_recipe(output_dir, record, recipe)
    status = run_status(uri, record.run_id)
    if status is None:
        raise RunFolderError(
            f"{output_dir} belongs to run {record.run_id} of {record.tracking_uri}, which {uri} does not hold: "
            "use that tracking store, or start a new run with --fresh"
        )
    if status == "FINISHED":
        # Never reopened: its checkpoints and metrics are final (a longer training is another recipe).
        notes.append(f"run {record.run_id} in {output_dir} already finished; nothing to do")
        return RunStart(record.run_id, uri, new_run=False, finished_at=int(recipe.trainer.max_steps), notes=notes)
    checkpoint, checkpoint_notes = resume_checkpoint(output_dir / "checkpoints")
    return RunStart(record.run_id, uri, new_run=False, resume_from=str(checkpoint) if checkpoint else None,
                    notes=notes + checkpoint_notes)


def record_run_start(
    logger: MLFlowLogger, recipe: DictConfig, plan: dict | None, datamodule: CohortDataModule, start: RunStart, settings: TrainSettings
) -> None:
    """On rank 0: a new run gets its parameters, recipe, plan and dataset inputs; a resumed one a tag."""
    client, run_id = logger.experiment, start.run_id
    if not start.new_run:
        client.set_tag(run_id, "resumed", "true")
        client.update_run(run_id, status="RUNNING")
        return
    logger.log_hyperparams(flatten(OmegaConf.to_container(recipe, resolve=True, enum_to_str=True)))
    client.log_text(run_id, recipe_to_yaml(recipe), "recipe.yaml")
    if plan is not None:
        client.log_dict(run_id, plan, "nnunet_plan.json")
    if start.leakage_overridden:
        client.set_tag(run_id, "leakage_override", "true")
        client.log_text(run_id, "\n".join(start.leakage_overridden), "leakage_override.txt")
    log_dataset_inputs(client, run_id, datamodule, str(recipe.data.split))
    log_training_cases(client, run_id, datamodule.split)
    if settings.after_run_start is not None:
        settings.after_run_start(logger)


def record_provenance(logger: MLFlowLogger, recipe: DictConfig, datamodule: CohortDataModule, start: RunStart) -> dict:
    """On rank 0: what the model is trained on, which every checkpoint carries (``RecordProvenance``), so a
    copy of a checkpoint is checked at evaluation like its run; the run logs its training scans'
    signatures (``training_scan_signatures.npz``) once."""
    synthetic = getattr(datamodule, "synthetic_cohort", None)
    provenance, signatures = training_provenance(
        datamodule.split, datamodule.cohort, split_sha256(recipe.data.split), synthetic.root if synthetic is not None else None,
        start.run_id, signature_cache(recipe.tracking.output_dir),
    )
    client = logger.experiment
    if SIGNATURES_ARTIFACT not in {item.path for item in client.list_artifacts(start.run_id)}:
        log_training_signatures(client, start.run_id, signatures)
    return provenance


def checkpoint_callbacks(recipe: DictConfig, checkpoint_dir: Path) -> tuple[ModelCheckpoint, PeriodicCheckpoint]:
    """``best.ckpt`` by validation Dice of the tumor class (and ``last.ckpt`` after each validation),
    and ``last.ckpt`` every ``trainer.checkpoint_every_n_steps`` steps, so a kill loses at most that many."""
    best = ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename="best",
        monitor=f"val/dice/{recipe.data.tumor_class}",
        mode="max",
        save_top_k=1,
        save_last=True,
        enable_version_counter=False,
    )
    periodic = PeriodicCheckpoint(
        checkpoint_dir, int(recipe.trainer.checkpoint_every_n_steps), int(recipe.trainer.val_every_n_steps)
    )
    return best, periodic


@contextlib.contextmanager
def expected_checkpoint_warnings(recipe: DictConfig, best: ModelCheckpoint):
    """Without validation (``trainer.val_every_n_steps: 0``, as in the CPU profiles) the validation Dice
    that ``best.ckpt`` monitors never exists, by design: the model is ``last.ckpt``. Lightning's warning
    that the monitored key is missing is then expected and hidden; with validation it still shows."""
    with warnings.catch_warnings():
        if int(recipe.trainer.val_every_n_steps) == 0:
            warnings.filterwarnings("ignore", message=re.escape(f"`ModelCheckpoint(monitor={best.monitor!r})` could not find"))
        yield


def log_checkpoints(logger: MLFlowLogger, paths: Sequence[Path | None]) -> None:
    """Log the checkpoints that exist under the run's ``checkpoints/`` artifacts."""
    for path in paths:
        if path is not None and path.exists():
            logger.experiment.log_artifact(logger.run_id, str(path), "checkpoints")


def finished_result(start: RunStart, output_dir: Path) -> TrainResult:
    """The result of a run that had already finished: its checkpoints and final metrics."""
    checkpoint_dir = output_dir / "checkpoints"
    run = MlflowClient(tracking_uri=start.uri).get_run(start.run_id)
    best = checkpoint_dir / "best.ckpt"
    return TrainResult(
        start.run_id, output_dir, best if best.exists() else None, checkpoint_dir / "last.ckpt",
        dict(run.data.metrics), int(start.finished_at or 0),
    )


# ------------------------------------------------------------------------------------------------
# Data checks


def check_data(recipe: DictConfig, cohort, split) -> list[str]:
    """Validate the cohort and audit the split before training. Returns the leakage findings that
    were overridden (empty when clean); raises CohortError on a broken cohort or unapproved leakage."""
    if recipe.data.validate:
        problems = validate_cohort(cohort, classes=list(recipe.data.classes))
        if problems:
            raise CohortError(problems, cohort.root)
    leakage = _cached(
        Path(recipe.tracking.output_dir) / ".leakage_checks", _leakage_key(cohort, split), lambda: check_split_leakage(cohort, split)
    )
    if leakage and not recipe.data.allow_leakage:
        raise CohortError(
            [*leakage, "training refused: fix the split, or set data.allow_leakage=true to override (recorded in MLflow)"],
            cohort.root,
        )
    return list(leakage)


def _leakage_key(cohort, split) -> str:
    """Content key of a leakage check: the split rows, the metadata, and each CT's size and mtime."""
    digest = hashlib.sha256()
    digest.update(split.sort_values("case_id").to_csv(index=False).encode())
    digest.update(cohort.metadata.to_csv(index=False).encode())
    for case in cohort.cases():
        stat = case.ct_path.stat() if case.ct_path.exists() else None
        digest.update(f"{case.case_id}:{stat.st_size if stat else -1}:{stat.st_mtime_ns if stat else -1}".encode())
    return digest.hexdigest()[:24]


def _cached(folder: Path, key: str, compute) -> list[str]:
    """The patient/duplicate leakage findings, computed once per content key (reading every CT is slow)."""
    path = folder / f"{key}.json"
    if path.exists():
        return list(json.loads(path.read_text()))
    findings = [str(f) for f in compute()]
    atomic_write_bytes(path, json.dumps(findings).encode())
    return findings
