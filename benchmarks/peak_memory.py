"""Peak memory of a call, for the benchmarks: CUDA's allocator peak on a GPU, sampled resident memory on CPU.

Example::

    with PeakMemory(device) as peak:
        run()
    print(peak.mib)
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch


def resident_bytes() -> int:
    """This process's resident set size (Linux ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class PeakMemory:
    """Peak memory above the level at entry: ``torch.cuda.max_memory_allocated`` on CUDA, else resident
    memory sampled every ``interval`` seconds (so a spike shorter than that can be missed)."""

    def __init__(self, device: torch.device | str = "cpu", interval: float = 0.002):
        self.device = torch.device(device)
        self.interval = interval
        self.peak_bytes = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        self._start = resident_bytes()
        self._peak = self._start
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self._peak = max(self._peak, resident_bytes())
            threading.Event().wait(self.interval)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            return
        self._running = False
        self._thread.join()
        self.peak_bytes = max(self._peak, resident_bytes()) - self._start

    @property
    def mib(self) -> float:
        return self.peak_bytes / 2**20
