"""What one node pays per step for rollout sharing by recency, from 8 to 10^5 nodes: the design's arithmetic, checked against bench/swarm_scale.py.

Pure Python, no network, well under a second. Per node-step, from the design (node/swarm/index.py,
gossip.py, records.py) and hivemind's DHT (node.py, traverse.py, protocol.py):

  holders per bucket      H = N: every node keeps one record in every 30-s bucket (its own batch, re-announced
                          for announce_seconds, plus relayed ones)
  records per key         r = min(H, cap * overfill): the tree fills top-down, a key takes `cap` records plus the few
                          writers racing for its last slot (overfill, measured)
  keys per walk           a walk starts at a key drawn uniformly among the 2^(L-1) - 1 keys of levels 0..L-2 (L the first
                          level not full, H <= r (2^(L+1) - 1); the root where L <= 2), and below a full key goes on
                          with probability DESCEND = 1/2, down to level L (L + 1 where level L is exactly full: the walk
                          reads the empty key below it): E = sum over start levels s (weight 2^s) of sum of DESCEND^j
                          over j = 0..L - s, under 2 whatever N (`walks_from_root`: every walk from the root, as before)
  walks per step          1 + prev_share: the previous bucket is read where the current one offers fewer than 2K
                          batches: most steps of a small swarm, a bucket's first seconds (before holders move in) of
                          a large one; fitted at each measured N, the largest N's share beyond it
  DHT gets                walks * E (index reads) + placement reads * step_s / bucket_s (placing our record once a
                          bucket: 2 reads from the level it expects, index.first_open; L + 1 from the root before)
  DHT stores              1 (publish) + relay_stores + step_s / bucket_s (the keep-announcing re-store, once a bucket)
  replica lookups         step_s / bucket_s: the first store under a key (once a bucket) finds its replicas, later
                          stores write straight to them (records.py)
  RPCs                    an index read and a placement read stop at the first replica with a fresh record:
                          read_workers + hops RPCs, hops = log2(N / beam), none where the node is one of the key's
                          replicas itself (replicas / N of the keys: its own copy answers); a replica lookup crawls
                          its beam of 10: min(N - 1, lookup_beam + hops) (hivemind's store crawled 20);
                          a store sends `replicas` store RPCs
  record copies           every replica a find reaches answers with the whole key: replies * r per index or placement
                          read (replies fitted, about 1); none per replica lookup, which crawls towards the key's id
                          with its lowest bit flipped (records.replica_probe); replicas * r per lookup before
  bytes                   2 * k_fill * K * body (in + out) + find RPCs * rpc_bytes + copies * entry_bytes
                          + store RPCs * (record_bytes + rpc_bytes) + idle upkeep (measured, per node-step)
  k_fill                  a node of period T can take at most one new batch per author per step:
                          min(K, sum over others of min(1, T / T_j)) / K, averaged over node-steps

rpc_bytes, entry_bytes, replies and prev_share (per N) are fitted to the bench's measured points (`--measured FILE`,
the bench's RESULT line or its JSON, refits them and prints model and measurement side by side; the
defaults come from the run in docs/scale.md). record_bytes is measured on the real encoder when hivespec
is importable (a sealed record with a holder's 2 newest own batches). Variants: `lookup_every_store` is the design measured
on 2026-11-24 (hivemind's store, which looks the replicas up every time, and placement reads that crawl
the beam); `crawl_full_walks` the design before that (every read crawls the beam with hivemind's caching
on, walks go to the bottom of the tree, both buckets read every step); `walks_from_root` the design until
2026-11-26 (every walk and placement read from the root, whose replicas then answer the whole swarm:
`hot_key`); `coalesced_stores` a lever not built (a node stores its record at most once per 10 s).

The fitted pair (rpc_bytes, entry_bytes) is not what the wire shows (docs/scale.md, "How far to trust
the rows past 64"), and the hops term is checked against `FullTables`: early-stopping reads simulated
over routing tables as full as hivemind's k-bucket rules allow (printed as read_rpcs, model beside
simulation, at 64 to 10^5 nodes; about a second).

    python bench/scale_model.py                       # N = 8 .. 10^5
    python bench/scale_model.py --measured run.json   # also the bench's points, model beside measurement

Ends with one line `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import itertools
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

MAX_INDEX_LEVEL = 24  # protocol/keys.py
SIZES_N = (8, 16, 32, 64, 100, 1_000, 10_000, 100_000)


@dataclass(frozen=True)
class Design:
    """The knobs the per-node cost depends on (swarm config, hivemind defaults, the bench's load), and the fitted ones."""

    k: int = 4  # swarm.max_foreign_batches
    body_bytes: float = 80_000  # mean batch: half the nodes 10 KB, half 150 KB (the bench's mix)
    cap: int = 4  # swarm.index_key_records
    overfill: float = 1.25  # records a full key holds / cap: writers racing for its last slot (measured 1.2-1.4)
    bucket_s: float = 30.0  # swarm.index_bucket_s
    fastest_s: float = 2.0  # step periods log-even over [fastest_s, spread * fastest_s] (the bench's load)
    spread: float = 10.0
    descend: float = 0.5  # index.DESCEND
    replicas: int = 5  # hivemind num_replicas
    beam: int = 20  # hivemind bucket_size = beam_size
    lookup_beam: int = 10  # the replica lookup's beam (records.py: twice the replicas)
    read_workers: int = 1  # records.read's requests in flight for an index read
    relay_stores: float = 0.2  # relayed-batch re-stores per step (coalesced; measured 0.1-0.3)
    store_every_s: float = 0.0  # 0: a store per publish (as built); > 0: at most one store per this many seconds
    direct_stores: bool = True  # as built: stores go straight to a key's replicas, looked up once a bucket
    lookup_copies: bool = False  # the design before: a replica lookup crawled the key's own id, whose replicas answer with it
    crawl_placement: bool = False  # the design before: placement reads crawl the beam for the newest copy
    walks_from_root: bool = False  # the design before: walks start at the root, placements read their path from it
    record_bytes: float = 616  # a sealed index record with 2 items (see record_size())
    rpc_bytes: float = 1116  # wire bytes per DHT RPC besides records: request, neighbours, TLS/yamux/TCP (fitted)
    entry_bytes: float = 7121  # wire bytes per record copy in a find reply (record + subkey + expiration + framing; fitted)
    replies: float = 1.0  # replicas that answer an early-stopping index read with the key (fitted)
    prev_share: tuple[tuple[int, float], ...] = ((8, 0.627), (16, 0.143), (32, 0.131), (64, 0.048))  # (N, steps that also read the previous bucket), fitted
    idle_bytes_per_node_s: float = 153.0  # libp2p and DHT upkeep of a joined node (measured at N = 8)
    crawl_reads: bool = False  # the design before: every read crawls the beam, walks to the bottom, both buckets
    caching: bool = False  # the design before: hivemind's caching on (cached copies answer too; a push per get)
    cached_share: float = 0.45  # with caching: share of the crawled non-replica peers answering with a cached copy


def record_size(items: int = 2) -> int | None:
    """Bytes of a sealed index record with `items` items, from the real encoder (None when hivespec is not importable)."""
    try:
        import os

        from hivespec.protocol.announce import Announce, AnnouncedBody, encode_announce
        from hivespec.protocol.envelope import Kind, seal
        from hivespec.protocol.identity import Identity
    except ImportError:
        return None
    me = Identity.generate()
    p2p = "12D3KooW" + "A" * 44
    body = encode_announce(Announce(
        "hivespec/public/rollouts/59000000/12/2048", 1.7e9, p2p, (f"/ip4/203.0.113.10/tcp/31337/p2p/{p2p}",),
        tuple(AnnouncedBody(me.peer_id, os.urandom(32), 150_000, 1.7e9 + i, 100 + i) for i in range(items))))
    return len(seal(me, Kind.ANNOUNCE, 1, body))


def periods(n: int, d: Design) -> list[float]:
    return [d.fastest_s * d.spread ** (i / max(1, n - 1)) for i in range(n)]


def k_fill(n: int, d: Design) -> float:
    """Batches a step can take / K, over node-steps (one new batch per author per step at most)."""
    if n > 2000:  # the sum converges long before: every node has far more than K fresh authors
        return 1.0
    ts = periods(n, d)
    rates = [1.0 / t for t in ts]
    taken = [min(d.k, sum(min(1.0, t / u) for j, u in enumerate(ts) if j != i)) for i, t in enumerate(ts)]
    return sum(r * x for r, x in zip(rates, taken)) / (d.k * sum(rates))


def mean_period(n: int, d: Design) -> float:
    """The step period of an average node-step (harmonic mean: fast nodes make more steps)."""
    ts = periods(min(n, 2000), d)
    return len(ts) / sum(1.0 / t for t in ts)


def stores_per_step(n: int, d: Design) -> float:
    """Publishes that reach the DHT per node-step: every one, or at most one per store_every_s."""
    if d.store_every_s <= 0:
        return 1.0
    ts = periods(min(n, 2000), d)
    rates = [1.0 / t for t in ts]
    return sum(min(r, 1.0 / d.store_every_s) for r in rates) / sum(rates)


def tree_levels(h: float, d: Design) -> tuple[int, bool]:
    """L + 1, the levels a bucket of h records fills (levels below L full, level L not quite), and whether level L is
    exactly full (a walk then reads the empty key below it). Keys hold cap x overfill where more writers race for them."""
    per_key = min(h, d.cap * d.overfill) if h > d.cap else float(d.cap)
    level, room = 0, per_key
    while h > room and level < MAX_INDEX_LEVEL:
        level += 1
        room += per_key * 2**level
    return level + 1, h >= room


def prev_share_at(n: int, d: Design) -> float:
    """The share of steps that also walk the previous bucket: interpolated in log N between fitted points, the ends beyond."""
    points = sorted(d.prev_share)
    if n <= points[0][0]:
        return points[0][1]
    for (n0, s0), (n1, s1) in itertools.pairwise(points):
        if n <= n1:
            return s0 + (s1 - s0) * math.log(n / n0) / math.log(n1 / n0)
    return points[-1][1]


def per_node_step(n: int, d: Design) -> dict:
    """The model's per node-step figures for a swarm of n nodes."""
    step_s = mean_period(n, d)
    levels, full = tree_levels(n, d)
    per_key = min(float(n), d.cap * d.overfill)
    once_a_bucket = min(1.0, step_s / d.bucket_s)
    if d.crawl_reads:
        keys_per_walk, walks = float(levels), 2.0
    else:
        top = walk_top(levels, d)
        keys_per_walk = sum(2**s * sum(d.descend**j for j in range(levels + full - s)) for s in range(top + 1)) / (2 ** (top + 1) - 1)
        walks = 1.0 + prev_share_at(n, d)
    index_reads = walks * keys_per_walk
    placement_reads = (levels if d.walks_from_root or d.crawl_reads else min(levels, 2)) * once_a_bucket
    gets = index_reads + placement_reads
    stores = stores_per_step(n, d) + d.relay_stores + once_a_bucket
    lookups = once_a_bucket if d.direct_stores else stores  # stores that first look the key's replicas up
    hops = max(0.0, math.log2(n / d.beam)) if n > d.beam else 0.0
    crawl = min(n - 1, d.beam + hops)  # find RPCs of a crawling traversal: a store, a placement read (and reads before)
    if d.crawl_reads:
        read_rpcs = crawl
        holders = d.replicas + (d.cached_share * max(0.0, crawl - d.replicas) if d.caching else 0.0)
        read_copies = min(holders, n - 1) * per_key
    else:
        # A node among the key's replicas (replicas / N of the keys) finds a fresh copy in its own storage: no RPC.
        remote = 1.0 - min(1.0, d.replicas / n)
        read_rpcs = remote * min(n - 1, d.read_workers + hops)
        read_copies = remote * min(d.replies, n - 1) * per_key
    replica_copies = min(d.replicas, n - 1) * per_key
    if d.crawl_placement or d.crawl_reads:
        placement_rpcs, placement_copies = crawl, replica_copies
    else:
        placement_rpcs, placement_copies = read_rpcs, read_copies
    copies = index_reads * read_copies + placement_reads * placement_copies + (lookups * replica_copies if d.lookup_copies else 0.0)
    lookup_crawl = min(n - 1, d.lookup_beam + hops)
    find_rpcs = index_reads * read_rpcs + placement_reads * placement_rpcs + lookups * lookup_crawl
    store_rpcs = stores * d.replicas + (gets if d.caching else 0.0)  # cache_nearest=1 pushed each get's result once
    fill = k_fill(n, d)
    body = 2 * fill * d.k * d.body_bytes
    index = find_rpcs * d.rpc_bytes + copies * d.entry_bytes + store_rpcs * (d.record_bytes + d.rpc_bytes)
    idle = d.idle_bytes_per_node_s * step_s
    return {
        "nodes": n, "levels": levels, "keys_per_walk": round(keys_per_walk, 2), "records_per_key": round(per_key),
        "dht_gets": round(gets, 2), "placement_reads": round(placement_reads, 2), "dht_requests": round(gets + stores, 2), "hivemind_rpcs": round(find_rpcs + store_rpcs, 1),
        "record_copies": round(copies, 1), "read_rpcs": round(read_rpcs, 2), "k_fill": round(fill, 3), "body_bytes": round(body),
        "index_bytes": round(index + idle), "bytes": round(body + index + idle), "step_s": round(step_s, 2),
    }


def walk_top(levels: int, d: Design) -> int:
    """The deepest level a walk may start at: one above the deepest full one (levels - 2), or the root."""
    return 0 if d.walks_from_root or d.crawl_reads else max(0, levels - 3)


def hot_key(n: int, d: Design, step_s: float = 60.0) -> dict:
    """Load on one bucket's busiest key: the root where every walk starts there; otherwise a key of the deepest
    full level, read by the walks that start there or descend to it (the previous bucket's on prev_share of the steps)."""
    walks = n / step_s * (2.0 if d.crawl_reads else 1.0 + prev_share_at(n, d))
    top = walk_top(tree_levels(n, d)[0], d)
    share = sum((d.descend / 2) ** j for j in range(top + 1)) / (2 ** (top + 1) - 1)  # of the walks: start there, or above and descend
    reads = walks * share
    answering = d.replicas if d.crawl_reads else min(d.replies, d.replicas)
    per_holder = reads * answering / d.replicas  # replies each of the key's replicas sends per second
    return {"busiest_key_reads_per_s": round(reads, 2), "replies_per_s_per_replica": round(per_holder, 2),
            "upload_mb_s_per_replica": round(per_holder * d.cap * d.overfill * d.entry_bytes / 1e6, 3)}


def fit(measured: list[dict], d: Design) -> Design:
    """rpc_bytes and entry_bytes by least squares on the measured non-body bytes; replies and prev_share from the counts."""
    d = dataclasses.replace(d, idle_bytes_per_node_s=max(0.0, min(r.get("idle_bytes_per_node_s") or 0.0 for r in measured)))
    rows = [(r["hivemind_rpcs_per_node_step"], r["dht_record_copies_per_node_step"],
             r["bytes_per_node_step"] - r["body_bytes_per_node_step"] * 1.04 - (r.get("idle_bytes_per_node_step") or 0)) for r in measured]
    srr = sum(a * a for a, _, _ in rows)
    scc = sum(c * c for _, c, _ in rows)
    src = sum(a * c for a, c, _ in rows)
    sry = sum(a * y for a, _, y in rows)
    scy = sum(c * y for _, c, y in rows)
    det = srr * scc - src * src
    if len(rows) >= 2 and abs(det) > 1e-9:
        rpc, entry = (sry * scc - scy * src) / det, (scy * srr - sry * src) / det
        if rpc > 0 and entry > 0:
            d = dataclasses.replace(d, rpc_bytes=round(rpc), entry_bytes=round(entry))
    shares = []
    for r in measured:
        walk = per_node_step(r["nodes"], d)["keys_per_walk"]
        shares.append((r["nodes"], round(min(1.0, max(0.0, r["index_keys_read_per_node_step"] / walk - 1.0)), 3)))
    d = dataclasses.replace(d, prev_share=tuple(sorted(shares)))
    best, err = d.replies, math.inf
    for replies in [1 + i / 20 for i in range(81)]:
        trial = dataclasses.replace(d, replies=replies)
        e = sum((math.log(per_node_step(r["nodes"], trial)["record_copies"]) - math.log(max(1.0, r["dht_record_copies_per_node_step"]))) ** 2
                for r in measured)
        if e < err:
            best, err = replies, e
    return dataclasses.replace(d, replies=best)


class FullTables:
    """A swarm of n DHT nodes whose routing tables are as full as hivemind's rules allow: a check of the model's hops.

    hivemind splits a full k-bucket that holds the node's own id, or whose depth is not a multiple of
    depth_modulo (5); any other full bucket keeps k of its peers. A node here knows every peer such a
    table can hold (k drawn at random where a bucket is full), a table a long-running node fills
    towards. 64-bit ids (enough for 10^5 nodes); tables are built for the nodes a lookup visits.
    """

    def __init__(self, n: int, k: int = 20, depth_modulo: int = 5, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.ids = sorted({rng.getrandbits(64) for _ in range(n)})
        self.k, self.depth_modulo = k, depth_modulo
        self._tables: dict[int, list[int]] = {}

    def _span(self, prefix: int, depth: int) -> tuple[int, int]:
        return bisect.bisect_left(self.ids, prefix << (64 - depth)), bisect.bisect_left(self.ids, (prefix + 1) << (64 - depth))

    def table(self, node: int) -> list[int]:
        if node not in self._tables:
            known, stack = [], [(0, 0)]
            while stack:
                prefix, depth = stack.pop()
                lo, hi = self._span(prefix, depth)
                ours = node >> (64 - depth) == prefix
                if hi - lo - ours <= self.k:
                    known += [v for v in self.ids[lo:hi] if v != node]
                elif ours or depth % self.depth_modulo:
                    stack += [(2 * prefix, depth + 1), (2 * prefix + 1, depth + 1)]
                else:
                    known += random.Random(node ^ prefix ^ depth).sample(self.ids[lo:hi], self.k)
            self._tables[node] = known
        return self._tables[node]

    def nearest(self, node: int, target: int, k: int) -> list[int]:
        return sorted(self.table(node), key=lambda v: v ^ target)[:k]

    def replicas(self, target: int, r: int) -> set[int]:
        """The r nodes nearest the target: all in the smallest prefix range around it that holds r."""
        for depth in range(64, -1, -1):
            lo, hi = self._span(target >> (64 - depth), depth)
            if hi - lo >= r:
                return set(sorted(self.ids[lo:hi], key=lambda v: v ^ target)[:r])
        return set(self.ids)

    def read_rpcs(self, reader: int, target: int, d: Design) -> int:
        """An early-stopping read, one request in flight from the reader's nearest peers: RPCs until a replica answers."""
        replicas = self.replicas(target, d.replicas)
        if reader in replicas:
            return 0
        candidates, seen, asked = set(self.nearest(reader, target, d.lookup_beam)), {reader}, 0
        while candidates:
            peer = min(candidates, key=lambda v: v ^ target)
            candidates.discard(peer)
            seen.add(peer)
            asked += 1
            if peer in replicas:
                break
            candidates |= set(self.nearest(peer, target, self.k)) - seen
        return asked


def simulated_read_rpcs(n: int, d: Design, reads: int = 200) -> float:
    """Mean RPCs of an index read that finds the key's records, in a swarm of n nodes with full routing tables."""
    swarm, rng = FullTables(n, d.beam), random.Random(1)
    return sum(swarm.read_rpcs(rng.choice(swarm.ids), rng.getrandbits(64), d) for _ in range(reads)) / reads


def load_measured(path: str) -> dict:
    text = Path(path).read_text().strip()
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return json.loads(text)


def _table(rows: list[dict], title: str) -> None:
    print(title)
    print(f"  {'N':>7} {'levels':>6} {'keys/walk':>9} {'rec/key':>7} {'gets':>6} {'dht req':>7} {'RPCs':>7} {'copies':>8} "
          f"{'k_fill':>6} {'body kB':>8} {'index kB':>9} {'total kB':>9} {'flat':>6}")
    base = rows[0]["bytes"]
    for r in rows:
        print(f"  {r['nodes']:>7} {r['levels']:>6} {r['keys_per_walk']:>9} {r['records_per_key']:>7} {r['dht_gets']:>6} "
              f"{r['dht_requests']:>7} {r['hivemind_rpcs']:>7} {r['record_copies']:>8} {r['k_fill']:>6} {r['body_bytes'] / 1e3:>8.0f} "
              f"{r['index_bytes'] / 1e3:>9.0f} {r['bytes'] / 1e3:>9.0f} {r['bytes'] / base:>6.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", help="bench/swarm_scale.py output (its RESULT line or JSON): refit and compare")
    parser.add_argument("--step-s", type=float, default=60.0, help="a real node's step period, for the root key's load")
    parser.add_argument("--quick", action="store_true", help="the same run (every bench takes --quick; this one is arithmetic, seconds)")
    args = parser.parse_args()
    built = Design()
    size = record_size()
    if size is not None:
        built = dataclasses.replace(built, record_bytes=size)
    measured = []
    if args.measured:
        result = load_measured(args.measured)
        measured = [r for r in result["runs"] if r["network"] == "loopback" and r.get("bytes_counted_as") == "wire"]
        if measured:
            built = fit(measured, built)
    print(f"as built: cap {built.cap} (x{built.overfill} racing), bucket {built.bucket_s:g} s, K {built.k}, "
          f"body {built.body_bytes / 1e3:.0f} kB, record {built.record_bytes:.0f} B, rpc {built.rpc_bytes:.0f} B, "
          f"record copy {built.entry_bytes:.0f} B, replies per read {built.replies}, previous bucket on {built.prev_share} of steps, "
          f"idle {built.idle_bytes_per_node_s:.0f} B/s, step periods {built.fastest_s:g}-{built.fastest_s * built.spread:g} s")
    comparison = []
    if measured:
        print("measured (bench) vs model:")
        for r in measured:
            m = per_node_step(r["nodes"], built)
            pairs = {"keys_read": (r["index_keys_read_per_node_step"], m["dht_gets"] - m["placement_reads"]),
                     "dht_requests": (r["dht_requests_per_node_step"], m["dht_requests"]),
                     "rpcs": (r["hivemind_rpcs_per_node_step"], m["hivemind_rpcs"]),
                     "record_copies": (r["dht_record_copies_per_node_step"], m["record_copies"]),
                     "k_fill": (r["k_fill"], m["k_fill"]), "kB": (round(r["bytes_per_node_step"] / 1e3), round(m["bytes"] / 1e3))}
            comparison.append({"nodes": r["nodes"], **{k: [v[0], round(v[1], 2)] for k, v in pairs.items()}})
            print(f"  N={r['nodes']:>3}: " + ", ".join(f"{k} {a} vs {b:.4g}" for k, (a, b) in pairs.items()))
    variants = {
        "as_built": built,
        "coalesced_stores": dataclasses.replace(built, store_every_s=10.0),
        "walks_from_root": dataclasses.replace(built, walks_from_root=True),
        "lookup_every_store": dataclasses.replace(built, direct_stores=False, crawl_placement=True, lookup_beam=built.beam,
                                                  lookup_copies=True),
        "crawl_full_walks": dataclasses.replace(built, crawl_reads=True, caching=True, direct_stores=False, crawl_placement=True,
                                                lookup_beam=built.beam, lookup_copies=True),
    }
    tables = {}
    for name, design in variants.items():
        rows = [per_node_step(n, design) for n in SIZES_N]
        tables[name] = rows
        _table(rows, f"{name}: per node-step (flat = bytes / bytes at N={SIZES_N[0]})")
    hot = {name: {n: hot_key(n, variants[name], args.step_s) for n in (64, 1_000, 100_000)}
           for name in ("as_built", "walks_from_root", "crawl_full_walks")}
    print(f"one bucket's busiest key at {args.step_s:g}-s steps: " + json.dumps(hot))
    # The model's hops (log2(N / beam) a read) against reads simulated over routing tables as full as hivemind allows.
    hops = {n: {"model": per_node_step(n, built)["read_rpcs"], "full_tables": round(simulated_read_rpcs(n, built), 2)}
            for n in (64, 1_000, 10_000, 100_000)}
    print("RPCs of an index read that finds its key (the model's formula; simulated with full routing tables): " + json.dumps(hops))
    result = {
        "design": dataclasses.asdict(built), "comparison": comparison, "hot_key": hot, "read_rpcs": hops,
        **{f"{name}_flat_64": round(rows[SIZES_N.index(64)]["bytes"] / rows[0]["bytes"], 2) for name, rows in tables.items()},
        **{f"{name}_flat_100k": round(rows[-1]["bytes"] / rows[0]["bytes"], 2) for name, rows in tables.items()},
        "tables": tables,
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
