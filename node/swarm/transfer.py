"""Body transfer over a hivemind P2P stream: a holder serves bodies by sha256, a reader pulls one and checks it.

Protocol "hivespec.rollouts.v1" (one body per stream): the reader sends the 32-byte sha256; the
holder answers a 9-byte header, status (0 found, 1 missing) and the body length (u64, big
endian), then the body in chunks of at most CHUNK_BYTES (p2pd caps one message at 4 MiB). The
reader refuses a length other than the announced one before reading any body byte, and a body
whose sha256 differs from the announced one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence

from hivemind.p2p import P2P, PeerID

from hivespec.node.swarm.bootstrap import dial
from hivespec.protocol.limits import MIB

logger = logging.getLogger(__name__)

STREAM_NAME = "hivespec.rollouts.v1"
CHUNK_BYTES = 1 * MIB
_STATUS_FOUND, _STATUS_MISSING = 0, 1
_HEADER_BYTES = 9  # status (1) + body length (8, big-endian)
# A reader's downloads at once (`fetching.Fetcher`), and so the streams a holder serves one peer at once: an honest
# reader never opens more, and a peer that does cannot hold more of the holder's answers than that.
PARALLEL_FETCHES = 8


class BadBody(Exception):
    """The holder served bytes that contradict its signed record (wrong size or hash)."""


async def serve_body(
    lookup: Callable[[bytes], bytes | None],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    timeout: float,
    stats: Counter,
    slots: asyncio.Semaphore | None = None,
) -> None:
    """Answer one body request; every read and drain has `timeout`, and no error escapes.

    With `slots`, the answer waits for one of them, the request's read does not: a peer that opens streams and sends
    nothing holds none, and honest requests behind it are answered at once.
    """
    try:
        digest = await asyncio.wait_for(reader.readexactly(32), timeout)
        async with slots if slots is not None else contextlib.nullcontext():
            await _answer(lookup(digest), writer, timeout=timeout, stats=stats)
    except Exception as exc:  # noqa: BLE001 - a peer that hangs up or stalls costs us nothing but a log line
        stats["serve_errors"] += 1
        logger.debug("serving a body failed: %s: %s", type(exc).__name__, exc)
    finally:
        writer.close()


async def _answer(body: bytes | None, writer: asyncio.StreamWriter, *, timeout: float, stats: Counter) -> None:
    if body is None:
        writer.write(bytes([_STATUS_MISSING]) + (0).to_bytes(8, "big"))
        stats["serve_missing"] += 1
    else:
        writer.write(bytes([_STATUS_FOUND]) + len(body).to_bytes(8, "big"))
        view = memoryview(body)
        for offset in range(0, len(body), CHUNK_BYTES):
            writer.write(view[offset : offset + CHUNK_BYTES])
            await asyncio.wait_for(writer.drain(), timeout)
        stats["bodies_served"] += 1
        stats["bytes_out"] += len(body)
    await asyncio.wait_for(writer.drain(), timeout)


async def _open_stream(
    p2p: P2P, peer: PeerID, maddrs: Sequence[str], timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, STREAM_NAME)
    except Exception:  # noqa: BLE001
        # p2pd may not know the holder's addresses yet (no DHT traffic between us so far):
        # dial the addresses from its signed record, then retry once.
        await dial(p2p, peer, maddrs, timeout)
        _, reader, writer = await p2p.call_binary_stream_handler(peer, STREAM_NAME)
    return reader, writer


async def download(p2p: P2P, peer: PeerID, maddrs: Sequence[str], digest: bytes, size: int, *, timeout: float) -> bytes:
    """The body with `digest` from `peer`; BadBody if it is not `size` bytes hashing to `digest`.

    LookupError when the holder no longer has it (evicted: not its fault); other exceptions for
    an unreachable or stalled holder. The caller bounds the whole call with a timeout.
    """
    reader, writer = await _open_stream(p2p, peer, maddrs, timeout)
    try:
        writer.write(digest)
        await writer.drain()
        header = await reader.readexactly(_HEADER_BYTES)
        status, got_size = header[0], int.from_bytes(header[1:], "big")
        if status == _STATUS_MISSING:
            raise LookupError("the holder no longer has this body")
        if status != _STATUS_FOUND or got_size != size:
            raise BadBody(f"stream header status {status}, size {got_size} (announced {size})")
        hasher = hashlib.sha256()
        parts = []
        left = size
        while left:
            part = await reader.readexactly(min(CHUNK_BYTES, left))
            hasher.update(part)
            parts.append(part)
            left -= len(part)
    finally:
        writer.close()
    if hasher.digest() != digest:
        raise BadBody("sha256 of the received body does not match the announce")
    return b"".join(parts)
