"""Rollout gossip over hivemind: signed announce records in the DHT, bodies over P2P streams.

Shape of one round:
- `publish(round, body)` keeps the body in memory and stores a small signed ANNOUNCE envelope
  (round, sha256, size, our libp2p peer id and addresses) in the DHT under
  `rollout_round_key(swarm, round)`, subkey = our hivespec peer id.
- `fetch_round(round)` reads that key, checks every announce (signature, author == subkey,
  round, size) and pulls each new body from its author over the "hivespec.rollouts.v1" stream,
  verifying sha256 and size.

hivemind runs in our own asyncio loop on a daemon thread, with `DHTNode` used directly: the
`hivemind.DHT` wrapper deadlocks on values over ~64 KiB (upstream PR #660). Bodies never enter
the DHT; only the announce (~300 bytes) does. One `P2P` (one p2pd child process) serves both.
Public methods are called from the runtime's thread and block with a timeout; all gossip state
is touched on the loop thread only, so it needs no locks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from hivespec.protocol.codec import pack, safe_unpack
from hivespec.protocol.envelope import Kind, open_envelope, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.keys import rollout_round_key, topic_key
from hivespec.protocol.limits import DEFAULT_LIMITS, KIB, MIB, Limits

logger = logging.getLogger(__name__)

STREAM_NAME = "hivespec.rollouts.v1"
CHUNK_BYTES = 1 * MIB  # bodies go out in pieces of at most this; p2pd caps one message at 4 MiB
ANNOUNCE_MAX_BYTES = 4 * KIB  # a sealed announce is ~300 B; anything much larger is junk
MAX_ANNOUNCE_MADDRS = 8
_ANNOUNCE_KEYS = frozenset({"round", "sha256", "size", "p2p", "maddrs"})
_STATUS_FOUND, _STATUS_MISSING = 0, 1
_HEADER_BYTES = 9  # status (1) + body length (8, big-endian)
_MAX_PARALLEL_FETCHES = 8
_POLL_INTERVAL_S = 0.5
_REMEMBERED_HASHES = 65536  # fetched/rejected sha256s kept for dedupe (~2 MiB)
_GRACE_S = 5.0  # slack for the caller's wait on top of the timeout enforced inside the loop

T = TypeVar("T")


class GossipError(RuntimeError):
    """hivemind could not be started or used; the message says what to check."""


@dataclass
class Fetched:
    """A body fetched from a peer: sha256 and size verified, content not yet validated."""

    author_peer_id: str
    body: bytes


@dataclass(frozen=True)
class _Announce:
    author: str
    round: int
    sha256: bytes
    size: int
    p2p_peer_id: PeerID
    maddrs: tuple[str, ...]


class _BadRecord(Exception):
    """A peer's announce or body is invalid; skipped and counted, never raised to the caller."""


