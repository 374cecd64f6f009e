"""The rollout index: fresh batches found by recency, in DHT keys of bounded size, sampled at bounded cost.

Nodes share no round numbers. A holder announces the batches it serves in the index of the
current time bucket (`bucket = floor(unix time / bucket_s)`), and a reader looks at the current
bucket, and at the previous one too where the current offers fewer than 2K batches it could take
(a small swarm, or a bucket's first `PLACEMENT_SPREAD` while holders move their records into it,
see Writing): what it sees is at most two buckets old.

Inside a bucket the records form a binary tree of DHT keys, `rollout_index_key(swarm, bucket,
level, prefix)`: level 0 is one key, level l has 2^l keys, and a holder's key at level l is the
first l bits of sha256(its peer id).
- **Writing** (`placement_path`): a holder's record goes to the first key on its path that holds
  fewer than `cap` other records, and stays there for the bucket (a re-store replaces its own
  subkey, adding no record). The tree grows a level each time the bucket's publishers double past
  `cap`, so a key holds at most `cap` records plus the few of writers racing for its last slot;
  storing peers refuse any new subkey past `dht_guard.MAX_RECORDS_PER_KEY`, whoever writes. A
  holder that wrote in the previous bucket moves to a new one at its own `placement_delay` into
  it, spread over the bucket's first third, so the swarm's placements do not all read a key's
  count in the same second (they did: 37 records in one key at cap 16 with 64 nodes). Until
  then its new batches join its previous record; when it moves, the fresh ones come along.
- **Finding our key** (`first_open`): keys fill root first, so along a path the full keys come
  before the open ones. A holder looks for that boundary from the level it expects (the deepest
  where it has read full keys at two prefixes, or the previous bucket's scaled to the holders moved in by now,
  `filled_by`), reading down or up from there: about 2 keys a bucket whatever the swarm's size,
  where reading from the root took one per level, and only a bucket's first holders read the root.
  Where the path showed deeper levels full than the holder knew, it reads one random key of that
  level beside its path (`probe_depth`): a level counts as full only from keys at two prefixes. It
  reads no deeper than `PLACEMENT_MARGIN` below the depth it knows, so a sybil that fills its path
  cannot bury its record where walks never reach (`place_on_path`, the whole placement).
- **Reading** (`descend`): from a start key drawn uniformly among the keys of levels 0..`top` (one
  above the deepest level where the reader has read full keys at two prefixes, `FullLevels`), down one random path; below a full key the reader goes
  on with probability `DESCEND` (1/2), so a walk reads at most 1/(1 - DESCEND) = 2 keys on average,
  whatever the swarm's size (a walk to the bottom would read log2(publishers / cap) + 1). Starting
  at the root, every walk of the swarm read the root, and its nearest replica answered them all:
  N / step reads a second, 1700/s at 10^5 nodes (docs/scale.md). Drawn over the 2^(top + 1) - 1
  keys above the boundary, each key is read by a share of walks that shrinks as the tree grows: a
  replica's reads stay bounded. A record at level l sits below full keys only (placement puts it at
  the first open key), so a walk meets it with probability sum over s <= min(l, top) of
  (DESCEND / 2)^(l - s) / (2^(top + 1) - 1), and sampling weighs it by the inverse,
  `level_weight(l, top)`: every publisher equally likely over time, early and late placers alike,
  whichever `top` each reader uses.
- **Choosing** (`choose_claims`): at most K batches a step among the fresh claims (not ours, not
  fetched, young enough, a policy version we accept), at most `per_author` from one author, drawn
  without replacement with weight level_weight(l) x trust x freshness, where trust mixes the author's peer
  score with a floor of `explore` (a newcomer with no score is still drawn, so every honest peer
  gets heard over time, and a few loud identities cannot crowd out the rest). With `fill`, slots the
  quota leaves empty, where fewer than K authors have a fresh batch (a small swarm), go to authors'
  further batches in the same draw's order: with no other author left there is nobody to crowd out. A
  step that waits for each peer's next batch (`swarm.expected_peers`) leaves it off: an author's
  second batch would be the one its next step waits for. With `informative_only`, a batch whose
  record says none of its samples carries a gradient (every group one reward) is not drawn: a step
  fetching for room in its pool would train on nothing of it (a slow node's step had spent its K
  on four such batches). The count is the holder's claim, checked on fetch (`rollouts.py`).

Pure functions over plain data (`first_open` over the reads it is given): `rollouts.py` does the DHT reads and
writes, `fetching.py` the downloads.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from hivespec.protocol.announce import AnnouncedBody
from hivespec.protocol.keys import MAX_INDEX_LEVEL, rollout_index_key

Claim = tuple[bytes, str, int]  # (sha256, author, size): one announced body


def bucket_of(unix_time: float, bucket_s: float) -> int:
    """The index bucket a moment falls in."""
    return int(unix_time // bucket_s)


def prefix_of(peer_id: str, level: int) -> int:
    """The first `level` bits of sha256(peer id): the holder's key at that level of the tree."""
    if level == 0:
        return 0
    digest = int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big")
    return digest >> (32 - level)


