"""The one Lightning ``Trainer`` construction, and what every process of a distributed run shares.

:func:`build_trainer` makes the Trainer of segmentation training, evaluation and SynthX training from
a recipe's ``trainer`` section, so precision, devices, strategy, checkpoint writing and the progress
bar mean the same everywhere. Checkpoints are written atomically (:class:`AtomicCheckpointIO`): a
kill mid-write leaves the previous file whole, and the ``last.ckpt`` it replaces is kept as
``last.previous.ckpt``.

Distributed runs: ``trainer.devices=2 trainer.strategy=ddp`` (Lightning starts the other processes),
``torchrun`` (TorchElastic) and Slurm ``srun`` (the processes exist from the start).
:func:`share_from_rank_zero` runs a decision (which MLflow run, which checkpoint) on global rank 0
only and gives its result, or its refusal, to every process.

Example::

    trainer = build_trainer(recipe.trainer, output_dir, max_steps=1000, logger=logger,
                            callbacks=[...], val_every_n_steps=200)
    trainer.fit(module, datamodule=datamodule)
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger, MLFlowLogger

from lightning_modules.infrastructure.process import raise_if_signalled
from lightning_modules.tracking import end_run

log = logging.getLogger(__name__)

PREVIOUS_LAST = "last.previous.ckpt"
# Where the launching process leaves rank 0's decision for the processes Lightning starts.
DECISION_VARIABLE = "BENCHX_RANK_ZERO_DECISION"


# ------------------------------------------------------------------------------------------------
# The Trainer


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written to a temporary file and renamed into place; ``last.ckpt``'s previous
    version is kept as ``last.previous.ckpt`` (a rename, no copy), the fallback for a damaged file."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            super().save_checkpoint(checkpoint, temporary, storage_options)
        except BaseException as error:
            # A partial file is of no use to anyone: the previous checkpoint stays the one to resume from.
            temporary.unlink(missing_ok=True)
            cause = error if isinstance(error, OSError) else error.__cause__ or error.__context__
            if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CheckpointWriteError(
                    f"cannot write checkpoint {path}: {os.strerror(cause.errno).lower()} in {path.parent}; "
                    "free space there (or give the run another --out folder) and rerun the same command to "
                    "resume from the previous checkpoint"
                ) from error
            raise
        if path.name == "last.ckpt" and path.exists():
            os.replace(path, path.with_name(PREVIOUS_LAST))
        os.replace(temporary, path)


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written for lack of space (the disk or the quota is full)."""


