"""Gossip over hivemind: owner-signed index records in the DHT, bodies over P2P streams from any holder.

Shape of one slot (a round of "rollouts", a policy version of "delta"):
- `publish(slot, body)` keeps the body in memory and stores our index record (`protocol/announce.py`)
  under `topic_key(swarm, topic, slot)`, subkey = our peer id: which bodies we hold (sha256,
  size, author) and where to fetch them (libp2p peer id, multiaddrs).
- `fetch_round(slot)` reads every holder's record, groups the announced bodies by
  (sha256, author, size) and pulls each new one over the "hivespec.rollouts.v1" stream from the
  first holder that serves it (the author's own record first), checking size and sha256.
- A body we fetched whose envelope is signed by its announced author is kept and added to our
  own record for the slot, so we serve it too: a batch survives its author leaving.

Trust: `dht_guard.AnnounceValidator` runs inside hivemind on every stored and found record
(owner signature, key and expiration bound, TTL cap, size cap) and `dht_guard.harden` limits
every DHT request before hivemind decodes it. `PeerScores` (optional) graylists holders that
serve bad bytes and rate-limits what we take from each; intake scores the content. In a private
swarm bodies and records are AEAD-encrypted and only allowlisted authors are accepted.

hivemind runs in our own asyncio loop on a daemon thread, with `DHTNode` used directly: the
`hivemind.DHT` wrapper deadlocks on values over ~64 KiB (upstream PR #660). One `P2P` (one p2pd
child process) serves both. Public methods are called from other threads and block with a
timeout; gossip state is touched on the loop thread only.
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
from typing import TYPE_CHECKING, Any, Self, TypeVar

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from hivespec.node.swarm.bootstrap import Joiner, PeerCache
from hivespec.node.swarm.dht_guard import AnnounceValidator, harden
from hivespec.node.swarm.nat import REACH_STREAM, RELAYED_BODY_LIMIT, ReachService, is_circuit, relay_candidates, start_p2pd
from hivespec.node.swarm.peers import PeerScores
from hivespec.node.swarm.transfer import (  # noqa: F401 - CHUNK_BYTES re-exported
    CHUNK_BYTES,
    STREAM_NAME,
    BadBody,
    download,
    serve_body,
)
from hivespec.protocol.announce import (
    MAX_ITEMS,
    MAX_MADDRS,
    Announce,
    AnnouncedBody,
    encode_announce,
)
from hivespec.protocol.envelope import Kind, open_envelope, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.keys import rollout_round_key, topic_key
from hivespec.protocol.limits import DEFAULT_LIMITS, MIB, Limits
from hivespec.protocol.private import PrivateSwarm

if TYPE_CHECKING:
    from hivespec.node.config import SwarmConfig

logger = logging.getLogger(__name__)

_MAX_PARALLEL_FETCHES = 8
_MAX_PARALLEL_SERVES = 16
_POLL_MIN_S, _POLL_MAX_S = 0.1, 1.0  # DHT reads while waiting back off from 0.1 s to 1 s
_REMEMBERED = 65536  # fetched/failed items and parsed records kept for dedupe
_GRACE_S = 5.0  # slack for the caller's wait on top of the timeout enforced inside the loop

T = TypeVar("T")
_Item = tuple[bytes, str, int]  # (sha256, author, size): one announced body claim


class GossipError(RuntimeError):
    """hivemind could not be started or used; the message says what to check."""


@dataclass
class Fetched:
    """A body fetched from a holder: size and sha256 verified (and decrypted in a private swarm), content not yet validated.

    `author_peer_id` is who the holder says wrote it; intake checks that against the signature.
    """

    author_peer_id: str
    body: bytes
    holder: str = ""
    sha256: bytes = b""


@dataclass(frozen=True)
class _Holder:
    peer: str
    p2p_peer_id: PeerID
    maddrs: tuple[str, ...]


class Gossip:
    """One node's gossip: hivemind P2P + DHTNode on a private event-loop thread.

    Call `start()` once, then `publish`/`fetch_round`/`wait_for_round` from any thread, and
    `shutdown()` at the end (idempotent). `max_body_bytes` bounds what we send and accept;
    `keep_rounds`/`keep_bytes` bound the bodies kept in memory to serve to peers. Bootstrap:
    `initial_peers` (or `bootstrap`, (source, maddr) pairs from `bootstrap.bootstrap_candidates`)
    are dialled with backoff for `bootstrap_timeout` s; if none answers the node runs solo
    (`status()["solo"]`) unless `require_peers`, and re-bootstraps every `rebootstrap_interval` s.
    """

    def __init__(
        self,
        identity: Identity,
        *,
        swarm: str,
        host: str = "127.0.0.1",
        port: int = 0,
        initial_peers: Sequence[str] = (),
        bootstrap: Sequence[tuple[str, str]] | None = None,
        peer_cache: PeerCache | None = None,
        bootstrap_timeout: float = 20.0,
        rebootstrap_interval: float = 60.0,
        require_peers: bool = False,
        announce_maddrs: Sequence[str] = (),
        use_relay: bool = True,
        use_auto_relay: bool = False,
        nat_port_map: bool = False,
        p2p_identity_path: str | None = None,
        request_timeout: float = 10.0,
        record_ttl: float = 600.0,
        start_timeout: float = 30.0,
        max_body_bytes: int = DEFAULT_LIMITS.max_envelope_bytes,
        keep_rounds: int = 8,
        keep_bytes: int = 256 * MIB,
        peers: PeerScores | None = None,
        private: PrivateSwarm | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        if min(request_timeout, record_ttl, start_timeout, rebootstrap_interval) <= 0 or bootstrap_timeout < 0:
            raise ValueError(
                f"timeouts must be positive, got request_timeout={request_timeout}, record_ttl={record_ttl}, "
                f"start_timeout={start_timeout}, bootstrap_timeout={bootstrap_timeout}, "
                f"rebootstrap_interval={rebootstrap_interval}"
            )
        rollout_round_key(swarm, 0)  # raises ValueError on an invalid swarm name, before anything starts
        self.identity = identity
        self.swarm = swarm
        self.host, self.port = host, port
        self.initial_peers = [str(p) for p in initial_peers]
        self.bootstrap = list(bootstrap) if bootstrap is not None else [("config", p) for p in self.initial_peers]
        self.peer_cache = peer_cache
        self.bootstrap_timeout, self.rebootstrap_interval = bootstrap_timeout, rebootstrap_interval
        self.require_peers = require_peers
        self.announce_maddrs = list(announce_maddrs)
        self.use_relay, self.use_auto_relay, self.nat_port_map = use_relay, use_auto_relay, nat_port_map
        self.p2p_identity_path = p2p_identity_path
        # Behind NAT: reserve relay slots on the configured bootstrap peers (not cached ones, which may be NATed too).
        self.relays = relay_candidates([m for source, m in self.bootstrap if source != "cache"]) if use_auto_relay else []
        self.request_timeout = request_timeout
        self.record_ttl = record_ttl
        self.start_timeout = start_timeout
        self.max_body_bytes = max_body_bytes
        self.keep_rounds, self.keep_bytes = keep_rounds, keep_bytes
        self.peers = peers
        self.private = private
        self.validator = AnnounceValidator(swarm, max_ttl=record_ttl, max_body_bytes=max_body_bytes, private=private, limits=limits)
        # A holder relays a body only once it checked the author's signature on it.
        self._relay_limits = dataclasses.replace(limits, max_envelope_bytes=max_body_bytes)

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._p2p: P2P | None = None
        self._dht: DHTNode | None = None
        self._joiner: Joiner | None = None
        self._maddrs: list[str] = []
        self._state_lock = threading.Lock()  # guards start/shutdown transitions and seq
        self._stopped = threading.Event()
        self._seq = 0
        self._last_expiry = 0.0

        # Loop-thread state.
        self._bodies: OrderedDict[bytes, tuple[tuple[str, int], bytes]] = OrderedDict()  # sha256 -> (slot, wire bytes)
        self._kept_bytes = 0
        self._holding: OrderedDict[tuple[str, int], list[AnnouncedBody]] = OrderedDict()  # our record's items per slot
        self._done: OrderedDict[_Item, None] = OrderedDict()
        self._failed: OrderedDict[tuple[_Item, str], None] = OrderedDict()  # (item, holder) that served bad bytes
        self._inflight: set[_Item] = set()
        self._parsed: OrderedDict[bytes, tuple[str, Announce] | None] = OrderedDict()
        self._authors_by_round: OrderedDict[tuple[str, int], set[str]] = OrderedDict()
        self._fetch_slots: asyncio.Semaphore | None = None
        self._serve_slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task] = set()
        self._restoring: set[tuple[str, int]] = set()
        self._stats: Counter[str] = Counter()

    # ----- lifecycle -------------------------------------------------------------------------


    @classmethod
    def from_config(
        cls,
        swarm: SwarmConfig,
        identity: Identity,
        *,
        bootstrap: Sequence[tuple[str, str]],
        peer_cache: PeerCache | None,
        p2p_identity_path: str | None,
        private: PrivateSwarm | None,
        peers: PeerScores | None = None,
        keep_rounds: int = 8,
        require_peers: bool | None = None,
    ) -> Self:
        """A gossip (not started) with the `swarm` section's settings: name, address, bootstrap timing, NAT, record TTL.

        What lives in files under the node's home (bootstrap candidates with the peers file and
        the peer cache, the libp2p key, the private swarm's allowlist and secret) comes in read
        already: `build.make_gossip` reads it, so every process joins the same way.
        `require_peers` overrides `swarm.require_peers` (a bootstrap peer, the first one up, never
        requires any). `keep_rounds` is how many rounds' bodies are kept to serve.
        """
        return cls(
            identity,
            swarm=swarm.swarm,
            host=swarm.host,
            port=swarm.port,
            bootstrap=bootstrap,
            peer_cache=peer_cache,
            bootstrap_timeout=swarm.bootstrap_timeout,
            rebootstrap_interval=swarm.rebootstrap_interval,
            require_peers=swarm.require_peers if require_peers is None else require_peers,
            announce_maddrs=swarm.announce_maddrs,
            use_relay=swarm.use_relay,
            use_auto_relay=swarm.use_auto_relay,
            nat_port_map=swarm.nat_port_map,
            p2p_identity_path=p2p_identity_path,
            record_ttl=swarm.record_ttl,
            peers=peers,
            private=private,
            keep_rounds=keep_rounds,
        )
    def start(self) -> None:
        """Spawn p2pd, start the DHT and bootstrap; raises GossipError if that fails within `start_timeout`.

        With bootstrap peers that do not answer, the node starts solo (unless `require_peers`).
        """
        with self._state_lock:
            if self._thread is not None or self._stopped.is_set():
                raise GossipError("Gossip.start() was already called; create a new Gossip to restart")
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="hivespec-gossip", daemon=True)
            self._thread.start()
        try:
            self._call(self._astart(), self.start_timeout + self.bootstrap_timeout)
        except BaseException as exc:
            self.shutdown()
            if not isinstance(exc, Exception):  # KeyboardInterrupt and friends pass through as they are
                raise
            where = f"/ip4/{self.host}/tcp/{self.port}"
            raise GossipError(
                f"could not start hivemind on {where} (start_timeout={self.start_timeout:g} s, "
                f"initial peers={[m for _, m in self.bootstrap]}): {type(exc).__name__}: {exc}. "
                "Check that the port is free and that the initial peers are running and reachable."
            ) from exc
        status = self.status()
        logger.info("gossip up: swarm %r, peer %s, maddrs %s, %s", self.swarm, self.identity.peer_id, self._maddrs,
                    "solo" if status["solo"] else f"joined via {status['joined_via']}")

    async def _astart(self) -> None:
        self._fetch_slots = asyncio.Semaphore(_MAX_PARALLEL_FETCHES)
        self._serve_slots = asyncio.Semaphore(_MAX_PARALLEL_SERVES)
        # No initial peers for p2pd itself: an unreachable one would fail its start; Joiner dials them.
        self._p2p = await start_p2pd(
            host_maddrs=[f"/ip4/{self.host}/tcp/{self.port}"],
            announce_maddrs=self.announce_maddrs,
            nat_port_map=self.nat_port_map,
            use_relay=self.use_relay,
            relays=self.relays,
            identity_path=self.p2p_identity_path,
            startup_timeout=self.start_timeout,
        )
        await self._p2p.add_binary_stream_handler(STREAM_NAME, self._serve_body)
        await self._p2p.add_binary_stream_handler(REACH_STREAM, ReachService(self._p2p).handle)
        self._dht = await DHTNode.create(
            p2p=self._p2p,
            record_validator=self.validator,
            # Per-RPC timeout: a dead peer must cost a fraction of one publish/fetch budget.
            wait_timeout=min(3.0, self.request_timeout / 3),
        )
        await harden(self._dht, self._stats)
        # Relay circuits after our own addresses: a peer tries them all and keeps the first that connects.
        self._maddrs = [str(m) for m in await self._p2p.get_visible_maddrs()] + [f"{r}/p2p-circuit" for r in self.relays]
        self._joiner = Joiner(
            self._p2p, self._dht, self.bootstrap, self.peer_cache, rpc_timeout=min(3.0, self.request_timeout / 3),
            relays=self.relays,
        )
        if self.bootstrap and not await self._joiner.start(self.bootstrap_timeout):
            if self.require_peers:
                raise GossipError(f"none of the {len(self.bootstrap)} initial peers answered within "
                                  f"{self.bootstrap_timeout:g} s and swarm.require_peers is set")
            logger.warning(
                "solo mode: none of %d bootstrap peers answered within %g s; training alone and retrying "
                "in the background (check the addresses, or your network/firewall)",
                len(self.bootstrap), self.bootstrap_timeout,
            )
        self._spawn(self._joiner.keep_joined(self.rebootstrap_interval))

    @property
    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with /p2p/<id>) other nodes pass as `initial_peers` to join through us."""
        self._require_started()
        return list(self._maddrs)

    def status(self) -> dict[str, Any]:
        """Swarm-facing state for the status snapshot: solo, reachability (+ reachability_detail), known_peers, joined_via, ...

        reachability is measured by peers (node/swarm/nat.py): reachable / relayed / unreachable / unknown.
        """
        dht, joiner = self._dht, self._joiner
        known = len(dht.protocol.routing_table.uid_to_peer_id) if dht is not None else 0
        return {
            "solo": known == 0,
            "known_peers": known,
            "reachability": joiner.reachability if joiner is not None and known else "unknown",
            "reachability_detail": joiner.reachability_detail if joiner is not None and known else "",
            "relays": list(self.relays),
            "joined_via": joiner.joined_via if joiner is not None else "",
            "last_bootstrap": joiner.last_attempt if joiner is not None else 0.0,
            "maddrs": list(self._maddrs),
            "private": self.private is not None,
            "dht_records_refused": sum(self.validator.rejected.values()),
        }

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
        except Exception as exc:  # noqa: BLE001 - keep tearing down: a half-stopped node must not keep p2pd alive
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
        if self.peers is not None:
            self.peers.save()

    async def _ashutdown(self) -> None:
        if self._joiner is not None:
            await self._joiner.remember_peers()
        if self._dht is not None:
            await self._dht.shutdown()
        if self._p2p is not None:
            await self._p2p.shutdown()
        # hivemind leaves background tasks (traversals, cache refresh) pending; end them and ours here.
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----- publish and serve -----------------------------------------------------------------

    def publish(self, round: int, body: bytes, *, topic: str = "rollouts") -> None:
        """Offer `body` (a sealed envelope) for slot `round` of `topic` and announce it in the DHT.

        Topics are listed in `protocol.keys.TOPIC_KEYS`: "rollouts" (slot = round) and "delta"
        (slot = the policy version the delta produces). The body is kept in memory (bounded by
        keep_rounds/keep_bytes) and served to peers that ask for it by sha256. Raises ValueError
        if it is larger than max_body_bytes, GossipError if the DHT store does not finish within
        request_timeout.
        """
        self._require_started()
        key = topic_key(self.swarm, topic, round)  # ValueError on an unknown topic or a negative slot
        body = bytes(body)
        if len(body) > self.max_body_bytes:
            raise ValueError(
                f"body is {len(body)} bytes, over max_body_bytes={self.max_body_bytes}; "
                "split the batch over several publish() calls"
            )
        wire = self.private.seal_body(body, context=key) if self.private is not None else body
        item = AnnouncedBody(self.identity.peer_id, hashlib.sha256(wire).digest(), len(wire))
        self._call(self._apublish(topic, round, item, wire), self.request_timeout + _GRACE_S)

    async def _apublish(self, topic: str, slot: int, item: AnnouncedBody, wire: bytes) -> None:
        self._keep_body((topic, slot), item.sha256, wire)
        self._remember(self._done, (item.sha256, item.author, item.size))
        held = self._holding_for((topic, slot))
        if item not in held:
            held.insert(0, item)
        await asyncio.wait_for(self._store_record(topic, slot), self.request_timeout)
        self._stats["published"] += 1

    def _holding_for(self, slot: tuple[str, int]) -> list[AnnouncedBody]:
        held = self._holding.setdefault(slot, [])
        self._holding.move_to_end(slot)
        while len(self._holding) > 4 * self.keep_rounds + 16:
            self._holding.popitem(last=False)
        return held

    async def _store_record(self, topic: str, slot: int) -> None:
        key = topic_key(self.swarm, topic, slot)
        items = self._holding_for((topic, slot))
        # Strictly increasing: the DHT keeps a subkey's value only if its expiration is newer.
        expires = max(get_dht_time() + self.record_ttl, self._last_expiry + 1e-3)
        self._last_expiry = expires
        body = encode_announce(Announce(key, expires, self._p2p.peer_id.to_base58(), tuple(self._maddrs[:MAX_MADDRS]),
                                        tuple(items[:MAX_ITEMS])))
        if self.private is not None:
            body = self.private.seal_index(body, context=DHTID.generate(source=key).to_bytes().hex())
        with self._state_lock:
            # Microsecond wall clock as a floor keeps seq increasing across restarts of the node.
            self._seq = max(self._seq + 1, time.time_ns() // 1000)
            seq = self._seq
        record = seal(self.identity, Kind.ANNOUNCE, seq, body)
        stored = await self._dht.store(key, record, expiration_time=expires, subkey=self.identity.peer_id)
        if not stored:
            # Only our own replica may exist; peers can still find the record once they reach us.
            self._stats["announce_store_failed"] += 1
            logger.warning("%s: no DHT peer accepted our index record; is the swarm reachable?", key)

    def _keep_body(self, slot: tuple[str, int], digest: bytes, body: bytes) -> None:
        if digest in self._bodies:
            return
        self._bodies[digest] = (slot, body)
        self._kept_bytes += len(body)
        slots = Counter(s for s, _ in self._bodies.values())
        # Oldest first; the body just added is always kept.
        while len(self._bodies) > 1 and (len(slots) > self.keep_rounds or self._kept_bytes > self.keep_bytes):
            _, (old_slot, old_body) = self._bodies.popitem(last=False)
            self._kept_bytes -= len(old_body)
            slots[old_slot] -= 1
            if slots[old_slot] == 0:
                del slots[old_slot]

    async def _serve_body(self, _info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with self._serve_slots:
            await serve_body(self._lookup_body, reader, writer, timeout=self.request_timeout, stats=self._stats)

    def _lookup_body(self, digest: bytes) -> bytes | None:
        entry = self._bodies.get(digest)
        return None if entry is None else entry[1]

    # ----- fetch -----------------------------------------------------------------------------

    def fetch_round(self, round: int, *, timeout: float, topic: str = "rollouts") -> list[Fetched]:
        """Fetch the bodies announced for slot `round` of `topic` that we have not fetched before.

        Bad records and bodies are skipped, counted in stats() and scored against their holder;
        holders that cannot be reached now are retried on the next call. Returns what arrived
        within `timeout`.
        """
        self._require_started()
        return self._call(self._afetch_round(topic, round, timeout), timeout + _GRACE_S)

    def wait_for_round(self, round: int, *, peers: int, timeout: float, topic: str = "rollouts") -> list[Fetched]:
        """Poll `fetch_round` until bodies from `peers` distinct other authors arrived for `round`.

        Counts authors fetched by earlier calls too; returns the bodies fetched by this call,
        possibly fewer than asked for when `timeout` runs out. Polls back off from 0.1 s to 1 s.
        """
        deadline = time.monotonic() + timeout
        fetched: list[Fetched] = []
        interval = _POLL_MIN_S
        while True:
            remaining = deadline - time.monotonic()
            fetched += self.fetch_round(round, timeout=max(0.1, min(remaining, self.request_timeout)), topic=topic)
            if len(self._authors_by_round.get((topic, round), ())) >= peers:
                return fetched
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stopped.wait(min(interval, remaining)):
                return fetched
            interval = min(2 * interval, _POLL_MAX_S)

    def announced_by(self, round: int, *, timeout: float, topic: str = "rollouts") -> set[str]:
        """Peer ids (other than ours) with a valid record for slot `round` of `topic`; fetches no body."""
        self._require_started()
        return self._call(self._aannounced_by(topic, round, timeout), timeout + _GRACE_S)

    def swarm_round(self, start: int, *, timeout: float) -> int:
        """The round to run first: `start`, or the swarm's latest round when peers are already past it.

        A node that joins late, or resumes from a checkpoint while the swarm trained on, would
        otherwise replay rounds nobody else is in. Probes for other peers' rollout records at
        start + 1, + 2, + 4, ... then bisects: O(log gap) small DHT reads of `timeout` at most
        each, no body is fetched. A solo node (no peer answers, or gossip fails) keeps `start`,
        so a solo resume stays bit-identical to an uninterrupted run.
        """

        def ahead(round_index: int) -> bool:
            try:
                return bool(self.announced_by(round_index, timeout=timeout))
            except GossipError:
                return False

        if not ahead(start + 1):
            return start
        low, step = start + 1, 2  # low: a round known to have records
        while ahead(start + step):
            low, step = start + step, step * 2
        high = start + step  # no records here
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if ahead(middle) else (low, middle)
        logger.info("the swarm is at round %d; skipping rounds %d..%d", low, start, low - 1)
        return low

    async def _aannounced_by(self, topic: str, slot: int, timeout: float) -> set[str]:
        return {holder.peer for holder, _ in await self._valid_records(topic_key(self.swarm, topic, slot), timeout)}

    async def _valid_records(self, key: str, timeout: float) -> list[tuple[_Holder, Announce]]:
        """Every other peer's valid (holder, announce) under `key`; invalid ones are counted and skipped."""
        try:
            found = await asyncio.wait_for(self._dht.get(key, latest=True), timeout)
        except TimeoutError:
            self._stats["dht_get_timeouts"] += 1
            return []
        if found is None or not isinstance(found.value, dict):
            return []
        key_id = DHTID.generate(source=key).to_bytes()
        records = []
        for subkey, entry in found.value.items():
            if subkey == self.identity.peer_id:
                continue
            parsed = self._parse_record(key, key_id, subkey, entry.value, entry.expiration_time)
            if parsed is not None:
                records.append(parsed)
        return records

    async def _afetch_round(self, topic: str, slot: int, timeout: float) -> list[Fetched]:
        deadline = time.monotonic() + timeout
        key = topic_key(self.swarm, topic, slot)
        claims: dict[_Item, list[_Holder]] = {}
        records = await self._valid_records(key, timeout)
        direct = await self._directly_connected() if any(h.maddrs and any(is_circuit(m) for m in h.maddrs)
                                                         for h, _ in records) else set()
        for holder, announce in records:
            if self.peers is not None and self.peers.graylisted(holder.peer):
                self._stats["graylisted_skipped"] += 1
                continue
            for item in announce.items:
                claim = (item.sha256, item.author, item.size)
                if item.author == self.identity.peer_id or claim in self._done or claim in self._inflight:
                    continue
                if self.peers is not None and item.author != holder.peer and self.peers.graylisted(item.author):
                    self._stats["graylisted_skipped"] += 1  # a graylisted author's bodies, relayed by someone else
                    continue
                holders = claims.setdefault(claim, [])
                if item.size > RELAYED_BODY_LIMIT and self._relay_only(holder, direct):
                    # p2pd's relay cuts a circuit after ~128 KiB: the body would be re-sent in vain on every
                    # poll. Peers with a direct connection to that holder (the public node) fetch it and serve it.
                    self._stats["relay_only_skipped"] += 1
                    continue
                if (claim, holder.peer) not in self._failed:
                    # The author's own record first: it is the one with the least reason to lie.
                    holders.insert(0 if holder.peer == item.author else len(holders), holder)
        results = await asyncio.gather(
            *(self._fetch_claim(topic, slot, key, claim, holders, deadline) for claim, holders in claims.items() if holders)
        )
        fetched = [f for f in results if f is not None]
        if fetched:
            authors = self._authors_by_round.setdefault((topic, slot), set())
            authors.update(f.author_peer_id for f in fetched)
            while len(self._authors_by_round) > 4 * self.keep_rounds + 16:
                self._authors_by_round.popitem(last=False)
        return fetched

    async def _directly_connected(self) -> set[str]:
        """Base58 ids of peers p2pd holds a non-relayed connection to."""
        try:
            peers = await asyncio.wait_for(self._p2p.list_peers(), self.request_timeout)
        except Exception:  # noqa: BLE001 - unknown: treat every circuit holder as relay-only this poll
            return set()
        return {info.peer_id.to_base58() for info in peers if any(not is_circuit(str(a)) for a in info.addrs)}

    @staticmethod
    def _relay_only(holder: _Holder, direct: set[str]) -> bool:
        """A NATed holder (it announces relay circuits) we have no direct connection to."""
        return any(is_circuit(m) for m in holder.maddrs) and holder.p2p_peer_id.to_base58() not in direct

    def _parse_record(self, key: str, key_id: bytes, subkey: object, value: object, expiration: float) -> tuple[_Holder, Announce] | None:
        """Validated (holder, announce) of one DHT entry, None if invalid (counted once); cached by content."""
        if not isinstance(subkey, str) or not isinstance(value, bytes) or not isinstance(expiration, float):
            self._stats["bad_records"] += 1
            return None
        digest = hashlib.sha256(f"{key}|{subkey}|{expiration!r}|".encode() + value).digest()
        if digest in self._parsed:
            self._parsed.move_to_end(digest)
            cached = self._parsed[digest]
            return None if cached is None else (self._holder(subkey, cached[1]), cached[1])
        record = DHTRecord(key_id, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration)
        reason, checked = self.validator.check(record)
        if checked is not None and checked[1].key != key:
            reason, checked = "key_not_bound", None
        self._parsed[digest] = None if checked is None else (subkey, checked[1])
        while len(self._parsed) > _REMEMBERED:
            self._parsed.popitem(last=False)
        if checked is None:
            self._stats["bad_records"] += 1
            logger.debug("skipped bad gossip record under %s by %r: %s", key, subkey[:40], reason)
            return None
        try:
            return self._holder(subkey, checked[1]), checked[1]
        except ValueError:
            self._parsed[digest] = None
            return None

    @staticmethod
    def _holder(subkey: str, announce: Announce) -> _Holder:
        return _Holder(subkey, PeerID.from_base58(announce.p2p), announce.maddrs)

    async def _fetch_claim(
        self, topic: str, slot: int, key: str, claim: _Item, holders: list[_Holder], deadline: float
    ) -> Fetched | None:
        digest, author, size = claim
        self._inflight.add(claim)
        try:
            async with self._fetch_slots:
                for holder in holders:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    if self.peers is not None and not self.peers.allow(holder.peer, size):
                        self._stats["rate_limited"] += 1
                        continue
                    try:
                        wire = await asyncio.wait_for(
                            download(self._p2p, holder.p2p_peer_id, holder.maddrs, digest, size, timeout=self.request_timeout),
                            min(remaining, self.request_timeout),
                        )
                        body = self._open_wire(wire, key)
                    except BadBody as exc:
                        self._remember(self._failed, (claim, holder.peer))
                        self._blame(holder.peer, f"{key}: body from holder {holder.peer}: {exc}")
                        continue
                    except Exception as exc:  # noqa: BLE001 - unreachable or slow holder (incl. TimeoutError): next holder, or the next poll
                        self._stats["fetch_failures"] += 1
                        logger.debug("fetch from %s failed (will retry): %s: %s", holder.peer, type(exc).__name__, exc)
                        continue
                    self._remember(self._done, claim)
                    self._stats["bodies_fetched"] += 1
                    self._stats["bytes_in"] += len(wire)
                    if holder.peer != author:
                        self._stats["bodies_fetched_from_relay"] += 1
                    self._maybe_relay(topic, slot, claim, wire, body)
                    return Fetched(author, body, holder=holder.peer, sha256=digest)
        finally:
            self._inflight.discard(claim)
        return None

    def _open_wire(self, wire: bytes, key: str) -> bytes:
        if self.private is None:
            return wire
        verdict, body = self.private.open_body(wire, context=key)
        if not verdict.ok or body is None:
            raise BadBody(f"private body: {verdict}")
        return body

    def _maybe_relay(self, topic: str, slot: int, claim: _Item, wire: bytes, body: bytes) -> None:
        """Serve a fetched body too, once its envelope is signed by the announced author; re-store our record."""
        digest, author, size = claim
        if self.peers is not None and self.peers.graylisted(author):
            return
        verdict, envelope = open_envelope(body, limits=self._relay_limits)
        if not verdict.ok or envelope is None or envelope.peer_id != author:
            return  # intake will judge it; we do not vouch for it
        held = self._holding_for((topic, slot))
        if len(held) >= MAX_ITEMS:
            return
        self._keep_body((topic, slot), digest, wire)
        held.append(AnnouncedBody(author, digest, size))
        self._spawn(self._restore_record(topic, slot))

    async def _restore_record(self, topic: str, slot: int) -> None:
        if (topic, slot) in self._restoring:
            return  # the pending store picks up this body too
        self._restoring.add((topic, slot))
        try:
            await asyncio.sleep(0.05)  # one store for a burst of relayed bodies
            await asyncio.wait_for(self._store_record(topic, slot), self.request_timeout)
            self._stats["relay_records"] += 1
        except Exception as exc:  # noqa: BLE001 - relaying is best effort
            logger.debug("re-storing our record for %s %d failed: %s", topic, slot, exc)
        finally:
            self._restoring.discard((topic, slot))

    # ----- helpers ---------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters: bytes_in/out, bodies_served/fetched, bad_records, fetch_failures, known_peers, dht_* refusals, ..."""
        snapshot = {
            "bytes_in": 0,
            "bytes_out": 0,
            "bodies_served": 0,
            "bodies_fetched": 0,
            "bodies_fetched_from_relay": 0,
            "bad_records": 0,
            "bad_bodies": 0,
            "fetch_failures": 0,
            "published": 0,
        }
        snapshot.update(self._stats.copy())
        snapshot["bodies_kept"] = len(self._bodies)
        snapshot["dht_records_refused"] = sum(self.validator.rejected.values())
        dht = self._dht
        snapshot["known_peers"] = len(dht.protocol.routing_table.uid_to_peer_id) if dht is not None else 0
        return snapshot

    def _blame(self, holder: str, reason: str) -> None:
        self._stats["bad_bodies"] += 1
        logger.debug("rejected a body: %s", reason)
        if self.peers is not None:
            self.peers.record(holder, "reject", reason.rsplit(": ", 1)[-1])

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _remember(seen: OrderedDict, key: object) -> None:
        seen[key] = None
        seen.move_to_end(key)
        while len(seen) > _REMEMBERED:
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

    def healthy(self, timeout: float = 5.0) -> bool:
        """Liveness probe (node/supervise.py): the loop thread runs, p2pd is alive and answers its control socket."""
        if self._stopped.is_set() or self._p2p is None or self._thread is None or not self._thread.is_alive():
            return False
        child = getattr(self._p2p, "_child", None)
        if child is not None and child.returncode is not None:
            return False
        try:
            self._call(self._p2p.list_peers(), timeout)
        except Exception:  # noqa: BLE001 - any failure to answer means not alive
            return False
        return True
