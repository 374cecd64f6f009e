"""`hivespec report`: a run directory's round events as matplotlib PNGs and a Markdown summary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from PIL import Image

from hivespec.node.config import InputError
from hivespec.node.results_cli import add_result_commands
from hivespec.node.run_report import load_run, summarize


def _round(node: str, index: int, reward: float, *, foreign: int = 4, made: int = 8, weight: float | None = 0.98) -> dict:
    return {
        "t": 1.0 + index, "event": "round", "node": node, "round": index, "policy_version": index + 1, "made": made,
        "received": 1, "accepted": foreign, "rejected": 0, "ignored": 0, "reward_mean": reward, "foreign_used": foreign,
        "foreign_weight_mean": weight, "foreign_weight_max": None if weight is None else weight + 0.5,
        "seconds": {"rollout": 2.0, "gossip": 0.5, "train": 3.0, "sync": 0.25, "round": 6.0},
    }


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "demo-run"
    for i, rewards in enumerate(([0.0, 0.25, 0.5, 0.75], [0.25, 0.25, 0.5])):
        home = run / f"node-{i}"
        home.mkdir(parents=True)
        events = [{"event": "ready", "name": f"node-{i}", "peer_id": f"hs{i}"}]
        events += [_round(f"node-{i}", r, reward, foreign=0 if r == 0 else 4, weight=None if r == 0 else 0.98)
                   for r, reward in enumerate(rewards)]
        if i == 1:
            events.insert(2, _round("node-1", 1, 1.0))  # round 1 logged twice (re-run after a crash): the last one counts
            events.append({"event": "done", "name": "node-1"})
        (home / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "rou')
    (run / "node-0" / "policy.json").write_text("{}")
    (run / "node-9").mkdir()
    (run / "node-9" / "events.jsonl").write_text(json.dumps({"event": "ready", "name": "node-9"}) + "\n")  # never got to a round
    return run


def test_load_run_keeps_the_last_event_of_each_round_and_skips_silent_nodes(tmp_path):
    nodes = load_run(_run(tmp_path))
    assert [n.name for n in nodes] == ["node-0", "node-1"]
    assert nodes[1].series("reward_mean") == [0.25, 0.25, 0.5] and nodes[1].finished and nodes[1].peer_id == "hs1"
    assert nodes[0].foreign_share() == [0.0, 1 / 3, 1 / 3, 1 / 3]


def test_summary_states_each_node_and_how_to_export(tmp_path):
    run = _run(tmp_path)
    text = summarize(load_run(run), run)
    assert "2 node(s), up to 4 step(s) each" in text
    assert "| node-0 | 4 | 0.00 -> 0.75 | 12 of 44 (27%) | 12 / 0 | 0.980 (1.48) | 6.0 | `policy.json` |" in text
    assert "| node-1 | 3 | 0.25 -> 0.50 |" in text and text.count("| - |") == 1  # node-1 keeps no policy
    assert "![reward](reward.png)" in text
    assert f"hivespec export --home {run / 'node-0'} --out {run / 'node-0-model'}" in text


def test_the_command_writes_three_plots_and_the_summary(tmp_path, capsys):
    run = _run(tmp_path)
    parser = argparse.ArgumentParser()
    add_result_commands(parser.add_subparsers())
    args = parser.parse_args(["report", str(run)])
    assert args.func(args) == 0
    out = run / "report"
    assert sorted(p.name for p in out.iterdir()) == ["foreign.png", "phases.png", "reward.png", "summary.md"]
    for name in ("foreign.png", "phases.png", "reward.png"):
        with Image.open(out / name) as image:
            assert image.format == "PNG" and image.width >= 600 and image.height >= 300
            colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
            assert len(colors) > 20  # drawn, not blank
    assert str(out / "summary.md") in capsys.readouterr().out


def test_a_report_of_the_working_folder_is_titled_with_its_name(tmp_path, monkeypatch):
    """`hivespec report .` had written "# Run report: " with no name."""
    monkeypatch.chdir(_run(tmp_path))
    assert summarize(load_run(Path(".")), Path(".")).startswith("# Run report: demo-run\n")


def test_a_folder_without_round_events_is_a_user_error(tmp_path):
    with pytest.raises(InputError, match="holds no round events"):
        load_run(tmp_path)
    with pytest.raises(InputError, match="does not exist"):
        load_run(tmp_path / "missing")


def test_a_run_whose_nodes_scored_themselves_gets_a_held_out_plot(tmp_path):
    from hivespec.node.run_report import write_report

    run = _run(tmp_path)
    events = run / "node-0" / "events.jsonl"
    rows = [_round("node-0", r, 0.5) | {"heldout_accuracy": None if r % 2 == 0 else r / 4} for r in range(4)]
    events.write_text("".join(json.dumps(e) + "\n" for e in rows))
    assert load_run(run)[0].heldout_curve() == [(1, 0.25), (3, 0.75)]
    written = write_report(run)
    assert [p.name for p in written] == ["reward.png", "foreign.png", "phases.png", "heldout.png", "summary.md"]
    with Image.open(run / "report" / "heldout.png") as image:
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 20
    assert "![heldout](heldout.png)" in (run / "report" / "summary.md").read_text()
