"""Resume: a node SIGKILLed mid-save and mid-round, then restarted, ends bit-identical to an uninterrupted run.

Real `hivespec join` child processes (solo, fixed seed, CPU, one thread), real checkpoints, a real
SIGKILL. The random tiny model never answers a task right (reward always 0, so GRPO never steps
and the test would compare untouched weights); the fixture model is the tiny one with its output
layer nudged so it often writes one digit and stops, which is sometimes the right answer: groups
get mixed rewards and the optimizer really steps.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hivespec.node.config import load_config
from hivespec.node.model.loader import load_model, load_tokenizer
from hivespec.node.tasks.source import TaskSource
from hivespec.node.training.checkpoint import MODEL_FILE, OPTIMIZER_FILE, CheckpointManager

ROUNDS = 6


def make_digit_model(folder: Path) -> Path:
    """The tiny model, untied, that often answers with one digit and stops: "7<eos>".

    Its output layer is nudged along the mean final hidden state at the first completion position
    (digits up) and at the position after a digit (end-of-text up, along the part orthogonal to
    the first), so the reward's "a completion that is just N" rule sometimes fires.
    """
    tokenizer = load_tokenizer("tiny")
    model = load_model("tiny")
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    tasks = TaskSource.from_config(load_config("tiny").tasks)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    prompts = [tasks.chat_prompt_ids(tokenizer, t) for r in range(8) for t in tasks.prompts(seed=1, round=r, count=2)]

    def mean_last_hidden(sequences: list[list[int]]) -> torch.Tensor:
        return torch.stack([model.model(input_ids=torch.tensor([s])).last_hidden_state[0, -1] for s in sequences]).mean(0)

    with torch.no_grad():
        first = mean_last_hidden(prompts)
        second = mean_last_hidden([p + [d] for p in prompts for d in digits[:3]])
        second = second - (second @ first) / (first @ first) * first
        model.lm_head.weight[digits] += 12.0 * first / (first @ first)
        model.lm_head.weight[tokenizer.eos_token_id] += 24.0 * second / (second @ second)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def digit_model(tmp_path_factory):
    return make_digit_model(tmp_path_factory.mktemp("digit-model"))


def _start(home: Path, model: Path, faults: str = "", rounds: int = ROUNDS) -> subprocess.Popen:
    """A `hivespec join` child; all of a test's children share one cache folder beside their homes.

    Speculative verification is lossless up to fp32 rounding between forward widths, and the
    widths follow the verify-cost curve a node times once per machine and caches: runs meant to
    be bit-identical must read the same curve, as restarts on one machine do. A node without
    the curve decodes plainly until it has measured it (in its first round), so the runs
    compared here all start once the curve is cached.
    """
    command = [
        sys.executable, "-P", "-m", "hivespec.node.cli", "-v", "join", "--config", "tiny", "--model", str(model),
        "--home", str(home), "--rounds", str(rounds), "--events", str(home / "events.jsonl"), "--linger", "0",
        "--set", "seed=7", "--set", "swarm.expected_peers=0", "--set", "checkpoint.every_rounds=1",
        "--set", "checkpoint.keep=2", "--set", "status.enabled=false",
        # Counting answers are small numbers, which the fixture model gets right now and then.
        "--set", "tasks.mix=[{family: count, difficulty: 1}]", "--set", "rollout.prompts_per_round=4",
    ]
    home.mkdir(parents=True, exist_ok=True)
    log = (home / "node.log").open("ab")
    env = dict(os.environ, HIVESPEC_FAULTS=faults, HIVESPEC_CACHE_DIR=str(home.parent / "cache"))
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _wait_while_running(child: subprocess.Popen, home: Path, done: Callable[[], bool], timeout: float = 300) -> None:
    """Poll until `done()`; fail with the child's log if it exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not done():
        assert child.poll() is None and time.monotonic() < deadline, (home / "node.log").read_text()[-3000:]
        time.sleep(0.05)


def _rounds(home: Path) -> list[dict]:
    path = home / "events.jsonl"
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == "round"]


def _final(home: Path) -> tuple[dict, dict, dict]:
    checkpoint = CheckpointManager(home / "checkpoints").load_latest()
    assert checkpoint is not None and checkpoint.next_round == ROUNDS
    return load_file(str(checkpoint.path / MODEL_FILE)), load_file(str(checkpoint.path / OPTIMIZER_FILE)), checkpoint.meta


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


@pytest.mark.slow  # ~1-2.5 min: two node processes, three restarts
@pytest.mark.timeout(600)
def test_sigkill_mid_save_and_mid_round_then_resume_is_bit_identical(tmp_path, digit_model):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    # A one-round node measures the verify-cost curve (a machine's first node does); the runs compared start after it.
    warm = _start(tmp_path / "warm", digit_model, rounds=1)
    assert warm.wait(timeout=300) == 0, (tmp_path / "warm" / "node.log").read_text()[-3000:]
    assert any((tmp_path / "cache" / "speculation").glob("verify-cost-*.json"))
    reference = _start(straight, digit_model)
    # Killed by its own fault point inside the 3rd save (after round 2, before the manifest).
    first = _start(broken, digit_model, faults="checkpoint.before_manifest@3")
    assert first.wait(timeout=300) == -signal.SIGKILL, (broken / "node.log").read_text()[-3000:]
    assert [r["round"] for r in _rounds(broken)] == [0, 1]

    # Resumes from ckpt-000002 (next round 2); SIGKILLed from outside once it has reported round 3.
    second = _start(broken, digit_model)
    _wait_while_running(second, broken, lambda: any(r["round"] == 3 for r in _rounds(broken)))
    second.send_signal(signal.SIGKILL)
    second.wait(timeout=60)

    third = _start(broken, digit_model)
    assert third.wait(timeout=300) == 0, (broken / "node.log").read_text()[-3000:]
    assert reference.wait(timeout=300) == 0, (straight / "node.log").read_text()[-3000:]

    log = (broken / "node.log").read_text()
    assert "fault point 'checkpoint.before_manifest' hit 3 time(s)" in log
    assert "left by a save that did not finish" in log
    assert "resumed from" in log

    reference_rounds = _rounds(straight)
    assert [r["round"] for r in reference_rounds] == list(range(ROUNDS))
    assert sum(r["trained_samples"] for r in reference_rounds) > 0, "the fixture model must make GRPO step"
    broken_rounds = _rounds(broken)
    assert {r["round"] for r in broken_rounds} == set(range(ROUNDS))

    model_a, optimizer_a, meta_a = _final(straight)
    model_b, optimizer_b, meta_b = _final(broken)
    assert _max_diff(model_a, model_b) == 0.0
    assert _max_diff(optimizer_a, optimizer_b) == 0.0
    assert meta_a["policy_version"] == meta_b["policy_version"] == ROUNDS
    initial = load_file(str(next(digit_model.glob("*.safetensors"))))
    moved = [k for k in model_a if k in initial and not torch.equal(model_a[k], initial[k])]
    assert moved, "training changed no weight: the comparison would be vacuous"
    # Every round's report after the resume matches the uninterrupted run's (same rollouts, same loss).
    last = {r["round"]: r for r in broken_rounds}
    for r in reference_rounds:
        assert (last[r["round"]]["reward_mean"], last[r["round"]]["loss"]) == (r["reward_mean"], r["loss"])
