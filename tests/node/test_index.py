"""The rollout index's pure parts (node/swarm/index.py): placement fills a bounded tree, a walk costs
a bounded number of keys whatever the swarm's size, and its weights make every holder equally likely."""

from __future__ import annotations

import asyncio
import random
import statistics
from collections import Counter

from hivespec.node.swarm.index import (
    PLACEMENT_MARGIN,
    PLACEMENT_SPREAD,
    Candidate,
    FullLevels,
    choose_claims,
    descend,
    filled_by,
    first_open,
    go_deeper,
    level_weight,
    place_on_path,
    placement_delay,
    placement_path,
    prefix_of,
)
from hivespec.protocol.announce import AnnouncedBody
from hivespec.protocol.keys import MAX_INDEX_LEVEL, rollout_index_key

SWARM = "index-test"
BUCKET = 123
CAP = 16


def fill(holders: int, bucket: int = BUCKET) -> dict[str, list[str]]:
    """Each holder's record on the first key of its placement path holding fewer than CAP (what gossip's placement does)."""
    keys: dict[str, list[str]] = {}
    for i in range(holders):
        peer = f"hs{i:016x}"
        for key in placement_path(SWARM, bucket, peer):
            if len(keys.setdefault(key, [])) < CAP:
                keys[key].append(peer)
                break
    return keys


def walk(keys: dict[str, list[str]], rng: random.Random, top: int = 0, reads: Counter | None = None) -> tuple[int, list[tuple[int, str]]]:
    """(keys read, (level, holder) met) of one reader's walk, as RolloutGossip._walk reads; `reads` counts each key read."""
    met, read = [], 0
    for level, _prefix, key in descend(SWARM, BUCKET, rng, top):
        records = keys.get(key, [])
        read += 1
        if reads is not None:
            reads[key] += 1
        met += [(level, peer) for peer in records]
        if not go_deeper(len(records), CAP, rng):
            break
    return read, met


def test_no_key_holds_more_than_the_cap_and_the_tree_grows_a_level_per_doubling() -> None:
    for holders, depth in ((8, 1), (16, 1), (100, 3), (2000, 7)):
        keys = fill(holders)
        assert max(len(records) for records in keys.values()) <= CAP
        assert sum(len(records) for records in keys.values()) == holders
        levels = {int(key.split("/")[-2]) for key, records in keys.items() if records}
        assert max(levels) + 1 <= depth + 2, (holders, sorted(levels))


def test_holders_move_into_a_new_bucket_spread_over_its_first_third() -> None:
    """Placements at a bucket's start are spread evenly (so they do not all read a key's count in the same second),
    each holder at a new moment each bucket."""
    bucket_s = 30.0
    delays = [placement_delay(f"hs{i:016x}", BUCKET, bucket_s) for i in range(4000)]
    assert all(0 <= d < PLACEMENT_SPREAD * bucket_s for d in delays)
    tenth = PLACEMENT_SPREAD * bucket_s / 10
    tenths = [sum(k * tenth <= d < (k + 1) * tenth for d in delays) for k in range(10)]
    assert min(tenths) > 300 and max(tenths) < 500  # about 400 in each tenth of the spread
    assert placement_delay("hs1", BUCKET, bucket_s) == placement_delay("hs1", BUCKET, bucket_s)
    assert len({round(placement_delay("hs1", b, bucket_s), 6) for b in range(50)}) == 50


def test_a_walk_reads_about_two_keys_whatever_the_swarm_size() -> None:
    rng = random.Random(0)
    for holders in (16, 100, 2000):
        keys = fill(holders)
        reads = [walk(keys, rng)[0] for _ in range(4000)]
        assert statistics.mean(reads) <= 2.05, (holders, statistics.mean(reads))


def full_depth(keys: dict[str, list[str]]) -> int:
    """The deepest level holding a full key (what a reader that has read it takes as its walks' `top`)."""
    return max(int(key.split("/")[-2]) for key, records in keys.items() if len(records) >= CAP)


def test_weighted_sightings_are_unbiased_for_every_holder_whatever_the_start_levels() -> None:
    """E[times met x level_weight] = walks for each holder, early placers at the root and late ones deep alike,
    for walks from the root (top 0) and from any key above the deepest full level."""
    keys = fill(200)
    for top in (0, full_depth(keys)):
        rng = random.Random(1)
        walks = 40_000
        weighted: dict[str, float] = {}
        for _ in range(walks):
            for level, peer in walk(keys, rng, top)[1]:
                weighted[peer] = weighted.get(peer, 0.0) + level_weight(level, top)
        estimates = [weighted.get(f"hs{i:016x}", 0.0) / walks for i in range(200)]
        assert abs(statistics.mean(estimates) - 1.0) < 0.05, top
        assert min(estimates) > 0.6 and max(estimates) < 1.5, (top, min(estimates), max(estimates))


