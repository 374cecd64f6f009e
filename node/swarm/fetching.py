"""Fetching announced bodies from their holders: which holder to ask, what to check, whom to blame.

A claim is (sha256, author, size) as a holder's signed record announced it. `Fetcher.fetch`
asks the claim's holders in turn (already shuffled or ordered by the caller), each within
`request_timeout` and the caller's deadline, and returns the first body whose size and sha256
match (decrypted in a private swarm). A holder that serves other bytes is remembered and scored
down (`PeerScores.record(..., "reject")`) and never asked for that claim again; one that cannot
be reached now is simply skipped (the next step may try again). Holders over their rate budget
(`PeerScores.allow`) are skipped. What was fetched, or is being fetched, is not fetched twice.
Behind NAT, p2pd's relay cuts a circuit after ~128 KiB, so a large body is never asked of a
holder we reach only through a relay (`relay_only`): a peer with a direct connection fetches and
re-serves it.

Loop-thread state: only gossip's event loop calls these.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P

from hivespec.node.swarm.index import Candidate
from hivespec.node.swarm.nat import RELAYED_BODY_LIMIT, is_circuit
from hivespec.node.swarm.peers import PeerScores
from hivespec.node.swarm.records import Holder
from hivespec.node.swarm.transfer import PARALLEL_FETCHES, BadBody, download
from hivespec.protocol.envelope import Envelope, open_envelope
from hivespec.protocol.limits import DEFAULT_LIMITS, Limits
from hivespec.protocol.private import PrivateSwarm

logger = logging.getLogger(__name__)

Claim = tuple[bytes, str, int]  # (sha256, author, size)
# Fetched and failed claims kept for dedupe, each for two record TTLs: a claim is offered for at most record_ttl
# (600 s), so after that no record can bring it back. At most 16384 (~5 MB; a node takes at most K (4) a step):
# kept by count alone, the set grew for hours on a small swarm.
_REMEMBERED = 16384


@dataclass
class Fetched:
    """A body fetched from a holder: size and sha256 verified (and decrypted in a private swarm), content not yet validated.

    `author_peer_id` is who the holder says wrote it; intake checks that against the signature.
    `born` and `version` are what the announcement claimed (intake reads the signed ones).
    """

    author_peer_id: str
    body: bytes
    holder: str = ""
    sha256: bytes = b""
    born: float = 0.0
    version: int = -1


class Fetcher:
    """Downloads claims from holders (see the module docstring); remembers what it fetched and who lied."""

    def __init__(
        self,
        *,
        private: PrivateSwarm | None,
        peers: PeerScores | None,
        request_timeout: float,
        stats: Counter,
        record_ttl: float = 600.0,
        limits: Limits = DEFAULT_LIMITS,
        max_parallel: int = PARALLEL_FETCHES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.private = private
        self.limits = limits  # for `signed_by_author`: its max_envelope_bytes is the largest body we serve
        self.peers = peers
        self.request_timeout = request_timeout
        self._stats = stats
        self._p2p: P2P | None = None
        self._slots = asyncio.Semaphore(max_parallel)
        self._remember_s = 2 * record_ttl
        self._clock = clock
        self._done: OrderedDict[Claim, float] = OrderedDict()  # -> when remembered, oldest first
        self._failed: OrderedDict[tuple[Claim, str], float] = OrderedDict()  # (claim, holder) that served bad bytes
        self._inflight: set[Claim] = set()

    def attach(self, p2p: P2P) -> None:
        self._p2p = p2p

    def wanted(self, claim: Claim) -> bool:
        """Not fetched yet and not being fetched now."""
        return claim not in self._done and claim not in self._inflight

    def mark_done(self, claim: Claim) -> None:
        """Never fetch this claim (our own body, or one we already have)."""
        self._remember(self._done, claim)

    def usable_holders(self, claim: Claim, holders: Sequence[Holder], direct: set[str]) -> list[Holder]:
        """The holders worth asking for `claim`: not caught serving other bytes for it, not graylisted, reachable."""
        usable = []
        for holder in holders:
            if (claim, holder.peer) in self._failed:
                continue
            if self.peers is not None and self.peers.graylisted(holder.peer):
                self._stats["graylisted_skipped"] += 1
                continue
            if claim[2] > RELAYED_BODY_LIMIT and relay_only(holder, direct):
                self._stats["relay_only_skipped"] += 1
                continue
            usable.append(holder)
        return usable

    def fetchable(self, candidates: Sequence[Candidate], direct: set[str]) -> list[Candidate]:
        """The candidates some holder could serve us, each left with only those holders (`usable_holders`).

        Sampling chooses among these alone: behind NAT, a large body whose only holders are NATed
        peers we reach through a relay cannot be fetched, and choosing it would waste one of K.
        """
        fetchable = []
        for candidate in candidates:
            candidate.holders = self.usable_holders(candidate.claim, candidate.holders, direct)
            if candidate.holders:
                fetchable.append(candidate)
        self._stats["unfetchable_skipped"] += len(candidates) - len(fetchable)
        return fetchable

    async def directly_connected(self, holders: Iterable[Holder]) -> set[str]:
        """Base58 ids of peers p2pd holds a non-relayed connection to, for `usable_holders`.

        Only a NATed holder can be relay-only (`relay_only`), so p2pd is asked only when one of
        `holders` is behind NAT; otherwise the answer is the empty set without a call.
        """
        if not any(holder.behind_nat for holder in holders):
            return set()
        try:
            peers = await asyncio.wait_for(self._p2p.list_peers(), self.request_timeout)
        except Exception:  # noqa: BLE001 - unknown: treat every circuit holder as relay-only this time
            return set()
        return {info.peer_id.to_base58() for info in peers if any(not is_circuit(str(a)) for a in info.addrs)}

    async def fetch(self, claim: Claim, holders: Sequence[Holder], deadline: float, *, context: str) -> tuple[Holder, bytes, bytes] | None:
        """(holder, wire bytes, body) of `claim` from the first holder that serves it before `deadline`, else None.

        `context` is the private swarm's AEAD context of the body (what it was sealed under).
        """
        digest, author, size = claim
        self._inflight.add(claim)
        try:
            async with self._slots:
                for holder in holders:
                    if time.monotonic() >= deadline:
                        return None
                    if self.peers is not None and not self.peers.allow(holder.peer, size):
                        self._stats["rate_limited"] += 1
                        continue
                    try:
                        wire = await self._download(holder, digest, size, deadline)
                        body = self._open(wire, context)
                    except BadBody as exc:
                        self._remember(self._failed, (claim, holder.peer))
                        self._blame(holder.peer, f"{context}: body from holder {holder.peer}: {exc}")
                        continue
                    except Exception as exc:  # noqa: BLE001 - unreachable or slow holder (incl. TimeoutError): next holder
                        self._stats["fetch_failures"] += 1
                        logger.debug("fetch from %s failed (will retry): %s: %s", holder.peer, type(exc).__name__, exc)
                        continue
                    self._remember(self._done, claim)
                    self._stats["bodies_fetched"] += 1
                    self._stats["bytes_in"] += len(wire)
                    if holder.peer != author:
                        self._stats["bodies_fetched_from_relay"] += 1
                    return holder, wire, body
        finally:
            self._inflight.discard(claim)
        return None

    def signed_by_author(self, body: bytes, author: str) -> Envelope | None:
        """A fetched body's envelope where we may vouch for the body enough to serve it (it is signed by its announced
        author, not graylisted), else None."""
        if self.peers is not None and self.peers.graylisted(author):
            return None
        verdict, envelope = open_envelope(body, limits=self.limits)
        return envelope if verdict.ok and envelope is not None and envelope.peer_id == author else None

    async def _download(self, holder: Holder, digest: bytes, size: int, deadline: float) -> bytes:
        """One holder's body within `request_timeout` and `deadline`; a NATed holder's is asked twice if the stream is cut.

        The relay resets a circuit once it has carried ~128 KiB (nat.py), whatever streams it carries, so a small
        body asked over a circuit that DHT traffic and earlier bodies have used up ends with no bytes; the next
        stream opens a new circuit.
        """
        retries = 1 if holder.behind_nat else 0
        while True:
            try:
                return await asyncio.wait_for(
                    download(self._p2p, holder.p2p_peer_id, holder.maddrs, digest, size, timeout=self.request_timeout),
                    max(0.0, min(deadline - time.monotonic(), self.request_timeout)),
                )
            except asyncio.IncompleteReadError:
                if not retries or time.monotonic() >= deadline:
                    raise
                retries -= 1
                self._stats["circuit_retries"] += 1

    def _open(self, wire: bytes, context: str) -> bytes:
        if self.private is None:
            return wire
        verdict, body = self.private.open_body(wire, context=context)
        if not verdict.ok or body is None:
            raise BadBody(f"private body: {verdict}")
        return body

    def _remember(self, seen: OrderedDict, key: object) -> None:
        """Keep `key` (newest last); forget the oldest past `_remember_s` or past `_REMEMBERED` entries."""
        now = self._clock()
        seen[key] = now
        seen.move_to_end(key)
        while len(seen) > _REMEMBERED or next(iter(seen.values())) < now - self._remember_s:
            seen.popitem(last=False)

    def _blame(self, holder: str, reason: str) -> None:
        self._stats["bad_bodies"] += 1
        logger.debug("rejected a body: %s", reason)
        if self.peers is not None:
            self.peers.record(holder, "reject", reason.rsplit(": ", 1)[-1])


def relay_only(holder: Holder, direct: set[str]) -> bool:
    """A NATed holder (it announces relay circuits) we have no direct connection to."""
    return holder.behind_nat and holder.p2p_peer_id.to_base58() not in direct



