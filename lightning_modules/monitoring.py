"""System metrics of a training run from Lightning's own callbacks, not hand-written step timers.

``ThroughputMonitor`` logs samples and batches per second (``train/device/samples_per_sec``, ...)
into the run's logger; on a GPU, ``DeviceStatsMonitor`` adds the device's memory and utilization.
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


def system_callbacks(accelerator: str = "auto") -> list[Callback]:
    """Throughput always; device statistics when training on a CUDA device (they cost nothing there
    and, on a CPU, would need psutil and add per-step overhead)."""
    import torch

    callbacks: list[Callback] = [ThroughputMonitor(batch_size_fn=batch_size)]
    if str(accelerator) in ("gpu", "cuda") or (str(accelerator) == "auto" and torch.cuda.is_available()):
        callbacks.append(DeviceStatsMonitor(cpu_stats=False))
    return callbacks