def test_no_key_is_read_by_every_walk_once_walks_start_above_the_full_depth() -> None:
    """From the root, every walk reads the root key (its replica answers the whole swarm); started uniformly among
    the keys above the deepest full level (one level up, as gossip does), the busiest key's share of the walks falls
    as the swarm grows, and a walk still reads about 2 keys."""
    rng = random.Random(3)
    busiest = {}
    for holders in (500, 5000):
        keys = fill(holders)
        top = full_depth(keys) - 1
        reads: Counter = Counter()
        walks = 4000
        spent = [walk(keys, rng, top, reads)[0] for _ in range(walks)]
        assert statistics.mean(spent) <= 2.05, (holders, statistics.mean(spent))
        busiest[holders] = max(reads.values()) / walks
        root = Counter()
        for _ in range(200):
            walk(keys, rng, 0, root)
        assert root.most_common(1)[0][1] == 200  # from the root: the root, every time
    assert busiest[500] < 0.2 and busiest[5000] < busiest[500] / 4, busiest


def test_a_placement_finds_the_first_open_key_from_its_guess_in_a_few_reads() -> None:
    """`first_open` from any guess lands where reading from the root would, in |guess - level| + 2 reads at most."""
    keys = fill(500)
    depth = full_depth(keys)
    for i in range(500, 540):
        peer = f"hs{i:016x}"
        path = placement_path(SWARM, BUCKET, peer)
        expected = next(level for level, key in enumerate(path) if len(keys.get(key, [])) < CAP)
        for guess in (0, depth, depth + 1, depth + 3):
            read: list[int] = []

            async def is_open(level: int, path: list[str] = path, read: list[int] = read) -> bool:
                read.append(level)
                return len(keys.get(path[level], [])) < CAP

            assert asyncio.run(first_open(is_open, guess)) == expected
            assert len(read) <= abs(guess - expected) + 2, (guess, expected, read)
            assert 0 not in read or expected <= 1 or guess == 0  # the root only when the tree is that shallow


def test_the_levels_taken_as_full_grow_with_the_share_of_holders_moved_in() -> None:
    assert filled_by(-1, 100.0, 30.0) == -1  # nothing seen: walks start at the root, placements read from it
    assert filled_by(4, 0.0, 30.0) == -1 and filled_by(4, 1e9, 30.0) == 4
    spread = PLACEMENT_SPREAD * 30.0
    levels = [filled_by(4, spread * k / 20, 30.0) for k in range(21)]
    assert levels == sorted(levels) and levels[-1] == 4
    assert filled_by(4, spread / 2, 30.0) == 3  # half of 31 keys' holders have moved: 15 keys, levels 0..3


async def place(levels: FullLevels, keys: dict[str, list[str]], bucket: int, peer: str, rng: random.Random) -> int:
    """One placement as RolloutGossip.placed_key makes it (`place_on_path` from the level we expect and the depth we
    know), every key read noted in `levels`. Returns the level placed at."""

    async def is_full(level: int, prefix: int) -> bool:
        full = len(keys.get(rollout_index_key(SWARM, bucket, level, prefix), [])) >= CAP
        levels.saw(bucket, level, prefix, full)
        return full

    return await place_on_path(is_full, lambda at: prefix_of(peer, at), expected_depth(levels, bucket),
                               levels.depth(bucket, buckets=4), rng)


def expected_depth(levels: FullLevels, bucket: int) -> int:
    """RolloutGossip._full_depth late in a bucket: what this bucket's reads showed, or the buckets' before."""
    return max(levels.depth(bucket), levels.depth(bucket - 1, buckets=3))


def reader_buckets(peer: str, steps: int, rng: random.Random, sybil: bool) -> tuple[FullLevels, list[int], list[int]]:
    """Four buckets of one reader's steps, as RolloutGossip takes them: a placement a bucket (`place`), and a walk a
    step from one level above the deepest it takes to be full. With `sybil`, every key of the reader's placement path is filled to
    the cap in every bucket. Returns its FullLevels, the levels it placed at, and the holders (the sybil's aside)
    each walk met."""
    levels, placed, met = FullLevels(buckets_kept=4), [], []
    for bucket in range(BUCKET, BUCKET + 4):
        keys = fill(500, bucket)
        if sybil:
            for level, key in enumerate(placement_path(SWARM, bucket, peer)):
                keys.setdefault(key, []).extend(f"sybil{level}-{i}" for i in range(CAP - len(keys.get(key, []))))
        placed.append(asyncio.run(place(levels, keys, bucket, peer, rng)))  # once a bucket
        met += [learning_walk(levels, keys, bucket, rng) for _ in range(steps)]
    return levels, placed, met


