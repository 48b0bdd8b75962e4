"""System metrics of a training run from Lightning's own callbacks, not hand-written step timers.

``ThroughputMonitor`` logs samples and batches per second (``train/device/samples_per_sec``, ...)
into the run's logger; on a GPU, ``DeviceStatsMonitor`` adds the device's memory and utilization.
Without a terminal (a batch job's log file), :class:`LogProgress` prints one line every N steps.
Both the segmentation training and the SynthX generator training add :func:`system_callbacks`.

Example::

    trainer = pl.Trainer(callbacks=[*system_callbacks(accelerator), ...])
"""

from __future__ import annotations

import time

from lightning.pytorch.callbacks import Callback, DeviceStatsMonitor, ThroughputMonitor


def batch_size(batch) -> int:
    """Samples in a batch: the leading size of its ``image`` tensor (dict batches) or first element."""
    image = batch["image"] if isinstance(batch, dict) else batch[0]
    return int(image.shape[0])


def system_callbacks(accelerator: str = "auto", progress_every: int = 0) -> list[Callback]:
    """Throughput always; device statistics when training on a CUDA device (they cost nothing there
    and, on a CPU, would need psutil and add per-step overhead); a one-line progress report every
    ``progress_every`` steps when stderr is not a terminal (no progress bar there; 0 = never)."""
    import sys

    import torch

    callbacks: list[Callback] = [ThroughputMonitor(batch_size_fn=batch_size)]
    if progress_every and not sys.stderr.isatty():
        callbacks.append(LogProgress(progress_every))
    if str(accelerator) in ("gpu", "cuda") or (str(accelerator) == "auto" and torch.cuda.is_available()):
        callbacks.append(DeviceStatsMonitor(cpu_stats=False))
    return callbacks


class LogProgress(Callback):
    """One line every ``every`` training steps (step, loss, samples/s, time left) when no progress
    bar is drawn, so a job's log file shows how far it is and when it will end."""

    def __init__(self, every: int = 50, clock=time.monotonic):
        self.every = max(1, int(every))
        self.clock = clock
        self.started: tuple[int, float] | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.started = (trainer.global_step, self.clock())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        loss = metrics.get("train/loss")
        speed = metrics.get("train/device/samples_per_sec")
        parts = [f"step {step}/{trainer.max_steps}"]
        if loss is not None:
            parts.append(f"train/loss {float(loss):.4f}")
        if speed is not None:
            parts.append(f"{float(speed):.1f} samples/s")
        left = self.seconds_left(step, int(trainer.max_steps))
        if left is not None:
            parts.append(f"ETA {format_duration(left)}")
        print("[train] " + ", ".join(parts), flush=True)

    def seconds_left(self, step: int, max_steps: int) -> float | None:
        """Time to ``max_steps`` at the mean pace since this process started training (a resumed run
        counts from where it resumed); None before the first step or without a step limit."""
        if self.started is None or max_steps <= 0:
            return None
        first_step, first_time = self.started
        done = step - first_step
        if done <= 0:
            return None
        return (self.clock() - first_time) / done * max(0, max_steps - step)


def format_duration(seconds: float) -> str:
    """``1 h 02 min``, ``3 min 05 s`` or ``42 s``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"
