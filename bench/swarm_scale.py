"""Light gossip-only nodes at N = 8..64: what one node pays per step for rollout sharing by recency, and how that grows with N.

Every node is a real `Gossip` (its own hivemind DHTNode, its own p2pd, its own Ed25519 identity)
built from the `public` preset's swarm section (its re-bootstrap interval included; no relay slots on
loopback), with no model: it publishes a real signed rollout batch (`RolloutBatch` of random tokens, sealed
as `Kind.ROLLOUTS`; ~10 KB and ~150 KB, alternating step by step on every node) with
`publish_rollouts`, then takes up to K = 4 fresh batches with `sample_rollouts` (index read plus
fetches, within a 10 s step timeout), opens each envelope and decodes each batch as intake would,
then sleeps its own jittered step period. Nobody waits for anybody: step periods are spread
log-evenly over a 10x range (2 s to 20 s by default), each node starts at a random phase and
with a random one of the two sizes. Every node alternating, the swarm's published mix is half and
half at every N and every speed; a size fixed per node would tie it to the speeds, and in a
swarm of 8 the fastest node's size weighs most (mean published batch 69 kB against 78 at 64,
when sizes alternated by speed rank): N = 8 paid less per fetched batch for that alone. Several
nodes share a worker process (8 by default; each node its own gossip loop thread and step thread), so 64 nodes fit on
2 cores and a few GB. Node 0 is the bootstrap peer everyone joins through, and a stepping node too.

Runs: N = 8, 16, 32, 64 on loopback (inside a network namespace of our own, so its `lo` counters
are exactly the swarm's wire bytes; on the host's loopback without them when namespaces cannot be
made), then N = 16 across network namespaces joined by a bridge, each node on its own host
namespace whose link is shaped with `tc tbf` (upload 10 Mbit/s, download 50 Mbit/s; this kernel
has no netem, so no added latency). `--quick` runs N = 8 and 16 on loopback (`--shaped` adds the
namespace run). `--nat HOMES` adds a run of 1 public node and HOMES nodes each in a home network
behind its own masquerading router (bench/net_topology.py, no port forwarding; the homes reserve
relay slots on the public node as the `public` preset does; `--up-mbit` caps each home's upload),
reporting besides the rest where the WAN bytes go (`upload`: the public node's Mbit/s and share,
its bytes per home step, a home's Mbit/s), `unfetchable_per_step` (candidates no holder could
serve: large batches held only by NATed peers) and `circuit_retries`.

Counted over a window after a warm-up (steps that start inside it, counter deltas across it):
  delivery                   batches fetched / batches chosen by sampling (`stats()["sample_chosen"]`), within the step timeout
  p95_s                      p95 wall time of one step's sample_rollouts (index read + fetches)
  bytes_per_node_step        wire bytes in+out per node-step: twice the bytes the swarm's interfaces sent
                             (DHT, bodies, TLS, yamux, TCP/IP headers), over node-steps; body_bytes_per_node_step is
                             gossip's own bytes_in+bytes_out (bodies only)
  dht_requests_per_node_step gossip's dht_gets + dht_stores (each a hivemind traversal) per node-step;
                             hivemind_rpcs_per_node_step counts the RPCs under them (DHTProtocol.call_find/call_store/call_ping)
  dht_payload_bytes_per_node_step  the DHT RPCs' protobuf payload (request + reply, in + out) by kind: find (index
                             reads, placement counts, replica lookups), store, ping; the rest of the wire bytes
                             beyond the bodies is framing (TLS, yamux, TCP/IP) and libp2p's own upkeep
  max_records_per_key        max over nodes of the most records one index key held when read
  served_per_node_s          the load a node carries for the others, per second: `finds_served` (DHT finds it
                             answered: reads, lookups' crawls) and `records_served` (keys it answered with their
                             records: a replica's reads); mean, max and max_over_mean (a hot key's replica)
  index_key_reads            of a bucket's index reads (the whole swarm's walks and placements), the busiest key's
                             share and the root key's (means over the window's buckets), and the busiest key's reads
  rss_mb_per_node            a worker's RSS plus its p2pd children's, over its nodes (max over samples and workers)
  idle_bytes_per_node_step   the wire bytes of the joined swarm idling for --idle-s before any step (libp2p and DHT
                             upkeep), per node and second, times the seconds one node-step takes: part of bytes_per_node_step
  flat                       bytes_per_node_step at the largest N / at N = 8; flat_bodies the same of the bodies alone
                             (its floor while N = 8's k_fill is below 1), flat_per_fetched_batch of bytes per batch fetched,
                             flat_at_equal_batch_mix with the largest N's bodies scaled to N = 8's mean fetched batch
  clean_shutdowns            no worker log holds a traceback, "Task was destroyed", "was never retrieved",
                             "gossip shutdown was not clean" or "did not stop within"; shutdown_stages_cut_short counts
                             shutdown stages that ran into the node's deadline (p2pd slow to exit while every peer
                             hangs up at once) and tasks still unwinding there, each then bounded and p2pd killed
  tcp_per_node_step          the private loopback's kernel TCP counters (/proc/net/snmp) over node-steps: `connects`
                             (new connections: each a TLS and an identify handshake) and `segments` sent (each
                             carries 66 bytes of Ethernet, IP and TCP headers on lo: most of the wire beyond bodies
                             and DHT payload)
  k_fill                     batches fetched per step / K: below 1 where fewer than K fresh unfetched batches existed
                             (a fast node in a small swarm of slow ones); k_fill_ceiling what it could have been with
                             every batch the others published in sight (each node replayed step by step: K a step, one
                             an author and then further ones, each batch once, oldest first): the swarm's supply,
                             the floor of flat_bodies

    python bench/swarm_scale.py            # N = 8 16 32 64 loopback + N = 16 shaped
    python bench/swarm_scale.py --quick    # N = 8 16 loopback
    python bench/swarm_scale.py --nodes 8 --shaped 0 --nat 9   # N = 8 loopback, then 1 public + 9 homes behind NAT

Every node's steps (when, what it fetched, from whom, how old) go to LOGS/<run>-steps.json for questions the
summary does not answer. Prints a row per run as it completes and progress every ~20 s, then one line `RESULT {json}`.
Targets at N = 64 (issue 22): delivery >= 0.99, p95_s <= 5, flat <= 1.3, clean_shutdowns.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import functools
import json
import logging
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

K = 4
SIZES = (10_000, 150_000)  # body bytes: a laptop's small batch, a workstation's 4 prompts x 4 completions
STEP_TIMEOUT_S = 10.0
MAX_AGE_S = 120.0
NODES_PER_WORKER = 8
PROGRESS_S = 20.0
UNCLEAN = ("Traceback", "Task was destroyed", "was never retrieved", "gossip shutdown was not clean", "did not stop within")
COUNTERS = ("bytes_in", "bytes_out", "bodies_served", "bodies_fetched", "bodies_fetched_from_relay", "dht_gets", "dht_stores",
            "dht_get_timeouts", "records_read", "index_keys_read", "sample_candidates", "sample_chosen", "fetch_failures",
            "peer_hangups", "reannounced", "relay_records", "published", "announce_store_failed", "bad_records", "bad_bodies",
            "dht_key_full_refused", "unfetchable_skipped", "circuit_retries", "false_informative_claims")
RPCS = ("call_find", "call_store", "call_ping")
SERVED = {"rpc_find": "find_bytes", "rpc_store": "store_bytes", "rpc_ping": "ping_bytes"}  # handler -> its counter
RPC_COUNTS = (*RPCS, "find_records", *SERVED.values(), "finds_served", "records_served")
NS_PREFIX = "hsn"  # net_topology.PREFIX: namespaces named hsn<owner pid>-<role>, so its remove_stale() clears a killed run's


# ----- worker: several light nodes in one process ------------------------------------------------

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
        import dataclasses

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
    parser = argparse.ArgumentParser(prog="swarm_scale.py --worker")
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
    p2pd = [node.gossip._p2p._child.pid for node in nodes]
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
    _emit({"op": "bye", "shutdown_s": round(time.monotonic() - clock, 2)})


# ----- networks: where the workers run ------------------------------------------------------------


def _ip(*args: str, tool: str = "ip", check: bool = True) -> str:
    result = subprocess.run([tool, *args], capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{tool} {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def _tx_bytes(ns: str, dev: str) -> int:
    return int(json.loads(_ip("-n", ns, "-j", "-s", "link", "show", dev))[0]["stats64"]["tx"]["bytes"])


def _tcp_counters(ns: str) -> dict[str, int]:
    """The namespace's kernel TCP counters (/proc/net/snmp): connections opened, segments sent."""
    text = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"], capture_output=True, text=True, check=True).stdout
    names, values = (line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:"))
    tcp = dict(zip(names, map(int, values)))
    return {"connects": tcp["ActiveOpens"], "segments": tcp["OutSegs"]}


def namespaces_unavailable() -> str | None:
    """Why this machine cannot make network namespaces (one line), or None."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return "network namespaces need Linux, root and iproute2 (ip, tc)"
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None if made.returncode == 0 else f"this kernel refuses network namespaces: {made.stderr.strip()}"


class Network:
    """Where worker i runs (argv prefix, listen address) and how many bytes the swarm put on the wire."""

    name = "loopback"

    def __init__(self) -> None:
        self._made: list[str] = []

    def _netns(self, role: str) -> str:
        ns = f"{NS_PREFIX}{os.getpid()}-{role}"
        _ip("netns", "del", ns, check=False)
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def prefix(self, worker: int) -> list[str]:
        return []

    def host(self, worker: int) -> str:
        return "127.0.0.1"

    def wire_bytes(self) -> int | None:
        return None

    def tcp_counters(self) -> dict[str, int] | None:
        return None

    def close(self) -> None:
        for ns in reversed(self._made):
            pids = _ip("netns", "pids", ns, check=False).split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            _ip("netns", "del", ns, check=False)
        self._made.clear()


class PrivateLoopback(Network):
    """Every worker on the loopback of one namespace of our own: its lo counters are exactly the swarm's bytes."""

    name = "loopback"

    def __init__(self) -> None:
        super().__init__()
        self.ns = self._netns("lo")

    def prefix(self, worker: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def wire_bytes(self) -> int:
        return _tx_bytes(self.ns, "lo")

    def tcp_counters(self) -> dict[str, int]:
        return _tcp_counters(self.ns)


class ShapedLan(Network):
    """One host namespace per worker on a bridge; each host's link shaped by tbf (upload on its side, download on the bridge's)."""

    name = "shaped"

    def __init__(self, hosts: int, up_mbit: float, down_mbit: float) -> None:
        super().__init__()
        self.hosts: list[tuple[str, str]] = []
        try:
            self.bridge = self._netns("lan")
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for i in range(hosts):
                ns, addr, port = self._netns(f"h{i}"), f"10.77.{i // 200}.{i % 200 + 10}", f"p{i}"
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.bridge)
                _ip("-n", self.bridge, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/16", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                self._shape(ns, "eth0", up_mbit)
                self._shape(self.bridge, port, down_mbit)
                self.hosts.append((ns, addr))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _shape(ns: str, dev: str, mbit: float) -> None:
        # burst ~ 10 ms at the rate (at least a few full packets); the queue holds at most 200 ms.
        burst = max(16_000, int(mbit * 1e6 / 8 / 100))
        _ip("-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(mbit * 1000)}kbit", "burst", str(burst),
            "latency", "200ms", tool="tc")

    def prefix(self, worker: int) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[worker][0]]

    def host(self, worker: int) -> str:
        return self.hosts[worker][1]

    def wire_bytes(self) -> int:
        return sum(_tx_bytes(ns, "eth0") + _tx_bytes(ns, "lo") for ns, _ in self.hosts)

    def drops(self) -> int:
        total = 0
        for ns, _ in self.hosts:
            for line in _ip("-n", ns, "-s", "qdisc", "show", "dev", "eth0", tool="tc").splitlines():
                if "dropped" in line:
                    total += int(line.split("dropped")[1].split(",")[0])
        return total


class NatWan(Network):
    """Worker 0 on a public host, every other worker in a home network behind its own masquerading router
    (bench/net_topology.py: no port forwarding, so homes reach each other only through the public node's relay
    circuits or through what it re-serves). Each home's upload shaped by tbf where `up_mbit` is set."""

    name = "nat"

    def __init__(self, homes: int, up_mbit: float | None) -> None:
        super().__init__()
        import net_topology

        self.topology = net_topology.Topology(homes=homes, uplink_mbit=up_mbit).build()
        self.hosts = [self.topology.public, *self.topology.home_hosts]
        self.public_addr = net_topology.PUBLIC_ADDR

    def prefix(self, worker: int) -> list[str]:
        return self.hosts[worker].command([])

    def host(self, worker: int) -> str:
        return self.public_addr if worker == 0 else "0.0.0.0"  # as bench/nat_swarm.py's homes listen

    def uploads(self) -> tuple[int, int]:
        """Bytes sent onto the WAN so far: (the public host's, all home routers' together)."""
        public = _tx_bytes(self.topology.public.ns, "wan0")
        return public, sum(_tx_bytes(router.ns, "wan0") for router in self.topology.routers)

    def wire_bytes(self) -> int:
        return sum(self.uploads())

    def close(self) -> None:
        self.topology.close()


# ----- parent: one run, then the summary -----------------------------------------------------------


def plan_nodes(n: int, fastest_s: float, spread: float, seed: int) -> list[dict]:
    """Step periods log-evenly over [fastest_s, spread x fastest_s], shuffled over node indices; each node's first size at random
    (every node alternates sizes step by step, see the module docstring)."""
    rng = random.Random(seed + n)
    ranks = list(range(n))
    rng.shuffle(ranks)
    return [{"index": i, "period": round(fastest_s * spread ** (r / max(1, n - 1)), 3), "first_size": rng.randrange(len(SIZES))}
            for i, r in enumerate(ranks)]


class Worker:
    def __init__(self, slot: int, argv: list[str], log: Path) -> None:
        self.slot, self.log = slot, log
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("wb"), text=True)
        self.messages: queue.Queue = queue.Queue()
        self.stash: list[dict] = []  # messages taken out of turn (while draining progress), read first by `wait_for`
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self.messages.put(json.loads(line))
        self.messages.put({"op": "eof"})

    def send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_swarm(n: int, network: Network, *, per_worker: int, warmup_s: float, window_s: float, fastest_s: float, spread: float,
              logs: Path, label: str, idle_s: float, key_records: int | None) -> dict:
    plans = plan_nodes(n, fastest_s, spread, seed=22)
    groups = [plans[i:i + per_worker] for i in range(0, n, per_worker)]
    here = str(Path(__file__).resolve())
    workers: list[Worker] = []
    started = time.monotonic()
    last_print = [started]

    def spawn(slot: int, bootstrap: str) -> Worker:
        argv = [*network.prefix(slot), sys.executable, "-P", here, "--worker", "--host", network.host(slot),
                "--plan", json.dumps(groups[slot])]
        if key_records:
            argv += ["--key-records", str(key_records)]
        if bootstrap:
            argv += ["--bootstrap", bootstrap]
        if isinstance(network, NatWan) and slot > 0:
            argv += ["--auto-relay"]
        worker = Worker(slot, argv, logs / f"{label}-worker{slot}.log")
        workers.append(worker)
        return worker

    def wait_for(worker: Worker, op: str, timeout: float, on_other=None) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = worker.stash.pop(0) if worker.stash else worker.messages.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{label}: worker {worker.slot} sent no {op!r} within {timeout:g} s:\n{worker.tail()}") from None
                if time.monotonic() - last_print[0] >= PROGRESS_S:  # never a silent minute
                    last_print[0] = time.monotonic()
                    print(f"  {label}: waiting for worker {worker.slot}'s {op!r} ({time.monotonic() - started:.0f} s)", flush=True)
                continue
            if message["op"] == op:
                return message
            if message["op"] == "eof":
                raise RuntimeError(f"{label}: worker {worker.slot} exited before {op!r}:\n{worker.tail()}")
            if on_other is not None:
                on_other(worker, message)

    up = Counter()

    def count_up(worker: Worker, message: dict) -> None:
        if message["op"] == "up":
            up[worker.slot] += 1
            if time.monotonic() - last_print[0] >= 10.0:
                last_print[0] = time.monotonic()
                print(f"  {label}: {sum(up.values())}/{n} nodes up ({time.monotonic() - started:.0f} s)", flush=True)

    try:
        first = spawn(0, "")
        maddr = wait_for(first, "boot", 120.0, count_up)["maddr"]
        for slot in range(1, len(groups)):
            spawn(slot, maddr)
        peers: dict[str, int] = {}
        for worker in workers:
            peers.update({peer: int(index) for index, peer in wait_for(worker, "ready", 60.0 + 15.0 * per_worker, count_up)["peers"].items()})
        startup_s = time.monotonic() - started
        print(f"  {label}: {n}/{n} nodes up in {startup_s:.0f} s; {idle_s:.0f} s idle (background traffic), "
              f"{warmup_s:.0f} s warm-up, then {window_s:.0f} s counted", flush=True)
        idle_before, idle_clock = network.wire_bytes(), time.monotonic()
        time.sleep(idle_s)  # joined, not stepping: what the swarm costs a node with nothing to share
        idle_after = network.wire_bytes()
        # No idle window (--idle-s 0), no rate: a few ms of whatever the joining left in flight is not upkeep.
        idle_rate = (None if idle_before is None or idle_after is None or idle_s <= 0
                     else 2 * (idle_after - idle_before) / (time.monotonic() - idle_clock) / n)
        t0 = time.time() + 1.0
        measure_from, until = t0 + warmup_s, t0 + warmup_s + window_s
        for worker in workers:
            worker.send({"t0": t0, "measure_from": measure_from, "until": until})
        time.sleep(max(0.0, measure_from - time.time()))
        wire_before, tcp_before = network.wire_bytes(), network.tcp_counters()
        uploads_before = network.uploads() if isinstance(network, NatWan) else None
        progress: dict[int, dict] = {}

        def note(worker: Worker, message: dict) -> None:
            if message["op"] == "progress":
                progress[worker.slot] = message
            else:
                worker.stash.append(message)

        while time.time() < until:
            time.sleep(min(PROGRESS_S, max(0.0, until - time.time())))
            for worker in workers:
                while not worker.messages.empty():
                    note(worker, worker.messages.get())
            steps, chosen, fetched = (sum(p[key] for p in progress.values()) for key in ("steps", "chosen", "fetched"))
            print(f"  {label}: +{time.time() - measure_from:.0f}/{window_s:.0f} s counted: {steps} steps, "
                  f"{fetched}/{chosen} chosen batches fetched", flush=True)
        done = [wait_for(worker, "done", STEP_TIMEOUT_S * 3 + 60.0) for worker in workers]
        # Every node's steps (when, what it fetched, from whom, how old), for questions the summary does not answer.
        (logs / f"{label}-steps.json").write_text(json.dumps(
            {"measure_from": measure_from, "until": until, "peers": peers,
             "nodes": [{key: node[key] for key in ("index", "peer", "period", "steps")} for message in done for node in message["nodes"]]}))
        wire_after, tcp_after = network.wire_bytes(), network.tcp_counters()
        uploads_after = network.uploads() if isinstance(network, NatWan) else None
        drops = network.drops() if isinstance(network, ShapedLan) else None
        for message, worker in zip(done, workers):
            message["census"] = wait_for(worker, "census", 120.0)["tree"]
        for worker in workers:
            worker.send({"op": "quit"})
        byes = [wait_for(worker, "bye", 120.0) for worker in workers]
    finally:
        for worker in workers:
            with contextlib.suppress(OSError):
                worker.process.stdin.close()
        for worker in workers:
            try:
                worker.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
    unclean, cut_short = [], 0
    for worker in workers:
        text = worker.log.read_text(errors="replace")
        cut_short += text.count("gossip shutdown: ")  # a stage or a task's unwinding that ran past the deadline: bounded, counted
        unclean += [f"{worker.log.name}: {line.strip()[:200]}" for line in text.splitlines() if any(p in line for p in UNCLEAN)]
        if worker.process.returncode != 0:
            unclean.append(f"{worker.log.name}: exit code {worker.process.returncode}")
    summary = summarize(n, network, done, byes, peers, measure_from, until, wire_before, wire_after, drops, unclean, startup_s)
    summary["idle_bytes_per_node_s"] = None if idle_rate is None else round(idle_rate)
    summary["shutdown_stages_cut_short"] = cut_short
    if tcp_before is not None and tcp_after is not None:
        # Connection churn: each new TCP connection costs a TLS and an identify handshake (a few kB) besides its RPC.
        summary["tcp_per_node_step"] = {key: round((tcp_after[key] - tcp_before[key]) / max(1, summary["node_steps"]), 2)
                                        for key in tcp_after}
    if uploads_before is not None and uploads_after is not None:
        public, homes = (after - before for before, after in zip(uploads_before, uploads_after, strict=True))
        window = summary["window_s"]
        home_steps = sum(1 for message in done for node in message["nodes"] if node["index"] != 0
                         for step in node["steps"] if measure_from <= step["t"] < until)
        # Where the bytes go when homes cannot dial each other: the public node relays circuits and re-serves bodies.
        summary["upload"] = {
            "public_mbit_s": round(8 * public / window / 1e6, 2), "home_mbit_s_mean": round(8 * homes / window / 1e6 / (n - 1), 2),
            "public_share": round(public / max(1, public + homes), 3),
            "public_bytes_per_home_step": round(public / max(1, home_steps)),
        }
    if idle_rate is not None and summary["node_steps"]:
        # The idle traffic that falls on one node-step: a node pays it whatever it shares.
        summary["idle_bytes_per_node_step"] = round(idle_rate * n * summary["window_s"] / summary["node_steps"])
    return summary


