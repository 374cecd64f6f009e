"""This process's memory, from /proc and the control group it runs in (Linux): what a node holds (`resident_mb`,
`anonymous_bytes`), the most it has held (`peak_resident_mb`), and what it may still take (`available_bytes`). Where
the OS does not say: None, the whole resident size, and the machine's available memory."""

from __future__ import annotations

import os
from pathlib import Path

from hivespec.node import control_groups


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
    kib = _status_kib("VmHWM")
    return None if kib is None else round(kib * 1024 / 1e6, 1)


def anonymous_bytes() -> int:
    """The memory this process holds of its own (RssAnon: heap and tensors, not the shared libraries' file pages,
    which another process or group may have paid for); its whole resident size where the OS does not say."""
    kib = _status_kib("RssAnon")
    if kib is not None:
        return kib * 1024
    import psutil

    return psutil.Process().memory_info().rss


def _status_kib(field: str) -> int | None:
    """A "<field>: <n> kB" line of /proc/self/status, in KiB; None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return None


def available_bytes() -> int:
    """Memory this process can still take: the machine's available memory (MemAvailable), or less where the control
    group it runs in (a container's memory limit, a systemd slice) leaves less. What a node sizes its step by."""
    import psutil

    available = psutil.virtual_memory().available
    rooms = [room for room in map(_room_in, control_groups.folders("memory")) if room is not None]
    return min([available, *rooms])


_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as the largest page-aligned 63-bit number


def _room_in(folder: Path) -> int | None:
    """What the group's limit leaves: limit less usage, less the page cache it can drop; None without a limit. In
    cgroup v2 the limit is the lower of `memory.max` (past it the kernel stops a process) and `memory.high` (past it
    the group is throttled: a node there crawls)."""
    v2 = (folder / "memory.max").exists()
    limits = ("memory.max", "memory.high") if v2 else ("memory.limit_in_bytes",)
    usage_name, cache_name = ("memory.current", "inactive_file") if v2 else ("memory.usage_in_bytes", "total_inactive_file")
    try:
        texts = [(folder / name).read_text().strip() for name in limits if (folder / name).exists()]
        set_limits = [int(text) for text in texts if text != "max" and int(text) < _UNLIMITED]
        if not set_limits:
            return None
        usage = int((folder / usage_name).read_text())
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if len(line.split()) == 2)
    except (OSError, ValueError):
        return None
    return max(0, min(set_limits) - usage + int(stat.get(cache_name, 0)))
