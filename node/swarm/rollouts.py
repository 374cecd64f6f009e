"""Rollout batches by recency: announcing ours in the index, keeping them findable, sampling and relaying others'.

Nodes share no round numbers. A batch is announced in the index of the current time bucket
(`index.py`: a tree of keys of at most `index_key_records` records each). Our record there lists
our newest own batches (`_OWN_ANNOUNCED`) and the ones we relay (`IndexRecords.hold`).

- **Placement** (`placed_key`): in each bucket our record lives under the first key of our path
  holding fewer than `index_key_records` records (found from the level we expect it at,
  `index.place_on_path`), chosen at our own `placement_delay` into the bucket (spread over its first
  third so the swarm does not race for a key's last slots); until then we keep writing under our
  key of the previous bucket, and our fresh batches come along when we move.
- **Keeping announced** (`keep_announcing`, one tick `reannounce`): bodies we serve that are
  younger than `announce_seconds` stay in the current bucket's record, so a slow author's batch
  stays findable by readers, who look at the last two buckets only.
- **Sampling** (`sample`): one random walk of the current bucket's keys, started at a key of the
  levels above the deepest we take to be full there (`_full_depth`), so that no key, the root included, is read by every
  walk of the swarm (the previous bucket too where the current offers fewer than 2K batches: a
  small swarm, or a bucket's first seconds),
  then at most K fresh batches by peer score with exploration (`index.choose_claims`), at most
  `max_batches_per_peer` per author (with `fill`, then further ones for slots that leaves empty;
  with `informative_only`, none announced with no sample that carries a gradient), among
  those some holder can serve us (`Fetcher.fetchable`),
  each fetched from any of its holders. Where records list one batch with other metadata, the
  author's own record says what it is (`_add_candidates`).
- **Relaying** (`relay`): a fetched batch signed by its announced author joins our record, so any
  holder serves it and the author's upload stays bounded as its readers spread it, once the body
  bears out the informative count its record announced (`claim_holds`; we copy the claim). A holder
  whose count the body belies is scored down (a reject): the count is a function of the body, so
  every record that announced it lied, and a node that lists flat batches as informative would
  otherwise spend its readers' K.

Loop-thread state: only gossip's event loop calls these (`Gossip` is the thread-safe front).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hivespec.node.swarm.fetching import Fetched
from hivespec.node.swarm.index import (
    Candidate,
    FullLevels,
    bucket_of,
    choose_claims,
    descend,
    filled_by,
    go_deeper,
    level_weight,
    place_on_path,
    placement_delay,
    placement_path,
    prefix_of,
    trust_from_score,
)
from hivespec.node.swarm.machinery import Machinery
from hivespec.node.swarm.records import Holder
from hivespec.protocol.advantages import informative_samples
from hivespec.protocol.announce import MAX_ITEMS, AnnouncedBody
from hivespec.protocol.envelope import Envelope
from hivespec.protocol.keys import MAX_INDEX_LEVEL, rollout_index_key
from hivespec.protocol.limits import Limits
from hivespec.protocol.rollout import decode_batch

if TYPE_CHECKING:
    from hivespec.node.config import SwarmConfig

logger = logging.getLogger(__name__)

_EXPLORE = 0.25  # share of a candidate's weight that does not depend on its author's score
# Our own bodies an index record lists, the newest: a reader takes at most max_batches_per_peer (1) of an
# author's a step and prefers the fresh, so older ones only made every copy of the record larger
# (9 items are 1.3 KB sealed, 2 are 0.6 KB, and whole records are most of what an index read moves).
_OWN_ANNOUNCED = 2
_ANNOUNCED_KEPT = 256  # bodies we remember announcing (each leaves once the body store no longer serves it)
_PLACEMENTS_KEPT = 4  # buckets whose key we remember

Walk = list[tuple[float, Holder, tuple[AnnouncedBody, ...]]]  # (level_weight, holder, items) of each record met


@dataclass(eq=False)
class RolloutGossip(Machinery):
    """Our rollout batches in the index by recency, and peers' sampled from it (see the module docstring)."""

    config: SwarmConfig
    swarm: str  # the swarm's checked name

    def __post_init__(self) -> None:
        self._rng = random.Random()
        self.placed: OrderedDict[int, str] = OrderedDict()  # bucket -> the index key our record lives under
        # One placement at a time: the K relays of one step, a publish and a tick can all ask first in a new bucket,
        # and a second placement read the first's record as one more in the key and placed us again a level down.
        self._placing = asyncio.Lock()
        self._full = FullLevels(buckets_kept=_PLACEMENTS_KEPT)  # the index keys we read full
        self._announced: OrderedDict[bytes, AnnouncedBody] = OrderedDict()  # rollout bodies we serve, oldest first

    @property
    def context(self) -> str:
        """A private swarm's AEAD context of rollout bodies (they move between index keys, so not a key)."""
        return f"hivespec/{self.swarm}/rollouts"

    # ----- ours ------------------------------------------------------------------------------

    async def publish(self, item: AnnouncedBody, wire: bytes) -> None:
        """Serve our batch and store our record, with it first, in the current bucket's key."""
        self.serve_own(item, wire)
        self._remember(item)  # after serve_own: _remember drops the announced bodies the store does not serve
        key = await self.placed_key(time.time())
        self._hold(key, item, first=True)
        await asyncio.wait_for(self.records.store(key), self.request_timeout)
        self.stats["published"] += 1

    async def placed_key(self, now: float) -> str:
        """The key our record lives under at `now`: in its bucket, the first on our path holding fewer than
        index_key_records others; before our `placement_delay` into the bucket, our key of the previous one."""
        config = self.config
        bucket = bucket_of(now, config.index_bucket_s)
        key = self.placed.get(bucket)
        if key is not None:
            return key
        previous = self.placed.get(bucket - 1)
        if previous is not None and now < bucket * config.index_bucket_s + placement_delay(self.identity.peer_id, bucket, config.index_bucket_s):
            return previous
        async with self._placing:
            return self.placed.get(bucket) or await self._place(bucket, now, previous)

    async def _place(self, bucket: int, now: float, previous: str | None) -> str:
        config = self.config
        path = placement_path(self.swarm, bucket, self.identity.peer_id)

        def ours(level: int) -> int:
            return prefix_of(self.identity.peer_id, level)

        async def is_full(level: int, prefix: int) -> bool:
            # A count, not the newest copy: the first replica with a record of this bucket answers (2-3 RPCs, not 20).
            _, total = await self.records.read(rollout_index_key(self.swarm, bucket, level, prefix), self.request_timeout,
                                               fresh_within=config.index_bucket_s)
            self._saw(bucket, level, prefix, total)
            return total >= config.index_key_records

        level = await place_on_path(is_full, ours, self._full_depth(bucket, now), self._full.depth(bucket, buckets=_PLACEMENTS_KEPT),
                                    self._rng)
        key = path[level]
        self.placed[bucket] = key
        while len(self.placed) > _PLACEMENTS_KEPT:
            self.placed.popitem(last=False)
        if previous is not None:  # what we announced in the previous bucket comes along
            for item in self._fresh_announced(now):
                self._hold(key, item)
        return key

    async def keep_announcing(self) -> None:
        """Keep the rollout bodies we serve that are younger than announce_seconds in the current bucket's record (a task)."""
        bucket_s = self.config.index_bucket_s
        while True:
            await asyncio.sleep(min(bucket_s / 4, 10.0) * (0.5 + self._rng.random()))
            now = time.time()
            try:
                await self.reannounce(now)
            except Exception as exc:  # noqa: BLE001 - the next tick tries again
                logger.debug("re-announcing in bucket %d failed: %s", bucket_of(now, bucket_s), exc)

    async def reannounce(self, now: float) -> bool:
        """One tick of `keep_announcing`: store our record when it moved to a new bucket, a body is missing from it, or
        its last store failed (a publish whose store timed out had left its batch out of the DHT until the next one).

        A record placed in a new key is stored at once: the others count a key's records when they place theirs,
        and one placed but not stored let them overfill the key (at 64 light nodes half the placements read a
        count short of the records already placed there: keys of cap 4 held 5-6 on average).
        """
        fresh = self._fresh_announced(now)
        if not fresh:
            return False
        key = await self.placed_key(now)
        added = [self._hold(key, item) for item in fresh]
        if not any(added) and self.records.stored(key) and not self.records.failed(key):
            return False
        await asyncio.wait_for(self.records.store(key), self.request_timeout)
        self.stats["reannounced"] += 1
        return True

    # ----- theirs ----------------------------------------------------------------------------

    async def sample(self, k: int, max_age_s: float, timeout: float, version_ok: Callable[[int], bool] | None, *,
                     fill: bool = False, informative_only: bool = False) -> list[Fetched]:
        """Fetch up to `k` fresh batches we have not fetched before, chosen from the index; what arrived within `timeout`.

        `fill`, `informative_only`: see `index.choose_claims`."""
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
            explore=_EXPLORE, rng=self._rng, version_ok=version_ok, fill=fill, informative_only=informative_only,
        )
        if informative_only:
            self.stats["flat_skipped"] += sum(1 for c in fetchable if c.item.informative == 0)
        self.stats["sample_candidates"] += len(candidates)
        self.stats["sample_chosen"] += len(chosen)
        if not chosen:
            return []
        # A NATed author's batch is relayed urgently (`relay`), whichever holder we got it from.
        results = await asyncio.gather(*(self._fetch(c, deadline, urgent=c.item.author in natted) for c in chosen))
        return [f for f in results if f is not None]

    async def relay(self, item: AnnouncedBody, *, urgent: bool) -> None:
        """Serve a fetched batch too: add it to our record in the current bucket (see `IndexRecords.hold`), and store it.

        In place of an older relayed batch (the record is full) it is stored at once only when `urgent`: its author
        announces relay circuits, so NATed readers get it only from the records of those who relay it. Otherwise our
        next publish takes it: a store per relayed batch would cost a fast holder one more store per step, for
        batches their authors announce themselves.
        """
        try:
            key = await self.placed_key(time.time())
            full = len(self.records.held(key)) >= MAX_ITEMS
            changed = self._hold(key, item)
            if (changed and (urgent or not full)) or not self.records.stored(key):  # or a placement to store
                await self.records.restore(key, self.request_timeout)
        except Exception as exc:  # noqa: BLE001 - relaying is best effort
            logger.debug("relaying %s failed: %s", item.sha256.hex()[:12], exc)

    def _add_candidates(self, candidates: dict[tuple[bytes, str], Candidate], walk: Walk) -> None:
        """Add the claims of one walk's records that we could fetch to `candidates`, with their holders and weights."""
        for weight, holder, items in walk:
            for item in items:
                if item.author == self.identity.peer_id or not self.fetcher.wanted((item.sha256, item.author, item.size)):
                    continue
                if self.peers is not None and self.peers.graylisted(item.author):
                    self.stats["graylisted_skipped"] += 1  # a graylisted author's batch, relayed by an honest holder
                    continue
                # Keyed by (bytes, author): a holder that claims someone else's bytes under another author
                # makes a candidate of its own and cannot shadow the true claim.
                candidate = candidates.setdefault((item.sha256, item.author), Candidate(item))
                if candidate.item != item:
                    # The same batch with other metadata (born, version, informative count): the author's own record says
                    # what it is, and the holders that said otherwise are dropped; between relays the first claim stands.
                    # First-seen alone let a relay hide an honest batch from steps fetching to train by calling it flat.
                    if holder.peer != item.author:
                        continue
                    candidate.item, candidate.holders = item, []
                candidate.holders.append(holder)
                candidate.weight = max(candidate.weight, weight)

    async def _walk(self, bucket: int, deadline: float) -> Walk:
        """Records along one random path of `bucket`'s index tree: (level_weight, holder, items) each."""
        found = []
        # One above the deepest level taken to be full: a level fills unevenly, and beside a full key some of its level
        # are open, some still empty; a walk started at an empty key pays a crawl for nothing (at 64 light nodes, starts
        # at the deepest full level took 1.5 more find RPCs per node-step).
        top = min(max(0, self._full_depth(bucket, time.time()) - 1), MAX_INDEX_LEVEL)
        for level, prefix, key in descend(self.swarm, bucket, self._rng, top):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            records, total = await self.records.read(key, min(remaining, self.request_timeout),
                                                     fresh_within=self.config.index_bucket_s)
            self.stats["index_keys_read"] += 1
            self._saw(bucket, level, prefix, total)
            weight = level_weight(level, top)
            for holder, announce in records:
                if self.peers is not None and self.peers.graylisted(holder.peer):
                    self.stats["graylisted_skipped"] += 1
                    continue
                found.append((weight, holder, announce.items))
            if not go_deeper(total, self.config.index_key_records, self._rng):
                break
        return found

    async def _fetch(self, candidate: Candidate, deadline: float, *, urgent: bool) -> Fetched | None:
        """Fetch a chosen candidate from one of its holders (all usable: `Fetcher.fetchable` kept only those), then relay it."""
        holders = list(candidate.holders)
        self._rng.shuffle(holders)  # any holder will do: relays spread the author's upload
        got = await self.fetcher.fetch(candidate.claim, holders, deadline, context=self.context)
        if got is None:
            return None
        holder, wire, body = got
        item = candidate.item
        envelope = self.fetcher.signed_by_author(body, item.author)
        if envelope is not None and not claim_holds(envelope, item.informative, self.fetcher.limits):
            self.stats["false_informative_claims"] += 1
            logger.debug("%s announced %d informative samples its body does not hold", item.sha256.hex()[:12], item.informative)
            if self.peers is not None:
                for liar in candidate.holders:  # each signed a record with this count for these bytes
                    self.peers.record(liar.peer, "reject", "false informative count")
        elif envelope is not None:
            self.bodies.keep(item.sha256, wire)
            self._remember(item)
            self.spawn(self.relay(item, urgent=urgent))
        return Fetched(item.author, body, holder=holder.peer, sha256=item.sha256, born=item.born, version=item.version)

    def _saw(self, bucket: int, level: int, prefix: int, total: int) -> None:
        """Note the key at (`level`, `prefix`) of `bucket`'s tree read holding `total` records."""
        self._full.saw(bucket, level, prefix, total >= self.config.index_key_records)

    def _full_depth(self, bucket: int, now: float) -> int:
        """The deepest level of `bucket` we take to be full at `now` (-1: none): where our reads of it found it full,
        or where those of the buckets before found theirs (`FullLevels`), scaled to the holders moved in by now
        (`index.filled_by`)."""
        bucket_s = self.config.index_bucket_s
        before = self._full.depth(bucket - 1, buckets=_PLACEMENTS_KEPT - 1)
        return max(self._full.depth(bucket), filled_by(before, now - bucket * bucket_s, bucket_s))

    def _fresh_announced(self, now: float) -> list[AnnouncedBody]:
        """The bodies we serve that are younger than announce_seconds, our own first, newest first (a full record keeps those)."""
        fresh = [item for item in self._announced.values() if now - item.born <= self.config.announce_seconds]
        return sorted(fresh, key=lambda i: (i.author != self.identity.peer_id, -i.born))

    def _hold(self, key: str, item: AnnouncedBody, *, first: bool = False) -> bool:
        """Add a rollout batch to our record under `key`: at most `_OWN_ANNOUNCED` of its items our own (see `IndexRecords.hold`)."""
        return self.records.hold(key, item, first=first, own_limit=_OWN_ANNOUNCED)

    def _remember(self, item: AnnouncedBody) -> None:
        self._announced[item.sha256] = item
        while len(self._announced) > _ANNOUNCED_KEPT or (self._announced and next(iter(self._announced)) not in self.bodies):
            self._announced.popitem(last=False)


def claim_holds(envelope: Envelope, informative: int, limits: Limits) -> bool:
    """Whether a fetched rollout envelope bears out the `informative` count announced for it: it is a batch with at least
    that many samples that carry a gradient (`informative_samples`, from the rewards it carries). -1 claims nothing."""
    if informative < 0:
        return True
    _, batch = decode_batch(envelope.body, limits=limits)
    return batch is not None and informative_samples(batch.rollouts) >= informative
