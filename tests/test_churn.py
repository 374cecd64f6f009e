"""Churn and chaos on a real loopback swarm (node processes, hivemind, SQLite journals, checkpoints).

- churn: nodes SIGKILLed at random moments and by their own fault points mid-save and mid-store,
  then restarted: no accepted rollout is lost and no checkpoint is torn (bench/churn.py);
- a hung peer (SIGSTOP) stalls nobody, and carries on after SIGCONT;
- a node whose p2pd is SIGKILLed rebuilds gossip with the same identity and keeps receiving;
- the harness removes a bench's temporary folder (node homes: gigabytes) unless the run failed.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # the harness; the repo root itself stays off sys.path

from swarm_harness import start_swarm, work_dir


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_churn_loses_no_accepted_rollout_and_tears_no_checkpoint(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "churn.py"), "--nodes", "4", "--seconds", "100", "--kill-every", "15",
               "--no-baseline", "--seed", "3", "--dir", str(tmp_path)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=840)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(lines[-1][len("RESULT "):])
    assert report["lost_accepted_rollouts"] == 0
    assert report["torn_checkpoints"] == 0
    assert report["accepted_journaled"] >= report["accepted_reported"] > 0
    assert report["kills"] >= 3, report
    assert report["min_policy_version"] > 0  # every node trained
    assert result.returncode == 0


def test_a_bench_removes_its_temporary_folder_and_keeps_a_given_one_or_a_failed_runs(tmp_path, capsys):
    with work_dir(None, "bench-") as root:
        (root / "policy.bin").write_bytes(b"x" * 1024)
    assert not root.exists()

    with work_dir(tmp_path, "bench-") as given:
        (given / "node.log").write_text("kept")
    assert given == tmp_path and (tmp_path / "node.log").exists()

    with pytest.raises(RuntimeError), work_dir(None, "bench-") as failed:
        (failed / "node.log").write_text("why it failed")
        raise RuntimeError("a node died")
    assert (failed / "node.log").read_text() == "why it failed"
    assert str(failed) in capsys.readouterr().err
    (failed / "node.log").unlink()
    failed.rmdir()


def _wait(predicate, timeout: float, nodes, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in nodes:
            node.poll()
        if predicate():
            return
        time.sleep(0.2)
    logs = "\n".join(f"--- {n.name}\n{n.log_text()[-1500:]}" for n in nodes)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_hung_peer_stalls_nobody_and_p2pd_death_is_survived(tmp_path):
    sets = ["swarm.expected_peers=2", "swarm.round_timeout=8", "status.enabled=false", "checkpoint.every_rounds=0",
            "supervise.gossip_probe_every=3"]
    nodes = start_swarm(tmp_path, 3, sets)
    try:
        _wait(lambda: all(n.rounds() for n in nodes), 300, nodes, "a first round on every node")
        hung, others = nodes[2], nodes[:2]
        hung.process.send_signal(19)  # SIGSTOP: alive, connected, silent
        before = {n.name: len(n.rounds()) for n in others}
        _wait(lambda: all(len(n.rounds()) >= before[n.name] + 3 for n in others), 240, nodes,
              "3 rounds on each live node while one peer is stopped")
        hung.process.send_signal(18)  # SIGCONT
        resumed_at = len(hung.rounds())
        _wait(lambda: len(hung.rounds()) > resumed_at, 240, nodes, "the stopped node to carry on after SIGCONT")

        victim = others[1]
        p2pd = [p for p in psutil.Process(victim.process.pid).children(recursive=True) if "p2pd" in p.name()]
        assert len(p2pd) == 1
        p2pd[0].kill()
        killed_at = len(victim.rounds())
        _wait(lambda: any(r["gossip_restarts"] >= 1 and r["accepted"] > 0 for r in victim.rounds()[killed_at:]), 300, nodes,
              "the node whose p2pd died to rebuild gossip and accept peers' rollouts again")
        assert victim.alive()
        log = victim.log_text()
        assert "gossip is down" in log and "gossip rebuilt (restart 1" in log
        new_p2pd = [p for p in psutil.Process(victim.process.pid).children(recursive=True) if "p2pd" in p.name()]
        assert len(new_p2pd) == 1 and new_p2pd[0].pid != p2pd[0].pid
    finally:
        for node in nodes:
            node.stop(timeout=30)
