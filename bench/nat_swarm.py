"""Gossip through NAT on one machine: a public node and two nodes in home networks behind masquerading routers.

The topology is bench/net_topology.py (Linux network namespaces, nftables masquerade, no port
forwarding). Every node is a DHT-only publisher of the demo's payload sizes (a ~150 KB sealed
rollout batch announced in the rollout index by recency and a ~3 MB sealed delta in a slot per
round, as bench/gossip_swarm.py), started with the `public` preset's swarm settings: the public
node listens on 203.0.113.10:31337 with a fixed p2p key; the home nodes bootstrap from it and
reserve relay slots on it (swarm.use_auto_relay).
Each received body is checked as usual: gossip checks size and sha256, and the child opens the
envelope and checks that it is signed by the announced author.

Phases:
1. reachability per node, as the nodes measured it (node/swarm/nat.py), once settled;
2. R rounds on unlimited links: delivery (items every other node got / items expected) and, per
   item, the time until the last node has it (p50/p95 over items and rounds); then each node's
   clock against its peers' (node/swarm/clock.py: the reach stream's ping carries the time,
   through the relay between the homes), with one home node measuring and answering with a clock
   --clock-skew seconds behind (its announcements keep the machine's clock): it must warn, with
   the offset it was given, and the two others, which see one skewed peer of two, must not;
3. the same with a 10 Mbit/s tbf uplink on each home router: bytes each home uploads per round
   (its router's WAN tx counter) and the time until every node has every item;
4. the public node is SIGKILLed and restarted (same key, same address): rejoin_s is the time from
   its restart until a round started after it is delivered to every node again.

Usage: python bench/nat_swarm.py [--quick] [--rounds 5] [--uplink-mbit 10]
Needs root (namespaces); prints `RESULT {"skipped": reason}` where the kernel forbids them.
Ends with `RESULT {"delivery", "p95_s", "reachability", "clock", "rejoin_s", ...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import net_topology
from gossip_swarm import DELTA_BYTES, ROLLOUT_BYTES

PUBLIC_PORT = 31337
TOPICS = ("rollouts", "delta")


# ----- child: one node inside a namespace --------------------------------------------------------


def child(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--bootstrap", action="append", default=[])
    parser.add_argument("--p2p-key")
    parser.add_argument("--clock-skew", type=float, default=0.0)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if os.environ.get("NAT_SWARM_DEBUG"):
        logging.getLogger("hivespec.node.swarm.gossip").setLevel(logging.DEBUG)

    import dataclasses

    from hivespec.node.config import load_config
    from hivespec.node.swarm.gossip import Gossip
    from hivespec.protocol.envelope import Kind, open_envelope, seal
    from hivespec.protocol.identity import Identity

    # The preset under test (relay and re-bootstrap settings), on this node's address and bootstrap peers.
    swarm = dataclasses.replace(load_config("public").swarm, swarm="natbench", host=args.host, port=args.port,
                                initial_peers=args.bootstrap, nat_port_map=False, request_timeout=10.0)
    me = Identity.generate()
    gossip = Gossip(me, swarm, p2p_identity_path=args.p2p_key, clock=lambda: time.time() + args.clock_skew)
    gossip.start()
    print(json.dumps({"peer": me.peer_id, "p2p": str(gossip._p2p.peer_id), "maddrs": gossip.visible_maddrs}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "status":
            status = gossip.status()
            print(json.dumps({k: status[k] for k in ("reachability", "reachability_detail", "known_peers", "solo")}), flush=True)
            continue
        if cmd["op"] == "clock":
            for _ in range(cmd["asks"]):  # as at (re)joins: three peers, then one a time, the unmeasured first
                gossip.check_clock()
            status = gossip.status()
            print(json.dumps({k: status[k] for k in ("clock_offset_s", "clock_peers", "clock_warning", "known_peers")}), flush=True)
            continue
        r, t0 = cmd["round"], cmd["t0"]
        time.sleep(max(0.0, t0 - time.time()))
        bodies = {"rollouts": seal(me, Kind.ROLLOUTS, 2 * r + 1, os.urandom(cmd["rollout_bytes"])),
                  "delta": seal(me, Kind.DELTA, 2 * r + 2, os.urandom(cmd["delta_bytes"]))}
        got: dict[str, float] = {}
        bad = 0
        for topic, body in bodies.items():
            try:
                if topic == "rollouts":
                    gossip.publish_rollouts(body, version=r)
                else:
                    gossip.publish(r, body, topic=topic)
            except Exception as exc:  # noqa: BLE001 - an unreachable swarm is what some phases measure
                print(f"publish {topic} {r} failed: {exc}", file=sys.stderr, flush=True)
        deadline = time.time() + cmd["timeout"]
        interval = 0.02
        while time.time() < deadline and len(got) < 2 * cmd["others"]:
            for topic in TOPICS:
                # Bounded by request_timeout: a body slower than that is cut and re-fetched.
                timeout = min(gossip.request_timeout, max(0.1, deadline - time.time()))
                if topic == "rollouts":
                    # Rollouts carry no round: a batch missed in an earlier round may arrive now; only this round's counts.
                    fetched_now = gossip.sample_rollouts(k=cmd["others"], max_age_s=240.0, timeout=timeout)
                else:
                    fetched_now = gossip.fetch_slot(r, topic=topic, timeout=timeout)
                for fetched in fetched_now:
                    verdict, envelope = open_envelope(fetched.body)
                    if not verdict.ok or envelope is None or envelope.peer_id != fetched.author_peer_id:
                        bad += 1
                        continue
                    if envelope.seq == 2 * r + (1 if topic == "rollouts" else 2):
                        got[f"{topic}:{fetched.author_peer_id}"] = time.time() - t0
            time.sleep(interval)
            interval = min(interval * 2, 0.2)
        stats = gossip.stats()
        print(json.dumps({"got": got, "bad": bad, "stats": {k: stats.get(k, 0) for k in (
            "bytes_out", "bodies_served", "fetch_failures", "bodies_fetched", "bodies_fetched_from_relay")}}), flush=True)
    gossip.shutdown()


# ----- parent ------------------------------------------------------------------------------------


class Node:
    """A child process in a namespace, spoken to over stdin/stdout lines."""

    def __init__(self, name: str, host: net_topology.Host, argv: list[str], log: Path) -> None:
        self.name, self.host, self.argv, self.log = name, host, argv, log
        self.start()

    def start(self) -> None:
        command = [sys.executable, __file__, "--child", *self.argv]
        self.proc = self.host.popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=self.log.open("a"), text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} did not start; see {self.log}:\n{self.log.read_text()[-3000:]}")
        self.info = json.loads(line)

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited; see {self.log}:\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def status(self) -> dict:
        self.send({"op": "status"})
        return self.reply()

    def kill(self) -> None:
        # `ip netns exec` execs the child, so this is the node itself; its p2pd follows it down.
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def quit(self) -> None:
        try:
            self.send({"op": "quit"})
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def start_swarm(topo: net_topology.Topology, workdir: Path, clock_skew: float = 0.0) -> list[Node]:
    """The public node, then one node per home bootstrapping from it, the last one's clock `clock_skew` s behind;
    returns [public, home1, ...]."""
    key = workdir / "public.p2p.key"
    public = Node("public", topo.public, ["--host", net_topology.PUBLIC_ADDR, "--port", str(PUBLIC_PORT),
                                          "--p2p-key", str(key)], workdir / "public.log")
    maddr = f"/ip4/{net_topology.PUBLIC_ADDR}/tcp/{PUBLIC_PORT}/p2p/{public.info['p2p']}"
    hosts = topo.home_hosts
    homes = [Node(f"home{i + 1}", host, ["--host", "0.0.0.0", "--bootstrap", maddr,
                                         "--clock-skew", str(-clock_skew if i == len(hosts) - 1 else 0.0)],
                  workdir / f"home{i + 1}.log")
             for i, host in enumerate(hosts)]
    return [public, *homes]


def settle_reachability(nodes: list[Node], timeout: float) -> dict[str, dict]:
    """Poll every node's measured reachability until none is unknown/unreachable (or `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        states = {n.name: n.status() for n in nodes}
        if all(s["reachability"] in ("reachable", "relayed") for s in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(1.0)


def check_clocks(nodes: list[Node], skew: float) -> dict:
    """Each node asks its peers for their time (three times: every peer is asked, the relayed home included) and says
    what it concluded; `ok` where exactly the skewed node (the last) warns, with an offset within 2 s of `skew`."""
    verdicts = {}
    for node in nodes:
        node.send({"op": "clock", "asks": 3})
        verdicts[node.name] = node.reply()
        v = verdicts[node.name]
        print(f"{node.name}: clock offset {v['clock_offset_s']} s over {v['clock_peers']} of {v['known_peers']} known peers"
              f"{': ' + v['clock_warning'] if v['clock_warning'] else ', no warning'}", flush=True)
    skewed = nodes[-1].name if skew else None
    ok = all(bool(v["clock_warning"]) == (name == skewed) for name, v in verdicts.items())
    if skewed is not None:
        offset = verdicts[skewed]["clock_offset_s"]
        ok = ok and offset is not None and abs(offset - skew) < 2.0
    return {"skew_s": skew, "skewed": skewed, "ok": ok,
            **{name: {"offset_s": v["clock_offset_s"], "peers": v["clock_peers"], "warned": bool(v["clock_warning"])}
               for name, v in verdicts.items()}}


def run_round(nodes: list[Node], r: int, timeout: float, rollout_bytes: int, delta_bytes: int) -> tuple[int, int, list[float], int]:
    """One round on every node: (delivered, expected, per-item time until the last node had it, bad bodies)."""
    t0 = time.time() + 0.3
    for n in nodes:
        n.send({"op": "round", "round": r, "t0": t0, "timeout": timeout, "others": len(nodes) - 1,
                "rollout_bytes": rollout_bytes, "delta_bytes": delta_bytes})
    replies = [n.reply() for n in nodes]
    delivered, latencies = 0, []
    for author in nodes:
        for topic in TOPICS:
            item = f"{topic}:{author.info['peer']}"
            times = [rep["got"][item] for rep, n in zip(replies, nodes) if n is not author and item in rep["got"]]
            delivered += len(times)
            if len(times) == len(nodes) - 1:
                latencies.append(max(times))
    if os.environ.get("NAT_SWARM_STATS"):
        print("  stats: " + json.dumps({n.name: rep["stats"] for n, rep in zip(nodes, replies)}), flush=True)
    return delivered, 2 * len(nodes) * (len(nodes) - 1), latencies, sum(rep["bad"] for rep in replies)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds per phase, small bandwidth phase (about a minute)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds in the unlimited phase (default 10, --quick 3)")
    parser.add_argument("--uplink-mbit", type=float, default=10.0, help="home upload cap in the bandwidth phase (0 = skip it)")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds a node waits for a round's items")
    parser.add_argument("--no-restart", action="store_true", help="skip the public-node restart phase")
    parser.add_argument("--clock-skew", type=float, default=60.0,
                        help="seconds the last home node's clock is behind in the clock check (0 = every clock agrees)")
    parser.add_argument("--dir", type=Path, default=None, help="work directory for logs and keys (default: a temp dir)")
    args = parser.parse_args()
    reason = net_topology.unavailable()
    if reason is not None:
        print(f"skipped: {reason}")
        print("RESULT " + json.dumps({"skipped": reason}))
        return 0
    rounds = args.rounds or (3 if args.quick else 10)
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="nat_swarm."))
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict = {"rounds": rounds, "rollout_bytes": ROLLOUT_BYTES, "delta_bytes": DELTA_BYTES}
    with net_topology.Topology(homes=2) as topo:
        nodes = start_swarm(topo, workdir, args.clock_skew)
        try:
            t_settle = time.monotonic()
            states = settle_reachability(nodes, timeout=60.0)
            result["settle_s"] = round(time.monotonic() - t_settle, 1)
            result["reachability"] = {name: s["reachability"] for name, s in states.items()}
            for name, s in states.items():
                print(f"{name}: {s['reachability']} ({s['reachability_detail']})", flush=True)

            delivered = expected = bad = 0
            latencies: list[float] = []
            for r in range(rounds):
                d, e, lat, b = run_round(nodes, r, args.timeout, ROLLOUT_BYTES, DELTA_BYTES)
                delivered, expected, bad = delivered + d, expected + e, bad + b
                latencies += lat
                print(f"round {r}: {d}/{e} delivered, slowest item {max(lat, default=float('nan')):.2f} s", flush=True)
            result.update(delivery=round(delivered / expected, 4), p50_s=percentile(latencies, 0.5),
                          p95_s=percentile(latencies, 0.95), bad_bodies=bad)
            result["clock"] = check_clocks(nodes, args.clock_skew)  # once the rounds' traffic filled the routing tables
            next_round = rounds

            if args.uplink_mbit > 0:
                for router in topo.routers:
                    topo.set_uplink(router, args.uplink_mbit)
                bw_rounds = 2 if args.quick else 3
                sent, bw_lat, bw_delivered, bw_expected = [], [], 0, 0
                for r in range(next_round, next_round + bw_rounds):
                    before = [topo.wan_bytes_sent(router) for router in topo.routers]
                    d, e, lat, _ = run_round(nodes, r, max(args.timeout, 60.0), ROLLOUT_BYTES, DELTA_BYTES)
                    sent.append([topo.wan_bytes_sent(router) - b for router, b in zip(topo.routers, before)])
                    bw_lat += lat
                    bw_delivered, bw_expected = bw_delivered + d, bw_expected + e
                    print(f"round {r} at {args.uplink_mbit:g} Mbit/s up: {d}/{e} delivered, every item in "
                          f"{max(lat, default=float('nan')):.2f} s, homes uploaded {sent[-1]} bytes", flush=True)
                next_round += bw_rounds
                for router in topo.routers:
                    topo.set_uplink(router, None)
                result["uplink"] = {
                    "mbit": args.uplink_mbit,
                    "delivery": round(bw_delivered / bw_expected, 4),
                    "upload_bytes_per_round": int(statistics.mean(max(s) for s in sent)),
                    "deliver_all_s": percentile(bw_lat, 1.0),
                }

            if not args.no_restart:
                public = nodes[0]
                public.kill()
                t_restart = time.monotonic()
                print(f"public node killed at {time.strftime('%H:%M:%S')}", flush=True)
                public.start()
                rejoin_s = None
                r = next_round
                while time.monotonic() - t_restart < 90.0:
                    d, e, _, _ = run_round(nodes, r, 10.0, ROLLOUT_BYTES, DELTA_BYTES)
                    r += 1
                    print(f"after restart, round {r - 1}: {d}/{e} delivered at {time.monotonic() - t_restart:.1f} s", flush=True)
                    if d == e:
                        rejoin_s = round(time.monotonic() - t_restart, 1)
                        break
                result["rejoin_s"] = rejoin_s
                result["reachability_after_restart"] = {n.name: n.status()["reachability"] for n in nodes}
        finally:
            for n in nodes:
                n.quit()
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
