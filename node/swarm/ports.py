"""Whether a fixed listening port is already taken on this machine, asked before p2pd starts.

p2pd (go-libp2p) listens with SO_REUSEPORT, so a second process asking for the same port gets it
too, without any error, and the kernel then hands each incoming connection to one of the two at
random. A `hivespec bootstrap` and a `hivespec join --config public` on one machine both took port
31337 that way: the node's dial to the bootstrap peer reached itself as often as not, failed its
peer-id check, and the node trained solo for its whole run with "no bootstrap peer answered". So a
node with a fixed `swarm.port` asks first (`Gossip._free_port_or_any`), as `hivespec doctor` does for its ports.

Asking is not enough where two nodes start at once (a script starting a node per GPU): both ask
before either p2pd listens, both hear "free", and both take the port. So a node claims the port
number machine-wide first (`PortClaim`, an advisory lock file) and holds the claim from its question
until its p2pd listens: the second node's question then comes after the first's p2pd took the port.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

try:
    from hivespec.node.file_lock import flock_within
except ImportError:  # not a POSIX system (no fcntl): no claims, the question alone
    flock_within = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
_CLAIM_POLL_S = 0.05  # a claim is held for about a second (p2pd's start): asked again often


def port_in_use(host: str, port: int) -> str | None:
    """Why TCP `port` on `host` cannot be bound now (the OS's reason), or None where it is free.

    The probe binds with SO_REUSEADDR, as a listening server does, so connections of an earlier
    run still in TIME_WAIT do not count, and without SO_REUSEPORT, so another process's listener does.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def wait_for_port(host: str, port: int, seconds: float) -> str | None:
    """`port_in_use`, asked again for up to `seconds` while the port is taken: None once it is free, else the OS's
    reason. A node restarted right after a crash finds its old p2pd still listening for a moment (it exits as soon as
    it sees its node gone: 0.1 s after a SIGKILL, measured)."""
    deadline = time.monotonic() + seconds
    while (taken := port_in_use(host, port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return taken


class PortClaim:
    """A machine-wide claim on a TCP port number among hivespec processes: an advisory lock (flock) on a file named for
    the port in the system's temporary directory, so nodes of any home and any user on this machine see it.

    `PortClaim(port, timeout)` waits up to `timeout` s for the claim and holds it until `release()` (safe to call again),
    which removes the file as it lets go, so claims leave no files behind: a claim that finds its file gone once it
    holds it starts over on the file now at that path (two claims never hold two files of one name). The OS lets go of
    the lock when the process dies; the file a crash left is the next claim's. Port 0 (any free port) claims nothing.
    Where the claim cannot be had (no flock here, a lock file we may not open, another process holding it past
    `timeout`) it goes on without one and says so at debug level: the claim narrows a race, the port's question decides.
    """

    def __init__(self, port: int, timeout: float) -> None:
        self.port = port
        self._fd: int | None = None
        self._path: Path | None = None
        self._release_lock = threading.Lock()  # the gossip loop releases once p2pd listens, start() again on its way out
        if port and flock_within is not None:
            path = Path(tempfile.gettempdir()) / f"hivespec-port-{port}.lock"
            self._fd = self._acquire(path, time.monotonic() + timeout)
            self._path = path if self._fd is not None else None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _acquire(self, path: Path, deadline: float) -> int | None:
        while True:
            try:
                # Read-only is enough for flock; an existing file of another user in a sticky /tmp may refuse O_CREAT.
                fd = os.open(path, os.O_RDONLY) if path.exists() else os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
            except OSError as exc:  # FileNotFoundError too: removed by a claim letting go between our two looks
                if isinstance(exc, FileNotFoundError) and time.monotonic() < deadline:
                    time.sleep(_CLAIM_POLL_S)
                    continue
                log.debug("no claim on port %d: cannot open %s (%s)", self.port, path, exc)
                return None
            try:
                if not flock_within(fd, max(0.0, deadline - time.monotonic()), _CLAIM_POLL_S):
                    log.debug("no claim on port %d: another process held %s past the wait", self.port, path)
                elif _is_at(fd, path):
                    return fd
                elif time.monotonic() < deadline:  # the claim we waited on removed this file as it let go: start over
                    os.close(fd)
                    continue
            except OSError as exc:  # a file system without locks
                log.debug("no claim on port %d: flock on %s failed (%s)", self.port, path, exc)
            os.close(fd)
            return None

    def release(self) -> None:
        with self._release_lock:  # two threads closing one descriptor number: the second could close a reused one
            fd, self._fd, path = self._fd, None, self._path
        if fd is not None:
            if path is not None:  # while still held: a claim waiting on this file then sees it gone and starts over
                with contextlib.suppress(OSError):  # another user's file in a sticky /tmp stays
                    path.unlink()
            os.close(fd)  # closing the only descriptor of the lock's open file releases it

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the file at `path` (not removed or replaced since it was opened)."""
    try:
        at = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (at.st_dev, at.st_ino)