class Gossip:
    """One node's rollout gossip: hivemind P2P + DHTNode on a private event-loop thread.

    Call `start()` once, then `publish`/`fetch_round`/`wait_for_round` from any thread, and
    `shutdown()` at the end (idempotent). `max_body_bytes` bounds what we send and accept;
    `keep_rounds`/`keep_bytes` bound the bodies kept in memory to serve to peers.
    """

    def __init__(
        self,
        identity: Identity,
        *,
        swarm: str,
        host: str = "127.0.0.1",
        port: int = 0,
        initial_peers: Sequence[str] = (),
        request_timeout: float = 10.0,
        record_ttl: float = 600.0,
        start_timeout: float = 30.0,
        max_body_bytes: int = DEFAULT_LIMITS.max_envelope_bytes,
        keep_rounds: int = 8,
        keep_bytes: int = 256 * MIB,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        if request_timeout <= 0 or record_ttl <= 0 or start_timeout <= 0:
            raise ValueError(
                f"timeouts must be positive, got request_timeout={request_timeout}, "
                f"record_ttl={record_ttl}, start_timeout={start_timeout}"
            )
        rollout_round_key(swarm, 0)  # raises ValueError on an invalid swarm name, before anything starts
        self.identity = identity
        self.swarm = swarm
        self.host, self.port = host, port
        self.initial_peers = [str(p) for p in initial_peers]
        self.request_timeout = request_timeout
        self.record_ttl = record_ttl
        self.start_timeout = start_timeout
        self.max_body_bytes = max_body_bytes
        self.keep_rounds, self.keep_bytes = keep_rounds, keep_bytes
        # An announce stays in the DHT for record_ttl, so accept envelope timestamps that old.
        self._announce_limits = dataclasses.replace(
            limits,
            max_envelope_bytes=ANNOUNCE_MAX_BYTES,
            max_clock_skew_s=limits.max_clock_skew_s + record_ttl,
        )

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._p2p: P2P | None = None
        self._dht: DHTNode | None = None
        self._maddrs: list[str] = []
        self._state_lock = threading.Lock()  # guards start/shutdown transitions only
        self._stopped = threading.Event()
        self._seq = 0

        # Loop-thread state.
        self._bodies: OrderedDict[bytes, tuple[tuple[str, int], bytes]] = OrderedDict()  # sha256 -> ((topic, slot), body)
        self._kept_bytes = 0
        self._done: OrderedDict[bytes, None] = OrderedDict()  # sha256s fetched, own or rejected
        self._inflight: set[bytes] = set()
        self._bad_seen: OrderedDict[tuple, None] = OrderedDict()
        self._authors_by_round: OrderedDict[tuple[str, int], set[str]] = OrderedDict()
        self._fetch_slots: asyncio.Semaphore | None = None
        self._stats: Counter[str] = Counter()

    # ----- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn p2pd and join the DHT; raises GossipError if that fails within `start_timeout`."""
        with self._state_lock:
            if self._thread is not None or self._stopped.is_set():
                raise GossipError("Gossip.start() was already called; create a new Gossip to restart")
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="hivespec-gossip", daemon=True)
            self._thread.start()
        try:
            self._call(self._astart(), self.start_timeout)
        except BaseException as exc:
            self.shutdown()
            if not isinstance(exc, Exception):  # KeyboardInterrupt and friends pass through as they are
                raise
            where = f"/ip4/{self.host}/tcp/{self.port}"
            raise GossipError(
                f"could not start hivemind on {where} (start_timeout={self.start_timeout:g} s, "
                f"initial_peers={self.initial_peers}): {type(exc).__name__}: {exc}. "
                "Check that the port is free and that the initial peers are running and reachable."
            ) from exc
        logger.info("gossip up: swarm %r, peer %s, maddrs %s", self.swarm, self.identity.peer_id, self._maddrs)

    async def _astart(self) -> None:
        self._fetch_slots = asyncio.Semaphore(_MAX_PARALLEL_FETCHES)
        self._p2p = await P2P.create(
            initial_peers=self.initial_peers,
            host_maddrs=[f"/ip4/{self.host}/tcp/{self.port}"],
            nat_port_map=False,  # loopback/LAN: no UPnP calls to the router
            startup_timeout=self.start_timeout,
        )
        await self._p2p.add_binary_stream_handler(STREAM_NAME, self._serve_body)
        self._dht = await DHTNode.create(
            p2p=self._p2p,
            initial_peers=self.initial_peers,
            # Per-RPC timeout: a dead peer must cost a fraction of one publish/fetch budget.
            wait_timeout=min(3.0, self.request_timeout / 3),
        )
        self._maddrs = [str(m) for m in await self._p2p.get_visible_maddrs()]

    @property
    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with /p2p/<id>) other nodes pass as `initial_peers` to join through us."""
        self._require_started()
        return list(self._maddrs)

    def shutdown(self) -> None:
        """Stop the DHT node, p2pd, the loop and its thread; safe to call more than once."""
        with self._state_lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            self._call(self._ashutdown(), self.request_timeout + _GRACE_S)
        except Exception as exc:  # keep tearing down: a half-stopped node must not keep p2pd alive
            logger.warning("gossip shutdown was not clean: %s: %s", type(exc).__name__, exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=self.request_timeout)
        if thread.is_alive():
            logger.warning("gossip loop thread did not stop within %g s", self.request_timeout)
            return
        child = getattr(self._p2p, "_child", None)
        if child is not None and child.returncode is None:  # p2pd ignored SIGTERM: do not leak it
            try:
                child.kill()
            except ProcessLookupError:
                pass
        loop.close()

    async def _ashutdown(self) -> None:
        if self._dht is not None:
            await self._dht.shutdown()
        if self._p2p is not None:
            await self._p2p.shutdown()
        # hivemind leaves background tasks (traversals, cache refresh) pending; end them here.
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> Gossip:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----- publish and serve -----------------------------------------------------------------

    def publish(self, round: int, body: bytes, *, topic: str = "rollouts") -> None:
        """Offer `body` (a sealed envelope) for slot `round` of `topic` and announce it in the DHT.

        Topics are listed in `protocol.keys.TOPIC_KEYS`: "rollouts" (slot = round) and "delta"
        (slot = the policy version the delta produces).

        The body is kept in memory (bounded by keep_rounds/keep_bytes) and served to peers that
        ask for it by sha256. Raises ValueError if it is larger than max_body_bytes, GossipError
        if the DHT store does not finish within request_timeout.
        """
        self._require_started()
        topic_key(self.swarm, topic, round)  # ValueError on an unknown topic or a negative slot
        body = bytes(body)
        if len(body) > self.max_body_bytes:
            raise ValueError(
                f"rollout body is {len(body)} bytes, over max_body_bytes={self.max_body_bytes}; "
                "split the batch over several publish() calls"
            )
        digest = hashlib.sha256(body).digest()
        with self._state_lock:
            # Microsecond wall clock as a floor keeps seq increasing across restarts of the node.
            self._seq = max(self._seq + 1, time.time_ns() // 1000)
            seq = self._seq
        announce = pack(
            {
                "round": round,
                "sha256": digest,
                "size": len(body),
                "p2p": self._p2p.peer_id.to_base58(),
                "maddrs": self._maddrs[:MAX_ANNOUNCE_MADDRS],
            }
        )
        record = seal(self.identity, Kind.ANNOUNCE, seq, announce)
        self._call(self._apublish(topic, round, digest, body, record), self.request_timeout + _GRACE_S)

    async def _apublish(self, topic: str, round: int, digest: bytes, body: bytes, record: bytes) -> None:
        self._keep_body((topic, round), digest, body)
        stored = await asyncio.wait_for(
            self._dht.store(
                topic_key(self.swarm, topic, round),
                record,
                expiration_time=get_dht_time() + self.record_ttl,
                subkey=self.identity.peer_id,
            ),
            self.request_timeout,
        )
        self._stats["published"] += 1
        if not stored:
            # Only our own replica may exist; peers can still find the record once they reach us.
            self._stats["announce_store_failed"] += 1
            logger.warning("%s %d: no DHT peer accepted our announce; is the swarm reachable?", topic, round)

    def _keep_body(self, slot: tuple[str, int], digest: bytes, body: bytes) -> None:
        if digest in self._bodies:
            return
        self._bodies[digest] = (slot, body)
        self._kept_bytes += len(body)
        self._remember(self._done, digest)
        rounds = Counter(slot for slot, _ in self._bodies.values())
        # Oldest first; the body just published is always kept.
        while len(self._bodies) > 1 and (len(rounds) > self.keep_rounds or self._kept_bytes > self.keep_bytes):
            _, (old_round, old_body) = self._bodies.popitem(last=False)
            self._kept_bytes -= len(old_body)
            rounds[old_round] -= 1
            if rounds[old_round] == 0:
                del rounds[old_round]

    async def _serve_body(self, _info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            digest = await asyncio.wait_for(reader.readexactly(32), self.request_timeout)
            entry = self._bodies.get(digest)
            if entry is None:
                writer.write(bytes([_STATUS_MISSING]) + (0).to_bytes(8, "big"))
                self._stats["serve_missing"] += 1
            else:
                body = entry[1]
                writer.write(bytes([_STATUS_FOUND]) + len(body).to_bytes(8, "big"))
                view = memoryview(body)
                for offset in range(0, len(body), CHUNK_BYTES):
                    writer.write(view[offset : offset + CHUNK_BYTES])
                    await asyncio.wait_for(writer.drain(), self.request_timeout)
                self._stats["bodies_served"] += 1
                self._stats["bytes_out"] += len(body)
            await asyncio.wait_for(writer.drain(), self.request_timeout)
        except Exception as exc:  # a peer that hangs up or stalls costs us nothing but a log line
            self._stats["serve_errors"] += 1
            logger.debug("serving a body failed: %s: %s", type(exc).__name__, exc)
        finally:
            writer.close()

    # ----- fetch -----------------------------------------------------------------------------

    def fetch_round(self, round: int, *, timeout: float, topic: str = "rollouts") -> list[Fetched]:
        """Fetch the bodies announced for slot `round` of `topic` that we have not fetched before.

        Bad announces and bodies are skipped and counted in stats(); peers that cannot be
        reached now are retried on the next call. Returns what arrived within `timeout`.
        """
        self._require_started()
        return self._call(self._afetch_round(topic, round, timeout), timeout + _GRACE_S)

    def wait_for_round(self, round: int, *, peers: int, timeout: float, topic: str = "rollouts") -> list[Fetched]:
        """Poll `fetch_round` until bodies from `peers` distinct other authors arrived for `round`.

        Counts authors fetched by earlier calls too; returns the bodies fetched by this call,
        possibly fewer than asked for when `timeout` runs out.
        """
        deadline = time.monotonic() + timeout
        fetched: list[Fetched] = []
        while True:
            remaining = deadline - time.monotonic()
            fetched += self.fetch_round(round, timeout=max(0.1, min(remaining, self.request_timeout)), topic=topic)
            if len(self._authors_by_round.get((topic, round), ())) >= peers:
                return fetched
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stopped.wait(min(_POLL_INTERVAL_S, remaining)):
                return fetched

    async def _afetch_round(self, topic: str, round: int, timeout: float) -> list[Fetched]:
        deadline = time.monotonic() + timeout
        key = topic_key(self.swarm, topic, round)
        try:
            found = await asyncio.wait_for(self._dht.get(key, latest=True), timeout)
        except asyncio.TimeoutError:
            self._stats["dht_get_timeouts"] += 1
            return []
        if found is None:
            return []
        if not isinstance(found.value, dict):
            self._bad(("not-a-dict", round), f"round {round}: DHT value is {type(found.value).__name__}, not subkeys")
            return []
        announces = []
        for subkey, entry in found.value.items():
            if subkey == self.identity.peer_id:
                continue
            try:
                announce = self._parse_announce(round, subkey, entry.value)
            except _BadRecord as exc:
                self._bad(("announce", subkey, _fingerprint(entry.value)), f"round {round}: announce by {subkey!r}: {exc}")
                continue
            if announce.sha256 not in self._done and announce.sha256 not in self._inflight:
                announces.append(announce)
        results = await asyncio.gather(*(self._fetch_one(a, deadline) for a in announces))
        fetched = [f for f in results if f is not None]
        if fetched:
            authors = self._authors_by_round.setdefault((topic, round), set())
            authors.update(f.author_peer_id for f in fetched)
            while len(self._authors_by_round) > 4 * self.keep_rounds + 16:
                self._authors_by_round.popitem(last=False)
        return fetched

    def _parse_announce(self, round: int, subkey: object, value: object) -> _Announce:
        if not isinstance(subkey, str) or not isinstance(value, bytes):
            raise _BadRecord(f"subkey/value types {type(subkey).__name__}/{type(value).__name__}")
        verdict, envelope = open_envelope(value, limits=self._announce_limits, expected_kind=Kind.ANNOUNCE)
        if not verdict.ok:
            raise _BadRecord(f"envelope rejected: {verdict}")
        if envelope.peer_id != subkey:
            # Anyone can write any subkey; only the key's owner may announce under it.
            raise _BadRecord(f"signed by {envelope.peer_id}, stored under subkey {subkey}")
        verdict, body = safe_unpack(envelope.body, max_size=ANNOUNCE_MAX_BYTES, max_depth=2)
        if not verdict.ok:
            raise _BadRecord(f"announce body: {verdict}")
        if not isinstance(body, dict) or set(body) != _ANNOUNCE_KEYS:
            raise _BadRecord(f"announce body keys {sorted(map(str, body)) if isinstance(body, dict) else body!r}")
        if body["round"] != round or isinstance(body["round"], bool):
            raise _BadRecord(f"announce is for round {body['round']!r}, stored under round {round}")
        digest, size, p2p_id, maddrs = body["sha256"], body["size"], body["p2p"], body["maddrs"]
        if not isinstance(digest, bytes) or len(digest) != 32:
            raise _BadRecord("sha256 is not 32 bytes")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= self.max_body_bytes:
            raise _BadRecord(f"size {size!r} outside (0, {self.max_body_bytes}]")
        if not isinstance(maddrs, list) or len(maddrs) > MAX_ANNOUNCE_MADDRS or not all(
            isinstance(m, str) for m in maddrs
        ):
            raise _BadRecord("maddrs is not a short list of str")
        try:
            peer = PeerID.from_base58(p2p_id)
        except Exception as exc:
            raise _BadRecord(f"p2p peer id {p2p_id!r:.80}: {exc}") from None
        return _Announce(subkey, round, digest, size, peer, tuple(maddrs))

    async def _fetch_one(self, announce: _Announce, deadline: float) -> Fetched | None:
        self._inflight.add(announce.sha256)
        try:
            async with self._fetch_slots:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                body = await asyncio.wait_for(self._download(announce), min(remaining, self.request_timeout))
        except _BadRecord as exc:
            self._remember(self._done, announce.sha256)  # the author signed a bad body: do not retry it
            self._bad(("body", announce.sha256), f"round {announce.round}: body from {announce.author}: {exc}")
            return None
        except Exception as exc:  # unreachable or slow peer (incl. TimeoutError): retried on the next poll
            self._stats["fetch_failures"] += 1
            logger.debug("fetch from %s failed (will retry): %s: %s", announce.author, type(exc).__name__, exc)
            return None
        finally:
            self._inflight.discard(announce.sha256)
        self._remember(self._done, announce.sha256)
        self._stats["bodies_fetched"] += 1
        self._stats["bytes_in"] += len(body)
        return Fetched(announce.author, body)

    async def _open_stream(self, announce: _Announce) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            _, reader, writer = await self._p2p.call_binary_stream_handler(announce.p2p_peer_id, STREAM_NAME)
        except Exception:
            # p2pd may not know the author's addresses yet (no DHT traffic between us so far):
            # dial the addresses from its signed announce, then retry once. P2P has no public
            # connect(); hivemind itself uses _client.connect the same way.
            maddrs = [_without_peer_id(Multiaddr(m)) for m in announce.maddrs]
            await self._p2p._client.connect(announce.p2p_peer_id, maddrs)
            _, reader, writer = await self._p2p.call_binary_stream_handler(announce.p2p_peer_id, STREAM_NAME)
        return reader, writer

    async def _download(self, announce: _Announce) -> bytes:
        reader, writer = await self._open_stream(announce)
        try:
            writer.write(announce.sha256)
            await writer.drain()
            header = await reader.readexactly(_HEADER_BYTES)
            status, size = header[0], int.from_bytes(header[1:], "big")
            if status == _STATUS_MISSING:
                raise LookupError("the author no longer has this body")  # evicted: not the author's fault
            if status != _STATUS_FOUND or size != announce.size:
                raise _BadRecord(f"stream header status {status}, size {size} (announced {announce.size})")
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
        if hasher.digest() != announce.sha256:
            raise _BadRecord("sha256 of the received body does not match the announce")
        return b"".join(parts)

    # ----- helpers ---------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters: bytes_in/out, bodies_served/fetched, bad_records, fetch_failures, known_peers, ..."""
        snapshot = {
            "bytes_in": 0,
            "bytes_out": 0,
            "bodies_served": 0,
            "bodies_fetched": 0,
            "bad_records": 0,
            "fetch_failures": 0,
            "published": 0,
        }
        snapshot.update(self._stats.copy())
        snapshot["bodies_kept"] = len(self._bodies)
        dht = self._dht
        snapshot["known_peers"] = len(dht.protocol.routing_table.uid_to_peer_id) if dht is not None else 0
        return snapshot

    def _bad(self, key: tuple, reason: str) -> None:
        # The same bad record comes back on every poll: count and log it once.
        if key in self._bad_seen:
            return
        self._remember(self._bad_seen, key)
        self._stats["bad_records"] += 1
        logger.debug("skipped bad gossip record: %s", reason)

    @staticmethod
    def _remember(seen: OrderedDict, key: object) -> None:
        seen[key] = None
        seen.move_to_end(key)
        while len(seen) > _REMEMBERED_HASHES:
            seen.popitem(last=False)

    def _require_started(self) -> None:
        if self._dht is None or self._stopped.is_set():
            raise GossipError("gossip is not running: call start() first (and not after shutdown())")

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            if not future.done():
                future.cancel()
                raise GossipError(f"hivemind call did not finish within {timeout:g} s; is the gossip loop stuck?") from None
            raise GossipError(
                f"a DHT request got no answer within {self.request_timeout:g} s; check that the swarm's peers "
                "are running, or raise request_timeout"
            ) from None


def _fingerprint(value: object) -> bytes:
    data = value if isinstance(value, bytes) else repr(value).encode()
    return hashlib.sha256(data).digest()[:16]


def _without_peer_id(maddr: Multiaddr) -> Multiaddr:
    # p2pd's connect takes the peer id separately and transport addresses only.
    if "p2p" in [proto.name for proto in maddr.protocols()]:
        return maddr.decapsulate(Multiaddr(f"/p2p/{maddr.value_for_protocol('p2p')}"))
    return maddr
