"""Loopback swarm propagation: N gossip processes vs direct all-to-all TCP of the same bytes, in one run.

Each round every node publishes a ~150 KB sealed rollout batch (announced in the rollout index by
recency, `publish_rollouts`, and read with `sample_rollouts`) and a ~3 MB sealed payload (slot topic
"delta", sent in 1 MiB stream chunks), then polls until it holds every other node's two items. Per item we take the time until the *last* node has it (from the
round's start signal); p50/p95 are over items and rounds. The baseline sends the same bytes
from every node to every other node over plain TCP sockets, same processes, same round start.

Wire bytes for gossip come from the kernel, not from our counters: `ss` tcp_info bytes_sent of
every established TCP socket of the nodes' p2pd processes (TLS, yamux, DHT traffic included),
after minus before. For TCP: the bytes the Python processes passed to sendall (payload plus a
24-byte header and a name). IP/TCP headers are counted in neither. Overhead = wire bytes /
(payload x (N - 1)); vs_tcp = gossip p95 / TCP p95.

Usage: python -P bench/gossip_swarm.py [--quick] [--nodes 4 8] [--rounds 5]
Ends with `RESULT {"delivery", "p50_s", "p95_s", "overhead", "vs_tcp", ...}` (the largest N's figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

ROLLOUT_BYTES = 150_000
DELTA_BYTES = 3_000_000


def tcp_bytes_sent(pids: set[int]) -> dict[tuple[str, str], int]:
    """bytes_sent (kernel tcp_info) of every established TCP socket owned by `pids`, by (local, peer) address."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True, check=True).stdout
    sent, current = {}, None
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):
            parts = line.split()
            owner = re.search(r"pid=(\d+)", line)
            current = (parts[2], parts[3]) if owner and int(owner.group(1)) in pids else None
        elif current is not None:
            match = re.search(r"bytes_sent:(\d+)", line)
            if match:
                sent[current] = int(match.group(1))
    return sent


# ----- child -------------------------------------------------------------------------------------


