"""Gossip over hivemind: owner-signed index records in the DHT, bodies over P2P streams from any holder.

`Gossip` is the thread-safe front: it runs hivemind (one `P2P`, so one p2pd child process, and a
`DHTNode`) in its own asyncio loop on a daemon thread, starts, bootstraps, reports and shuts down,
and carries each public call onto the loop, where two ways to find bodies share one machinery
(index records, `records.py`; fetching, `fetching.py`; serving, `bodies.py`):
- **Rollouts, by recency** (`publish_rollouts`, `sample_rollouts`; `rollouts.py`): nodes share no
  round numbers; a batch is announced in the current time bucket's index and a step samples at
  most `max_foreign_batches` fresh ones by peer score with exploration.
- **Slots** (`publish`, `fetch_slot`, `wait_for_slot`; `slots.py`): one key per (topic, slot) for
  the weight topics ("delta", "snapshot", "head"), which a leader's followers read in order.

Either way a record lists the bodies its holder serves; a reader pulls a body over the
"hivespec.rollouts.v1" stream from one of its holders and checks size and sha256. A fetched body
whose envelope is signed by its announced author is kept and added to the reader's own record:
any holder serves it, so a batch survives its author and the author's upload stays bounded as the
readers spread it.

Trust: `dht_guard.AnnounceValidator` runs inside hivemind on every stored and found record
(owner signature, key and expiration bound, TTL cap, size cap), `dht_guard.harden` limits every
DHT request before hivemind decodes it and caps the records one key holds. `PeerScores`
(optional) graylists holders that serve bad bytes, rate-limits what we take from each and weighs
whom a step samples; intake scores the content. In a private swarm bodies and records are
AEAD-encrypted and only allowlisted authors are accepted.

`DHTNode` is used directly: the `hivemind.DHT` wrapper deadlocks on values over ~64 KiB
(upstream PR #660). Public methods are called from other threads and block with a timeout;
gossip state is touched on the loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Self, TypeVar

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from hivespec.node.swarm.bodies import BodyStore
from hivespec.node.swarm.bootstrap import Joiner, PeerCache
from hivespec.node.swarm.clock import ClockCheck
from hivespec.node.swarm.dht_guard import AnnounceValidator, harden
from hivespec.node.swarm.fetching import Fetched, Fetcher
from hivespec.node.swarm.machinery import Machinery
from hivespec.node.swarm.nat import REACH_STREAM, ReachService, relay_candidates
from hivespec.node.swarm.p2pd import start_p2pd
from hivespec.node.swarm.peers import PeerScores
from hivespec.node.swarm.ports import PortClaim, wait_for_port
from hivespec.node.swarm.records import IndexRecords
from hivespec.node.swarm.rollouts import RolloutGossip
from hivespec.node.swarm.slots import SlotGossip
from hivespec.node.swarm.transfer import STREAM_NAME
from hivespec.protocol.announce import SWARM_PROTOCOL
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
_PORT_GRACE_S = 3.0  # how long a taken fixed swarm.port is asked again before start() moves off it (node/swarm/ports.py)

T = TypeVar("T")


async def _cancel_all(tasks: set[asyncio.Task], timeout: float) -> set[asyncio.Task]:
    """Cancel `tasks` and wait for them up to `timeout` s; those still unwinding. Exceptions are retrieved, never logged."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return set()
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved: a peer's late request failing as we stop is not news
    return pending


