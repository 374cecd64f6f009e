"""The weight topics' slots: one index key per (topic, slot), read whole, in order, by a leader's followers.

Topics are `protocol.keys.TOPIC_KEYS`: "delta" and "snapshot" (slot = `delta_slot`) and "head"
(slot 0). A publisher's record under the slot's key lists the body; a reader fetches every body
announced there that it has not fetched before, asking the author's own record first (it has the
least reason to lie), and relays what its author signed, so any holder serves it.

Loop-thread state: only gossip's event loop calls these (`Gossip` is the thread-safe front).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

from hivespec.node.swarm.fetching import Claim, Fetched
from hivespec.node.swarm.machinery import Machinery
from hivespec.node.swarm.records import Holder
from hivespec.protocol.announce import Announce, AnnouncedBody

_SLOTS_KEPT = 1024  # slot keys whose authors we remember


@dataclass(eq=False)
class SlotGossip(Machinery):
    """Bodies published and fetched by (topic, slot) key."""

    def __post_init__(self) -> None:
        self._authors: OrderedDict[str, set[str]] = OrderedDict()  # slot key -> authors fetched from it

    def authors(self, key: str) -> int:
        """How many distinct other authors' bodies we have fetched from `key` so far."""
        return len(self._authors.get(key, ()))

    async def publish(self, key: str, item: AnnouncedBody, wire: bytes) -> None:
        self.serve_own(item, wire)
        self.records.hold(key, item, first=True)
        await asyncio.wait_for(self.records.store(key), self.request_timeout)
        self.stats["published"] += 1

    async def fetch(self, key: str, timeout: float) -> list[Fetched]:
        """The bodies announced under `key` that we have not fetched before, as many as arrived within `timeout`."""
        deadline = time.monotonic() + timeout
        records, _ = await self.records.read(key, timeout)
        claims = self._claims(records)
        if not claims:
            return []
        direct = await self.fetcher.directly_connected(h for _, hs in claims.values() for h in hs)

        async def one(claim: Claim, item: AnnouncedBody, holders: list[Holder]) -> Fetched | None:
            got = await self.fetcher.fetch(claim, self.fetcher.usable_holders(claim, holders, direct), deadline, context=key)
            if got is None:
                return None
            holder, wire, body = got
            if self.fetcher.signed_by_author(body, item.author) and self.records.hold(key, item):
                self.bodies.keep(item.sha256, wire)
                self.spawn(self.records.restore(key, self.request_timeout))
            return Fetched(item.author, body, holder=holder.peer, sha256=item.sha256, born=item.born, version=item.version)

        results = await asyncio.gather(*(one(claim, item, holders) for claim, (item, holders) in claims.items()))
        fetched = [f for f in results if f is not None]
        if fetched:
            self._authors.setdefault(key, set()).update(f.author_peer_id for f in fetched)
            self._authors.move_to_end(key)
            while len(self._authors) > _SLOTS_KEPT:
                self._authors.popitem(last=False)
        return fetched

    def _claims(self, records: list[tuple[Holder, Announce]]) -> dict[Claim, tuple[AnnouncedBody, list[Holder]]]:
        """Each claim we still want from these records, with its holders: the author's own record first."""
        claims: dict[Claim, tuple[AnnouncedBody, list[Holder]]] = {}
        for holder, announce in records:
            if self.peers is not None and self.peers.graylisted(holder.peer):
                self.stats["graylisted_skipped"] += 1
                continue
            for item in announce.items:
                claim = (item.sha256, item.author, item.size)
                if item.author == self.identity.peer_id or not self.fetcher.wanted(claim):
                    continue
                if self.peers is not None and item.author != holder.peer and self.peers.graylisted(item.author):
                    self.stats["graylisted_skipped"] += 1  # a graylisted author's bodies, relayed by someone else
                    continue
                _, holders = claims.setdefault(claim, (item, []))
                # The author's own record first: it is the one with the least reason to lie.
                holders.insert(0 if holder.peer == item.author else len(holders), holder)
        return claims
