"""bench/swarm_scale.py's light nodes: real gossip and signed batches, no model; several to a worker process.

Every node is a real `Gossip` (its own hivemind DHTNode, its own p2pd, its own Ed25519 identity) built from the
`public` preset's swarm section (its re-bootstrap interval included; relay slots only behind NAT). Each step it
publishes a real signed rollout batch (`RolloutBatch` of random tokens sealed as `Kind.ROLLOUTS`, ~10 KB and ~150 KB
alternating step by step) with `publish_rollouts`, takes up to K fresh batches with `sample_rollouts` (index read plus
fetches, within the step timeout), opens each envelope and decodes each batch as intake would, then sleeps its own
jittered step period. Nobody waits for anybody.

The parent starts a worker as `python -P bench/light_nodes.py --host ADDR --plan JSON [--bootstrap MADDR]`, inside the
network namespace its run asks for, and they talk in JSON lines. Out: `boot` (the swarm's first node's address), `up`
per node, `ready`, `progress` every PROGRESS_S / 2, `done` (every step, counter deltas over the window, RSS, CPU),
`census` (the index trees, from the bootstrap node's worker), `bye` (with each p2pd's exit status). In: the start (t0, measure_from, until), then quit.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import random
import sys
import threading
import time
from collections import Counter

K = 4
SIZES = (10_000, 150_000)  # body bytes: a laptop's small batch, a workstation's 4 prompts x 4 completions
STEP_TIMEOUT_S = 10.0
MAX_AGE_S = 120.0
PROGRESS_S = 20.0
COUNTERS = ("bytes_in", "bytes_out", "bodies_served", "bodies_fetched", "bodies_fetched_from_relay", "dht_gets", "dht_stores",
            "dht_get_timeouts", "records_read", "index_keys_read", "sample_candidates", "sample_chosen", "fetch_failures",
            "peer_hangups", "reannounced", "relay_records", "published", "announce_store_failed", "bad_records", "bad_bodies",
            "replica_lookups",
            "dht_key_full_refused", "unfetchable_skipped", "circuit_retries", "false_informative_claims")
RPCS = ("call_find", "call_store", "call_ping")
SERVED = {"rpc_find": "find_bytes", "rpc_store": "store_bytes", "rpc_ping": "ping_bytes"}  # handler -> its counter
RPC_COUNTS = (*RPCS, "find_records", *SERVED.values(), "finds_served", "records_served")

_rpc_counts: Counter = Counter()
_key_reads: Counter = Counter()  # (bucket, level, prefix) -> this worker's index reads of that key (walks and placements)


def _count_rpcs() -> None:
    """Count hivemind's outgoing DHT RPCs per DHTProtocol instance (patched before any node starts)."""
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.storage import DictionaryDHTValue

    for name in RPCS:
        original = getattr(DHTProtocol, name)

        async def counted(self, *args, _original=original, _name=name, **kwargs):
            _rpc_counts[(id(self), _name)] += 1
            result = await _original(self, *args, **kwargs)
            if _name == "call_find" and result:
                # Record copies a find reply carried: every replica and cache holding the key sends its whole dictionary.
                for found, _ in result.values():
                    if found is not None and isinstance(found.value, DictionaryDHTValue):
                        _rpc_counts[(id(self), "find_records")] += len(found.value.data)
            return result

        setattr(DHTProtocol, name, functools.wraps(original)(counted))

    for name, counter in SERVED.items():
        original = getattr(DHTProtocol, name)

        async def served(self, request, context, _original=original, _counter=counter):
            # Request plus reply payload (protobuf) of each DHT RPC this node answers: the index's bytes before framing.
            response = await _original(self, request, context)
            _rpc_counts[(id(self), _counter)] += request.ByteSize() + response.ByteSize()
            if _counter == "find_bytes":  # the load one node carries for the others: finds answered, and keys answered with records
                _rpc_counts[(id(self), "finds_served")] += 1
                _rpc_counts[(id(self), "records_served")] += sum(1 for r in response.results if r.type)  # NOT_FOUND is 0
            return response

        setattr(DHTProtocol, name, functools.wraps(original)(served))


