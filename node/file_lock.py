"""Waiting for an exclusive `flock`: flock has no timeout of its own, so a non-blocking attempt is retried.

Shared by the machine-wide locks of the node: the model cache's (`node/model/loader.py: _exclusive_lock`) and
a fixed swarm port's claim (`node/swarm/ports.py: PortClaim`). A holder that dies releases its lock with its
process, so a stale lock file never blocks anyone. POSIX only (the callers decide what to do without `fcntl`).
"""

from __future__ import annotations

import fcntl
import time


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
