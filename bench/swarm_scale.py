"""Light gossip-only nodes at N = 8..64: what one node pays per step for rollout sharing by recency, and how that grows with N.

Every node is a light node (bench/light_nodes.py): a real `Gossip` from the `public` preset's swarm section, no model,
publishing a real signed batch each step (~10 KB and ~150 KB, alternating step by step), then taking up to K = 4 fresh
batches with `sample_rollouts` and checking each as intake would. Nobody waits for anybody: step periods are spread
log-evenly over a 10x range (2 s to 20 s by default), each node starts at a random phase and with a random one of the
two sizes. Every node alternating, the swarm's published mix is half and half at every N and every speed; a size fixed
per node would tie it to the speeds, and in a swarm of 8 the fastest node's size weighs most (mean published batch
69 kB against 78 at 64, when sizes alternated by speed rank): N = 8 paid less per fetched batch for that alone.
Several nodes share a worker process (8 by default; each node its own gossip loop thread and step thread), so 64
nodes fit on 2 cores and a few GB. Node 0 is the bootstrap peer everyone joins through, and a stepping node too.

Runs (networks: bench/scale_networks.py): N = 8, 16, 32, 64 on loopback (inside a network namespace of our own, so its `lo` counters
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
  dht_requests_per_node_step gossip's dht_gets + dht_stores + replica_lookups per node-step (index reads, stores, and
                             the lookup of a key's replicas before a store, at most once per key and 30 s: each a traversal);
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
                             "gossip shutdown was not clean" or "did not stop within", every worker exited 0 and
                             every p2pd as stopped (0 or SIGTERM's; or killed at the deadline); shutdown_stages_cut_short counts
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
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from light_nodes import MAX_AGE_S, PROGRESS_S, RPCS, SERVED, SIZES, STEP_TIMEOUT_S, K
from scale_networks import NatWan, Network, PrivateLoopback, ShapedLan, namespaces_unavailable

NODES_PER_WORKER = 8
UNCLEAN = ("Traceback", "Task was destroyed", "was never retrieved", "gossip shutdown was not clean", "did not stop within")


# ----- one run, then the summary ------------------------------------------------------------------



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
    light_nodes = str(Path(__file__).resolve().with_name("light_nodes.py"))
    workers: list[Worker] = []
    started = time.monotonic()
    last_print = [started]

    def spawn(slot: int, bootstrap: str) -> Worker:
        argv = [*network.prefix(slot), sys.executable, "-P", light_nodes, "--host", network.host(slot),
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
    for slot, worker in enumerate(workers):
        text = worker.log.read_text(errors="replace")
        cut_short += text.count("gossip shutdown: ")  # a stage or a task's unwinding that ran past the deadline: bounded, counted
        unclean += unclean_stops(worker.log.name, text, worker.process.returncode, byes[slot].get("p2pd_exits", []))
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


def unclean_stops(name: str, log: str, exit_code: int | None, p2pd_exits: list[int | None]) -> list[str]:
    """What in one worker's stop was not clean: its log's lines matching UNCLEAN, its own exit status, and each p2pd's.

    A stopped p2pd exits 0, or 143 / -SIGTERM on hivemind's SIGTERM, or is killed at the shutdown's deadline (-SIGKILL,
    logged as a stage cut short and counted there); any other status is a crash (a Go panic exits 2), whose stack
    hivemind logs at debug only."""
    found = [f"{name}: {line.strip()[:200]}" for line in log.splitlines() if any(p in line for p in UNCLEAN)]
    if exit_code != 0:
        found.append(f"{name}: exit code {exit_code}")
    stopped = (0, 128 + signal.SIGTERM, -signal.SIGTERM, -signal.SIGKILL, None)
    found += [f"{name}: p2pd exit code {code}" for code in p2pd_exits if code not in stopped]
    return found


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
        "dht_requests_per_node_step": round((delta["dht_gets"] + delta["dht_stores"] + delta["replica_lookups"]) / node_steps, 2),
        "dht_gets_per_node_step": round(delta["dht_gets"] / node_steps, 2),
        "dht_stores_per_node_step": round(delta["dht_stores"] / node_steps, 2),
        "replica_lookups_per_node_step": round(delta["replica_lookups"] / node_steps, 2),
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
