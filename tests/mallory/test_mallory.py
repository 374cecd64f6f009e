"""Mallory (a real hostile process) against two honest nodes that keep training: nothing of hers gets in.

The honest node H and the victim V are full nodes (tiny model, real hivemind, SQLite). Mallory
(mallory.py) joins through H and announces her batches in the rollout index where V's next step
looks; V must stay up, accept only H's rollouts, score Mallory down to the graylist, and after a
restart with the same home still refuse replays of envelopes it already admitted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hivespec.node.build import build_node
from hivespec.node.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SWARM = "test-mallory"


def node(home: Path, peers: list[str], name: str):
    config = load_config("tiny", overrides={
        "home": str(home), "name": name, "swarm.swarm": SWARM, "swarm.expected_peers": "1",
        "swarm.round_timeout": "20", "swarm.bootstrap_timeout": "10", "status.enabled": "false",
        "checkpoint.every_rounds": "0", "checkpoint.at_exit": "false", "checkpoint.resume": "false",
        "swarm.initial_peers": json.dumps(peers),
        # A step may take all of one author's announced batches (the default takes 1 per author, so
        # graylisting Mallory would take several steps): every attack reaches intake in one step.
        "swarm.max_foreign_batches": "16", "swarm.max_batches_per_peer": "16",
        # A version window (off by default): Mallory's batch of a far-future version, announced as version 0,
        # passes the reader's filter on the announcement and must be caught on the envelope.
        "train.staleness_versions": "64",
    })
    return build_node(config)


def rounds_together(nodes, index: int):
    reports = [None] * len(nodes)

    def run(i):
        reports[i] = nodes[i].run_round(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return reports


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mallory_gets_nothing_in_and_honest_nodes_keep_training(tmp_path: Path) -> None:
    honest = node(tmp_path / "h", [], "honest")
    victim = node(tmp_path / "v", honest.gossip.visible_maddrs, "victim")
    mallory_proc = None
    try:
        r0 = rounds_together([honest, victim], 0)
        assert r0[1].admissions.accepted > 0  # the victim trains on the honest node's rollouts

        out = tmp_path / "mallory.json"
        command = [sys.executable, "-P", str(ROOT / "tests/mallory/mallory.py"), honest.gossip.visible_maddrs[0], SWARM,
                   victim.identity.peer_id, victim.gossip._p2p.peer_id.to_base58(), honest.identity.peer_id, "90", str(out)]
        mallory_proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(1200):
            if out.exists() or mallory_proc.poll() is not None:
                break
            threading.Event().wait(0.1)
        assert out.exists(), mallory_proc.communicate(timeout=30)[1][-3000:]
        tally = json.loads(out.read_text())
        mallory_id = tally["mallory"]

        intake_before = dict(victim.intake.counters.outcomes)
        reports = rounds_together([honest, victim], 1)
        report = reports[1]
        assert report.policy_version > r0[1].policy_version  # still training
        assert report.admissions.accepted > 0 and report.engine_mismatch == 0

        # Every accepted rollout is the honest node's; none is Mallory's.
        assert {r.author for r in victim.store.foreign_after(0)} == {honest.identity.peer_id}
        scores = victim.peer_scores.snapshot()
        assert scores[mallory_id]["graylisted"], scores
        assert scores[mallory_id]["accepted"] == 0
        assert not scores.get(honest.identity.peer_id, {}).get("graylisted", False)
        outcomes = victim.intake.counters.outcomes
        rejected_now = outcomes["reject"] - intake_before.get("reject", 0)
        assert rejected_now >= 3  # what was fetched before the graylist closed in
        refused = victim.gossip.validator.rejected + honest.gossip.validator.rejected
        assert refused["subkey_not_owned_by_signer"] >= 1 and refused["expiration_too_far"] >= 1, refused
        assert victim.gossip.healthy() and honest.gossip.healthy()
        print("mallory tally:", json.dumps({"attempts": len(tally["announced"]) + len(tally["dht"]) + len(tally["raw"]),
                                             "victim_reasons": dict(victim.intake.counters.reasons),
                                             "dht_refused": dict(refused), "raw": tally["raw"],
                                             "mallory_score": scores[mallory_id]}))

        # The victim restarts with the same home: the replay log and Mallory's score survive.
        victim.close()
        victim = node(tmp_path / "v", honest.gossip.visible_maddrs, "victim")
        assert victim.peer_scores.graylisted(mallory_id)
        # Fresh gossip: it fetches the honest node's batches of rounds 0 and 1 again, which are still fresh.
        fetched = victim.gossip.sample_rollouts(k=16, max_age_s=victim.intake.staleness_seconds, timeout=15.0)
        admissions = {f.sha256: (f, victim.intake.admit(f.author_peer_id, f.body, current_version=victim.trainer.version))
                      for f in fetched}
        replays = [a for f, a in admissions.values() if f.author_peer_id == honest.identity.peer_id]
        assert replays and all(a.outcome == "ignore" and a.reason == "replay" for a in replays), admissions
        # Mallory's bodies that the honest node relayed before she was graylisted are skipped by author:
        # nothing of hers is fetched again.
        others = [(f.author_peer_id, a) for f, a in admissions.values() if f.author_peer_id != honest.identity.peer_id]
        assert not others, others
    finally:
        if mallory_proc is not None:
            mallory_proc.terminate()
            mallory_proc.wait(timeout=30)
        victim.close()
        honest.close()
