"""Gossip over hivemind: owner-signed index records in the DHT, bodies over P2P streams from any holder.

Two ways to find bodies, one machinery underneath:
- **Rollouts, by recency** (`publish_rollouts`, `sample_rollouts`): nodes share no round numbers.
  A batch is announced in the index of the current time bucket (`index.py`: a tree of keys of at
  most `index_key_records` records each, a record listing its holder's newest own batches and the
  ones it relays); a step reads the current bucket along one random path (the previous one too
  where the current is thin), chooses at most `max_foreign_batches` fresh batches by peer score
  with exploration, at most `max_batches_per_peer` per author, among those some holder can serve
  it (behind NAT, not a large body held only by NATed peers: `Fetcher.fetchable`), and fetches them. Held bodies younger than
  `announce_seconds` are re-announced in each new bucket, so a slow author's batch stays findable.
- **Slots** (`publish`, `fetch_slot`, `wait_for_slot`): one key per (topic, slot) for the weight
  topics ("delta", "snapshot", "head"), which a leader's followers read in order.

Either way a record lists the bodies its holder serves; a reader pulls a body over the
"hivespec.rollouts.v1" stream from one of its holders (`fetching.py`) and checks size and
sha256. A fetched body whose envelope is signed by its announced author is kept and added to the
reader's own record (`bodies.py` serves it): any holder serves it, so a batch survives its author
and the author's upload stays bounded as the readers spread it.

Trust: `dht_guard.AnnounceValidator` runs inside hivemind on every stored and found record
(owner signature, key and expiration bound, TTL cap, size cap), `dht_guard.harden` limits every
DHT request before hivemind decodes it and caps the records one key holds. `PeerScores`
(optional) graylists holders that serve bad bytes, rate-limits what we take from each and weighs
whom a step samples; intake scores the content. In a private swarm bodies and records are
AEAD-encrypted and only allowlisted authors are accepted.

hivemind runs in our own asyncio loop on a daemon thread, with `DHTNode` used directly: the
`hivemind.DHT` wrapper deadlocks on values over ~64 KiB (upstream PR #660). One `P2P` (one p2pd
child process) serves both. Public methods are called from other threads and block with a
timeout; gossip state is touched on the loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import random
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Self, TypeVar

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from hivespec.node.swarm.bodies import BodyStore
from hivespec.node.swarm.bootstrap import Joiner, PeerCache
from hivespec.node.swarm.dht_guard import AnnounceValidator, harden
from hivespec.node.swarm.fetching import Fetched, Fetcher
from hivespec.node.swarm.index import (
    Candidate,
    bucket_of,
    choose_claims,
    descend,
    go_deeper,
    level_weight,
    placement_delay,
    placement_path,
    trust_from_score,
)
from hivespec.node.swarm.nat import REACH_STREAM, ReachService, relay_candidates, start_p2pd
from hivespec.node.swarm.peers import PeerScores
from hivespec.node.swarm.records import Holder, IndexRecords
from hivespec.node.swarm.transfer import STREAM_NAME
from hivespec.protocol.announce import MAX_ITEMS, AnnouncedBody
from hivespec.protocol.envelope import open_envelope
from hivespec.protocol.identity import Identity
from hivespec.protocol.keys import check_swarm_name, topic_key
from hivespec.protocol.limits import DEFAULT_LIMITS, Limits
from hivespec.protocol.private import PrivateSwarm

if TYPE_CHECKING:
    from hivespec.node.config import SwarmConfig

__all__ = ["Fetched", "Gossip", "GossipError"]

logger = logging.getLogger(__name__)

_POLL_MIN_S, _POLL_MAX_S = 0.1, 1.0  # slot reads while waiting back off from 0.1 s to 1 s
_GRACE_S = 5.0  # slack for the caller's wait on top of the timeout enforced inside the loop
_EXPLORE = 0.25  # share of a candidate's weight that does not depend on its author's score
# Our own bodies an index record lists, the newest: a reader takes at most max_batches_per_peer (1) of an
# author's a step and prefers the fresh, so older ones only made every copy of the record larger
# (9 items are 1.3 KB sealed, 2 are 0.6 KB, and whole records are most of what an index read moves).
_OWN_ANNOUNCED = 2

T = TypeVar("T")


class GossipError(RuntimeError):
    """hivemind could not be started or used; the message says what to check."""


class Gossip:
    """One node's gossip: hivemind P2P + DHTNode on a private event-loop thread.

    Built from the `swarm` config section (`SwarmConfig`) plus what lives in files under the
    node's home, read by `build.make_gossip`: `bootstrap` ((source, maddr) pairs from
    `bootstrap.bootstrap_candidates`; default: `swarm.initial_peers`), the peer cache, the libp2p
    key path and the private swarm. Call `start()` once, then the publish/fetch methods from any
    thread, and `shutdown()` at the end (idempotent). Bootstrap peers are dialled with backoff
    for `bootstrap_timeout` s; if none answers the node runs solo (`status()["solo"]`) unless
    `require_peers`, and re-bootstraps every `rebootstrap_interval` s.
    """

    def __init__(
        self,
        identity: Identity,
        config: SwarmConfig,
        *,
        bootstrap: Sequence[tuple[str, str]] | None = None,
        peer_cache: PeerCache | None = None,
        p2p_identity_path: str | None = None,
        private: PrivateSwarm | None = None,
        peers: PeerScores | None = None,
        require_peers: bool | None = None,
        max_body_bytes: int = DEFAULT_LIMITS.max_envelope_bytes,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.identity = identity
        self.config = config
        self.swarm = check_swarm_name(config.swarm)  # ValueError on an invalid name, before anything starts
        self.bootstrap = list(bootstrap) if bootstrap is not None else [("config", str(p)) for p in config.initial_peers]
        self.peer_cache = peer_cache
        self.require_peers = config.require_peers if require_peers is None else require_peers
        self.p2p_identity_path = p2p_identity_path
        # Behind NAT: reserve relay slots on the configured bootstrap peers (not cached ones, which may be NATed too).
        self.relays = relay_candidates([m for source, m in self.bootstrap if source != "cache"]) if config.use_auto_relay else []
        self.request_timeout = config.request_timeout
        self.max_body_bytes = max_body_bytes
        self.peers = peers
        self.private = private
        self.validator = AnnounceValidator(
            self.swarm, max_ttl=config.record_ttl, max_body_bytes=max_body_bytes, private=private, limits=limits
        )
        # A holder relays a body only once it checked the author's signature on it.
        self._relay_limits = dataclasses.replace(limits, max_envelope_bytes=max_body_bytes)

        self._stats: Counter[str] = Counter()
        self.records = IndexRecords(identity, validator=self.validator, private=private, record_ttl=config.record_ttl, stats=self._stats)
        self.bodies = BodyStore(
            keep_seconds=config.keep_seconds, keep_bytes=config.keep_bytes, request_timeout=config.request_timeout, stats=self._stats
        )
        self.fetcher = Fetcher(
            private=private, peers=peers, request_timeout=config.request_timeout, stats=self._stats, record_ttl=config.record_ttl
        )
        self._rng = random.Random()

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._p2p: P2P | None = None
        self._dht: DHTNode | None = None
        self._joiner: Joiner | None = None
        self._maddrs: list[str] = []
        self._state_lock = threading.Lock()  # guards start/shutdown transitions
        self._stopped = threading.Event()

        # Loop-thread state.
        self._placed: OrderedDict[int, str] = OrderedDict()  # bucket -> the index key our record lives under
        self._announced: OrderedDict[bytes, AnnouncedBody] = OrderedDict()  # rollout bodies we serve, oldest first
        self._authors_by_slot: OrderedDict[str, set[str]] = OrderedDict()  # slot key -> authors fetched from it
        self._tasks: set[asyncio.Task] = set()
        self._restoring: set[str] = set()

    # ----- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn p2pd, start the DHT and bootstrap; raises GossipError if that fails within `start_timeout`.

        With bootstrap peers that do not answer, the node starts solo (unless `require_peers`).
        """
        with self._state_lock:
            if self._thread is not None or self._stopped.is_set():
                raise GossipError("Gossip.start() was already called; create a new Gossip to restart")
            self._loop = asyncio.new_event_loop()
            self._loop.set_exception_handler(self._on_loop_exception)
            self._thread = threading.Thread(target=self._loop.run_forever, name="hivespec-gossip", daemon=True)
            self._thread.start()
        config = self.config
        try:
            self._call(self._astart(), config.start_timeout + config.bootstrap_timeout)
        except BaseException as exc:
            self.shutdown()
            if not isinstance(exc, Exception):  # KeyboardInterrupt and friends pass through as they are
                raise
            where = f"/ip4/{config.host}/tcp/{config.port}"
            raise GossipError(
                f"could not start hivemind on {where} (start_timeout={config.start_timeout:g} s, "
                f"initial peers={[m for _, m in self.bootstrap]}): {type(exc).__name__}: {exc}. "
                "Check that the port is free and that the initial peers are running and reachable."
            ) from exc
        status = self.status()
        logger.info("gossip up: swarm %r, peer %s, maddrs %s, %s", self.swarm, self.identity.peer_id, self._maddrs,
                    "solo" if status["solo"] else f"joined via {status['joined_via']}")

    async def _astart(self) -> None:
        config = self.config
        # No initial peers for p2pd itself: an unreachable one would fail its start; Joiner dials them.
        self._p2p = await start_p2pd(
            host_maddrs=[f"/ip4/{config.host}/tcp/{config.port}"],
            announce_maddrs=config.announce_maddrs,
            nat_port_map=config.nat_port_map,
            use_relay=config.use_relay,
            relays=self.relays,
            identity_path=self.p2p_identity_path,
            startup_timeout=config.start_timeout,
        )
        await self._p2p.add_binary_stream_handler(STREAM_NAME, self.bodies.serve)
        await self._p2p.add_binary_stream_handler(REACH_STREAM, ReachService(self._p2p).handle)
        rpc_timeout = min(3.0, self.request_timeout / 3)  # a dead peer must cost a fraction of one request's budget
        # No DHT caching: every get would push its result to one more peer (an extra store RPC each) and a
        # cached copy of an index key goes stale within a bucket; the replicas serve every read.
        self._dht = await DHTNode.create(p2p=self._p2p, record_validator=self.validator, wait_timeout=rpc_timeout,
                                         cache_locally=False, cache_nearest=0, cache_on_store=False)
        await harden(self._dht, self._stats)
        # Relay circuits after our own addresses: a peer tries them all and keeps the first that connects.
        self._maddrs = [str(m) for m in await self._p2p.get_visible_maddrs()] + [f"{r}/p2p-circuit" for r in self.relays]
        self.records.attach(self._dht, self._p2p.peer_id.to_base58(), self._maddrs)
        self.fetcher.attach(self._p2p)
        self._joiner = Joiner(self._p2p, self._dht, self.bootstrap, self.peer_cache, rpc_timeout=rpc_timeout, relays=self.relays)
        if self.bootstrap and not await self._joiner.start(config.bootstrap_timeout):
            if self.require_peers:
                raise GossipError(f"none of the {len(self.bootstrap)} initial peers answered within "
                                  f"{config.bootstrap_timeout:g} s and swarm.require_peers is set")
            logger.warning(
                "solo mode: none of %d bootstrap peers answered within %g s; training alone and retrying "
                "in the background (check the addresses, or your network/firewall)",
                len(self.bootstrap), config.bootstrap_timeout,
            )
        self._spawn(self._joiner.keep_joined(config.rebootstrap_interval))
        self._spawn(self._keep_announcing())

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

    def stats(self) -> dict[str, int]:
        """Counters: bytes_in/out, bodies_served/fetched, dht_gets/stores, records_read, bad_records, known_peers, ..."""
        snapshot = dict.fromkeys(
            ("bytes_in", "bytes_out", "bodies_served", "bodies_fetched", "bodies_fetched_from_relay", "bad_records",
             "bad_bodies", "fetch_failures", "published", "dht_gets", "dht_stores", "records_read", "max_records_per_key"),
            0,
        )
        snapshot.update(self._stats.copy())
        snapshot["bodies_kept"] = len(self.bodies)
        snapshot["dht_records_refused"] = sum(self.validator.rejected.values())
        dht = self._dht
        snapshot["known_peers"] = len(dht.protocol.routing_table.uid_to_peer_id) if dht is not None else 0
        return snapshot

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
        # Tasks started while we shut down (a peer's request arriving late) end here, not as "destroyed but pending".
        leftover = asyncio.all_tasks(loop)
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        loop.close()
        if self.peers is not None:
            self.peers.save()

    async def _ashutdown(self) -> None:
        """Save peers, drop the DHT's handlers, stop p2pd: all within request_timeout, p2pd stopped whatever came before.

        When a whole swarm stops at once (a bench, a lab's shutdown), p2pd's control socket and its exit can each
        take seconds while every peer hangs up on it; a stage that runs past the deadline is cut short and logged,
        and p2pd still gets SIGTERM, then SIGKILL at the deadline (it holds no state of ours).
        """
        deadline = time.monotonic() + self.request_timeout

        async def stage(name: str, coro: Coroutine[Any, Any, Any]) -> None:
            started = time.monotonic()
            try:
                await asyncio.wait_for(coro, max(deadline - started, 1.0))  # each late stage still gets a second
            except TimeoutError:
                logger.info("gossip shutdown: %s cut short after %.1f s", name, time.monotonic() - started)

        if self._joiner is not None:
            await stage("saving the peer cache", self._joiner.remember_peers())
        if self._dht is not None:
            await stage("removing the DHT handlers", self._dht.shutdown())
        if self._p2p is not None:
            await stage("waiting for p2pd to exit", self._p2p.shutdown())
            child = getattr(self._p2p, "_child", None)
            if child is not None and child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await stage("waiting for p2pd to die", child.wait())
        # hivemind leaves background tasks (traversals, cache refresh) pending; end them and ours here.
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _on_loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """A peer hanging up mid-stream is an expected event: counted and logged at debug, never a traceback."""
        exc = context.get("exception")
        if isinstance(exc, ConnectionError | asyncio.IncompleteReadError | asyncio.CancelledError):
            self._stats["peer_hangups"] += 1
            logger.debug("a peer hung up: %s", context.get("message", ""), exc_info=exc)
            return
        loop.default_exception_handler(context)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----- rollouts, by recency --------------------------------------------------------------

    def publish_rollouts(self, body: bytes, *, version: int, born: float | None = None) -> None:
        """Offer `body` (a sealed rollout batch from policy `version`) and announce it in the current bucket's index.

        Raises ValueError if the body is larger than max_body_bytes, GossipError if the DHT store
        does not finish within request_timeout.
        """
        self._require_started()
        body = self._check_size(body)
        wire = self.private.seal_body(body, context=self._rollout_context) if self.private is not None else body
        born = time.time() if born is None else born
        item = AnnouncedBody(self.identity.peer_id, hashlib.sha256(wire).digest(), len(wire), born, version)
        self._call(self._apublish_rollouts(item, wire), self.request_timeout * 3 + _GRACE_S)

    async def _apublish_rollouts(self, item: AnnouncedBody, wire: bytes) -> None:
        self.bodies.keep(item.sha256, wire)
        self.fetcher.mark_done((item.sha256, item.author, item.size))
        self._remember_announced(item)
        key = await self._placed_key(time.time())
        self._hold_rollouts(key, item, first=True)
        await asyncio.wait_for(self.records.store(key), self.request_timeout)
        self._stats["published"] += 1

    def sample_rollouts(
        self, *, k: int, max_age_s: float, timeout: float, version_ok: Callable[[int], bool] | None = None
    ) -> list[Fetched]:
        """Fetch up to `k` fresh batches we have not fetched before, chosen from the index (see the module docstring).

        At most `swarm.max_batches_per_peer` per author; only batches younger than `max_age_s`
        whose policy version `version_ok` accepts. Returns what arrived within `timeout`.
        """
        self._require_started()
        return self._call(self._asample(k, max_age_s, timeout, version_ok), timeout + _GRACE_S)

    async def _asample(self, k: int, max_age_s: float, timeout: float, version_ok: Callable[[int], bool] | None) -> list[Fetched]:
        deadline = time.monotonic() + timeout
        now = time.time()
        bucket = bucket_of(now, self.config.index_bucket_s)
        candidates: dict[tuple[bytes, str], Candidate] = {}
        self._add_candidates(candidates, await self._walk(bucket, deadline))
        if len(candidates) < 2 * k:
            # A thin bucket (a small swarm, or early in a bucket while holders still move into it at their
            # placement_delay) is topped up from the previous one, where their newest batches are until then.
            self._add_candidates(candidates, await self._walk(bucket - 1, deadline))
        # Only what some holder can serve us (`Fetcher.fetchable`).
        natted = {h.peer for c in candidates.values() for h in c.holders if h.behind_nat}
        direct = await self.fetcher.directly_connected(h for c in candidates.values() for h in c.holders)
        fetchable = self.fetcher.fetchable(list(candidates.values()), direct)
        peers = self.peers
        chosen = choose_claims(
            fetchable, k=k, per_author=self.config.max_batches_per_peer, now=now, max_age_s=max_age_s,
            trust=(lambda author: trust_from_score(peers.score(author))) if peers is not None else (lambda _author: 0.5),
            explore=_EXPLORE, rng=self._rng, version_ok=version_ok,
        )
        self._stats["sample_candidates"] += len(candidates)
        self._stats["sample_chosen"] += len(chosen)
        if not chosen:
            return []
        # A NATed author's batch is relayed urgently (`_relay_rollouts`), whichever holder we got it from.
        results = await asyncio.gather(*(self._fetch_rollouts(c, deadline, urgent=c.item.author in natted) for c in chosen))
        return [f for f in results if f is not None]

    def _add_candidates(self, candidates: dict[tuple[bytes, str], Candidate], walk: list[tuple[int, Holder, tuple[AnnouncedBody, ...]]]) -> None:
        """Add the claims of one walk's records that we could fetch to `candidates`, with their holders and weights."""
        for level, holder, items in walk:
            for item in items:
                if item.author == self.identity.peer_id or not self.fetcher.wanted((item.sha256, item.author, item.size)):
                    continue
                if self.peers is not None and self.peers.graylisted(item.author):
                    self._stats["graylisted_skipped"] += 1  # a graylisted author's batch, relayed by an honest holder
                    continue
                # Keyed by (bytes, author): a holder that claims someone else's bytes under another author
                # makes a candidate of its own and cannot shadow the true claim.
                candidate = candidates.setdefault((item.sha256, item.author), Candidate(item))
                if candidate.item != item:  # the same batch with other metadata: keep the first claim, skip the rest
                    continue
                candidate.holders.append(holder)
                candidate.weight = max(candidate.weight, level_weight(level))

    async def _walk(self, bucket: int, deadline: float) -> list[tuple[int, Holder, tuple[AnnouncedBody, ...]]]:
        """Records along one random path of `bucket`'s index tree: (level, holder, items) each."""
        found = []
        for level, key in descend(self.swarm, bucket, self._rng):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            records, total = await self.records.read(key, min(remaining, self.request_timeout), fresh_within=self.config.index_bucket_s)
            self._stats["index_keys_read"] += 1
            for holder, announce in records:
                if self.peers is not None and self.peers.graylisted(holder.peer):
                    self._stats["graylisted_skipped"] += 1
                    continue
                found.append((level, holder, announce.items))
            if not go_deeper(total, self.config.index_key_records, self._rng):
                break
        return found

    async def _fetch_rollouts(self, candidate: Candidate, deadline: float, *, urgent: bool) -> Fetched | None:
        """Fetch a chosen candidate from one of its holders (all usable: `Fetcher.fetchable` kept only those), then relay it."""
        claim = candidate.claim
        holders = list(candidate.holders)
        self._rng.shuffle(holders)  # any holder will do: relays spread the author's upload
        got = await self.fetcher.fetch(claim, holders, deadline, context=self._rollout_context)
        if got is None:
            return None
        holder, wire, body = got
        if self._signed_by_author(body, candidate.item.author):
            self.bodies.keep(candidate.item.sha256, wire)
            self._remember_announced(candidate.item)
            self._spawn(self._relay_rollouts(candidate.item, urgent=urgent))
        return Fetched(candidate.item.author, body, holder=holder.peer, sha256=candidate.item.sha256,
                       born=candidate.item.born, version=candidate.item.version)

    async def _relay_rollouts(self, item: AnnouncedBody, *, urgent: bool) -> None:
        """Serve a fetched batch too: add it to our record in the current bucket (see `IndexRecords.hold`), and store it.

        In place of an older relayed batch (the record is full) it is stored at once only when `urgent`: its author
        announces relay circuits, so NATed readers get it only from the records of those who relay it. Otherwise our
        next publish takes it: a store per relayed batch would cost a fast holder one more store per step, for
        batches their authors announce themselves.
        """
        try:
            key = await self._placed_key(time.time())
            full = len(self.records.held(key)) >= MAX_ITEMS
            changed = self._hold_rollouts(key, item)
            if (changed and (urgent or not full)) or not self.records.stored(key):  # or a placement to store
                await self._restore(key)
        except Exception as exc:  # noqa: BLE001 - relaying is best effort
            logger.debug("relaying %s failed: %s", item.sha256.hex()[:12], exc)

    async def _placed_key(self, now: float) -> str:
        """The key our record lives under at `now`: in its bucket, the first on our path holding fewer than
        index_key_records others; before our `placement_delay` into the bucket, our key of the previous one."""
        bucket_s = self.config.index_bucket_s
        bucket = bucket_of(now, bucket_s)
        key = self._placed.get(bucket)
        if key is not None:
            return key
        previous = self._placed.get(bucket - 1)
        if previous is not None and now < bucket * bucket_s + placement_delay(self.identity.peer_id, bucket, bucket_s):
            return previous
        cap = self.config.index_key_records
        path = placement_path(self.swarm, bucket, self.identity.peer_id)
        for key in path:
            # A count, not the newest copy: the first replica with a record of this bucket answers (2-3 RPCs, not 20).
            _, total = await self.records.read(key, self.request_timeout, fresh_within=self.config.index_bucket_s)
            if total < cap:
                break
        self._placed[bucket] = key
        while len(self._placed) > 4:
            self._placed.popitem(last=False)
        if previous is not None:  # what we announced in the previous bucket comes along
            for item in self._fresh_announced(now):
                self._hold_rollouts(key, item)
        return key

    async def _keep_announcing(self) -> None:
        """Keep the rollout bodies we serve that are younger than announce_seconds in the current bucket's record.

        A slow author's batch stays findable by readers, who look at the last two buckets only.
        """
        bucket_s = self.config.index_bucket_s
        while True:
            await asyncio.sleep(min(bucket_s / 4, 10.0) * (0.5 + self._rng.random()))
            now = time.time()
            try:
                await self._reannounce(now)
            except Exception as exc:  # noqa: BLE001 - the next tick tries again
                logger.debug("re-announcing in bucket %d failed: %s", bucket_of(now, bucket_s), exc)

    async def _reannounce(self, now: float) -> bool:
        """One tick of `_keep_announcing`: store our record when it moved to a new bucket (or a body is missing from it).

        A record placed in a new key is stored at once: the others count a key's records when they place theirs,
        and one placed but not stored let them overfill the key (at 64 light nodes half the placements read a
        count short of the records already placed there: keys of cap 4 held 5-6 on average).
        """
        fresh = self._fresh_announced(now)
        if not fresh:
            return False
        key = await self._placed_key(now)
        added = [self._hold_rollouts(key, item) for item in fresh]
        if not any(added) and self.records.stored(key):
            return False
        await asyncio.wait_for(self.records.store(key), self.request_timeout)
        self._stats["reannounced"] += 1
        return True

    def _fresh_announced(self, now: float) -> list[AnnouncedBody]:
        """The bodies we serve that are younger than announce_seconds, our own first, newest first (a full record keeps those)."""
        fresh = [item for item in self._announced.values() if now - item.born <= self.config.announce_seconds]
        return sorted(fresh, key=lambda i: (i.author != self.identity.peer_id, -i.born))

    def _hold_rollouts(self, key: str, item: AnnouncedBody, *, first: bool = False) -> bool:
        """Add a rollout batch to our record under `key`: at most `_OWN_ANNOUNCED` of its items our own (see `IndexRecords.hold`)."""
        return self.records.hold(key, item, first=first, own_limit=_OWN_ANNOUNCED)

    def _remember_announced(self, item: AnnouncedBody) -> None:
        self._announced[item.sha256] = item
        while len(self._announced) > 256 or (self._announced and next(iter(self._announced)) not in self.bodies):
            self._announced.popitem(last=False)

    @property
    def _rollout_context(self) -> str:
        """A private swarm's AEAD context of rollout bodies (they move between index keys, so not a key)."""
        return f"hivespec/{self.swarm}/rollouts"

    # ----- slots: the weight topics ----------------------------------------------------------

    def publish(self, slot: int, body: bytes, *, topic: str) -> None:
        """Offer `body` (a sealed envelope) for `slot` of `topic` and announce it under that slot's key.

        Topics are `protocol.keys.TOPIC_KEYS`: "delta" and "snapshot" (slot = `delta_slot`) and
        "head" (slot 0). Raises ValueError on an unknown topic or a body over max_body_bytes,
        GossipError if the DHT store does not finish within request_timeout.
        """
        self._require_started()
        key = topic_key(self.swarm, topic, slot)  # ValueError on an unknown topic or a negative slot
        body = self._check_size(body)
        wire = self.private.seal_body(body, context=key) if self.private is not None else body
        item = AnnouncedBody(self.identity.peer_id, hashlib.sha256(wire).digest(), len(wire), time.time(), -1)
        self._call(self._apublish_slot(key, item, wire), self.request_timeout + _GRACE_S)

    async def _apublish_slot(self, key: str, item: AnnouncedBody, wire: bytes) -> None:
        self.bodies.keep(item.sha256, wire)
        self.fetcher.mark_done((item.sha256, item.author, item.size))
        self.records.hold(key, item, first=True)
        await asyncio.wait_for(self.records.store(key), self.request_timeout)
        self._stats["published"] += 1

    def fetch_slot(self, slot: int, *, topic: str, timeout: float) -> list[Fetched]:
        """Fetch the bodies announced for `slot` of `topic` that we have not fetched before.

        Bad records and bodies are skipped, counted in stats() and scored against their holder;
        holders that cannot be reached now are retried on the next call. Returns what arrived
        within `timeout`.
        """
        self._require_started()
        key = topic_key(self.swarm, topic, slot)
        return self._call(self._afetch_slot(key, timeout), timeout + _GRACE_S)

    def wait_for_slot(self, slot: int, *, topic: str, peers: int, timeout: float) -> list[Fetched]:
        """Poll `fetch_slot` until bodies from `peers` distinct other authors arrived for `slot`.

        Counts authors fetched by earlier calls too; returns the bodies fetched by this call,
        possibly fewer than asked for when `timeout` runs out. Polls back off from 0.1 s to 1 s.
        """
        key = topic_key(self.swarm, topic, slot)
        deadline = time.monotonic() + timeout
        fetched: list[Fetched] = []
        interval = _POLL_MIN_S
        while True:
            remaining = deadline - time.monotonic()
            fetched += self.fetch_slot(slot, topic=topic, timeout=max(0.1, min(remaining, self.request_timeout)))
            if len(self._authors_by_slot.get(key, ())) >= peers:
                return fetched
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stopped.wait(min(interval, remaining)):
                return fetched
            interval = min(2 * interval, _POLL_MAX_S)

    async def _afetch_slot(self, key: str, timeout: float) -> list[Fetched]:
        deadline = time.monotonic() + timeout
        records, _ = await self.records.read(key, timeout)
        claims: dict[tuple[bytes, str, int], tuple[AnnouncedBody, list[Holder]]] = {}
        for holder, announce in records:
            if self.peers is not None and self.peers.graylisted(holder.peer):
                self._stats["graylisted_skipped"] += 1
                continue
            for item in announce.items:
                claim = (item.sha256, item.author, item.size)
                if item.author == self.identity.peer_id or not self.fetcher.wanted(claim):
                    continue
                if self.peers is not None and item.author != holder.peer and self.peers.graylisted(item.author):
                    self._stats["graylisted_skipped"] += 1  # a graylisted author's bodies, relayed by someone else
                    continue
                _, holders = claims.setdefault(claim, (item, []))
                # The author's own record first: it is the one with the least reason to lie.
                holders.insert(0 if holder.peer == item.author else len(holders), holder)
        if not claims:
            return []
        direct = await self.fetcher.directly_connected(h for _, hs in claims.values() for h in hs)

        async def one(claim: tuple[bytes, str, int], item: AnnouncedBody, holders: list[Holder]) -> Fetched | None:
            got = await self.fetcher.fetch(claim, self.fetcher.usable_holders(claim, holders, direct), deadline, context=key)
            if got is None:
                return None
            holder, wire, body = got
            if self._signed_by_author(body, item.author) and self.records.hold(key, item):
                self.bodies.keep(item.sha256, wire)
                self._spawn(self._restore(key))
            return Fetched(item.author, body, holder=holder.peer, sha256=item.sha256, born=item.born, version=item.version)

        results = await asyncio.gather(*(one(claim, item, holders) for claim, (item, holders) in claims.items()))
        fetched = [f for f in results if f is not None]
        if fetched:
            self._authors_by_slot.setdefault(key, set()).update(f.author_peer_id for f in fetched)
            self._authors_by_slot.move_to_end(key)
            while len(self._authors_by_slot) > 1024:
                self._authors_by_slot.popitem(last=False)
        return fetched

    # ----- helpers ---------------------------------------------------------------------------

    def _check_size(self, body: bytes) -> bytes:
        body = bytes(body)
        if len(body) > self.max_body_bytes:
            raise ValueError(
                f"body is {len(body)} bytes, over max_body_bytes={self.max_body_bytes}; split the batch over several publishes"
            )
        return body

    def _signed_by_author(self, body: bytes, author: str) -> bool:
        """Whether we may vouch for a body enough to serve it: its envelope is signed by its announced author."""
        if self.peers is not None and self.peers.graylisted(author):
            return False
        verdict, envelope = open_envelope(body, limits=self._relay_limits)
        return verdict.ok and envelope is not None and envelope.peer_id == author

    async def _restore(self, key: str) -> None:
        """Re-store our record under `key` after relayed bodies joined it (one store for a burst).

        A body that joins while the store is under way was not in what it sent: one more store follows.
        """
        if key in self._restoring:
            return  # the pending store picks up this body, or the one after it does
        self._restoring.add(key)
        try:
            await asyncio.sleep(0.05)
            while True:
                await asyncio.wait_for(self.records.store(key), self.request_timeout)
                self._stats["relay_records"] += 1
                if not self.records.unsent(key):
                    break
        except Exception as exc:  # noqa: BLE001 - relaying is best effort
            logger.debug("re-storing our record under %s failed: %s", key, exc)
        finally:
            self._restoring.discard(key)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
