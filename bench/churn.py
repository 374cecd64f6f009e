"""Churn: 5 nodes on loopback, random nodes SIGKILLed again and again (also mid-save, mid-store) and restarted.

Two runs of the same length side by side: a baseline swarm with no kills, then the churn swarm.
During churn, every `--kill-every` seconds a random live node is killed, one of three ways:
SIGKILL from outside at a random moment, or a restart with `HIVESPEC_FAULTS` armed so it
SIGKILLs itself inside a checkpoint save (after the model file, before the manifest) or inside a
journal transaction (rows inserted, before COMMIT). A killed node is restarted after a short pause
with the same home and resumes from its newest good checkpoint.

Checked at the end (all nodes stopped):
- lost: accepted rollouts a node reported (sum of `accepted` over its round events, across all its
  lives) but that are not in its journal; must be 0;
- torn: checkpoint directories that fail verification (hash, size, manifest); must be 0;
- resumes: restarts that found a checkpoint and resumed from it; the swarm keeps training (policy
  versions keep growing after kills).
Reports rounds/min and accepted rollouts/min against the baseline, and the median time from a
restart to its first finished round.

    python bench/churn.py            # 2 x 6 minutes
    python bench/churn.py --quick    # 2 x 2.5 minutes, fewer kills

Ends with one line `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from swarm_harness import SwarmNode, live_maddrs, prepare_model, start_swarm, work_dir

from hivespec.node.training.checkpoint import CorruptCheckpoint, list_checkpoints, verify_checkpoint

NODE_SETTINGS = [
    "swarm.expected_peers=4",
    "swarm.round_timeout=8",  # a dead peer costs a round at most this long
    "checkpoint.every_rounds=1",  # a save after every round: kills often land in one
    "checkpoint.keep=2",
    "status.enabled=false",
    "supervise.gossip_probe_every=5",
]


def run_swarm(root: Path, *, nodes: int, seconds: float, kill_every: float | None, rng: random.Random) -> dict:
    swarm = start_swarm(root, nodes, NODE_SETTINGS)
    started = time.monotonic()
    kills = {"sigkill": 0, "mid_save": 0, "mid_store": 0}
    dead: dict[str, float] = {}  # name -> when to restart
    next_kill = started + (kill_every or 0)
    while time.monotonic() - started < seconds:
        now = time.monotonic()
        for node in swarm:
            node.poll()
            if not node.alive() and node.name not in dead:
                dead[node.name] = now + rng.uniform(1.0, 4.0)  # died (killed, or a fault point fired)
        for node in swarm:
            if node.name in dead and now >= dead[node.name]:
                del dead[node.name]
                mode = rng.choice(["sigkill", "mid_save", "mid_store"]) if kill_every else "sigkill"
                faults = ""
                if mode == "mid_save":
                    faults = f"checkpoint.before_manifest@{rng.randint(1, 3)}"
                elif mode == "mid_store":
                    faults = f"store.before_commit@{rng.randint(2, 8)}"
                if faults:
                    kills[mode] += 1
                node.start(live_maddrs(swarm, exclude=node), faults=faults)
        if kill_every and now >= next_kill:
            next_kill = now + kill_every
            # Running nodes only (a round reported by this life): a kill lands mid-round, mid-save or mid-store.
            candidates = [n for n in swarm if n.alive() and not n.lives[-1].faults and n.lives[-1].first_round_at]
            if candidates:
                victim = rng.choice(candidates)
                time.sleep(rng.uniform(0.0, 2.0))  # a random moment: mid-round, mid-save or mid-store
                victim.kill()
                kills["sigkill"] += 1
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    for node in swarm:
        node.stop()
        node.poll()
    return summarize(swarm, elapsed, kills)


def summarize(swarm: list[SwarmNode], elapsed: float, kills: dict) -> dict:
    reported = lost = journaled = torn = resumes = 0
    fired = {"sigkill": kills["sigkill"], "mid_save": 0, "mid_store": 0}
    rounds = 0
    rejoin = []
    versions = []
    for node in swarm:
        node_reported = sum(e["accepted"] for e in node.rounds())
        node_journal = node.journal()["foreign"]
        reported += node_reported
        journaled += node_journal
        lost += max(0, node_reported - node_journal)
        rounds += len(node.rounds())
        versions.append(max((e["policy_version"] for e in node.rounds()), default=0))
        for path in list_checkpoints(node.home / "checkpoints"):
            try:
                verify_checkpoint(path)
            except CorruptCheckpoint as exc:
                torn += 1
                print(f"TORN {path}: {exc}", flush=True)
        log = node.log_text()
        resumes += log.count("resumed from")
        fired["mid_save"] += log.count("fault point 'checkpoint.before_manifest'")
        fired["mid_store"] += log.count("fault point 'store.before_commit'")
        for life in node.lives[1:]:
            if life.first_round_at is not None:
                rejoin.append(life.first_round_at - life.started)
    minutes = elapsed / 60
    return {
        "seconds": round(elapsed, 1),
        "restarts": sum(len(n.lives) - 1 for n in swarm),
        "kills": fired,  # external SIGKILLs, and fault points that fired (an armed restart may end first)
        "resumes": resumes,
        "rounds": rounds,
        "rounds_per_min": round(rounds / minutes, 2),
        "accepted_reported": reported,
        "accepted_journaled": journaled,
        "accepted_per_min": round(reported / minutes, 1),
        "lost": lost,
        "torn": torn,
        "policy_versions": versions,
        "median_rejoin_s": round(statistics.median(rejoin), 1) if rejoin else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 x 2.5 minutes instead of 2 x 6")
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--seconds", type=float, help="length of each run")
    parser.add_argument("--kill-every", type=float, help="seconds between kills (default 20, quick 25)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", help="keep node homes here (default: a temporary folder, removed at the end)")
    parser.add_argument("--no-baseline", action="store_true", help="churn run only (tests); no throughput ratio")
    args = parser.parse_args()
    seconds = args.seconds or (150.0 if args.quick else 360.0)
    kill_every = args.kill_every or (25.0 if args.quick else 20.0)
    prepare_model()
    baseline = {"lost": 0, "torn": 0, "rounds_per_min": float("nan"), "accepted_per_min": float("nan")}
    with work_dir(args.dir, "hivespec-churn-") as root:
        print(f"churn: {args.nodes} nodes, 2 x {seconds:.0f} s, a kill every {kill_every:.0f} s; homes in {root}", flush=True)
        if not args.no_baseline:
            baseline = run_swarm(root / "baseline", nodes=args.nodes, seconds=seconds, kill_every=None, rng=random.Random(args.seed))
            print("baseline:", json.dumps(baseline), flush=True)
        churn = run_swarm(root / "churn", nodes=args.nodes, seconds=seconds, kill_every=kill_every, rng=random.Random(args.seed))
        print("churn:   ", json.dumps(churn), flush=True)
    result = {
        "nodes": args.nodes,
        "seconds": seconds,
        "kills": sum(churn["kills"].values()),
        "kills_by_kind": churn["kills"],
        "restarts": churn["restarts"],
        "resumes": churn["resumes"],
        "lost_accepted_rollouts": churn["lost"] + baseline["lost"],
        "torn_checkpoints": churn["torn"] + baseline["torn"],
        "accepted_reported": churn["accepted_reported"],
        "accepted_journaled": churn["accepted_journaled"],
        "rounds_per_min": churn["rounds_per_min"],
        "rounds_per_min_baseline": None if args.no_baseline else baseline["rounds_per_min"],
        "throughput_ratio": round(churn["rounds_per_min"] / baseline["rounds_per_min"], 3) if not args.no_baseline else None,
        "accepted_per_min": churn["accepted_per_min"],
        "accepted_per_min_baseline": None if args.no_baseline else baseline["accepted_per_min"],
        "accepted_ratio": round(churn["accepted_per_min"] / baseline["accepted_per_min"], 3) if not args.no_baseline else None,
        "median_rejoin_s": churn["median_rejoin_s"],
        "min_policy_version": min(churn["policy_versions"]),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["lost_accepted_rollouts"] == 0 and result["torn_checkpoints"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