def _fill_ceiling(nodes: list[dict], measure_from: float, until: float) -> float | None:
    """What k_fill could have been with every batch of the swarm in sight: its supply bound.

    Each node is replayed step by step against every batch the others published (stored before the step began and
    younger than MAX_AGE_S), taking K a step as the sampling does (one an author, then authors' further batches where
    that leaves slots), each batch once, oldest first (the order that leaves the most for later steps). Below 1, the
    swarm made fewer fresh batches than its fast nodes asked for; k_fill below the ceiling is what the index and the
    sampling left on the table.
    """
    published = sorted((s["t"] + s["publish_s"], s["t"], node["index"], seq)
                       for node in nodes for seq, s in enumerate(node["steps"], 1))
    landings = [landed for landed, *_ in published]
    possible = windowed = 0
    for node in nodes:
        taken: set[tuple[int, int]] = set()
        for step in node["steps"]:
            t = step["t"]
            seen: set[int] = set()
            first, further = [], []  # (born, author, seq): each author's oldest batch we could take, and the rest
            for landed, born, author, seq in published[bisect.bisect_left(landings, t - MAX_AGE_S):]:
                if landed >= t:
                    break
                if author != node["index"] and t - born <= MAX_AGE_S and (author, seq) not in taken:
                    (further if author in seen else first).append((born, author, seq))
                    seen.add(author)
            chosen = (sorted(first) + sorted(further))[:K]
            taken.update((author, seq) for _, author, seq in chosen)
            if measure_from <= t < until:
                windowed += 1
                possible += len(chosen)
    return round(possible / windowed / K, 3) if windowed else None