def _count_key_reads() -> None:
    """Count this worker's reads of each rollout index key (IndexRecords.read, patched before any node starts)."""
    from hivespec.node.swarm.records import IndexRecords

    original = IndexRecords.read

    async def read(self, key, *args, _original=original, **kwargs):
        parts = key.rsplit("/", 4)
        if len(parts) == 5 and parts[1] == "rollouts":
            _key_reads[(int(parts[2]), int(parts[3]), int(parts[4]))] += 1
        return await _original(self, key, *args, **kwargs)

    IndexRecords.read = functools.wraps(original)(read)


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def census(gossip: object, buckets: list[int], levels: int = 5) -> list[list[int]]:
    """[bucket, level, prefix, records] of every key of the first `levels` levels of these buckets' index trees (one node reads)."""
    import asyncio

    from hivespec.protocol.keys import rollout_index_key

    keys = [(b, level, prefix) for b in buckets for level in range(levels) for prefix in range(2**level)]

    async def read_all() -> list:
        return await asyncio.gather(*(gossip.records.read(rollout_index_key(gossip.swarm, *key), STEP_TIMEOUT_S) for key in keys))

    found = gossip._call(read_all(), STEP_TIMEOUT_S * 3)  # the bench's diagnostics reach into gossip's loop
    return [[*key, total] for key, (_, total) in zip(keys, found) if total]