def _task_name(task: asyncio.Task) -> str:
    """A task's name and its coroutine's, for a log line about a task that would not stop."""
    coro = task.get_coro()
    return f"{task.get_name()} ({getattr(coro, '__qualname__', coro)})"


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
        clock: Callable[[], float] = time.time,
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
        # The wall clock this node measures its peers' clocks with and answers their pings with (a bench shifts it).
        self.clock_check = ClockCheck(config.index_bucket_s, clock=clock)
        self._stats: Counter[str] = Counter()
        self.records = IndexRecords(identity, validator=self.validator, private=private, record_ttl=config.record_ttl, stats=self._stats)
        self.bodies = BodyStore(
            keep_seconds=config.keep_seconds, keep_bytes=config.keep_bytes, request_timeout=config.request_timeout, stats=self._stats
        )
        self.fetcher = Fetcher(
            private=private, peers=peers, request_timeout=config.request_timeout, stats=self._stats, record_ttl=config.record_ttl,
            # A holder relays a body only once it checked the author's signature on it, up to the largest body we serve.
            limits=dataclasses.replace(limits, max_envelope_bytes=max_body_bytes),
        )
        shared = Machinery(identity=identity, records=self.records, bodies=self.bodies, fetcher=self.fetcher, peers=peers,
                           private=private, stats=self._stats, request_timeout=config.request_timeout, spawn=self._spawn)
        # The two ways to find bodies: each is the shared machinery's objects (not copies) plus its own state.
        self.rollouts = RolloutGossip(**vars(shared), config=config, swarm=self.swarm)
        self.slots = SlotGossip(**vars(shared))

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._p2p: P2P | None = None
        self._dht: DHTNode | None = None
        self._joiner: Joiner | None = None
        self._maddrs: list[str] = []
        self._state_lock = threading.Lock()  # guards start/shutdown transitions
        self._stopped = threading.Event()
        self._tasks: set[asyncio.Task] = set()  # our background tasks on the loop

    # ----- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn p2pd, start the DHT and bootstrap; raises GossipError if that fails within `start_timeout`.

        With bootstrap peers that do not answer, the node starts solo (unless `require_peers`).
        """
        config = self.config
        # Held from the port's question until p2pd listens: another node of this machine starting at the same moment
        # asks after us, and finds the port taken (node/swarm/ports.py).
        with PortClaim(config.port, timeout=_PORT_GRACE_S + config.start_timeout) as claim:
            self._start(claim)

    def _start(self, claim: PortClaim) -> None:
        config = self.config
        with self._state_lock:
            if self._thread is not None or self._stopped.is_set():
                raise GossipError("Gossip.start() was already called; create a new Gossip to restart")
            port = self._free_port_or_any()  # may raise GossipError: nothing is started yet
            self._loop = asyncio.new_event_loop()
            self._loop.set_exception_handler(self._on_loop_exception)
            self._thread = threading.Thread(target=self._loop.run_forever, name="hivespec-gossip", daemon=True)
            self._thread.start()
        try:
            self._call(self._astart(port, claim), config.start_timeout + config.bootstrap_timeout)
        except BaseException as exc:
            self.shutdown()
            if not isinstance(exc, Exception):  # KeyboardInterrupt and friends pass through as they are
                raise
            where = f"/ip4/{config.host}/tcp/{port}"
            raise GossipError(
                f"could not start hivemind on {where} (start_timeout={config.start_timeout:g} s, "
                f"initial peers={[m for _, m in self.bootstrap]}): {type(exc).__name__}: {exc}. "
                "Check that the port is free and that the initial peers are running and reachable."
            ) from exc
        status = self.status()
        logger.info("gossip up: swarm %r, peer %s, maddrs %s, %s", self.swarm, self.identity.peer_id, self._maddrs,
                    "solo" if status["solo"] else f"joined via {status['joined_via']}")

    def _free_port_or_any(self) -> int:
        """The port p2pd listens on: `swarm.port`, unless another process listens there (asked for `_PORT_GRACE_S`:
        a node restarted after a crash finds its old p2pd for a moment). p2pd would share that port without a word
        (SO_REUSEPORT) and the kernel would hand each incoming connection to either process: a node and a bootstrap
        peer of the `public` preset on one machine both took 31337, and the node's dial to the bootstrap peer reached
        itself. So such a node listens on any free port instead, and says so; where `swarm.announce_maddrs` tells peers
        the address, moving would strand them, and it refuses to start (GossipError)."""
        config = self.config
        if not config.port or not (taken := wait_for_port(config.host, config.port, _PORT_GRACE_S)):
            return config.port
        owner = (f"port {config.port} on {config.host} is taken ({taken}): another process listens on it (another hivespec "
                 f"node or bootstrap peer on this machine? `ss -ltnp | grep :{config.port}`)")
        if config.announce_maddrs:
            raise GossipError(f"{owner}, and swarm.announce_maddrs tells peers to reach this node there; stop that "
                              "process, or set swarm.port and swarm.announce_maddrs to another port")
        logger.warning("%s; listening on any free port instead (set swarm.port to choose one)", owner)
        return 0

    async def _astart(self, port: int, claim: PortClaim) -> None:
        config = self.config
        # No initial peers for p2pd itself: an unreachable one would fail its start; Joiner dials them.
        self._p2p = await start_p2pd(
            host_maddrs=[f"/ip4/{config.host}/tcp/{port}"],
            announce_maddrs=config.announce_maddrs,
            nat_port_map=config.nat_port_map,
            use_relay=config.use_relay,
            relays=self.relays,
            identity_path=self.p2p_identity_path,
            startup_timeout=config.start_timeout,
        )
        claim.release()  # p2pd listens: the next node's question sees the port taken
        await self._p2p.add_binary_stream_handler(STREAM_NAME, self.bodies.serve)
        await self._p2p.add_binary_stream_handler(REACH_STREAM, ReachService(self._p2p, clock=self.clock_check.clock).handle)
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
        self._joiner = Joiner(self._p2p, self._dht, self.bootstrap, self.peer_cache, rpc_timeout=rpc_timeout, relays=self.relays,
                              clock_check=self.clock_check)
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
        self._spawn(self.rollouts.keep_announcing())

    @property
    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with /p2p/<id>) other nodes pass as `initial_peers` to join through us."""
        self._require_started()
        return list(self._maddrs)

    def status(self) -> dict[str, Any]:
        """Swarm-facing state for the status snapshot: solo, reachability (+ reachability_detail), known_peers, joined_via, ...

        reachability is measured by peers (node/swarm/nat.py): reachable / relayed / unreachable / unknown.
        """
        joiner, known = self._joiner, self.known_peers()
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
            # swarm protocol -> peers seen announcing under it (another hivespec version: nothing is shared with them)
            "other_protocols": self.validator.other_protocol_peers(),
            # our clock against our peers' (node/swarm/clock.py): the median offset (positive: ours is behind), the
            # peers measured, and the warning in force ("" while it agrees)
            "clock_offset_s": None if (offset := self.clock_check.offset_s) is None else round(offset, 2),
            "clock_peers": self.clock_check.peers,
            "clock_warning": self.clock_check.warning,
        }

    def check_clock(self, timeout: float = 20.0) -> None:
        """Ask peers for their time now and judge our clock (`status()`'s clock_*); the node does this itself after each
        (re)join, one peer a re-bootstrap once three answered (node/swarm/clock.py)."""
        self._require_started()
        self._call(self._joiner.check_clock(), timeout)

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
        # Peers seen announcing under another swarm protocol (another hivespec version: nothing is shared with them).
        other = self.validator.other_protocol_peers()
        snapshot["peers_older_protocol"] = sum(n for protocol, n in other.items() if protocol < SWARM_PROTOCOL)
        snapshot["peers_newer_protocol"] = sum(n for protocol, n in other.items() if protocol > SWARM_PROTOCOL)
        snapshot["known_peers"] = self.known_peers()
        return snapshot

    def known_peers(self) -> int:
        """Peers in this node's DHT routing table (0 before it starts, or alone)."""
        dht = self._dht
        return len(dht.protocol.routing_table.uid_to_peer_id) if dht is not None else 0

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
        # p2pd ignored SIGTERM, or the loop is stuck and never sent it: do not leak it (a signal, safe from this thread);
        # a supervisor's restart would otherwise start beside a live p2pd holding our peer id and port.
        child = getattr(self._p2p, "_child", None)
        if child is not None and child.returncode is None:
            try:
                child.kill()
            except ProcessLookupError:
                pass
        if thread.is_alive():
            logger.warning("gossip loop thread did not stop within %g s; its p2pd is killed", self.request_timeout)
            return
        # Tasks started while we shut down (a peer's request arriving late), and any still unwinding, end here, not as
        # "destroyed but pending"; one that ignores a second cancel is left to the garbage collector.
        loop.run_until_complete(_cancel_all(asyncio.all_tasks(loop), _GRACE_S))
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
        # hivemind leaves background tasks (traversals, cache refresh) pending; end them and ours here. A task may
        # unwind for long once cancelled (an await in its cleanup): it gets what is left of the deadline, is named,
        # and is cancelled again by `shutdown` with the loop's other leftovers.
        pending = await _cancel_all(asyncio.all_tasks() - {asyncio.current_task()}, max(deadline - time.monotonic(), 1.0))
        if pending:
            logger.warning("gossip shutdown: %d task(s) still unwinding at the deadline: %s", len(pending),
                           ", ".join(sorted(_task_name(t) for t in pending)))

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

    # ----- rollouts, by recency (rollouts.py) ------------------------------------------------

    def publish_rollouts(self, body: bytes, *, version: int, informative: int = -1, born: float | None = None) -> None:
        """Offer `body` (a sealed rollout batch from policy `version`) and announce it in the current bucket's index, with
        how many of its samples carry a gradient (`protocol.advantages.informative_samples`; -1: not said).

        Raises ValueError if the body is larger than max_body_bytes, GossipError if the DHT store
        does not finish within request_timeout.
        """
        self._require_started()
        rollouts = self.rollouts
        item, wire = rollouts.own_body(self._check_size(body), context=rollouts.context, born=time.time() if born is None else born,
                                       version=version, informative=informative)
        self._call(self.rollouts.publish(item, wire), self.request_timeout * 3 + _GRACE_S)

    def sample_rollouts(
        self, *, k: int, max_age_s: float, timeout: float, version_ok: Callable[[int], bool] | None = None, fill: bool = False,
        informative_only: bool = False,
    ) -> list[Fetched]:
        """Fetch up to `k` fresh batches we have not fetched before, chosen from the index (`RolloutGossip.sample`).

        At most `swarm.max_batches_per_peer` per author (with `fill`, authors' further batches take the slots that
        leaves empty); only batches younger than `max_age_s` whose policy version `version_ok` accepts, and with
        `informative_only` none whose record says no sample of it carries a gradient. Returns what arrived within `timeout`.
        """
        self._require_started()
        return self._call(self.rollouts.sample(k, max_age_s, timeout, version_ok, fill=fill, informative_only=informative_only),
                          timeout + _GRACE_S)

    # ----- slots: the weight topics (slots.py) -----------------------------------------------

    def publish(self, slot: int, body: bytes, *, topic: str) -> None:
        """Offer `body` (a sealed envelope) for `slot` of `topic` and announce it under that slot's key.

        Topics are `protocol.keys.TOPIC_KEYS`: "delta" and "snapshot" (slot = `delta_slot`) and
        "head" (slot 0). Raises ValueError on an unknown topic or a body over max_body_bytes,
        GossipError if the DHT store does not finish within request_timeout.
        """
        self._require_started()
        key = topic_key(self.swarm, topic, slot)  # ValueError on an unknown topic or a negative slot
        item, wire = self.slots.own_body(self._check_size(body), context=key, born=time.time(), version=-1)
        self._call(self.slots.publish(key, item, wire), self.request_timeout + _GRACE_S)

    def fetch_slot(self, slot: int, *, topic: str, timeout: float) -> list[Fetched]:
        """Fetch the bodies announced for `slot` of `topic` that we have not fetched before.

        Bad records and bodies are skipped, counted in stats() and scored against their holder;
        holders that cannot be reached now are retried on the next call. Returns what arrived
        within `timeout`.
        """
        self._require_started()
        return self._call(self.slots.fetch(topic_key(self.swarm, topic, slot), timeout), timeout + _GRACE_S)

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
            if self.slots.authors(key) >= peers:
                return fetched
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stopped.wait(min(interval, remaining)):
                return fetched
            interval = min(2 * interval, _POLL_MAX_S)

    # ----- helpers ---------------------------------------------------------------------------

    def _check_size(self, body: bytes) -> bytes:
        body = bytes(body)
        if len(body) > self.max_body_bytes:
            raise ValueError(
                f"body is {len(body)} bytes, over max_body_bytes={self.max_body_bytes}; split the batch over several publishes"
            )
        return body

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