class PeriodicCheckpoint(ModelCheckpoint):
    """``last.ckpt`` every ``every_n_train_steps`` steps, except at steps that end in a validation.

    Lightning saves step checkpoints before the validation of the same step; a run killed during
    that validation would resume after it and never log that validation point. At those steps the
    checkpoint written after validation (``save_last`` of the best-model callback) is the one kept.
    """

    def __init__(self, dirpath: str | Path, every_n_train_steps: int, val_every_n_steps: int | None):
        super().__init__(
            dirpath=dirpath, save_top_k=0, save_last=True, every_n_train_steps=every_n_train_steps,
            enable_version_counter=False,
        )
        self.val_every_n_steps = val_every_n_steps

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.val_every_n_steps and trainer.global_step % self.val_every_n_steps == 0:
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class StopOnSignal(Callback):
    """Raise a SIGTERM/SIGINT recorded under :func:`lightning_modules.infrastructure.process.deferred_signals`
    between batches, where stopping leaves no MLflow write or collective half done."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        raise_if_signalled()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        raise_if_signalled()

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        raise_if_signalled()


class FailWithLaunchedProcesses(Callback):
    """On the launching process (rank 0), end the run FAILED as soon as a process Lightning's launcher
    started dies with an error: Lightning then SIGKILLs the launching process, which could not end
    the run itself. Watches from a daemon thread (every half second) during ``fit``."""

    def __init__(self, uri: str, run_id: str, period: float = 0.5):
        self.uri, self.run_id, self.period = uri, run_id, period
        self._stop = threading.Event()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        processes = list(getattr(trainer.strategy.launcher, "procs", None) or [])
        if trainer.is_global_zero and processes:
            self._stop.clear()
            threading.Thread(target=self._watch, args=(processes,), daemon=True, name="benchx-rank-watcher").start()

    def _watch(self, processes) -> None:
        while not self._stop.wait(self.period):
            failed = [p for p in processes if p.poll() not in (None, 0)]
            if failed:
                log.error("process %d of the run ended with code %d: ending run %s FAILED", failed[0].pid, failed[0].returncode, self.run_id)
                end_run(self.uri, self.run_id, "FAILED")
                return

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop.set()


def build_trainer(
    trainer_config,
    output_dir: str | Path | None,
    *,
    logger: Logger | bool,
    callbacks: Sequence[Callback] = (),
    max_steps: int = -1,
    val_every_n_steps: int | None = None,
    **overrides: Any,
) -> pl.Trainer:
    """The Trainer for a recipe's ``trainer`` section.

    Args:
        trainer_config: the recipe's ``trainer`` node; read: ``accelerator``, ``devices``, ``precision``,
            ``log_every_n_steps``, ``gradient_clip_val``, ``deterministic``, and when present
            ``strategy`` (default ``auto``), ``num_nodes`` (1) and ``progress_bar`` (true; shown only
            on a terminal).
        output_dir: Lightning's ``default_root_dir`` (None: the working folder; evaluation).
        logger: the run's logger, or False.
        callbacks: the run's callbacks (checkpointing included; none means no checkpoints);
            :class:`StopOnSignal` is always added.
        max_steps: optimizer steps (-1: evaluation only, ``trainer.validate``/``trainer.test``).
        val_every_n_steps: validate every this many steps; None: no validation during ``fit``.
        overrides: keyword arguments of ``pl.Trainer`` that replace the ones derived here.
    """
    get = trainer_config.get if hasattr(trainer_config, "get") else lambda key, default=None: getattr(trainer_config, key, default)
    if val_every_n_steps:
        validation = dict(val_check_interval=int(val_every_n_steps), check_val_every_n_epoch=None)
    else:  # a training without validation; evaluation (max_steps -1) validates when asked
        validation = dict(limit_val_batches=0) if max_steps > 0 else {}
    arguments = dict(
        max_steps=int(max_steps),
        accelerator=get("accelerator", "auto"),
        devices=get("devices", 1),
        strategy=get("strategy", "auto") or "auto",
        num_nodes=int(get("num_nodes", 1) or 1),
        precision=get("precision", "32-true"),
        log_every_n_steps=int(get("log_every_n_steps", 50)),
        gradient_clip_val=get("gradient_clip_val", None),
        deterministic=bool(get("deterministic", False)),
        default_root_dir=str(output_dir) if output_dir is not None else None,
        logger=logger,
        callbacks=[*callbacks, StopOnSignal()],
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        plugins=[AtomicCheckpointIO()],
        num_sanity_val_steps=0,
        enable_model_summary=False,
        enable_progress_bar=bool(get("progress_bar", True)) and sys.stderr.isatty(),
        **validation,
    )
    arguments.update(overrides)
    return pl.Trainer(**arguments)


class MemoryAdviceError(MemoryError):
    """Training or inference ran out of (GPU or CPU) memory; the message names the settings to lower."""


MEMORY_SETTINGS = "data.patch_size, data.batch_size or data.samples_per_volume (training), trainer.sw_batch_size (inference)"


def is_allocation_failure(error: BaseException) -> bool:
    """torch's out-of-memory errors: CUDA's ``OutOfMemoryError`` and the CPU allocator's RuntimeError."""
    import torch

    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


@contextlib.contextmanager
def memory_advice(recipe, stage: str = "training"):
    """Turn an allocation failure inside the block into :class:`MemoryAdviceError`, naming the
    recipe's values to lower; any other error passes unchanged.

    Example::

        with memory_advice(recipe):
            trainer.fit(module, datamodule=datamodule)
    """
    try:
        yield
    except Exception as error:
        if isinstance(error, MemoryAdviceError) or not is_allocation_failure(error):
            raise
        data, trainer = recipe.data, recipe.trainer
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise MemoryAdviceError(
            f"{stage} ran out of memory ({first[:200]}); lower {MEMORY_SETTINGS}: now "
            f"data.patch_size={list(data.patch_size)}, data.batch_size={data.batch_size}, "
            f"data.samples_per_volume={data.samples_per_volume}, trainer.sw_batch_size={trainer.sw_batch_size}"
        ) from error


