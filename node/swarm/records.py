"""Index records in the DHT: ours written under a key, everyone's read back and checked.

One record per (key, holder), stored under subkey = the holder's peer id and sealed as a
`Kind.ANNOUNCE` envelope (`protocol/announce.py`): the bodies it serves, its libp2p id and
multiaddrs, bound to its key and expiration. `store(key)` writes our record for a key from what
we `hold` there; `read(key)` returns every other holder's valid record under it (the validator's
checks, cached by content) and how many records the key holds, ours included.

A node re-stores its record under the same key at every step of a bucket (its newest batch, the
batches it relays). hivemind's store looks up the key's nearest peers first, and every peer that
lookup asks answers with the whole key: at 64 nodes that was 3 in 4 of the record copies a node
received. So the first store under a key finds its replicas and later ones write straight to them
for `REPLICAS_TTL_S`; a replica that does not answer sends the next store through a new lookup, and
a lookup that found fewer than hivemind's num_replicas (a swarm of a few nodes, or one we are still
joining) is not remembered. That lookup crawls towards a neighbour of the key's id
(`replica_probe`): the same nearest peers, and replies that carry none of the key's records.

Loop-thread state: only gossip's event loop calls these.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from hivespec.node.swarm.dht_guard import AnnounceValidator
from hivespec.node.swarm.nat import is_circuit
from hivespec.protocol.announce import MAX_ITEMS, MAX_MADDRS, Announce, AnnouncedBody, encode_announce
from hivespec.protocol.envelope import Kind, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.private import PrivateSwarm

logger = logging.getLogger(__name__)

# Parsed records kept (by content) so a record polled again is not re-verified, each until it expires (then
# no peer can return it again): the cache holds the records of the last record_ttl, a few hundred on a small
# swarm, and at most 4096 on a large one (~3.4 KB each: under 14 MB). Kept by count alone, it filled for
# hours on a small swarm and looked like a leak of a few MB/h.
_PARSED = 4096
# How long the DHT peers nearest a key are written to without looking them up again: about one index
# bucket, the life of a key our record is re-stored under, so a peer that joins nearer than them is
# found within a bucket. The keys remembered are the ones we hold records under (a few per bucket).
REPLICAS_TTL_S = 30.0
_REPLICAS_KEPT = 64
_LOOKUP_BEAM = 2  # the replica lookup's beam, in replicas


@dataclass(frozen=True)
class Holder:
    """A peer that serves bodies: its hivespec peer id, libp2p id and addresses (from its signed record)."""

    peer: str
    p2p_peer_id: PeerID
    maddrs: tuple[str, ...]

    @property
    def behind_nat(self) -> bool:
        """It announces relay circuits: a NATed peer, reached through a relay unless we hold a connection to it."""
        return any(is_circuit(m) for m in self.maddrs)


def _oldest_relayed(held: list[AnnouncedBody], mine: str) -> int | None:
    """Index of the relayed body (not authored by `mine`) with the oldest signature time in `held`; None if none."""
    return min((i for i, h in enumerate(held) if h.author != mine), key=lambda i: held[i].born, default=None)


class IndexRecords:
    """Our index records (what we hold under each key) and the reading of everyone's."""

    def __init__(
        self,
        identity: Identity,
        *,
        validator: AnnounceValidator,
        private: PrivateSwarm | None,
        record_ttl: float,
        stats: Counter,
        max_keys: int = 256,
    ) -> None:
        self.identity = identity
        self.validator = validator
        self.private = private
        self.record_ttl = record_ttl
        self.max_keys = max_keys
        self._stats = stats
        self._dht: DHTNode | None = None
        self._p2p_id = ""
        self._maddrs: tuple[str, ...] = ()
        self._held: OrderedDict[str, list[AnnouncedBody]] = OrderedDict()  # key -> our record's items, newest first
        self._stored: set[str] = set()  # keys of _held whose record a DHT peer has accepted at least once
        self._unsent: set[str] = set()  # keys of _held whose items changed since their last store began
        self._failed: set[str] = set()  # keys of _held whose last store no DHT peer accepted (or that did not finish)
        self._restoring: set[str] = set()  # keys a `restore` is under way for
        # content digest -> (expiration, (subkey, announce) or None when invalid), least recently seen first
        self._parsed: OrderedDict[bytes, tuple[float, tuple[str, Announce] | None]] = OrderedDict()
        self._replicas: OrderedDict[str, tuple[float, dict[DHTID, PeerID]]] = OrderedDict()  # key -> (found at, nearest)
        self._seq_lock = threading.Lock()
        self._seq = 0
        self._expiry: dict[str, float] = {}  # key -> the expiration of our last record there, while it lasts

    def attach(self, dht: DHTNode, p2p_id: str, maddrs: list[str]) -> None:
        """Use this DHT node, announcing this libp2p id and these addresses (gossip's start)."""
        self._dht, self._p2p_id, self._maddrs = dht, p2p_id, tuple(maddrs[:MAX_MADDRS])

    def held(self, key: str) -> list[AnnouncedBody]:
        """The items of our record under `key` (a live list: the caller adds to it, then `store`s)."""
        held = self._held.setdefault(key, [])
        self._held.move_to_end(key)
        while len(self._held) > self.max_keys:
            evicted = self._held.popitem(last=False)[0]
            self._stored.discard(evicted)
            self._unsent.discard(evicted)
            self._failed.discard(evicted)
        return held

    def stored(self, key: str) -> bool:
        """Whether our record under `key` was ever accepted by a DHT peer: a placement counts for the others only then."""
        return key in self._stored

    def holds(self, key: str) -> bool:
        return bool(self._held.get(key))

    def failed(self, key: str) -> bool:
        """Whether our last store under `key` failed: what it sent is not in the DHT (`reannounce` stores it again)."""
        return key in self._failed

    def unsent(self, key: str) -> bool:
        """Whether our record under `key` changed since its last store began (`hold` changed it; no store sent it yet)."""
        return key in self._unsent

    def hold(self, key: str, item: AnnouncedBody, *, first: bool = False, own_limit: int = MAX_ITEMS) -> bool:
        """Add `item` to our record under `key` (first: our own newest body; else one we relay); True if the record changed.

        At most `own_limit` of the record's items are our own bodies, the newest: older ones leave it
        as a new one comes first, and one that is not first is refused once the record has as many.
        In a full record a body takes the place of the oldest one it relays (by the author's signature
        time), a relayed body only when that one is older: readers look for the freshest, and a NATed
        author's batch reaches other NATed peers only through the records of those who relay it.
        """
        held = self.held(key)
        if any(h.sha256 == item.sha256 for h in held):
            return False
        mine = self.identity.peer_id
        if first:
            held.insert(0, item)
            own = [i for i, h in enumerate(held) if h.author == mine]
            for i in reversed(own[own_limit:]):
                del held[i]
            while len(held) > MAX_ITEMS:
                oldest = _oldest_relayed(held, mine)
                del held[oldest if oldest is not None else MAX_ITEMS]
            self._unsent.add(key)
            return True
        if item.author == mine and sum(h.author == mine for h in held) >= own_limit:
            return False
        if len(held) >= MAX_ITEMS:
            oldest = _oldest_relayed(held, mine)
            if oldest is None or held[oldest].born >= item.born:
                return False
            del held[oldest]
        held.append(item)
        self._unsent.add(key)
        return True

    async def store(self, key: str) -> bool:
        """Write our record for `key` (what we hold there); False when no DHT peer accepted it (`failed` until one does)."""
        self._unsent.discard(key)
        stored = False
        try:
            stored = await self._store(key)
        finally:  # a cancelled store (a timeout) failed too
            if stored or key not in self._held:
                self._failed.discard(key)
            else:
                self._failed.add(key)
        return stored

    async def _store(self, key: str) -> bool:
        items = self.held(key)[:MAX_ITEMS]
        # Strictly increasing per key: the DHT keeps a subkey's value only if its expiration is newer. Per key, not across
        # keys: after the clock steps back (NTP mending a clock that ran ahead), an expiration carried over from before the
        # step lies past what every validator takes (`dht_guard.EXPIRY_SLACK_S`), and each new key's store was refused too.
        now = get_dht_time()
        expires = max(now + self.record_ttl, self._expiry.get(key, 0.0) + 1e-3)
        self._expiry = {k: e for k, e in self._expiry.items() if e > now} | {key: expires}
        body = encode_announce(Announce(key, expires, self._p2p_id, self._maddrs, tuple(items)))
        if self.private is not None:
            body = self.private.seal_index(body, context=DHTID.generate(source=key).to_bytes().hex())
        with self._seq_lock:
            # Microsecond wall clock as a floor keeps seq increasing across restarts of the node.
            self._seq = max(self._seq + 1, time.time_ns() // 1000)
            seq = self._seq
        record = seal(self.identity, Kind.ANNOUNCE, seq, body)
        self._stats["dht_stores"] += 1
        stored = await self._store_at_replicas(key, record, expires)
        if stored is None:  # no replica accepted it and some did not answer: hivemind's own lookup and store
            stored = await self._dht.store(key, record, expiration_time=expires, subkey=self.identity.peer_id)
        if not stored:
            # Only our own replica may exist; peers can still find the record once they reach us.
            self._stats["announce_store_failed"] += 1
            logger.debug("%s: no DHT peer accepted our index record", key)
        elif key in self._held:
            self._stored.add(key)
        return bool(stored)

    async def restore(self, key: str, timeout: float) -> None:
        """Re-store our record under `key` after relayed bodies joined it: one store for a burst, best effort.

        A body that joins while the store is under way was not in what it sent (`unsent`): one more store follows.
        """
        if key in self._restoring:
            return  # the pending store picks up this body, or the one after it does
        self._restoring.add(key)
        try:
            await asyncio.sleep(0.05)
            while True:
                await asyncio.wait_for(self.store(key), timeout)
                self._stats["relay_records"] += 1
                if not self.unsent(key):
                    break
        except Exception as exc:  # noqa: BLE001 - relaying is best effort
            logger.debug("re-storing our record under %s failed: %s", key, exc)
        finally:
            self._restoring.discard(key)

    async def _store_at_replicas(self, key: str, record: bytes, expires: float) -> bool | None:
        """Store our sealed `record` straight at `key`'s remembered replicas (found on first use).

        True when another peer accepted it (or we are alone and kept it), False when every peer refused
        it, None when none accepted while some did not answer: the caller then stores the usual way.
        A replica that does not answer makes the next store look the replicas up again.
        """
        dht = self._dht
        key_id = DHTID.generate(source=key)
        remembered = self._replicas.get(key)
        if remembered is None or time.monotonic() - remembered[0] > REPLICAS_TTL_S:
            # A beam of twice the replicas, not hivemind's 20: the crawl stops once the 10 nearest peers it knows have
            # answered (at 64 nodes a node's RPCs per step fell from 16.2 to 13.8).
            probe = replica_probe(key_id)
            found = await dht.find_nearest_nodes([probe], k_nearest=dht.num_replicas, beam_size=_LOOKUP_BEAM * dht.num_replicas)
            self._stats["replica_lookups"] += 1
            remembered = (time.monotonic(), found.get(probe, {}))
            self._replicas.pop(key, None)
            # Only a full set is remembered: fewer means a swarm of under num_replicas nodes, or one we have
            # barely joined (alone, a lookup finds only us), and either may grow before the next store.
            if len(remembered[1]) >= dht.num_replicas:
                self._replicas[key] = remembered
                while len(self._replicas) > _REPLICAS_KEPT:
                    self._replicas.popitem(last=False)
        replicas = remembered[1]  # ours among them unless farther from the key than num_replicas peers
        # The bytes hivemind's store_many would send: msgpack of the subkey and of the value.
        protocol, subkey = dht.protocol, self.identity.peer_id
        value = protocol.serializer.dumps(record)
        kept = False
        if dht.node_id in replicas:
            checked = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), value, expires)
            if protocol.record_validator is None or protocol.record_validator.validate(checked):
                kept = bool(protocol.storage.store(key_id, value, expires, subkey=subkey))
        remote = [peer for node, peer in replicas.items() if node != dht.node_id]
        answers = await asyncio.gather(*(protocol.call_store(peer, [key_id], [value], [expires], [subkey]) for peer in remote))
        self._stats["direct_stores"] += 1
        silent = any(answer is None for answer in answers)
        if silent:
            self._replicas.pop(key, None)
        if not remote:
            return kept
        if any(answer is not None and answer[0] for answer in answers):
            return True
        return None if silent else False

    async def read(self, key: str, timeout: float, *, fresh_within: float | None = None) -> tuple[list[tuple[Holder, Announce]], int]:
        """Every other holder's valid (holder, announce) under `key`, and how many records the key holds (ours too).

        `fresh_within=None` crawls hivemind's whole beam for the latest copy of the key (a slot's newest
        head or delta). With `fresh_within=s` the search stops at the first DHT peer whose copy holds a
        record stored in the last `s` seconds: a handful of RPCs instead of the beam's twenty, whatever
        the swarm's size, for a copy that may miss a record or two of the others (an index read samples).
        Invalid records are counted and skipped; a read that times out counts as an empty key.
        """
        self._stats["dht_gets"] += 1
        # A record stored t seconds ago expires at store time + record_ttl (ours and, by the preset, every peer's).
        if fresh_within is None:
            search = {"sufficient_expiration_time": float("inf")}
        else:
            # One request in flight, not hivemind's four: every replica that answers sends the whole key, and the
            # nearest peer asked first is mostly a replica (two in flight brought 2.1 copies of a key a read at 64 nodes).
            # The replica lookup's beam, not hivemind's 20: a key no one holds (a bucket's first placement, a walk
            # below the tree's deepest key) is given up once the nearest 10 peers have answered without it.
            search = {"sufficient_expiration_time": get_dht_time() + self.record_ttl - fresh_within, "num_workers": 1,
                      "beam_size": _LOOKUP_BEAM * self._dht.num_replicas}
        try:
            found = await asyncio.wait_for(self._dht.get(key, **search), timeout)
        except TimeoutError:
            self._stats["dht_get_timeouts"] += 1
            return [], 0
        if found is None or not isinstance(found.value, dict):
            return [], 0
        total = len(found.value)
        self._stats["records_read"] += total
        self._stats["max_records_per_key"] = max(self._stats["max_records_per_key"], total)
        key_id = DHTID.generate(source=key).to_bytes()
        records = []
        for subkey, entry in found.value.items():
            if subkey == self.identity.peer_id:
                continue
            parsed = self._parse(key, key_id, subkey, entry.value, entry.expiration_time)
            if parsed is not None:
                records.append(parsed)
        return records, total

    def _parse(self, key: str, key_id: bytes, subkey: object, value: object, expiration: float) -> tuple[Holder, Announce] | None:
        """Validated (holder, announce) of one DHT entry, None if invalid (counted once); cached by content."""
        if not isinstance(subkey, str) or not isinstance(value, bytes) or not isinstance(expiration, float):
            self._stats["bad_records"] += 1
            return None
        digest = hashlib.sha256(f"{key}|{subkey}|{expiration!r}|".encode() + value).digest()
        if digest in self._parsed:
            self._parsed.move_to_end(digest)
            cached = self._parsed[digest][1]
            return None if cached is None else (_holder(subkey, cached[1]), cached[1])
        record = DHTRecord(key_id, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration)
        reason, checked = self.validator.check(record)
        if checked is not None and checked[1].key != key:
            reason, checked = "key_not_bound", None
        self._parsed[digest] = (expiration, None if checked is None else (subkey, checked[1]))
        self._forget_parsed(get_dht_time())
        if checked is None:
            self._stats["bad_records"] += 1
            logger.debug("skipped bad gossip record under %s by %r: %s", key, subkey[:40], reason)
            return None
        try:
            return _holder(subkey, checked[1]), checked[1]
        except ValueError:
            self._parsed[digest] = (expiration, None)
            return None

    def _forget_parsed(self, now: float) -> None:
        """Drop the least recently seen records while they have expired or the cache is over its bound."""
        while self._parsed and (len(self._parsed) > _PARSED or next(iter(self._parsed.values()))[0] < now):
            self._parsed.popitem(last=False)


def replica_probe(key_id: DHTID) -> DHTID:
    """The id a replica lookup for `key_id` crawls towards: `key_id` with its lowest bit flipped.

    Its nearest peers are the key's: flipping one bit of the target flips the same bit of every
    peer's XOR distance, which reorders only two peers whose ids differ in that bit alone (never,
    for random 160-bit ids). But no peer holds a value under it, so no find reply of the crawl
    carries the key's records: hivemind's find answers with the whole key wherever it is stored,
    and the crawl asks all 5 replicas.
    """
    return DHTID(key_id ^ 1)


def _holder(subkey: str, announce: Announce) -> Holder:
    return Holder(subkey, PeerID.from_base58(announce.p2p), announce.maddrs)
