"""Joining a swarm: where bootstrap peers come from, how we dial them, solo mode, and who may run as us.

Sources, tried in this order and deduplicated: the config's `initial_peers`, the
``HIVESPEC_INITIAL_PEERS`` environment variable (whitespace or comma separated), a peers file
(one multiaddr per line, ``#`` comments), and an on-disk cache of peers we met recently
(`PeerCache`, in the node's home). A candidate must be a multiaddr ending in ``/p2p/<peer id>``.

`Joiner` dials candidates from gossip's event loop: connect (p2pd), DHT ping, then a lookup of
our own id to fill the routing table, each under a timeout. At start it retries with
exponential backoff until `bootstrap_timeout`; if nobody answered, the node runs **solo**
(logged as a warning, visible in `Gossip.status()`) and keeps retrying in the background. Once
joined it re-bootstraps every `rebootstrap_interval` seconds, which merges a DHT that started
split (hivemind#624). A routine re-bootstrap (joined, the peer we joined through still
connected, the last full join under `REFRESH_S` ago) pings the configured bootstrap peers and the
peer we joined through; a full join (the first, out of solo, after losing that peer, or every
`REFRESH_S`) pings every candidate, the peer cache's too, and looks up our own id. That lookup
crawls hivemind's beam of 20 peers, each reply listing 20 neighbours: done at every re-bootstrap
of the public preset (then every 15 s), it was 80 % of a node's idle traffic at 64 light nodes (7.9
kB/s per node, against 1.6 routine; bench/swarm_scale.py). A restarted peer is not waited for by
the interval: losing the peer we joined through is noticed within `LOST_CHECK_S` and retried with
backoff to at most `RETRY_MAX_S`, so every bootstrap peer answers each joined node's ping once a
`rebootstrap_interval` (60 s), not more often.

Reachability is measured, not guessed, after every (re)join: the peer that answered opens a fresh
connection to us, or another peer reaches us through our relay (node/swarm/nat.py; hivemind's own
dial-back reuses our connection and passes behind any NAT). So is our clock against a few peers'
(node/swarm/clock.py): the index finds batches by wall-clock time.

`HomeLock` holds an exclusive lock on the node's home, so a second node with the same identity
file refuses to start instead of fighting the first over its peer id.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import os
import random
import re
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from hivespec.node.swarm.clock import ClockCheck, ask_time
from hivespec.node.swarm.nat import Reach, check_reachability, listen_ports, to_transport

logger = logging.getLogger(__name__)

PEERS_ENV = "HIVESPEC_INITIAL_PEERS"
CACHE_FILE = "peers.cache.json"
P2P_KEY_FILE = "p2p.key"  # libp2p private key (hivemind writes it on first start): a stable peer id across restarts
LOCK_FILE = "node.lock"
MAX_CACHED_PEERS = 64
LOST_CHECK_S = 2.0  # how often keep_joined checks that p2pd still holds a connection to the peer we joined through
REMEASURE_S = 300.0  # a settled reachability is re-measured at the first re-bootstrap after this long
REFRESH_S = 300.0  # a joined node's re-bootstrap is a full join again (every candidate, own-id lookup) after this long
RETRY_MAX_S = 15.0  # a solo or lost node's retries back off to at most this (or rebootstrap_interval, if shorter)
_MADDR = re.compile(r"/(ip4|ip6|dns|dns4|dns6)/[^/\s]+/(tcp|udp)/\d{1,5}(/[^\s]*)?/p2p/[1-9A-HJ-NP-Za-km-z]{32,64}")


class IdentityInUse(RuntimeError):
    """Another running node holds this home (and so this identity)."""


class HomeLock:
    """An exclusive, non-blocking `flock` on ``<home>/node.lock``, released on close or process exit."""

    def __init__(self, home: Path) -> None:
        self.path = Path(home) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise IdentityInUse(
                f"another hivespec node (pid {holder}) is already running with the identity in {home}; "
                "two nodes with one identity would share a peer id. Stop that node, or give this one its "
                "own --home (a new identity is created there)"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def is_bootstrap_maddr(text: str) -> bool:
    """Whether `text` is a dialable multiaddr with a ``/p2p/<peer id>`` part."""
    return maddr_problem(text) is None


def maddr_problem(text: str) -> str | None:
    """What keeps `text` from being a dialable multiaddr with a ``/p2p/<peer id>`` part; None where nothing does.

    The form alone is not enough: ``/ip4/boot.example.org/...`` has it and fails to parse, which had stopped a node's
    start with every other bootstrap peer fine.
    """
    text = text.strip() if isinstance(text, str) else ""
    if _MADDR.fullmatch(text) is None:
        return "not of the form"
    port = int(text.split("/")[4])
    if not 1 <= port <= 65535:
        return f"port {port}; a TCP port is 1..65535"
    try:
        Multiaddr(text).value_for_protocol("p2p")
    except ValueError as exc:  # multiaddr's ParseError: "Invalid MultiAddr '...' protocol <name>: <reason>"
        reason = str(exc).rsplit(": ", 1)[-1]
        if " protocol p2p: " in str(exc):
            return "the peer id after /p2p/ does not decode"
        host = re.fullmatch(r"base address '(.*)' is not IPv[46]", reason)
        named = host is not None and re.search("[g-z]", host[1], re.IGNORECASE)  # a letter past hex: a name, not an address
        return reason + ("; a host name goes under /dns4/ or /dns6/" if named else "")
    return None


def read_peers_file(path: Path) -> list[str]:
    """Multiaddrs from a peers file; raises ValueError naming the first line that is not one."""
    peers = []
    for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not is_bootstrap_maddr(line):
            raise ValueError(f"peers file {path} line {number}: {line[:120]!r} is not a multiaddr ending in /p2p/<peer id>")
        peers.append(line)
    return peers


@dataclass
class PeerCache:
    """Recently seen peers' multiaddrs in the node's home, newest first, at most MAX_CACHED_PEERS."""

    path: Path
    entries: dict[str, float] = field(default_factory=dict)  # maddr -> last seen (wall clock)

    @classmethod
    def load(cls, path: Path) -> PeerCache:
        """The cache at `path`; an unreadable or malformed file gives an empty cache (it is only a hint)."""
        cache = cls(Path(path))
        try:
            data = json.loads(cache.path.read_text())
        except (OSError, ValueError):
            return cache
        if isinstance(data, dict):
            cache.entries = {
                m: float(t) for m, t in data.items() if is_bootstrap_maddr(m) and isinstance(t, (int, float))
            }
        return cache

    def maddrs(self) -> list[str]:
        return sorted(self.entries, key=self.entries.get, reverse=True)

    def remember(self, maddrs: Sequence[str], now: float | None = None) -> None:
        """Mark `maddrs` as seen now and save (atomically); keeps the newest MAX_CACHED_PEERS."""
        now = time.time() if now is None else now
        for m in maddrs:
            if is_bootstrap_maddr(m):
                self.entries[m] = now
        self.entries = dict(sorted(self.entries.items(), key=lambda kv: kv[1], reverse=True)[:MAX_CACHED_PEERS])
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.debug("could not save the peer cache %s: %s", self.path, exc)


def bootstrap_candidates(
    initial_peers: Sequence[str],
    *,
    peers_file: Path | None = None,
    cache: PeerCache | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[tuple[str, str]]:
    """(source, multiaddr) for every configured bootstrap peer, in source order, without repeats.

    Raises ValueError on a malformed entry from config, env or the peers file (the cache is a hint
    and is filtered instead).
    """
    env = os.environ if environ is None else environ
    sources: list[tuple[str, list[str]]] = [("config", list(initial_peers))]
    if env.get(PEERS_ENV):
        sources.append(("env", [p for p in re.split(r"[\s,]+", env[PEERS_ENV]) if p]))
    if peers_file is not None:
        sources.append(("peers_file", read_peers_file(peers_file)))
    if cache is not None:
        sources.append(("cache", cache.maddrs()))
    seen, out = set(), []
    for source, maddrs in sources:
        for m in maddrs:
            m = m.strip()
            if source != "cache" and not is_bootstrap_maddr(m):
                raise ValueError(f"bootstrap peer {m[:120]!r} from {source} is not a multiaddr ending in /p2p/<peer id>")
            if m not in seen:
                seen.add(m)
                out.append((source, m))
    return out


async def dial(p2p: P2P, peer: PeerID, maddrs: Sequence[str], timeout: float) -> None:
    """Make p2pd connect to `peer` at `maddrs`, relay circuits included (P2P has no public connect(); hivemind uses _client so too)."""
    # p2pd's connect takes the peer id separately and transport addresses only.
    addrs = [to_transport(m) for m in maddrs]
    await asyncio.wait_for(p2p._client.connect(peer, addrs), timeout)


@dataclass
class Joiner:
    """Bootstraps a DHTNode from candidate multiaddrs; runs on gossip's event loop."""

    p2p: P2P
    dht: DHTNode
    candidates: list[tuple[str, str]]
    cache: PeerCache | None = None
    rpc_timeout: float = 3.0
    relays: list[str] = field(default_factory=list)  # bootstrap maddrs we hold relay slots on (node/swarm/nat.py)
    clock_check: ClockCheck | None = None  # our clock against peers', asked after each (re)join (node/swarm/clock.py)
    solo: bool = True
    joined_via: str = ""  # "<source> <maddr>" of the last peer that answered
    reachability: str = "unknown"
    reachability_detail: str = ""
    last_attempt: float = 0.0
    _measured_at: float = field(default=-1e9, repr=False)
    full_joins: int = 0  # joins that answered and looked up our own id
    attempts: Counter = field(default_factory=Counter)  # join attempts by kind: "full", "routine"
    pinged: Counter = field(default_factory=Counter)  # candidates those attempts pinged, by kind
    _full_at: float = field(default=-1e9, repr=False)
    _joined_peer: PeerID | None = field(default=None, repr=False)
    _joined_maddr: str = field(default="", repr=False)
    _lost: bool = field(default=False, repr=False)  # the peer we joined through dropped: rejoin with backoff

    async def join_once(self, *, routine: bool = False) -> bool:
        """Try the candidates once (concurrently); True if at least one answered a DHT ping.

        A full join tries every candidate and then looks up our own id (fills the routing table
        around us); a `routine` one pings the configured bootstrap peers and the peer we joined
        through, and looks nothing up.
        """
        self.last_attempt = time.time()
        own = {str(self.p2p.peer_id)}
        todo = [(s, m) for s, m in self.candidates if Multiaddr(m).value_for_protocol("p2p") not in own]
        if routine:
            todo = [(s, m) for s, m in todo if s != "cache" or m == self._joined_maddr]
        kind = "routine" if routine else "full"
        self.attempts[kind] += 1
        self.pinged[kind] += len(todo)
        if not todo:
            return False
        results = await asyncio.gather(*(self._try(s, m) for s, m in todo))
        answered = [r for r in results if r is not None]
        if not answered:
            return False
        self.solo, self._lost = False, False
        (source, maddr), self._joined_peer = answered[0][0], answered[0][1]
        self.joined_via, self._joined_maddr = f"{source} {maddr}", maddr
        if not routine:
            self.full_joins += 1
            self._full_at = time.monotonic()
            try:
                await asyncio.wait_for(self.dht.find_nearest_nodes([self.dht.node_id]), 3 * self.rpc_timeout)
            except TimeoutError:
                logger.debug("routing table refresh timed out after a successful bootstrap ping")
        if self.needs_measuring():
            self._record(await self._reachability(answered[0][1]))
        await self.check_clock()
        await self.remember_peers()
        return True

    def needs_measuring(self) -> bool:
        """Whether reachability needs measuring now: unsettled, or settled more than REMEASURE_S ago."""
        settled = self.reachability in ("reachable", "relayed")
        return not settled or time.monotonic() - self._measured_at > REMEASURE_S

    def _record(self, verdict: Reach) -> None:
        if verdict.state == "unknown" and self.reachability != "unknown":
            return  # a peer that could not answer says nothing about us
        if verdict.state != self.reachability:
            logger.info("reachability: %s (%s)", verdict.state, verdict.detail)
        self.reachability, self.reachability_detail = verdict.state, verdict.detail
        self._measured_at = time.monotonic()

    async def _try(self, source: str, maddr: str) -> tuple[tuple[str, str], PeerID] | None:
        try:
            peer = PeerID.from_base58(Multiaddr(maddr).value_for_protocol("p2p"))
            await dial(self.p2p, peer, [maddr], self.rpc_timeout)
            node_id = await asyncio.wait_for(self.dht.protocol.call_ping(peer), self.rpc_timeout)
        except Exception as exc:  # noqa: BLE001 - unreachable, refused, malformed: try the next one
            logger.debug("bootstrap peer %s (%s) did not answer: %s: %s", maddr, source, type(exc).__name__, exc)
            return None
        return ((source, maddr), peer) if node_id is not None else None

    async def _reachability(self, peer: PeerID) -> Reach:
        """Ask `peer` to dial us back; if it cannot, to have a third peer reach us through our relays."""
        ports = listen_ports([str(m) for m in await self.p2p.get_visible_maddrs()])
        return await check_reachability(self.p2p, peer, ports=ports, circuits=[f"{r}/p2p-circuit" for r in self.relays],
                                        timeout=self.rpc_timeout)

    async def measure(self) -> None:
        """Measure reachability against a peer in the routing table (nodes without bootstrap peers: the public ones)."""
        peers = list(self.dht.protocol.routing_table.uid_to_peer_id.values())
        if peers and self.needs_measuring():
            self._record(await self._reachability(random.choice(peers)))

    async def check_clock(self) -> None:
        """Ask peers of the routing table for their time, those not measured yet first (`ClockCheck.choose`): three until
        three answered, then one (one small request a re-bootstrap, spread over the swarm: not aimed at the bootstrap peers)."""
        if self.clock_check is None:
            return
        peers = list(self.dht.protocol.routing_table.uid_to_peer_id.values())
        await ask_time(self.p2p, self.clock_check.choose(peers), self.clock_check, self.rpc_timeout)

    async def remember_peers(self) -> None:
        """Save the addresses of peers p2pd is connected to in the peer cache."""
        if self.cache is None:
            return
        try:
            peers = await asyncio.wait_for(self.p2p.list_peers(), self.rpc_timeout)
        except Exception as exc:  # noqa: BLE001
            logger.debug("could not list peers for the cache: %s", exc)
            return
        maddrs = [f"{addr}/p2p/{info.peer_id}" for info in peers for addr in info.addrs if "p2p-circuit" not in str(addr)]
        self.cache.remember(maddrs)

    async def start(self, timeout: float) -> bool:
        """Retry `join_once` with exponential backoff (1 s doubling, jittered) for up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        delay = 1.0
        while True:
            if await self.join_once():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.candidates:
                return False
            await asyncio.sleep(min(remaining, delay * random.uniform(0.8, 1.2)))
            delay = min(delay * 2, 30.0)

    async def keep_joined(self, interval: float) -> None:
        """Background task: while solo retry with backoff; once joined re-bootstrap every `interval` s.

        Until a relay is confirmed (reachability not yet reachable/relayed), rejoin at least every 10 s.
        When p2pd loses its connection to the peer we joined through (a restarted public node, our
        relay), rejoin within LOST_CHECK_S and then with backoff (at most RETRY_MAX_S between tries),
        not after a whole `interval`. Out of solo, after a loss and every REFRESH_S the rejoin is a
        full one; in between, routine.
        """
        delay = 1.0
        while True:
            settled = self.reachability in ("reachable", "relayed")
            if self.solo or self._lost:
                wait = delay
            else:
                wait = interval if settled else min(interval, 10.0)
            await self._wait(wait * random.uniform(0.8, 1.2))
            was_solo = self.solo
            routine = not (was_solo or self._lost) and time.monotonic() - self._full_at <= REFRESH_S
            try:
                ok = await self.join_once(routine=routine)
                if not self.candidates:  # no bootstrap peers (the swarm's first node): its routing table's peers
                    await self.measure()
                    await self.check_clock()
            except Exception as exc:  # noqa: BLE001 - a failed attempt must not end the task
                logger.debug("re-bootstrap failed: %s: %s", type(exc).__name__, exc)
                ok = False
            if ok and was_solo:
                logger.warning("left solo mode: joined the swarm via %s", self.joined_via)
            if not ok and not self.solo and not self.dht.protocol.routing_table.uid_to_peer_id:
                self.solo = True
                logger.warning("solo mode: every known peer is gone; retrying the bootstrap sources")
            delay = 1.0 if ok else min(delay * 2, interval, RETRY_MAX_S)

    async def _wait(self, seconds: float) -> None:
        """Sleep `seconds`, waking early (and marking us lost) when the peer we joined through disconnects."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, LOST_CHECK_S))
            if self.solo or self._joined_peer is None:
                continue
            try:
                connected = {info.peer_id for info in await asyncio.wait_for(self.p2p.list_peers(), self.rpc_timeout)}
            except Exception:  # noqa: BLE001, S112 - p2pd busy: look again at the next slice
                continue
            if self._joined_peer not in connected:
                self._lost = True
                return
