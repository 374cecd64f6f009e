"""Checkpoints: exact round trip, pruning, a corruption corpus, kills at every step of a save, disk full."""

import json
import logging
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from hivespec.node.training.checkpoint import (
    MANIFEST,
    MODEL_FILE,
    OPTIMIZER_FILE,
    CheckpointError,
    CheckpointManager,
    CorruptCheckpoint,
    restore_training,
    training_snapshot,
)


class _Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(50, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as in the tiny model
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))) * self.scale)


def _trained(seed: int = 0, steps: int = 2):
    model = _Net(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        _step(model, optimizer, step)
    return model, optimizer


def _step(model, optimizer, step: int) -> None:
    ids = torch.arange(step, step + 8) % 50
    loss = torch.nn.functional.cross_entropy(model(ids), (ids + 1) % 50)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _save(manager, model, optimizer, next_round):
    return manager.save(training_snapshot(model, optimizer, {"next_round": next_round}))


def test_round_trip_is_exact_and_training_continues_identically(tmp_path):
    model, optimizer = _trained()
    manager = CheckpointManager(tmp_path)
    _save(manager, model, optimizer, 7)
    torch.manual_seed(1234)
    np.random.seed(99)
    random.seed(5)
    expected_draws = None

    other, other_optimizer = _trained(seed=3, steps=1)
    checkpoint = manager.load_latest()
    assert checkpoint.next_round == 7
    restore_training(checkpoint, other, other_optimizer)
    expected_draws = (torch.rand(3), np.random.rand(3), random.random())
    restore_training(checkpoint, other, other_optimizer)  # RNGs rewind to the save
    assert torch.equal(torch.rand(3), expected_draws[0])
    assert np.array_equal(np.random.rand(3), expected_draws[1])
    assert random.random() == expected_draws[2]

    for step in (5, 6, 7):
        _step(model, optimizer, step)
        _step(other, other_optimizer, step)
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), name
    assert other.head.weight is other.embed.weight


def test_a_resumed_optimizer_keeps_its_own_kernel_and_continues_with_the_same_numbers(tmp_path):
    """Which AdamW kernel runs (fused, foreach, a loop) is this machine's choice: a checkpoint saved by one resumes into another."""
    model, optimizer = _trained()
    CheckpointManager(tmp_path).save(training_snapshot(model, optimizer, {"next_round": 2}))
    other = _Net(3)
    fused = torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    restore_training(CheckpointManager(tmp_path).load_latest(), other, fused)
    assert fused.param_groups[0]["fused"] is True
    for step in (2, 3):
        _step(model, optimizer, step)
        _step(other, fused, step)
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_keeps_only_the_newest_complete_checkpoints(tmp_path):
    model, optimizer = _trained()
    manager = CheckpointManager(tmp_path, keep=2)
    paths = [_save(manager, model, optimizer, i) for i in range(4)]
    assert [p.name for p in manager.checkpoints()] == ["ckpt-000003", "ckpt-000004"]
    assert [p.name for p in paths] == ["ckpt-000001", "ckpt-000002", "ckpt-000003", "ckpt-000004"]


def _truncate(path, rng):
    data = path.read_bytes()
    path.write_bytes(data[: rng.randrange(len(data))])


def _flip(path, rng):
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def _edit_manifest(path, _rng):
    manifest = json.loads(path.read_text())
    manifest["next_round"] += 1  # valid JSON, wrong content: only the checksum catches it
    path.write_text(json.dumps(manifest))


