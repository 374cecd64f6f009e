"""Volunteers behind home NAT, as real training nodes: do they learn from the swarm, and the swarm from them?

bench/nat_swarm.py checks the network part with gossip-only nodes; this runs the product. `hivespec
join` processes on the demo model with the `public` preset as it ships (no waiting,
`swarm.use_auto_relay` on), in the network namespaces of bench/net_topology.py: one on the public
host (203.0.113.10:31337, a machine with a public address) and one in each of `--homes` home
networks (default 2), each behind its own masquerading router with no port forwarding, its upload
capped at `--uplink-mbit` (tbf on the router's WAN side). The homes join through the public node
and cannot dial each other: what one home makes reaches another only through the public node (a
relay circuit for small bodies, the public node's own copy of the batch for larger ones): with
more homes, more of them lean on one public node, as in a public swarm of laptops. Every node runs
2 prompts x 4 completions a step; with `--hetero` home1 runs 1 x 2 and every other node 4 x 4
(bench/hetero_swarm.py's fast and slow nodes: a fast laptop at home among slower peers).

Counted over the steady window (from the moment every node has published a batch to the end):
  nodes.<name>.steps, steps_per_min         steps, and the same a minute
  nodes.<name>.foreign_step_share           the share of its steps that trained on foreign samples (samples that
                                            carried a gradient)
  nodes.<name>.trained_from                 foreign samples the node trained on, by author (node names)
  nodes.<name>.reachability                 the node's own verdict (node/swarm/nat.py) in its last step
  nodes.<name>.upload_bytes_per_step        the node's upload per step of its own (the WAN link's counter: a home's
                                            router, the public host's own link; over the whole run)
  share_both_ways                           every node trained on samples of each of the others: home to
                                            home included, through the public node
  pairs_shared                              the share of (reader, author) pairs where the reader trained on the
                                            author's samples (1.0 with share_both_ways)
  home_to_home_samples                      foreign samples a home trained on that another home made (each came
                                            through the public node)
  foreign_age_s                             age of the foreign samples the homes trained on, median and p95
  clean_stops                               every node stopped by SIGTERM exited 0 with no traceback in its log

    python bench/nat_nodes.py            # 6 minutes
    python bench/nat_nodes.py --quick    # 3 minutes
    python bench/nat_nodes.py --hetero   # a fast home among slow peers
    python bench/nat_nodes.py --homes 4  # four homes on one public node

Needs root (namespaces); prints `RESULT {"skipped": reason}` where the kernel forbids them.
Ends with one line `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import ClassVar

import net_topology
from swarm_harness import SwarmNode, check_memory, median_p95, prepare_model, steady, wait_ready, watch_steps, work_dir

PUBLIC_PORT = 31337
# No status server, no checkpoints (they would only cost disk here).
COMMON = ["swarm.bootstrap_timeout=60", "status.enabled=false", "checkpoint.every_rounds=0", "checkpoint.at_exit=false"]
EQUAL = ["rollout.prompts_per_round=2", "rollout.num_generations=4"]  # every node's step by default
# --hetero: home1 is bench/hetero_swarm.py's fast node (an eighth of the others' work per step), the others its slow ones.
FAST, SLOW = ["rollout.prompts_per_round=1", "rollout.num_generations=2"], ["rollout.prompts_per_round=4", "rollout.num_generations=4"]


class NamespacedNode(SwarmNode):
    """A `hivespec join` of the `public` preset run inside a network namespace (`ip netns exec` execs it: same pid)."""

    preset: ClassVar[str] = "public"

    def __init__(self, name: str, home: Path, sets: list[str], host: net_topology.Host, local_nodes: int) -> None:
        super().__init__(name, home, sets, local_nodes=local_nodes)
        self.host = host

    def command(self, initial_peers: list[str]) -> list[str]:
        return self.host.command(super().command(initial_peers))


def run(topo: net_topology.Topology, root: Path, minutes: float, *, until_shared: bool = False,
        hetero: bool = False) -> tuple[list[NamespacedNode], dict, float, dict]:
    """Start the public node, then a node in each of the topology's homes through it; run `minutes` (`until_shared`: or
    until every node has trained on samples of every other); stop them. Nodes, each node's (arrival time, step) list,
    the end, each node's upload in bytes. `hetero`: home1 does an eighth of the others' work per step."""
    count = 1 + len(topo.home_hosts)

    def work(name: str) -> list[str]:
        return (FAST if name == "home1" else SLOW) if hetero else EQUAL

    public = NamespacedNode("public", root / "public", COMMON + work("public") + [
        f"swarm.host={net_topology.PUBLIC_ADDR}", f"swarm.port={PUBLIC_PORT}", "seed=1"], topo.public, count)
    homes = []
    for i, host in enumerate(topo.home_hosts):
        name = f"home{i + 1}"
        homes.append(NamespacedNode(name, root / name, COMMON + work(name) + ["swarm.port=0", f"seed={2 + i}"], host, count))
    nodes = [public, *homes]
    started = time.monotonic()
    try:
        public.start([])
        entry = [m for m in wait_ready(public) if net_topology.PUBLIC_ADDR in m]
        for home in homes:
            home.start(entry)
        for home in homes:
            wait_ready(home)
        links = {"public": topo.public} | {home.name: router for home, router in zip(homes, topo.routers, strict=True)}
        uploads_at_start = {name: topo.wan_bytes_sent(link) for name, link in links.items()}
        print(f"{count} nodes up after {time.monotonic() - started:.0f}s (homes joined through {entry[0]}); running {minutes:g} min",
              flush=True)
        def shared(arrivals: dict) -> bool:
            return shares_both_ways(nodes, trained_from(nodes, steady(arrivals, time.monotonic())[1]))

        arrivals = watch_steps(nodes, minutes, started=started, until=shared if until_shared else None)
        end = time.monotonic()
        uploads = {name: topo.wan_bytes_sent(link) - uploads_at_start[name] for name, link in links.items()}
    finally:
        for node in nodes:
            node.stop(timeout=60)
    return nodes, arrivals, end, uploads


def trained_from(nodes: list[NamespacedNode], steps: dict[str, list[dict]]) -> dict[str, dict[str, int]]:
    """Per node, the foreign samples its `steps` trained on, by author (node names)."""
    names = {e["peer_id"]: n.name for n in nodes for e in n.events if e["event"] == "ready"}
    counts: dict[str, dict[str, int]] = {}
    for node in nodes:
        by_author = counts[node.name] = {}
        for event in steps[node.name]:
            for source, stats in (event.get("importance_by_source") or {}).items():
                if source != "own":
                    author = names.get(source, source)
                    by_author[author] = by_author.get(author, 0) + stats["samples"]
    return counts


def pairs_shared(nodes: list[NamespacedNode], trained: dict[str, dict[str, int]]) -> float:
    """The share of (reader, author) pairs of distinct nodes where the reader trained on the author's samples."""
    pairs = [trained[n.name].get(other.name, 0) > 0 for n in nodes for other in nodes if other is not n]
    return sum(pairs) / len(pairs)