def child(index: int, bootstrap: str) -> None:
    from hivespec.node.config import SwarmConfig
    from hivespec.node.swarm.gossip import Gossip
    from hivespec.protocol.envelope import Kind, open_envelope, seal
    from hivespec.protocol.identity import Identity

    me = Identity.generate()
    gossip = Gossip(me, SwarmConfig(swarm="bench", initial_peers=[bootstrap] if bootstrap != "-" else [], request_timeout=10.0,
                                    bootstrap_timeout=20.0))
    gossip.start()
    server = socket.create_server(("127.0.0.1", 0))
    arrivals: dict[str, float] = {}
    lock = threading.Lock()

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=receive, args=(conn,), daemon=True).start()

    def receive(conn: socket.socket) -> None:
        with conn:
            header = b""
            while len(header) < 24:
                header += conn.recv(24 - len(header))
            name_len, size = int(header[:8]), int(header[8:])
            name = conn.recv(name_len, socket.MSG_WAITALL).decode()
            left = size
            while left:
                left -= len(conn.recv(min(left, 1 << 20)))
            with lock:
                arrivals[name] = time.time()

    threading.Thread(target=serve, daemon=True).start()
    out = {"maddr": gossip.visible_maddrs[0], "tcp": server.getsockname()[1], "peer": me.peer_id,
           "p2pd": gossip._p2p._child.pid, "pid": os.getpid()}
    print(json.dumps(out), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        r, t0, n = cmd["round"], cmd["t0"], cmd["nodes"]
        time.sleep(max(0.0, t0 - time.time()))
        rollouts = seal(me, Kind.ROLLOUTS, r * 2 + 1, os.urandom(ROLLOUT_BYTES))
        delta = seal(me, Kind.DELTA, r * 2 + 2, os.urandom(DELTA_BYTES))
        got: dict[str, float] = {}
        sent = 0
        if cmd["op"] == "gossip":
            gossip.publish_rollouts(rollouts, version=r)
            gossip.publish(r, delta, topic="delta")
            deadline = time.time() + cmd["timeout"]
            interval = 0.02
            while time.time() < deadline and len(got) < 2 * (n - 1):
                # Rollouts carry no round: this round's batch is the one sealed with this round's sequence number
                # (a batch missed in an earlier round may still arrive now; it does not count).
                for f in gossip.sample_rollouts(k=n - 1, max_age_s=120.0, timeout=5.0):
                    _, envelope = open_envelope(f.body)
                    if envelope is not None and envelope.seq == r * 2 + 1:
                        got[f"rollouts:{f.author_peer_id}"] = time.time() - t0
                for f in gossip.fetch_slot(r, topic="delta", timeout=5.0):
                    got[f"delta:{f.author_peer_id}"] = time.time() - t0
                time.sleep(interval)
                interval = min(interval * 2, 0.2)
        else:
            for port in cmd["ports"]:
                for name, body in (("rollouts", rollouts), ("delta", delta)):
                    with socket.create_connection(("127.0.0.1", port)) as s:
                        tag = f"{name}:{me.peer_id}".encode()
                        message = f"{len(tag):08d}{len(body):016d}".encode() + tag + body
                        s.sendall(message)
                        sent += len(message)
            deadline = time.time() + cmd["timeout"]
            while time.time() < deadline:
                with lock:
                    if len(arrivals) >= 2 * (n - 1):
                        break
                time.sleep(0.01)
            with lock:
                got = {k: v - t0 for k, v in arrivals.items()}
                arrivals.clear()
        print(json.dumps({"got": got, "sent": sent}), flush=True)
    gossip.shutdown()


# ----- parent ------------------------------------------------------------------------------------


def run_swarm(n: int, rounds: int, timeout: float) -> dict:
    procs = []

    def spawn(bootstrap: str) -> dict:
        p = subprocess.Popen([sys.executable, "-P", __file__, "--child", str(len(procs)), bootstrap],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        return json.loads(p.stdout.readline())

    infos = [spawn("-")]
    infos += [spawn(infos[0]["maddr"]) for _ in range(n - 1)]
    time.sleep(1.0)

    p2pds = {i["p2pd"] for i in infos}

    results = {}
    try:
        for mode in ("gossip", "tcp"):
            latencies, delivered, tcp_sent = [], 0, 0
            wire_before = tcp_bytes_sent(p2pds)
            for r in range(rounds):
                t0 = time.time() + 0.5
                cmd = {"op": mode, "round": r, "t0": t0, "nodes": n, "timeout": timeout,
                       "ports": []}
                replies = []
                for p, info in zip(procs, infos):
                    cmd["ports"] = [i["tcp"] for i in infos if i is not info]
                    p.stdin.write(json.dumps(cmd) + "\n")
                    p.stdin.flush()
                answers = [json.loads(p.stdout.readline()) for p in procs]
                replies = [a["got"] for a in answers]
                tcp_sent += sum(a["sent"] for a in answers)
                items = {f"{topic}:{i['peer']}" for i in infos for topic in ("rollouts", "delta")}
                for item in items:
                    times = [got[item] for got, info in zip(replies, infos) if item in got]
                    expected = n - 1
                    delivered += len(times)
                    if len(times) == expected:
                        latencies.append(max(times))
            wire_after = tcp_bytes_sent(p2pds)
            # Sockets that closed mid-run drop out of ss (an undercount); p2pd keeps its connections open.
            gossip_wire = sum(v - wire_before.get(k, 0) for k, v in wire_after.items())
            wire = gossip_wire if mode == "gossip" else tcp_sent
            payload = rounds * n * (ROLLOUT_BYTES + DELTA_BYTES)
            latencies.sort()
            results[mode] = {
                "delivery": delivered / (rounds * 2 * n * (n - 1)),
                "p50_s": round(statistics.median(latencies), 3) if latencies else None,
                "p95_s": round(latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))], 3) if latencies else None,
                "overhead": round(wire / (payload * (n - 1)), 3),
            }
    finally:
        for p in procs:
            try:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    return results


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 4, 3 rounds (under 2 minutes)")
    parser.add_argument("--nodes", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a node waits for a round's items")
    args = parser.parse_args()
    sizes = args.nodes or ([4] if args.quick else [4, 8])
    rounds = args.rounds or (3 if args.quick else 5)
    final = {}
    for n in sizes:
        res = run_swarm(n, rounds, args.timeout)
        g, t = res["gossip"], res["tcp"]
        vs = round(g["p95_s"] / t["p95_s"], 2) if g["p95_s"] and t["p95_s"] else None
        print(f"N={n} rounds={rounds}: gossip {g} | tcp {t} | gossip/tcp p95 {vs}", flush=True)
        final = {"nodes": n, "rounds": rounds, "delivery": g["delivery"], "p50_s": g["p50_s"], "p95_s": g["p95_s"],
                 "overhead": g["overhead"], "vs_tcp": vs, "tcp_p95_s": t["p95_s"], "tcp_overhead": t["overhead"]}
    print("RESULT " + json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