def placement_path(swarm: str, bucket: int, peer_id: str) -> list[str]:
    """A holder's keys in `bucket`, root first: it writes to the first one not full."""
    return [rollout_index_key(swarm, bucket, level, prefix_of(peer_id, level)) for level in range(MAX_INDEX_LEVEL + 1)]


PLACEMENT_SPREAD = 1 / 3  # of a bucket: the span over which holders move their records into it
# Levels below the depth a holder knows (`FullLevels`) that its placement reads down to at most. Keys fill root first,
# so a path's first open key is seldom more than two levels below the deepest level read full at two prefixes; where
# it is (a lone full key with a full child, a swarm that just grew), the record makes a key one over the cap. Without
# the bound, a sybil that fills a holder's path puts the holder's record at its bottom, where walks almost never reach.
PLACEMENT_MARGIN = 2


def placement_delay(peer_id: str, bucket: int, bucket_s: float) -> float:
    """Seconds into `bucket` at which a holder that wrote in the previous bucket places its record in this one.

    Spread evenly over the first `PLACEMENT_SPREAD` of the bucket by a hash of (peer, bucket), a new
    draw each bucket. Until then the holder's new batches join its record in the previous bucket,
    which readers also read early in a bucket (see the module docstring).
    """
    digest = hashlib.sha256(f"{peer_id}|{bucket}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * PLACEMENT_SPREAD * bucket_s


DESCEND = 0.5  # probability that a walk goes on below a full key


def level_weight(level: int, top: int = 0) -> float:
    """The inverse of the probability that a walk starting at a uniform key of levels 0..`top` meets a given record at `level`."""
    step = DESCEND / 2  # go on below a full key, and take the record's child of the two
    met = sum(step ** (level - start) for start in range(min(level, top) + 1)) / (2 ** (top + 1) - 1)
    return 1.0 / met


def go_deeper(records: int, cap: int, rng: random.Random) -> bool:
    """Whether a walk that just read a key holding `records` goes on to the next level."""
    return records >= cap and rng.random() < DESCEND


def descend(swarm: str, bucket: int, rng: random.Random, top: int = 0) -> Iterable[tuple[int, int, str]]:
    """(level, prefix, key) of one random path of `bucket`'s tree from a start key drawn uniformly among levels 0..`top`'s
    2^(top + 1) - 1 keys; the reader reads keys until `go_deeper` says no."""
    start = 1 + rng.randrange(2 ** (top + 1) - 1)  # keys numbered as a heap: key n is at level log2(n), prefix n - 2^level
    first = start.bit_length() - 1
    prefix = start - (1 << first)
    for level in range(first, MAX_INDEX_LEVEL + 1):
        yield level, prefix, rollout_index_key(swarm, bucket, level, prefix)
        prefix = 2 * prefix + rng.getrandbits(1)


def filled_by(depth: int, elapsed_s: float, bucket_s: float) -> int:
    """The deepest level likely full `elapsed_s` into a bucket whose previous one was full down to `depth` (-1: none).

    Holders move into a bucket over its first `PLACEMENT_SPREAD`; levels 0..d hold 2^(d + 1) - 1 keys, so when a
    share f of the previous bucket's holders has moved, the levels down to log2(f (2^(depth + 1) - 1) + 1) - 1 are full.
    """
    moved = min(1.0, max(0.0, elapsed_s / (PLACEMENT_SPREAD * bucket_s)))
    return math.floor(math.log2(moved * (2 ** (depth + 1) - 1) + 1)) - 1


class FullLevels:
    """The keys a reader has read full, by bucket, and the deepest level it takes to be full from them.

    A level counts as full once keys at two of its prefixes were read full (level 0: its one key). A reader's
    placement path follows its peer id, which its records give away; one key read full a level was enough, so a
    sybil that filled that path's keys down to level 24 (4 records a level, 100 a bucket) made the reader start its
    walks among millions of keys, nearly all empty: each read a 10-peer crawl, and no batch found. A walk's keys are
    drawn at random, so passing a level off as full takes filling the keys of that level, as many records as the
    swarm writes there. The path keeps its prefixes from bucket to bucket, so only the prefixes of several buckets
    are pooled (`depth(..., buckets=n)`), and a placement reads one random key beside its path (`probe_depth`):
    walks alone, a few a bucket starting near the root, still took a tree of 5000 holders 3 levels too shallow after
    8 buckets at 2 steps a bucket.
    """

    def __init__(self, buckets_kept: int) -> None:
        self._kept = buckets_kept
        self._full: dict[int, dict[int, set[int]]] = {}  # bucket -> level -> prefixes of the keys read full

    def saw(self, bucket: int, level: int, prefix: int, full: bool) -> None:
        """Note a read of the key at (`level`, `prefix`) of `bucket`'s tree that found it full or not."""
        if not full:
            return
        self._full.setdefault(bucket, {}).setdefault(level, set()).add(prefix)
        for old in [b for b in self._full if b <= bucket - self._kept]:
            del self._full[old]

    def depth(self, bucket: int, *, buckets: int = 1) -> int:
        """The deepest level with keys at two prefixes read full (-1: none) in `bucket` and the `buckets` - 1 before it;
        the levels above it fill first."""
        prefixes: dict[int, set[int]] = {}
        for b in range(bucket - buckets + 1, bucket + 1):
            for level, seen in self._full.get(b, {}).items():
                prefixes.setdefault(level, set()).update(seen)
        return max((level for level, seen in prefixes.items() if len(seen) >= min(2, 2**level)), default=-1)


async def first_open(is_open: Callable[[int], Awaitable[bool]], guess: int, deepest: int = MAX_INDEX_LEVEL) -> int:
    """The level of the first open key (fewer than cap records) on a placement path, read from level `guess` up or down.

    Keys fill root first, so along a path full keys come before open ones; where none is open down to `deepest`,
    `deepest` (its key takes one record more than the cap).
    """
    deepest = min(deepest, MAX_INDEX_LEVEL)
    level = min(max(guess, 0), deepest)
    if await is_open(level):
        while level > 0 and await is_open(level - 1):
            level -= 1
        return level
    while level < deepest:
        level += 1
        if await is_open(level):
            return level
    return level


async def probe_depth(is_full: Callable[[int, int], Awaitable[bool]], path_depth: int, known: int, own: Callable[[int], int],
                      rng: random.Random) -> None:
    """After a placement found our path full down to `path_depth`: read a random key of that level off our path, and
    one of the level above where that one is open, unless `known` (`FullLevels.depth`) is already that deep.

    `is_full(level, prefix)` reads a key (and notes it in FullLevels); `own(level)` is our path's prefix there. Our
    path alone is evidence a sybil can fake; a key of the same level beside it, drawn at random, is not.
    """
    for level in (path_depth, path_depth - 1):
        if level < 1 or known >= level:
            return
        if await is_full(level, own(level) ^ (1 + rng.randrange(2**level - 1))):  # any prefix of the level but ours
            return


async def place_on_path(is_full: Callable[[int, int], Awaitable[bool]], own: Callable[[int], int], guess: int, known: int,
                        rng: random.Random) -> int:
    """The level of our record's key in a bucket: the first open key of our path read from level `guess` (`first_open`),
    no deeper than `PLACEMENT_MARGIN` below `known` (`FullLevels.depth`; -1, a newcomer's, reads on down), then
    `probe_depth` beside our path.

    `is_full(level, prefix)` reads a key (and notes it in FullLevels); `own(level)` is our path's prefix there. The
    bound is what keeps a sybil that fills our path from putting our record at its bottom, where walks almost never reach.
    """

    async def is_open(level: int) -> bool:
        return not await is_full(level, own(level))

    deepest = known + PLACEMENT_MARGIN if known >= 0 else MAX_INDEX_LEVEL
    level = await first_open(is_open, guess, deepest)  # full there, we read on one level down
    # What our path showed full counts once a key beside it agrees: a sybil can fill our path, not the level.
    await probe_depth(is_full, level - 1, known, own, rng)
    return level


@dataclass
class Candidate:
    """One announced body as the reader saw it: who holds it and how much its record weighs."""

    item: AnnouncedBody
    holders: list = field(default_factory=list)  # gossip's holders (peer, p2p id, maddrs), in the order seen
    weight: float = 1.0  # level_weight of the record it was met in (the largest, if met in several)

    @property
    def claim(self) -> Claim:
        return self.item.sha256, self.item.author, self.item.size


def choose_claims(
    candidates: Sequence[Candidate],
    *,
    k: int,
    per_author: int,
    now: float,
    max_age_s: float,
    trust: Callable[[str], float],
    explore: float,
    rng: random.Random,
    version_ok: Callable[[int], bool] | None = None,
    fill: bool = False,
    informative_only: bool = False,
) -> list[Candidate]:
    """Up to `k` candidates drawn without replacement, at most `per_author` of one author; with `fill`, where that
    leaves slots empty, authors' further claims in the draw's order (see the module docstring).

    `trust(author)` is in [0, 1] (0.5 for a peer we never heard from); a candidate older than
    `max_age_s`, born in the future by more than a bucket's slack, whose version `version_ok`
    refuses, or, with `informative_only`, announced with no informative sample, is never chosen
    (one that does not say, -1, may be). Efraimidis-Spirakis keys (u^(1/w)) give a weighted sample in one sort.
    """
    keyed = []
    for candidate in candidates:
        item = candidate.item
        age = now - item.born
        if not -60.0 <= age <= max_age_s or (version_ok is not None and not version_ok(item.version)):
            continue
        if informative_only and item.informative == 0:
            continue
        freshness = max(0.05, 1.0 - max(age, 0.0) / max_age_s)
        weight = candidate.weight * (explore + (1.0 - explore) * min(max(trust(item.author), 0.0), 1.0)) * freshness
        if weight <= 0:
            continue
        keyed.append((math.log(rng.random() or 1e-300) / weight, candidate))
    keyed.sort(key=lambda pair: pair[0], reverse=True)
    chosen: list[Candidate] = []
    beyond_quota: list[Candidate] = []
    taken: dict[str, int] = {}
    for _, candidate in keyed:
        author = candidate.item.author
        if taken.get(author, 0) >= per_author:
            beyond_quota.append(candidate)
            continue
        taken[author] = taken.get(author, 0) + 1
        chosen.append(candidate)
        if len(chosen) >= k:
            return chosen
    if fill:  # every author with a fresh batch has its quota and K is not reached: nobody is left to crowd out
        chosen += beyond_quota[:k - len(chosen)]
    return chosen


def trust_from_score(score: float) -> float:
    """A peer score (gossipsub-style: 0 unknown, positive for deliveries, below -50 graylisted) as trust in [0, 1]."""
    return 1.0 / (1.0 + math.exp(-score / 10.0))