def learning_walk(levels: FullLevels, keys: dict[str, list[str]], bucket: int, rng: random.Random) -> int:
    """One walk as RolloutGossip._walk takes it, from one level above the deepest it takes to be full, every key read
    noted in `levels`; returns the holders it met, a sybil's aside."""
    honest = 0
    for level, prefix, key in descend(SWARM, bucket, rng, max(0, expected_depth(levels, bucket) - 1)):
        records = keys.get(key, [])
        levels.saw(bucket, level, prefix, len(records) >= CAP)
        honest += sum(1 for r in records if not r.startswith("sybil"))
        if not go_deeper(len(records), CAP, rng):
            break
    return honest


def test_a_sybil_filling_one_readers_placement_path_does_not_send_its_walks_below_the_tree() -> None:
    """A sybil fills every key of the victim's placement path (its peer id gives it away) to the cap, down to the
    last level, bucket after bucket: the victim must not take the sybil's chain for the tree, and its walks keep
    meeting holders."""
    honest_deepest = full_depth(fill(500))  # the deepest level with a full key, the sybil's aside
    levels, placed, met = reader_buckets("hs-victim", 10, random.Random(5), sybil=True)
    # Knowing no depth yet, its first placement read the sybil's full keys down to the bottom; from then on no deeper
    # than PLACEMENT_MARGIN below what it knows, where walks still reach its record.
    assert placed[0] == MAX_INDEX_LEVEL and max(placed[1:]) <= honest_deepest + PLACEMENT_MARGIN, placed
    last = BUCKET + 3
    assert 0 < levels.depth(last, buckets=4) <= honest_deepest, (levels.depth(last, buckets=4), honest_deepest)
    assert statistics.mean(met) >= CAP, statistics.mean(met)  # about a key's worth of holders a walk, not an empty crawl


def test_a_slow_reader_learns_the_trees_depth_in_its_first_bucket() -> None:
    """Two steps a bucket (a node of 15-s steps): its placement and the probe beside its path show it the levels whose
    keys are all full from the first bucket, so its walks start among the levels above them, not at the root."""
    keys = fill(500)
    every_key_full = min(int(key.split("/")[-2]) for key, records in keys.items() if len(records) < CAP) - 1
    for seed in range(4):
        levels, placed, _ = reader_buckets(f"hs-slow{seed}", 2, random.Random(seed), sybil=False)
        assert levels.depth(BUCKET) >= every_key_full, (seed, levels.depth(BUCKET), every_key_full)
        assert levels.depth(BUCKET + 3, buckets=4) <= full_depth(keys) and max(placed) <= full_depth(keys) + 1


def test_bounding_the_placement_below_the_known_depth_moves_no_honest_record() -> None:
    """With every holder placing as RolloutGossip does, from the depth it learnt in the bucket before, PLACEMENT_MARGIN
    binds almost never: the same keys as reading on down to the first open one."""
    before, unbounded, bounded, rng = fill(2000), fill(2000, BUCKET + 1), {}, random.Random(7)
    for i in range(2000):
        peer = f"hs{i:016x}"
        levels = FullLevels(buckets_kept=4)
        asyncio.run(place(levels, before, BUCKET, peer, rng))  # what a holder learns in a bucket: a placement, 2 walks
        for _ in range(2):
            learning_walk(levels, before, BUCKET, rng)
        level = asyncio.run(place(levels, bounded, BUCKET + 1, peer, rng))
        bounded.setdefault(placement_path(SWARM, BUCKET + 1, peer)[level], []).append(peer)
    moved = sum(len(set(records) ^ set(bounded.get(key, []))) for key, records in unbounded.items()) / 2
    assert moved <= 2000 * 0.01, moved
    assert max(len(records) for records in bounded.values()) <= CAP + 1


def test_full_levels_count_a_level_once_keys_at_two_of_its_prefixes_were_read_full() -> None:
    levels = FullLevels(buckets_kept=3)
    levels.saw(7, 0, 0, True)
    levels.saw(7, 3, 5, True)
    levels.saw(7, 3, 5, True)  # the same key again
    levels.saw(7, 4, 1, False)
    assert levels.depth(7) == 0 and levels.depth(6) == -1
    levels.saw(8, 3, 5, True)  # the same prefix in the next bucket: a placement path's key, bucket after bucket
    assert levels.depth(8, buckets=2) == 0
    levels.saw(8, 3, 6, True)  # a second prefix: the level is full, below the root, which bucket 8 has not read yet
    assert levels.depth(8) == 3 and levels.depth(8, buckets=2) == 3
    levels.saw(10, 0, 0, True)  # buckets as old as buckets_kept before the newest are forgotten
    assert levels.depth(7) == -1 and levels.depth(10, buckets=3) == 3


