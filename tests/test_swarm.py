"""End to end: three real node processes (real hivemind on loopback, tiny model, SQLite, signatures)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hivespec.node.config import load_config
from hivespec.node.model.footprint import config_peak_bytes, model_shape

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_three_nodes_two_rounds_every_node_accepts_foreign_rollouts(tmp_path):
    command = [
        sys.executable, "-P", "-m", "hivespec.node.cli", "demo",
        "--config", "tiny", "--nodes", "3", "--rounds", "2", "--dir", str(tmp_path),
    ]
    result = subprocess.run(command, cwd=ROOT, check=False, capture_output=True, text=True, timeout=580)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    reports = {}
    for events in sorted(tmp_path.glob("node-*/events.jsonl")):
        lines = [json.loads(line) for line in events.read_text().splitlines()]
        reports[events.parent.name] = [e for e in lines if e["event"] == "round"]
        assert lines[-1]["event"] == "done"
    assert sorted(reports) == ["node-0", "node-1", "node-2"]
    for name, rounds in reports.items():
        assert [r["round"] for r in rounds] == [0, 1], name
        for report in rounds:
            assert report["made"] == 8
            assert report["accepted"] > 0, f"{name} accepted no foreign rollouts in round {report['round']}"
            assert 0 <= report["foreign_room"] <= report["made"] and report["foreign_pending"] >= 0  # foreign_fraction 0.5: budget = made
            assert report["rejected"] == 0
            assert report["engine_mismatch"] == 0
            assert 0 <= report["delta_density"] <= 1  # the tiny random model may earn no reward, hence no update
            assert report["delta_bytes"] == 0 and not report["delta_published"]  # no followers: nothing coded
    assert "foreign rollouts accepted by every node: yes" in result.stdout
    # The demo's last lines: the report it wrote, each node's policy, the export command.
    assert f"report: {tmp_path / 'report' / 'summary.md'}" in result.stdout
    assert {p.name for p in (tmp_path / "report").iterdir()} == {"summary.md", "reward.png", "foreign.png", "phases.png"}
    for name in reports:
        record = json.loads((tmp_path / name / "policy.json").read_text())
        # The tiny preset saves a checkpoint at exit: the record names its weights instead of copying them.
        assert record["policy_version"] == 2 and record["weights"].startswith("checkpoints/ckpt-")
        assert (tmp_path / name / record["weights"]).is_file()
        assert f"{name}: policy {tmp_path / name / 'policy.json'}" in result.stdout
    assert f"export a node's policy: hivespec export --home {tmp_path / 'node-0'}" in result.stdout
    # Each node's high-water mark, within the estimate the demo sized itself by, and in its summary.
    bound = config_peak_bytes(load_config("tiny"), model_shape("tiny"))
    for name, rounds in reports.items():
        peaks = [r["peak_resident_mb"] for r in rounds]
        assert peaks == sorted(peaks) and 0 < peaks[-1] * 1e6 <= bound, (name, peaks, bound)
    assert "  memory at most: node-0 " in result.stdout
