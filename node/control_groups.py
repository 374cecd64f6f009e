"""The control groups this process runs in (Linux, cgroup v1 and v2): the folders of a controller's group and its
ancestors (`folders`), and the cores a CPU quota allows (`quota_cores`: a container run with `docker --cpus 2`
on a 64-core host may run 2 cores' worth of time, whatever its affinity says). Memory's limits are read in
node/process_memory.py from the same folders."""

from __future__ import annotations

import math
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")


def folders(controller: str) -> list[Path]:
    """The folders of this process's `controller` group and its ancestors, as mounted here (v2 and v1)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:
            root = _ROOT
        elif controller in controllers.split(","):
            root = _ROOT / controller
        else:
            continue
        group = root / path.strip("/")
        # A container sees its own group at the mount's root: the path named here may not exist inside it.
        found += [folder for folder in (group, *group.parents) if folder.is_relative_to(root) and folder.is_dir()]
    return found


def quota_cores() -> int | None:
    """The cores' worth of CPU time this process's groups allow (the tightest quota, rounded up); None without one."""
    quotas = [cores for cores in map(_quota_in, folders("cpu")) if cores is not None]
    return min(quotas, default=None)


def _quota_in(folder: Path) -> int | None:
    """A group's CPU quota in cores, rounded up: v2's `cpu.max` ("max 100000" is none), v1's `cpu.cfs_quota_us`
    over `cpu.cfs_period_us` (-1 is none); None without a quota or where the files do not say."""
    try:
        if (folder / "cpu.max").exists():
            quota, period = (folder / "cpu.max").read_text().split()[:2]
        else:
            quota = (folder / "cpu.cfs_quota_us").read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
        if quota == "max" or int(quota) <= 0 or int(period) <= 0:
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None