def shares_both_ways(nodes: list[NamespacedNode], trained: dict[str, dict[str, int]]) -> bool:
    """Every node trained on samples of each of the others."""
    return pairs_shared(nodes, trained) == 1.0


def summary(nodes: list[NamespacedNode], arrivals: dict, end: float, uploads: dict) -> dict:
    """The RESULT's keys (the module doc) from the steps that came until `end`."""
    seconds, steps = steady(arrivals, end)
    trained = trained_from(nodes, steps)
    per_node = {}
    for node in nodes:
        own = steps[node.name]
        per_node[node.name] = {
            "steps": len(own),
            "steps_per_min": round(len(own) / (seconds / 60), 2) if seconds > 0 else 0.0,
            "foreign_step_share": round(sum(e["foreign_trained"] > 0 for e in own) / len(own), 3) if own else 0.0,
            "trained_from": trained[node.name],
            "reachability": own[-1]["swarm_reachability"] if own else None,
        }
        if node.name in uploads and own:
            per_node[node.name]["upload_bytes_per_step"] = round(uploads[node.name] / len(arrivals[node.name]))
    clean = all(n.process is not None and n.process.poll() == 0 and "Traceback" not in n.log_text() for n in nodes)
    ages = [a for n in nodes if n.name != "public" for e in steps[n.name] for a in e["foreign_ages_s"]]
    homes = [n.name for n in nodes if n.name != "public"]
    return {"nodes": per_node, "share_both_ways": shares_both_ways(nodes, trained),
            "pairs_shared": round(pairs_shared(nodes, trained), 3),
            "home_to_home_samples": sum(trained[reader].get(author, 0) for reader in homes for author in homes),
            "foreign_step_share_min": min(p["foreign_step_share"] for p in per_node.values()),
            "foreign_age_s": median_p95(ages), "steady_seconds": round(seconds), "clean_stops": clean}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 minutes instead of 6")
    parser.add_argument("--minutes", type=float, help="minutes to run (default 6, quick 3)")
    parser.add_argument("--homes", type=int, default=2,
                        help="home networks, a node in each, behind one public node (default 2; each node takes up to "
                             "~5 GB of memory while it trains: the bench refuses more nodes than the memory available holds)")
    parser.add_argument("--uplink-mbit", type=float, default=10.0, help="each home's upload cap, Mbit/s (default 10)")
    parser.add_argument("--hetero", action="store_true",
                        help="home1 does an eighth of the others' work per step (1 prompt x 2 completions against 4 x 4)")
    parser.add_argument("--dir", help="keep node homes and logs here (default: a temporary folder, removed at the end)")
    args = parser.parse_args()
    if not 1 <= args.homes <= net_topology.MAX_HOMES:
        parser.error(f"--homes must be between 1 and {net_topology.MAX_HOMES}")
    reason = net_topology.unavailable()
    if reason is not None:
        print(f"nat_nodes: skipped: {reason}", flush=True)
        print("RESULT " + json.dumps({"skipped": reason}), flush=True)
        return 0
    minutes = args.minutes or (3.0 if args.quick else 6.0)
    check_memory(1 + args.homes)
    from hivespec.node.model.precision import cpu_facts

    prepare_model()
    with work_dir(args.dir, "nat-nodes-") as root, net_topology.Topology(homes=args.homes, uplink_mbit=args.uplink_mbit) as topo:
        print(f"nat_nodes: {args.homes} homes, {minutes:g} min, home uplinks {args.uplink_mbit:g} Mbit/s, in {root}; "
              f"CPU {json.dumps(cpu_facts())}", flush=True)
        nodes, arrivals, end, uploads = run(topo, root, minutes, hetero=args.hetero)
        result = summary(nodes, arrivals, end, uploads)
    for name, node in result["nodes"].items():
        print(f"{name}: {node}", flush=True)
    result |= {"homes": args.homes, "minutes": minutes, "uplink_mbit": args.uplink_mbit, "hetero": args.hetero}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