def summarize(n: int, network: Network, done: list[dict], byes: list[dict], peers: dict[str, int], measure_from: float, until: float,
              wire_before: int | None, wire_after: int | None, drops: int | None, unclean: list[str], startup_s: float) -> dict:
    nodes = [node for message in done for node in message["nodes"]]
    steps = [dict(s, node=node["index"]) for node in nodes for s in node["steps"] if measure_from <= s["t"] < until]
    node_steps = max(1, len(steps))
    delta = Counter()
    for node in nodes:
        delta.update(node["delta"])
    chosen, fetched = sum(s["chosen"] for s in steps), sum(s["fetched"] for s in steps)
    sample_s = [s["sample_s"] for s in steps]
    ages = [a for s in steps for a in s["ages"]]
    wire = None if wire_before is None or wire_after is None else 2 * (wire_after - wire_before)
    body_bytes = delta["bytes_in"] + delta["bytes_out"]
    published: Counter = Counter(s["node"] for s in steps)
    heard: Counter = Counter(peers.get(a, -1) for s in steps for a in s["authors"])
    fast = sorted(nodes, key=lambda node: node["period"])
    fill = {}
    for name, group in (("fastest_quarter", fast[: max(1, n // 4)]), ("slowest_quarter", fast[-max(1, n // 4):])):
        indices = {node["index"] for node in group}
        mine = [s["fetched"] for s in steps if s["node"] in indices]
        fill[name] = round(statistics.mean(mine) / K, 3) if mine else None
    rss = [m["rss"]["total_kb"] / 1024 / len(m["nodes"]) for m in done]
    cpu = [m["cpu"] for m in done if m["cpu"]]
    cpu_python, cpu_p2pd = sum(c["python_s"] for c in cpu), sum(c["p2pd_s"] for c in cpu)
    tree = [entry for m in done for entry in m["census"]]
    by_level: dict[int, list[int]] = {}
    for _, level, _, total in tree:
        by_level.setdefault(level, []).append(total)
    buckets = {b for b, *_ in tree}
    errors = Counter()
    for node in nodes:
        errors.update(node["errors"])
    return {
        "nodes": n, "network": network.name, "window_s": round(until - measure_from), "startup_s": round(startup_s, 1),
        "node_steps": len(steps), "steps_per_node_min_max": [min(published.values(), default=0), max(published.values(), default=0)],
        "delivery": round(fetched / chosen, 4) if chosen else None,
        "k_fill": round(fetched / node_steps / K, 3), "k_fill_by_speed": fill,
        "k_fill_ceiling": _fill_ceiling(nodes, measure_from, until),
        "p50_s": _percentile(sample_s, 0.5), "p95_s": _percentile(sample_s, 0.95), "max_s": max(sample_s, default=None),
        "publish_p95_s": _percentile([s["publish_s"] for s in steps], 0.95),
        "bytes_per_node_step": round(wire / node_steps) if wire is not None else round(body_bytes / node_steps),
        "bytes_counted_as": "wire" if wire is not None else "bodies",
        "body_bytes_per_node_step": round(body_bytes / node_steps),
        "bytes_per_fetched_batch": round((wire if wire is not None else body_bytes) / max(1, fetched)),
        "mean_fetched_batch_bytes": round(sum(s["bytes"] for s in steps) / max(1, fetched)),
        "dht_requests_per_node_step": round((delta["dht_gets"] + delta["dht_stores"]) / node_steps, 2),
        "dht_gets_per_node_step": round(delta["dht_gets"] / node_steps, 2),
        "dht_stores_per_node_step": round(delta["dht_stores"] / node_steps, 2),
        "index_keys_read_per_node_step": round(delta["index_keys_read"] / node_steps, 2),
        "hivemind_rpcs_per_node_step": round(sum(delta[name] for name in RPCS) / node_steps, 1),
        "hivemind_rpcs_by_kind_per_node_step": {name: round(delta[name] / node_steps, 1) for name in RPCS},
        "dht_record_copies_per_node_step": round(delta["find_records"] / node_steps, 1),
        # Payload in + out (twice what the answering node saw, like bytes_per_node_step): the DHT's share before framing.
        "dht_payload_bytes_per_node_step": {handler.removeprefix("rpc_"): round(2 * delta[counter] / node_steps)
                                            for handler, counter in SERVED.items()},
        # The load a node carries for the others: DHT finds it answered, and keys it answered with records (a
        # replica's reads), per second; the busiest node against the mean shows a hot key's replica.
        "served_per_node_s": _served(nodes, until - measure_from),
        "index_key_reads": _key_read_shares(done, buckets),
        "candidates_per_step": round(delta["sample_candidates"] / node_steps, 1),
        "max_records_per_key": max((node["max_records_per_key"] for node in nodes), default=0),
        "records_read_per_node_step": round(delta["records_read"] / node_steps, 1),
        "relayed_share": round(sum(s["relayed"] for s in steps) / fetched, 3) if fetched else None,
        "reannounced_per_node_step": round(delta["reannounced"] / node_steps, 2),
        "relay_records_per_node_step": round(delta["relay_records"] / node_steps, 2),
        "authors_heard_share": round(sum(1 for node in nodes if heard[node["index"]]) / n, 3),
        "age_p50_s": _percentile(ages, 0.5), "age_p95_s": _percentile(ages, 0.95),
        "bad_bodies": sum(s["bad"] for s in steps) + delta["bad_bodies"], "fetch_failures": delta["fetch_failures"],
        "false_informative_claims": delta["false_informative_claims"],  # an honest swarm's: 0 (each is a holder's lie)
        # Behind NAT: candidates no holder could serve us (not chosen), and streams re-asked after a circuit reset.
        "unfetchable_per_step": round(delta["unfetchable_skipped"] / node_steps, 2), "circuit_retries": delta["circuit_retries"],
        "dht_get_timeouts": delta["dht_get_timeouts"], "peer_hangups": delta["peer_hangups"],
        "step_errors": dict(errors.most_common(5)),
        "known_peers_min": min((node["known_peers"] for node in nodes), default=0),
        "rss_mb_per_node": round(max(rss), 1) if rss else None,
        "cpu_s_per_node_step": round((cpu_python + cpu_p2pd) / node_steps, 3),
        "cpu_p2pd_share": round(cpu_p2pd / max(1e-9, cpu_python + cpu_p2pd), 3),
        "machine_cpu_busy": round((cpu_python + cpu_p2pd) / max(1.0, max((c["wall_s"] for c in cpu), default=1.0)) / (os.cpu_count() or 1), 3),
        "index_tree": {"buckets": len(buckets), "records_per_bucket": round(len(tree) and sum(t[3] for t in tree) / len(buckets), 1),
                       "keys_by_level": {level: len(v) for level, v in sorted(by_level.items())},
                       "max_by_level": {level: max(v) for level, v in sorted(by_level.items())},
                       "mean_by_level": {level: round(statistics.mean(v), 1) for level, v in sorted(by_level.items())}},
        "tbf_drops": drops, "shutdown_s_max": max((b["shutdown_s"] for b in byes), default=None),
        "clean_shutdowns": not unclean, "unclean": unclean[:10],
    }


def _served(nodes: list[dict], window_s: float) -> dict:
    """Finds answered and keys answered with records, per node and second: mean, max and max over mean."""
    out = {}
    for name in ("finds_served", "records_served"):
        rates = [node["delta"][name] / window_s for node in nodes]
        mean = statistics.mean(rates) if rates else 0.0
        out[name] = {"mean": round(mean, 2), "max": round(max(rates, default=0.0), 2),
                     "max_over_mean": round(max(rates) / mean, 1) if mean else None}
    return out


def _key_read_shares(done: list[dict], buckets: set[int]) -> dict:
    """Of a bucket's index reads (walks and placements, the whole swarm's), the busiest key's share and the root's:
    the mean over the window's buckets, and the busiest key's reads in the bucket at most."""
    reads: Counter = Counter()
    for message in done:
        for bucket, level, prefix, n in message.get("key_reads", []):
            if bucket in buckets:
                reads[(bucket, level, prefix)] += n
    busiest, root, most = [], [], 0
    for bucket in sorted(buckets):
        counts = {key: n for key, n in reads.items() if key[0] == bucket}
        total = sum(counts.values())
        if total:
            busiest.append(max(counts.values()) / total)
            root.append(counts.get((bucket, 0, 0), 0) / total)
            most = max(most, max(counts.values()))
    return {"busiest_key_share": round(statistics.mean(busiest), 3) if busiest else None,
            "root_share": round(statistics.mean(root), 3) if root else None, "busiest_key_reads": most}


def _flat_at_equal_mix(smallest: dict, largest: dict) -> float | None:
    """flat with `largest`'s bodies scaled to `smallest`'s mean fetched batch (None without a batch fetched at either)."""
    if smallest["nodes"] == largest["nodes"] or not smallest["mean_fetched_batch_bytes"] or not largest["mean_fetched_batch_bytes"]:
        return None
    bodies = largest["body_bytes_per_node_step"] * smallest["mean_fetched_batch_bytes"] / largest["mean_fetched_batch_bytes"]
    index = largest["bytes_per_node_step"] - largest["body_bytes_per_node_step"]
    return round((bodies + index) / smallest["bytes_per_node_step"], 3)


def _row(r: dict) -> str:
    return (f"N={r['nodes']:>3} {r['network']:<8} delivery {r['delivery']} k_fill {r['k_fill']} (ceiling {r['k_fill_ceiling']}) p50 {r['p50_s']} s p95 {r['p95_s']} s | "
            f"{r['bytes_per_node_step'] / 1e3:.0f} kB/node-step ({r['bytes_counted_as']}; bodies {r['body_bytes_per_node_step'] / 1e3:.0f} kB) | "
            f"dht {r['dht_requests_per_node_step']} req ({r['hivemind_rpcs_per_node_step']} RPCs)/node-step, "
            f"{r['index_keys_read_per_node_step']} keys read | max {r['max_records_per_key']} records/key | "
            f"keys served/node-s {r['served_per_node_s']['records_served']['mean']} (busiest "
            f"{r['served_per_node_s']['records_served']['max_over_mean']}x) | busiest key {r['index_key_reads']['busiest_key_share']} "
            f"of a bucket's reads (root {r['index_key_reads']['root_share']}) | "
            f"idle {(r.get('idle_bytes_per_node_step') or 0) / 1e3:.0f} kB/node-step | tcp/node-step {r.get('tcp_per_node_step')} | "
            f"{r['cpu_s_per_node_step']} cpu-s/node-step | {r['rss_mb_per_node']} MB/node | clean {r['clean_shutdowns']}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 8 16 on loopback, shorter windows")
    parser.add_argument("--nodes", type=int, nargs="+", default=None, help="loopback sizes (default 8 16 32 64; --quick 8 16)")
    parser.add_argument("--shaped", type=int, default=None, help="nodes of the tbf-shaped namespace run (default 16; --quick 0); 0 skips")
    parser.add_argument("--per-worker", type=int, default=NODES_PER_WORKER, help="nodes per worker process on loopback")
    parser.add_argument("--fastest-s", type=float, default=2.0, help="the fastest node's step period (s)")
    parser.add_argument("--spread", type=float, default=10.0, help="slowest / fastest step period")
    parser.add_argument("--warmup-s", type=float, default=None, help="seconds of steps before counting (default 40; --quick 30)")
    parser.add_argument("--window-s", type=float, default=None, help="seconds counted (default 150; --quick 90)")
    parser.add_argument("--up-mbit", type=float, default=10.0, help="shaped run: each host's upload; nat run: each home's upload")
    parser.add_argument("--down-mbit", type=float, default=50.0, help="shaped run: each host's download")
    parser.add_argument("--logs", type=Path, default=None, help="folder for the workers' logs (default: a new temp folder)")
    parser.add_argument("--idle-s", type=float, default=20.0, help="seconds the joined swarm idles before stepping (background traffic)")
    parser.add_argument("--key-records", type=int, default=None, help="swarm.index_key_records (default: the config's)")
    parser.add_argument("--nat", type=int, default=0, metavar="HOMES",
                        help="also run 1 public node + HOMES nodes each behind its own NAT router (relay slots on the public node; "
                             "--up-mbit caps each home's upload; default 0: skipped)")
    args = parser.parse_args()
    sizes = args.nodes or ([8, 16] if args.quick else [8, 16, 32, 64])
    shaped = args.shaped if args.shaped is not None else (0 if args.quick else 16)
    warmup_s = args.warmup_s if args.warmup_s is not None else (30.0 if args.quick else 40.0)
    window_s = args.window_s if args.window_s is not None else (90.0 if args.quick else 150.0)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="swarm_scale-"))
    logs.mkdir(parents=True, exist_ok=True)
    why_not = namespaces_unavailable()
    if not why_not:
        import net_topology  # from this folder (the parent runs without -P; workers never import it)

        net_topology.remove_stale()  # namespaces of an earlier run that was killed
        # SIGTERM's default skips `finally`: make it SystemExit, so our namespaces (and the workers in them) go.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    print(f"swarm_scale: loopback N={sizes}, shaped N={shaped or '-'} ({args.up_mbit:g}/{args.down_mbit:g} Mbit/s up/down), "
          f"K={K}, batches {SIZES[0] // 1000}/{SIZES[1] // 1000} kB, step periods {args.fastest_s:g}-{args.fastest_s * args.spread:g} s, "
          f"{args.per_worker} nodes/worker; logs in {logs}" + (f"; no namespaces ({why_not}): host loopback, body bytes only" if why_not else ""),
          flush=True)
    common = {"warmup_s": warmup_s, "window_s": window_s, "fastest_s": args.fastest_s, "spread": args.spread, "logs": logs,
              "idle_s": args.idle_s, "key_records": args.key_records}
    runs = []
    for n in sizes:
        network = Network() if why_not else PrivateLoopback()
        try:
            runs.append(run_swarm(n, network, per_worker=args.per_worker, label=f"loopback-{n}", **common))
        finally:
            network.close()
        print(_row(runs[-1]), flush=True)
    shaped_error = None
    if shaped and not why_not:
        try:
            network = ShapedLan(shaped, args.up_mbit, args.down_mbit)
            try:
                runs.append(run_swarm(shaped, network, per_worker=1, label=f"shaped-{shaped}", **common))
            finally:
                network.close()
            runs[-1]["link_mbit"] = {"up": args.up_mbit, "down": args.down_mbit}
            print(_row(runs[-1]), flush=True)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # the loopback runs still report
            shaped_error = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(f"shaped-{shaped}: failed: {shaped_error}", flush=True)
    nat_error, nat_skipped = None, (why_not if args.nat and why_not else None)
    if nat_skipped:
        print(f"nat-{args.nat}: skipped: {nat_skipped}", flush=True)
    if args.nat and not why_not:
        try:
            network = NatWan(args.nat, args.up_mbit)
            try:
                runs.append(run_swarm(args.nat + 1, network, per_worker=1, label=f"nat-{args.nat}", **common))
            finally:
                network.close()
            runs[-1]["link_mbit"] = {"home_up": args.up_mbit}
            print(_row(runs[-1]) + f" | upload {runs[-1]['upload']}", flush=True)
        except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as exc:
            nat_error = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(f"nat-{args.nat}: failed: {nat_error}", flush=True)
    loop = [r for r in runs if r["network"] == "loopback"]
    largest = max(loop, key=lambda r: r["nodes"])
    smallest = min(loop, key=lambda r: r["nodes"])
    result = {
        "nodes": largest["nodes"],
        **{key: largest[key] for key in ("delivery", "p95_s", "bytes_per_node_step", "dht_requests_per_node_step",
                                         "hivemind_rpcs_per_node_step", "max_records_per_key", "rss_mb_per_node", "k_fill")},
        "max_records_per_key": max(r["max_records_per_key"] for r in runs),
        "flat": round(largest["bytes_per_node_step"] / smallest["bytes_per_node_step"], 3) if smallest["nodes"] != largest["nodes"] else None,
        "flat_vs_nodes": smallest["nodes"],
        "flat_per_fetched_batch": round(largest["bytes_per_fetched_batch"] / smallest["bytes_per_fetched_batch"], 3),
        # What flat would be if the index cost nothing: the bodies alone (k_fill below 1 at N = 8, and the batch mix).
        "flat_bodies": round(largest["body_bytes_per_node_step"] / smallest["body_bytes_per_node_step"], 3),
        # Which batches a node happened to fetch moves the mean fetched batch by a few percent from run to run: flat
        # with the largest N's bodies scaled to the smallest N's mean fetched batch takes that out.
        "flat_at_equal_batch_mix": _flat_at_equal_mix(smallest, largest),
        "clean_shutdowns": all(r["clean_shutdowns"] for r in runs) and shaped_error is None and nat_error is None,
        "shaped_error": shaped_error,
        "nat_error": nat_error,
        "nat_skipped": nat_skipped,
        "runs": runs,
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