def test_choose_claims_keeps_the_per_author_quota_and_skips_what_is_too_old() -> None:
    now = 1_000.0
    loud = [Candidate(AnnouncedBody("loud", bytes([i]) * 32, 100, now - 1, 1)) for i in range(20)]
    quiet = [Candidate(AnnouncedBody(f"quiet{i}", bytes([100 + i]) * 32, 100, now - 1, 1)) for i in range(3)]
    stale = [Candidate(AnnouncedBody("stale", bytes([200]) * 32, 100, now - 500, 1))]
    chosen = choose_claims(loud + quiet + stale, k=4, per_author=1, now=now, max_age_s=240, trust=lambda _a: 0.5,
                           explore=0.25, rng=random.Random(2))
    authors = [c.item.author for c in chosen]
    assert len(chosen) == 4 and authors.count("loud") == 1 and "stale" not in authors


def test_choose_claims_fills_k_from_authors_further_batches_only_when_no_other_author_is_left() -> None:
    """A small swarm: two authors with three fresh batches each. With `fill`, K = 2 takes one of each; K = 4 takes one
    of each and two more from whoever the draw favours; K = 8 takes all six (and never the stale one). Without it
    (a step waiting for each peer's next batch), one of each whatever K."""
    now = 1_000.0
    claims = [Candidate(AnnouncedBody(author, bytes([n, i]) * 16, 100, now - 1 - i, 1))
              for n, author in enumerate(("a", "b")) for i in range(3)]
    claims.append(Candidate(AnnouncedBody("c", bytes([9]) * 32, 100, now - 500, 1)))

    def draw(k: int, seed: int, fill: bool = True) -> list[str]:
        return [c.item.author for c in choose_claims(claims, k=k, per_author=1, now=now, max_age_s=240,
                                                     trust=lambda _a: 0.5, explore=0.25, rng=random.Random(seed), fill=fill)]

    for seed in range(20):
        assert sorted(draw(2, seed)) == ["a", "b"]
        four = draw(4, seed)
        assert len(four) == 4 and sorted(four[:2]) == ["a", "b"]  # the quota's picks first
        assert sorted(draw(8, seed)) == ["a"] * 3 + ["b"] * 3
        assert sorted(draw(8, seed, fill=False)) == ["a", "b"]


def test_the_fill_never_lets_a_loud_trusted_author_crowd_out_a_quiet_one() -> None:
    """A loud author (eight fresh batches, the best score) beside two quiet ones (one batch each, a poor score): with
    `fill`, K = 4 takes each quiet author's batch first and gives the loud one the two slots left, whatever the draw;
    K = 2 takes two authors, never two of the loud one's."""
    now = 1_000.0
    claims = [Candidate(AnnouncedBody("loud", bytes([1, i]) * 16, 100, now - 1 - i, 1)) for i in range(8)]
    claims += [Candidate(AnnouncedBody(author, bytes([n, 9]) * 16, 100, now - 30, 1)) for n, author in enumerate(("q1", "q2"), 2)]
    trust = {"loud": 1.0, "q1": 0.05, "q2": 0.05}

    def draw(k: int, seed: int) -> list[str]:
        return [c.item.author for c in choose_claims(claims, k=k, per_author=1, now=now, max_age_s=240,
                                                     trust=trust.__getitem__, explore=0.25, rng=random.Random(seed), fill=True)]

    for seed in range(50):
        assert sorted(draw(4, seed)) == ["loud", "loud", "q1", "q2"]
        two = draw(2, seed)
        assert len(set(two)) == 2


def test_a_step_fetching_to_train_never_draws_a_batch_its_record_calls_flat() -> None:
    """With `informative_only` a batch announced with no sample that carries a gradient (0) is never drawn, whatever its
    author's trust or freshness; one whose holder does not say (-1) may be, as without it; without it the flat batch is
    drawn like any other (a step that fetches for the drafter or waits for its peers' next batch)."""
    now = 1_000.0
    flat = [Candidate(AnnouncedBody(f"flat{i}", bytes([i]) * 32, 100, now - 1, 1, 0)) for i in range(6)]
    unsaid = Candidate(AnnouncedBody("unsaid", bytes([50]) * 32, 100, now - 200, 1, -1))
    informative = Candidate(AnnouncedBody("informative", bytes([60]) * 32, 100, now - 200, 1, 4))
    trust = {**{c.item.author: 1.0 for c in flat}, "unsaid": 0.0, "informative": 0.0}

    def draw(seed: int, informative_only: bool) -> set[str]:
        chosen = choose_claims(flat + [unsaid, informative], k=4, per_author=1, now=now, max_age_s=240,
                               trust=trust.__getitem__, explore=0.25, rng=random.Random(seed), informative_only=informative_only)
        return {c.item.author for c in chosen}

    for seed in range(20):
        assert draw(seed, True) == {"unsaid", "informative"}
        assert len(draw(seed, False)) == 4
    assert any(draw(seed, False) & {c.item.author for c in flat} for seed in range(20))
