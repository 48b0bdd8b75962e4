"""System metrics of a training run from Lightning's own callbacks, not hand-written step timers.

``ThroughputMonitor`` logs samples and batches per second (``train/device/samples_per_sec``, ...)
into the run's logger; on a GPU, ``DeviceStatsMonitor`` adds the device's memory and utilization.
Without a terminal (a batch job's log file), :class:`LogProgress` prints one line every N steps.
Both the segmentation training and the SynthX generator training add :func:`system_callbacks`.

Example::

    trainer = pl.Trainer(callbacks=[*system_callbacks(accelerator), ...])
"""

from __future__ import annotations

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
    """One line every ``every`` training steps (step, loss, samples/s) when no progress bar is drawn,
    so a job's log file shows how far it is."""

    def __init__(self, every: int = 50):
        self.every = max(1, int(every))

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
        print("[train] " + ", ".join(parts), flush=True)
