"""Waiting for an exclusive `flock`: flock has no timeout of its own, so a non-blocking attempt is retried.

Shared by the machine-wide locks of the node: the model cache's (`node/model/loader.py: _exclusive_lock`) and
a fixed swarm port's claim (`node/swarm/ports.py: PortClaim`). A holder that dies releases its lock with its
process, so a stale lock file never blocks anyone. POSIX only (the callers decide what to do without `fcntl`).
`FolderLock` holds a folder itself (a node's checkpoint folder), leaving no file in it.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


class FolderLock:
    """An exclusive, non-blocking flock on the folder `path` itself (created if missing), released on close or process
    exit. Raises BlockingIOError when another open of the folder holds it."""

    def __init__(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(self._fd)
            raise

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def flock_within(fd: int, timeout: float, poll_s: float) -> bool:
    """Take an exclusive flock on `fd`, trying again every `poll_s` s while another open file holds it: True once
    held, False when `timeout` s passed first. Any other failure (a file system without locks) raises OSError."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