class RunLogger(MLFlowLogger):
    """Lightning's MLFlowLogger for a run whose status :func:`lightning_modules.tracking.ended_run` owns.

    Lightning ends its logger's run FINISHED after ``fit`` and FAILED on any exception; the run of a
    training also outlives ``fit`` (checkpoints are logged after it) and ends KILLED on a signal, so
    this logger leaves the status alone. Every process gets the run id, so ``run_id`` is never None.
    """

    def __init__(self, experiment_name: str, tracking_uri: str, run_id: str):
        super().__init__(experiment_name=experiment_name, tracking_uri=tracking_uri, run_id=run_id, log_model=False)

    def finalize(self, status: str = "success") -> None:
        """Leave the run's status to :func:`lightning_modules.tracking.ended_run`."""


# ------------------------------------------------------------------------------------------------
# Ranks


def launched_externally() -> bool:
    """True when every process was started from outside (torchrun, or srun with several tasks)."""
    torchelastic = all(key in os.environ for key in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    slurm = int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in os.environ
    return (torchelastic and int(os.environ.get("WORLD_SIZE", "1")) > 1) or slurm


def global_rank() -> int:
    """This process's global rank, known before the Trainer exists (0 for a single process)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"])
    # A process Lightning's launcher started: LOCAL_RANK > 0, or on a further node NODE_RANK > 0.
    local, node = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("NODE_RANK", "0"))
    return local if node == 0 else max(1, local + node)


class RankZeroRefusal(RuntimeError):
    """Rank 0 refused to start; every other process stops with the same message."""


def share_from_rank_zero(decide: Callable[[], Any], accelerator: str = "auto") -> Any:
    """Run ``decide`` on global rank 0 and return its (JSON-serializable) result on every process.

    How the result travels: for a single process, not at all; for processes Lightning's launcher
    will start, through an environment variable they inherit (they start inside ``fit``, after this
    decision); for processes started by torchrun or srun, through a broadcast over a process group
    initialized here, the one Lightning then uses. When ``decide`` raises on rank 0, every other
    process raises :class:`RankZeroRefusal` with its message.
    """
    if launched_externally():
        return _broadcast_decision(decide, accelerator)
    if global_rank() > 0:
        if DECISION_VARIABLE not in os.environ:
            raise RankZeroRefusal("started as a non-zero rank without rank 0's decision (start the run through its command)")
        payload = json.loads(os.environ[DECISION_VARIABLE])
    else:
        os.environ.pop(DECISION_VARIABLE, None)
        payload = {"value": decide()}
        os.environ[DECISION_VARIABLE] = json.dumps(payload)
    if "error" in payload:
        raise RankZeroRefusal(payload["error"])
    return payload["value"]


def _broadcast_decision(decide: Callable[[], Any], accelerator: str) -> Any:
    import torch
    import torch.distributed as dist

    _init_process_group(accelerator)
    group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    payload: list = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            payload[0] = {"value": decide()}
        except BaseException as raised:  # every rank must hear of it, then rank 0 re-raises
            error = raised
            payload[0] = {"error": f"rank 0 refused to start: {raised}"}
    dist.broadcast_object_list(payload, src=0, group=group)
    del torch
    if error is not None:
        raise error
    if "error" in payload[0]:
        raise RankZeroRefusal(payload[0]["error"])
    return payload[0]["value"]


def _init_process_group(accelerator: str) -> None:
    """The default process group, as Lightning's DDP strategy would create it (it reuses this one)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    environment = TorchElasticEnvironment() if TorchElasticEnvironment.detect() else SLURMEnvironment()
    os.environ["MASTER_ADDR"] = environment.main_address
    os.environ["MASTER_PORT"] = str(environment.main_port)
    use_cuda = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        rank=environment.global_rank(),
        world_size=environment.world_size(),
        timeout=timedelta(minutes=30),
    )
