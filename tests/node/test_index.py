"""The rollout index's pure parts (node/swarm/index.py): placement fills a bounded tree, a walk costs
a bounded number of keys whatever the swarm's size, and its weights make every holder equally likely."""

from __future__ import annotations

import random
import statistics

from hivespec.node.swarm.index import (
    PLACEMENT_SPREAD,
    Candidate,
    choose_claims,
    descend,
    go_deeper,
    level_weight,
    placement_delay,
    placement_path,
)
from hivespec.protocol.announce import AnnouncedBody

SWARM = "index-test"
BUCKET = 123
CAP = 16


def fill(holders: int) -> dict[str, list[str]]:
    """Each holder's record on the first key of its placement path holding fewer than CAP (what gossip's placement does)."""
    keys: dict[str, list[str]] = {}
    for i in range(holders):
        peer = f"hs{i:016x}"
        for key in placement_path(SWARM, BUCKET, peer):
            if len(keys.setdefault(key, [])) < CAP:
                keys[key].append(peer)
                break
    return keys


def walk(keys: dict[str, list[str]], rng: random.Random) -> tuple[int, list[tuple[int, str]]]:
    """(keys read, (level, holder) met) of one reader's walk, as RolloutGossip._walk reads."""
    met, read = [], 0
    for level, key in descend(SWARM, BUCKET, rng):
        records = keys.get(key, [])
        read += 1
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


def test_weighted_sightings_are_unbiased_for_every_holder() -> None:
    """E[times met x level_weight] = walks for each holder, early placers at the root and late ones deep alike."""
    keys = fill(200)
    rng = random.Random(1)
    walks = 40_000
    weighted: dict[str, float] = {}
    for _ in range(walks):
        for level, peer in walk(keys, rng)[1]:
            weighted[peer] = weighted.get(peer, 0.0) + level_weight(level)
    estimates = [weighted.get(f"hs{i:016x}", 0.0) / walks for i in range(200)]
    assert abs(statistics.mean(estimates) - 1.0) < 0.05
    assert min(estimates) > 0.6 and max(estimates) < 1.5, (min(estimates), max(estimates))


def test_choose_claims_keeps_the_per_author_quota_and_skips_what_is_too_old() -> None:
    now = 1_000.0
    loud = [Candidate(AnnouncedBody("loud", bytes([i]) * 32, 100, now - 1, 1)) for i in range(20)]
    quiet = [Candidate(AnnouncedBody(f"quiet{i}", bytes([100 + i]) * 32, 100, now - 1, 1)) for i in range(3)]
    stale = [Candidate(AnnouncedBody("stale", bytes([200]) * 32, 100, now - 500, 1))]
    chosen = choose_claims(loud + quiet + stale, k=4, per_author=1, now=now, max_age_s=240, trust=lambda _a: 0.5,
                           explore=0.25, rng=random.Random(2))
    authors = [c.item.author for c in chosen]
    assert len(chosen) == 4 and authors.count("loud") == 1 and "stale" not in authors
