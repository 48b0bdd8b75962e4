"""How much memory this machine has free: the bound the recipe checks and the header checks use.

Example::

    free = available_memory_bytes()  # None where the system does not say
"""

from __future__ import annotations

import os


def available_memory_bytes() -> int | None:
    """The memory the kernel reports as available (``MemAvailable``), or None where it is not known."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
