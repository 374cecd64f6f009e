"""This process's memory, from /proc (Linux; None elsewhere): what a node reports in its rounds and its status."""

from __future__ import annotations

import os
from pathlib import Path


def resident_mb() -> float | None:
    """This process's resident memory in MB (from /proc/self/statm; None where there is none)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return round(resident_pages * os.sysconf("SC_PAGE_SIZE") / 1e6, 1)


def peak_resident_mb() -> float | None:
    """The most resident memory this process has held, in MB (the kernel's high-water mark, VmHWM in
    /proc/self/status; None where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) * 1024 / 1e6, 1)
    except (OSError, IndexError, ValueError):
        return None
    return None