def _batch_body(size: int, seed: int) -> tuple[bytes, object]:
    """A RolloutBatch body of about `size` bytes (random tokens) and the batch, re-encoded per step with a new version."""
    import numpy as np

    from hivespec.protocol.rollout import Rollout, RolloutBatch, encode_batch

    rng = np.random.default_rng(seed)
    count = 2 if size < 50_000 else 16
    prompt = 64
    completion = max(1, (size // count - prompt * 4 - 120) // 8)
    rollouts = tuple(
        Rollout(f"arith:d1:{seed}:{i // 4}", i, seed, rng.integers(0, 49152, prompt, dtype=np.uint32),
                rng.integers(0, 49152, completion, dtype=np.uint32), -rng.random(completion, dtype=np.float32),
                float(i % 2), "length")
        for i in range(count)
    )
    batch = RolloutBatch(0, 0, "a1" * 8, rollouts)
    return encode_batch(batch), batch


class LightNode:
    """One gossip-only node: publish a batch, sample K, check them, sleep; no model."""

    def __init__(self, index: int, plan: dict, config: object) -> None:
        from hivespec.node.swarm.gossip import Gossip
        from hivespec.protocol.advantages import informative_samples
        from hivespec.protocol.identity import Identity

        self.index, self.period, self.first_size = index, plan["period"], plan["first_size"]
        self.identity = Identity.generate()
        self.gossip = Gossip(self.identity, config)
        self._batches = [_batch_body(size, index)[1] for size in SIZES]
        # Announced with each batch, as a node's exchange does: a reader's fetch checks it against the body before relaying.
        self._informative = [informative_samples(batch.rollouts) for batch in self._batches]
        self.steps: list[dict] = []
        self.errors: Counter = Counter()

    def body(self, seq: int) -> bytes:
        from hivespec.protocol.envelope import Kind, seal
        from hivespec.protocol.rollout import encode_batch

        batch = self._batches[self._size_of(seq)]
        return seal(self.identity, Kind.ROLLOUTS, seq, encode_batch(dataclasses.replace(batch, round=seq, policy_version=seq)))

    def _size_of(self, seq: int) -> int:
        return (self.first_size + seq) % len(SIZES)  # the sizes alternate step by step

    def counters(self) -> dict:
        stats = self.gossip.stats()
        out = {name: int(stats.get(name, 0)) for name in COUNTERS}
        protocol = self.gossip._dht.protocol  # the bench's instrumentation reads gossip's DHT node
        for name in RPC_COUNTS:
            out[name] = _rpc_counts[(id(protocol), name)]
        out["max_records_per_key"] = int(stats.get("max_records_per_key", 0))
        out["known_peers"] = int(stats.get("known_peers", 0))
        return out

    def run(self, t0: float, until: float, stop: threading.Event) -> None:
        from hivespec.node.swarm.gossip import GossipError
        from hivespec.protocol.envelope import Kind, open_envelope
        from hivespec.protocol.rollout import decode_batch

        rng = random.Random(self.index)
        next_at = t0 + rng.uniform(0.0, self.period)
        seq = 0
        while not stop.is_set():
            if stop.wait(max(0.0, next_at - time.time())):
                break
            started = time.time()
            if started >= until:
                break
            seq += 1
            body = self.body(seq)
            clock = time.monotonic()
            try:
                self.gossip.publish_rollouts(body, version=seq, informative=self._informative[self._size_of(seq)])
            except GossipError as exc:
                self.errors[f"publish: {str(exc)[:80]}"] += 1
            publish_s = time.monotonic() - clock
            before = self.gossip.stats().get("sample_chosen", 0)
            clock = time.monotonic()
            try:
                fetched = self.gossip.sample_rollouts(k=K, max_age_s=MAX_AGE_S, timeout=STEP_TIMEOUT_S, fill=True)
            except GossipError as exc:
                self.errors[f"sample: {str(exc)[:80]}"] += 1
                fetched = []
            sample_s = time.monotonic() - clock
            chosen = self.gossip.stats().get("sample_chosen", 0) - before
            bad = 0
            for got in fetched:
                verdict, envelope = open_envelope(got.body, expected_kind=Kind.ROLLOUTS)
                if not verdict.ok or envelope is None or envelope.peer_id != got.author_peer_id or not decode_batch(envelope.body)[0].ok:
                    bad += 1
            now = time.time()
            self.steps.append({
                "t": round(started, 3), "publish_s": round(publish_s, 3), "sample_s": round(sample_s, 3), "chosen": chosen,
                "fetched": len(fetched), "bad": bad, "bytes": sum(len(f.body) for f in fetched),
                "relayed": sum(1 for f in fetched if f.holder != f.author_peer_id),
                "ages": [round(now - f.born, 2) for f in fetched], "authors": [f.author_peer_id for f in fetched],
            })
            next_at = started + self.period * rng.uniform(0.8, 1.2)


def _emit(message: dict) -> None:
    print(json.dumps(message), flush=True)


def worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="light_nodes.py")
    parser.add_argument("--host", required=True)
    parser.add_argument("--bootstrap", default="")
    parser.add_argument("--plan", required=True, help="JSON: [{index, period, size}, ...]")
    parser.add_argument("--key-records", type=int, default=None, help="swarm.index_key_records (default: the config's)")
    parser.add_argument("--auto-relay", action="store_true", help="behind NAT: reserve relay slots on the bootstrap peer (the preset's way)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _count_rpcs()
    _count_key_reads()
    from hivespec.node.config import load_config

    # The public preset's swarm section (its re-bootstrap period included: that is upkeep every node pays), with
    # relay slots only behind NAT (--auto-relay), and the bench's step timeout.
    public = load_config("public", environ={}).swarm
    plans = json.loads(args.plan)
    nodes: list[LightNode] = []
    bootstrap = args.bootstrap
    for plan in plans:
        config = dataclasses.replace(public, swarm="scale", host=args.host, port=0, initial_peers=[bootstrap] if bootstrap else [],
                                     use_auto_relay=args.auto_relay, request_timeout=STEP_TIMEOUT_S, bootstrap_timeout=30.0,
                                     **({"index_key_records": args.key_records} if args.key_records else {}))
        node = LightNode(plan["index"], plan, config)
        node.gossip.start()
        nodes.append(node)
        if not bootstrap:  # the swarm's first node: everyone else joins through it
            bootstrap = node.gossip.visible_maddrs[0]
            _emit({"op": "boot", "maddr": bootstrap})
        _emit({"op": "up", "index": node.index})
    children = [node.gossip._p2p._child for node in nodes]  # each node's p2pd (asyncio Process)
    p2pd = [child.pid for child in children]
    _emit({"op": "ready", "peers": {node.index: node.identity.peer_id for node in nodes}})

    command = json.loads(sys.stdin.readline())
    t0, measure_from, until = command["t0"], command["measure_from"], command["until"]
    stop = threading.Event()
    threads = [threading.Thread(target=node.run, args=(t0, until, stop), name=f"step-{node.index}", daemon=True) for node in nodes]
    for thread in threads:
        thread.start()
    start_counters: dict[int, dict] = {}
    cpu_start: tuple[float, float] | None = None
    rss = {"total_kb": 0, "python_kb": 0, "p2pd_kb": 0}
    next_progress = time.time() + PROGRESS_S / 2
    while any(thread.is_alive() for thread in threads):
        time.sleep(0.5)
        now = time.time()
        if not start_counters and now >= measure_from:
            start_counters = {node.index: node.counters() for node in nodes}
            cpu_start = (_cpu_s(os.getpid()), sum(_cpu_s(pid) for pid in p2pd), time.monotonic())
        if now >= measure_from:
            python_kb, p2pd_kb = _rss_kb(os.getpid()), sum(_rss_kb(pid) for pid in p2pd)
            if python_kb + p2pd_kb > rss["total_kb"]:
                rss = {"total_kb": python_kb + p2pd_kb, "python_kb": python_kb, "p2pd_kb": p2pd_kb}
        if now >= next_progress:
            next_progress = now + PROGRESS_S / 2
            steps = [s for node in nodes for s in node.steps if s["t"] >= measure_from]
            _emit({"op": "progress", "steps": len(steps), "chosen": sum(s["chosen"] for s in steps),
                   "fetched": sum(s["fetched"] for s in steps)})
    end_counters = {node.index: node.counters() for node in nodes}
    cpu_end = (_cpu_s(os.getpid()), sum(_cpu_s(pid) for pid in p2pd))
    cpu = {"python_s": round(cpu_end[0] - cpu_start[0], 2), "p2pd_s": round(cpu_end[1] - cpu_start[1], 2),
           "wall_s": round(time.monotonic() - cpu_start[2], 2)} if cpu_start else None
    _emit({"op": "done", "rss": rss, "cpu": cpu, "key_reads": [[*key, n] for key, n in _key_reads.items()], "nodes": [{
        "index": node.index, "peer": node.identity.peer_id, "period": node.period,
        "steps": node.steps, "errors": dict(node.errors),
        "delta": {k: end_counters[node.index][k] - start_counters.get(node.index, {}).get(k, 0) for k in (*COUNTERS, *RPC_COUNTS)},
        "max_records_per_key": end_counters[node.index]["max_records_per_key"],
        "known_peers": end_counters[node.index]["known_peers"],
    } for node in nodes]})
    tree = []
    if nodes[0].index == 0:  # the bootstrap node's worker reads the index trees of the buckets inside the window, after it
        from hivespec.node.swarm.index import bucket_of

        bucket_s = nodes[0].gossip.config.index_bucket_s
        tree = census(nodes[0].gossip, list(range(bucket_of(measure_from, bucket_s) + 1, bucket_of(until, bucket_s))))
    _emit({"op": "census", "tree": tree})

    sys.stdin.readline()  # "quit"
    clock = time.monotonic()
    closers = [threading.Thread(target=node.gossip.shutdown, name=f"shutdown-{node.index}") for node in nodes]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join()
    # A p2pd that crashed (a Go panic: its stack goes to hivemind's log at debug) shows only in its exit status.
    _emit({"op": "bye", "shutdown_s": round(time.monotonic() - clock, 2), "p2pd_exits": [child.returncode for child in children]})


if __name__ == "__main__":
    worker(sys.argv[1:])
