"""A stop request (SIGTERM / Ctrl-C) reaches a real node and a real demo within seconds, mid-round.

Real `hivespec join` / `hivespec demo` child processes on the tiny model. A node that expects a
peer who never comes sits in its round's wait for peers (round_timeout is long): a SIGTERM
there must end it within seconds, keep its journal, save a checkpoint as of the round's start
and say so; the checkpoint must resume. Unit level: the engine's and the trainer's safe points.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hivespec.node.model.engine import GenerationRequest, SamplingParams, TorchEngine
from hivespec.node.model.loader import load_model
from hivespec.node.report import REPORT_HEADER
from hivespec.node.status.board import RoundStopped, RunControl
from hivespec.node.training.checkpoint import CheckpointManager
from hivespec.node.training.store import RolloutStore
from hivespec.node.training.trainer import OWN, Trainer, TrainSample

STOP_WITHIN_S = 10.0


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(child: subprocess.Popen, log: Path, done, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert child.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def _join(home: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    command = [
        sys.executable, "-P", "-m", "hivespec.node.cli", "-v", "join", "--config", "tiny", "--home", str(home),
        "--events", str(home / "events.jsonl"), "--linger", "0", "--set", "status.enabled=false",
        "--set", "checkpoint.every_rounds=0", *extra,
    ]
    home.mkdir(parents=True, exist_ok=True)
    log = (home / "node.log").open("ab")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


@pytest.mark.slow  # ~30-60 s: two node processes
@pytest.mark.timeout(400)
def test_sigterm_while_waiting_for_peers_stops_within_seconds_saves_and_resumes(tmp_path):
    home = tmp_path / "node"
    env = dict(os.environ, HIVESPEC_CACHE_DIR=str(tmp_path / "cache"))
    # One peer expected, none comes: each round waits round_timeout for its batch, then trains alone.
    child = _join(home, "--rounds", "3", "--set", "swarm.expected_peers=1", "--set", "swarm.round_timeout=10", env=env)
    events = home / "events.jsonl"
    waiting = {"phase": "waiting for peers", "detail": "round 1"}
    _wait_for(child, home / "node.log", lambda: any(waiting.items() <= e.items() for e in _events(events)))
    time.sleep(1.0)
    sent = time.monotonic()
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 0, (home / "node.log").read_text()[-3000:]
    assert time.monotonic() - sent < STOP_WITHIN_S
    log = (home / "node.log").read_text()
    assert "stopping at the next safe point of round 1 and saving a checkpoint" in log
    assert "stopped in round 1 while waiting for peers' new batches; nothing of round 1 was trained" in log
    assert "saved (resumes at round 1)" in log
    # What a user reads first: where the node stands in its swarm, and the rows' header.
    assert "no initial peers, so this node starts it" in log
    assert REPORT_HEADER in log.splitlines()
    assert [e["event"] for e in _events(events)][-2:] == ["stopped", "done"]
    phases = [e["phase"] for e in _events(events) if e["event"] == "phase"]
    distinct = [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]]  # loading reports twice (model, precision)
    assert distinct[:3] == ["loading", "starting gossip", "generating"]
    assert "calibrating" in phases  # no curve cached: measured in the first wait, before waiting for peers
    checkpoint = CheckpointManager(home / "checkpoints").load_latest()
    # The state of the last completed round (0): one optimizer step, round 1 to run next.
    assert checkpoint is not None and checkpoint.next_round == 1 and checkpoint.meta["policy_version"] == 1
    with RolloutStore(home / "rollouts.sqlite") as store:
        assert store.journal_high_water() > checkpoint.meta["journal_rowid"]  # the round's own rollouts stay journaled

    # The checkpoint resumes: round 1 again (solo now), then round 2.
    again = _join(home, "--rounds", "3", "--set", "swarm.expected_peers=0", env=env)
    assert again.wait(timeout=300) == 0, (home / "node.log").read_text()[-3000:]
    assert "resumed from" in (home / "node.log").read_text()
    rounds = [e["round"] for e in _events(events) if e["event"] == "round"]
    assert rounds == [0, 1, 2]
    # Resumed without expected_peers, it waits for nobody, and its phase says what it does instead.
    resumed = [e for e in _events(events) if e["event"] == "phase" and e["detail"].startswith("round 2")]
    assert {"fetching peers' batches", "training"} <= {e["phase"] for e in resumed}, resumed
    assert "waiting for peers" not in {e["phase"] for e in resumed}, resumed
    assert {"phase": "fetching peers' batches", "detail": "round 2: no peers known yet"} in [
        {k: e[k] for k in ("phase", "detail")} for e in resumed], resumed  # alone: no talk of room for foreign samples


@pytest.mark.slow  # ~40-90 s: a demo of two tiny nodes
@pytest.mark.timeout(400)
def test_sigterm_to_the_demo_stops_every_node_and_reports(tmp_path):
    env = dict(os.environ, HIVESPEC_CACHE_DIR=str(tmp_path / "cache"))
    command = [
        sys.executable, "-P", "-m", "hivespec.node.cli", "demo", "--model", "tiny", "--nodes", "2", "--rounds", "200",
        "--dir", str(tmp_path / "demo"), "--set", "status.enabled=false", "--set", "model.engine_dtype=float32",
        "--set", "model.autocast=false",
    ]
    out = (tmp_path / "demo.out").open("wb")
    demo = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    text = lambda: (tmp_path / "demo.out").read_text()
    _wait_for(demo, tmp_path / "demo.out", lambda: "all 2 nodes up" in text() and text().count("node-") >= 6)
    sent = time.monotonic()
    demo.send_signal(signal.SIGTERM)
    assert demo.wait(timeout=60) == 128 + signal.SIGTERM, text()[-3000:]
    assert time.monotonic() - sent < STOP_WITHIN_S + 5
    output = text()
    assert "asking 2 node(s) to stop at their next safe point" in output
    for name in ("node-0", "node-1"):
        line = next(line for line in output.splitlines() if line.startswith(f"  {name}: "))
        assert "round(s) done; stopped" in line, output[-3000:]
        assert "no checkpoint is configured (checkpoint.at_exit)" in line or "stopped after a round" in line


def test_engine_and_trainer_stop_between_steps_and_leave_no_update():
    control = RunControl()
    model = load_model("tiny", dtype=torch.float32).eval().requires_grad_(False)
    engine = TorchEngine(model, max_batch_size=2)
    steps = []

    def on_tokens(added: int) -> None:
        steps.append(added)
        if len(steps) == 3:
            control.stop()
        control.check("generating")

    requests = [GenerationRequest((1, 2, 3), seed=1, sample_index=i) for i in range(2)]
    with pytest.raises(RoundStopped, match="stopped while generating"):
        engine.generate(requests, SamplingParams(max_new_tokens=50), on_tokens=on_tokens)
    assert len(steps) == 3  # the very next decode step after the request

    trainer_model = load_model("tiny", dtype=torch.float32).requires_grad_(True)
    trainer = Trainer(trainer_model, learning_rate=1e-2, micro_batch_size=1, autocast_dtype=None)
    before = {k: v.clone() for k, v in trainer_model.state_dict().items()}
    samples = [
        TrainSample([1, 2, 3], [4 + i, 5], [-1.0, -1.0], reward=float(i % 2), group="g", source=OWN) for i in range(4)
    ]
    seen = []

    def between(index: int, total: int) -> None:
        seen.append((index, total))
        if index == 2:
            raise RoundStopped("training")

    trainer.between_micro_batches = between
    with pytest.raises(RoundStopped):
        trainer.step(samples)
    assert seen[-1] == (2, 4) and trainer.version == 0 and not trainer_model.training
    assert all(p.grad is None for p in trainer_model.parameters())
    assert all(torch.equal(before[k], v) for k, v in trainer_model.state_dict().items())
    assert not trainer.optimizer.state  # never stepped
    trainer.between_micro_batches = None
    assert trainer.step(samples).version == 1  # and trains normally afterwards
