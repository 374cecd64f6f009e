"""The bodies a node serves (its own and those it relays) and the stream handler that serves them.

Kept in memory by age (`keep_seconds`) and total size (`keep_bytes`), oldest first, the newest
always kept; looked up by sha256 (a holder serves exactly the bytes its record announced).
A peer asking for a body gets it over "hivespec.rollouts.v1" (`transfer.serve_body`); at most
`max_parallel` answers run at once (a request takes its slot once read: idle streams hold none), a
peer has at most `per_peer` streams open (more are closed at once, `serve_busy_peer`), and a peer
that hangs up mid-body is counted, never raised.
Loop-thread state: only gossip's event loop touches it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from hivespec.node.swarm.transfer import PARALLEL_FETCHES, serve_body


class BodyStore:
    """Bodies to serve, bounded by age and bytes; `serve` is the body stream's handler."""

    def __init__(
        self,
        *,
        keep_seconds: float,
        keep_bytes: int,
        request_timeout: float,
        stats: Counter,
        max_parallel: int = 16,
        per_peer: int = PARALLEL_FETCHES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keep_seconds, self.keep_bytes = keep_seconds, keep_bytes
        self.request_timeout = request_timeout
        self._stats = stats
        self._clock = clock
        self._bodies: OrderedDict[bytes, tuple[float, bytes]] = OrderedDict()  # sha256 -> (kept at, wire bytes)
        self._bytes = 0
        self._slots = asyncio.Semaphore(max_parallel)
        self.per_peer = per_peer
        self._open: Counter = Counter()  # peer id -> its streams being served now

    def __len__(self) -> int:
        return len(self._bodies)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._bodies

    def keep(self, digest: bytes, wire: bytes) -> None:
        """Serve `wire` under `digest` from now on; drops the oldest bodies past the age and byte bounds."""
        if digest in self._bodies:
            return
        now = self._clock()
        self._bodies[digest] = (now, wire)
        self._bytes += len(wire)
        while len(self._bodies) > 1:
            kept_at, oldest = next(iter(self._bodies.values()))
            if now - kept_at <= self.keep_seconds and self._bytes <= self.keep_bytes:
                break
            self._bodies.popitem(last=False)
            self._bytes -= len(oldest)

    def lookup(self, digest: bytes) -> bytes | None:
        entry = self._bodies.get(digest)
        return None if entry is None else entry[1]

    async def serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The body stream's handler (`P2P.add_binary_stream_handler`; `info.peer_id` is who opened the stream)."""
        peer = info.peer_id
        if self._open[peer] >= self.per_peer:
            self._stats["serve_busy_peer"] += 1
            writer.close()
            return
        self._open[peer] += 1
        try:
            await serve_body(self.lookup, reader, writer, timeout=self.request_timeout, stats=self._stats, slots=self._slots)
        finally:
            self._open[peer] -= 1
            if not self._open[peer]:
                del self._open[peer]
