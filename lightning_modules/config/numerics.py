"""The same figures from the same seed on any Intel x86-64 machine: CPU arithmetic pinned to one path.

Training is chaotic: a last-bit difference in one convolution's sum changes the weights after a few
hundred steps, and with them which tumors a model finds. On CPUs three things choose how sums run:

- ATen's vectorized kernels, by the processor's instruction set (``ATEN_CPU_CAPABILITY``: DEFAULT,
  AVX2 or AVX512);
- oneDNN (MKL-DNN) convolutions, whose JIT kernels follow the instruction set, the cache sizes and
  the thread count;
- MKL's matrix products, by instruction set and thread count.

:func:`pin_cpu_environment` sets ``ATEN_CPU_CAPABILITY=avx2`` and ``MKL_CBWR=AVX2,STRICT`` (MKL's
conditional numerical reproducibility: the AVX2 code path, results independent of the thread count)
and :func:`pin_cpu_kernels` turns oneDNN off, so convolutions run as ATen's unfold + MKL product.
Then the arithmetic is the same on every Intel processor with AVX2 (since 2013), whatever its
newer instructions or its core count. On other vendors MKL ignores the AVX2 request and takes its
own dispatch (Intel's conditional-reproducibility guide supports only AUTO and COMPATIBLE there),
so figures may differ from an Intel machine's. The settings are read when torch first runs a kernel, so the
environment is pinned when :mod:`lightning_modules` is imported and oneDNN is turned off when
:mod:`lightning_modules.models` is. ``BENCHX_NATIVE_CPU=1`` leaves the machine's own fastest paths
(figures may then differ between machines). GPUs are not affected.
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping

NATIVE_CPU_VARIABLE = "BENCHX_NATIVE_CPU"
PINNED_ENVIRONMENT = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}


def native_cpu(environ: MutableMapping[str, str] = os.environ) -> bool:
    """True when the user asked for the machine's own CPU paths (``BENCHX_NATIVE_CPU`` set and not 0)."""
    return environ.get(NATIVE_CPU_VARIABLE, "").strip() not in ("", "0")


def pin_cpu_environment(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Pin ATen's and MKL's CPU paths (before torch runs its first kernel); returns what was set.

    Child processes (replicate workers, Slurm steps started from here) inherit the pinned values.
    """
    if native_cpu(environ):
        return {}
    environ.update(PINNED_ENVIRONMENT)
    return dict(PINNED_ENVIRONMENT)


def pin_cpu_kernels() -> bool:
    """Turn oneDNN's CPU convolutions off (unless ``BENCHX_NATIVE_CPU``); True when pinned.

    Warns on stderr when torch had already chosen another instruction set (it ran a kernel before
    :mod:`lightning_modules` was imported): that choice is fixed for the life of the process.
    """
    if native_cpu():
        return False
    import torch

    torch.backends.mkldnn.enabled = False
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        print(f"warning: torch computes on the {capability} path, not AVX2: figures may differ from other "
              f"machines' (import lightning_modules before running torch, or set {NATIVE_CPU_VARIABLE}=1)",
              file=sys.stderr)
    return True


def arithmetic_host(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """What decides this process's CPU sums: processor vendor and model, torch's thread count, pinned or native.

    Figures reproduce between runs that agree on all four (an Intel processor, the same thread count,
    pinned arithmetic); the study records them on its parent run so a reader can tell which applies.
    """
    import platform

    import torch

    vendor = model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key.strip() == "model name" and not model:
                    model = value.strip()
    except OSError:
        pass
    return {
        "host.cpu_vendor": vendor or platform.processor() or platform.machine(),
        "host.cpu_model": model or platform.machine(),
        "host.torch_threads": str(torch.get_num_threads()),
        "host.cpu_arithmetic": "native" if native_cpu(environ) else "pinned",
    }
