"""Writes that survive a power cut: a file's data and a folder's entries forced to disk (fsync) before a rename
publishes them, so a reader never finds a whole-looking file of zeros or a name without its data."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def sync_file(path: Path) -> None:
    """Force a written file's data to disk."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def sync_dir(directory: Path) -> None:
    """Force a folder's entries (a file created or renamed in it) to disk; where the platform cannot, nothing."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sync_folder(folder: Path) -> dict[str, int]:
    """Force every file of `folder` (not its subfolders) and its entries to disk, before the folder is renamed into
    place; the files' sizes by name."""
    sizes = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        sync_file(path)
        sizes[path.name] = path.stat().st_size
    sync_dir(folder)
    return sizes