CORRUPTIONS = {
    "truncated model": (MODEL_FILE, _truncate),
    "flipped bit in optimizer": (OPTIMIZER_FILE, _flip),
    "zero-byte model": (MODEL_FILE, lambda p, _: p.write_bytes(b"")),
    "missing optimizer": (OPTIMIZER_FILE, lambda p, _: p.unlink()),
    "missing manifest": (MANIFEST, lambda p, _: p.unlink()),
    "manifest not json": (MANIFEST, lambda p, _: p.write_bytes(b"\x00{garbage")),
    "truncated manifest": (MANIFEST, _truncate),
    "edited manifest": (MANIFEST, _edit_manifest),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_newest_checkpoint_is_detected_and_the_previous_one_used(tmp_path, caplog, corruption):
    model, optimizer = _trained()
    manager = CheckpointManager(tmp_path)
    _save(manager, model, optimizer, 1)
    newest = _save(manager, model, optimizer, 2)
    filename, damage = CORRUPTIONS[corruption]
    damage(newest / filename, random.Random(corruption))
    with pytest.raises(CorruptCheckpoint):
        manager.verify(newest)
    with caplog.at_level(logging.WARNING, logger="hivespec.node.training.checkpoint"):
        checkpoint = manager.load_latest()
    assert checkpoint.path.name == "ckpt-000001" and checkpoint.next_round == 1
    assert "ckpt-000002 is unusable" in caplog.text and "falling back to the previous one" in caplog.text


def test_a_checkpoint_found_unusable_never_takes_the_place_of_a_good_one(tmp_path):
    """After resuming from ckpt-1 past a corrupt ckpt-2, the next save must keep ckpt-1 (the fallback), not ckpt-2."""
    model, optimizer = _trained()
    manager = CheckpointManager(tmp_path, keep=2)
    _save(manager, model, optimizer, 1)
    _flip(_save(manager, model, optimizer, 2) / OPTIMIZER_FILE, random.Random(0))
    assert manager.load_latest().path.name == "ckpt-000001"
    newest = _save(manager, model, optimizer, 3)
    assert [p.name for p in manager.checkpoints()] == ["ckpt-000001", "ckpt-000003"]
    _flip(newest / OPTIMIZER_FILE, random.Random(1))
    assert manager.load_latest().next_round == 1, "the good fallback is still there"


def test_random_corruption_corpus_is_always_detected(tmp_path):
    model, optimizer = _trained()
    manager = CheckpointManager(tmp_path)
    path = _save(manager, model, optimizer, 1)
    pristine = {f.name: f.read_bytes() for f in path.iterdir()}
    rng = random.Random(0)
    for trial in range(40):
        for name, data in pristine.items():
            (path / name).write_bytes(data)
        target = path / rng.choice(sorted(pristine))
        (_truncate if trial % 2 else _flip)(target, rng)
        with pytest.raises(CorruptCheckpoint):
            manager.load(path)


def test_nothing_usable_means_none_and_an_error_line(tmp_path, caplog):
    model, optimizer = _trained()
    manager = CheckpointManager(tmp_path)
    path = _save(manager, model, optimizer, 1)
    (path / MODEL_FILE).write_bytes(b"")
    with caplog.at_level(logging.ERROR, logger="hivespec.node.training.checkpoint"):
        assert manager.load_latest() is None
    assert "none of the 1 checkpoint(s)" in caplog.text


def test_a_restore_into_another_architecture_is_refused(tmp_path):
    model, optimizer = _trained()
    manager = CheckpointManager(tmp_path)
    _save(manager, model, optimizer, 1)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(CheckpointError, match="another model"):
        restore_training(manager.load_latest(), other, torch.optim.AdamW(other.parameters()))


_CHILD = textwrap.dedent(
    """
    import resource, signal, sys, torch
    from hivespec.node.training.checkpoint import CheckpointManager, CheckpointError, training_snapshot
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(sys.argv[1])
    for round in range(1, int(sys.argv[2]) + 1):
        if round == int(sys.argv[3]):  # from here on a file may not grow past 64 KiB: a full disk
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            print("saved", manager.save(training_snapshot(model, optimizer, {"next_round": round})).name, flush=True)
        except CheckpointError as exc:
            print("ERROR", exc, flush=True)
    """
)


def _child(tmp_path, saves: int, full_from: int = 0, faults: str = ""):
    env = dict(os.environ, HIVESPEC_FAULTS=faults)
    return subprocess.run(
        [sys.executable, "-P", "-c", _CHILD, str(tmp_path), str(saves), str(full_from or saves + 1)],
        check=False, capture_output=True, text=True, env=env, timeout=120,
    )


@pytest.mark.parametrize(
    "point", ["checkpoint.wrote.model", "checkpoint.wrote.optimizer", "checkpoint.before_manifest", "checkpoint.before_rename"]
)
def test_sigkill_at_any_step_of_a_save_leaves_the_previous_checkpoint(tmp_path, point):
    result = _child(tmp_path, saves=3, faults=f"{point}@2")
    assert result.returncode == -9, result.stderr[-2000:]
    assert "saved ckpt-000001" in result.stdout and "ckpt-000002" not in result.stdout
    manager = CheckpointManager(tmp_path)  # removes the half-written temp directory
    assert [p.name for p in manager.checkpoints()] == ["ckpt-000001"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert manager.load_latest().next_round == 1


def test_sigkill_after_the_rename_keeps_the_new_checkpoint(tmp_path):
    result = _child(tmp_path, saves=3, faults="checkpoint.after_rename@2")
    assert result.returncode == -9
    assert CheckpointManager(tmp_path).load_latest().next_round == 2


def test_disk_full_gives_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path):
    result = _child(tmp_path, saves=3, full_from=2)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "saved ckpt-000001"
    errors = [line for line in lines if line.startswith("ERROR")]
    assert len(errors) == 2
    assert "File too large" in errors[0] and "the previous checkpoint (ckpt-000001) is kept" in errors[0]
    assert "free some space" in errors[0]
    manager = CheckpointManager(tmp_path)
    assert [p.name for p in manager.checkpoints()] == ["ckpt-000001"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert manager.load_latest().next_round == 1
