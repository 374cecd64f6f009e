"""NodeState: a save and a restore put back the trainer, the engine (through WeightSync.reset), the pool and the providers."""

import copy
import time

import numpy as np
import pytest
import torch

from hivespec.node.config import NodeConfig
from hivespec.node.model.engine import TorchEngine
from hivespec.node.model.loader import load_model
from hivespec.node.tasks.source import TaskSource
from hivespec.node.training.checkpoint import CheckpointError, CheckpointManager
from hivespec.node.training.foreign_pool import ForeignPool
from hivespec.node.training.intake import Intake
from hivespec.node.training.node_state import NodeState
from hivespec.node.training.store import RolloutStore, StoredRollout
from hivespec.node.training.trainer import Trainer, TrainSample
from hivespec.node.weights.sync import WeightSync
from hivespec.protocol.rollout import Rollout


class _Counter:
    """A StateProvider: JSON-able state that a checkpoint keeps."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state) -> None:
        self.value = state["value"]


def _rollout(prompt: str, reward: float, index: int) -> Rollout:
    return Rollout(prompt, index, 0, np.asarray([1, 2, 3], np.uint32), np.asarray([4, 5], np.uint32), np.asarray([-0.5, -0.5], np.float32),
                   reward, "stop")


def _pool(store) -> ForeignPool:
    intake = Intake.from_config(NodeConfig().train, fingerprint="fp-a", vocab_size=1, tasks=TaskSource(), tokenizer=None, store=store,
                                private=None)
    return ForeignPool(foreign_fraction=0.5, still_fresh=intake.still_fresh)


def _node_state(tmp_path, trainer, sync, engine, store, pool, providers, fingerprint="fp-a"):
    return NodeState(CheckpointManager(tmp_path / "checkpoints"), trainer=trainer, sync=sync, engine=engine, store=store, pool=pool,
                     providers=providers, fingerprint=fingerprint, seed=7)


def test_a_restore_puts_back_what_the_save_held(tmp_path):
    torch.manual_seed(0)
    trainer_model = load_model("tiny", dtype=torch.float32)
    engine = TorchEngine(copy.deepcopy(trainer_model).eval().requires_grad_(False), max_batch_size=2)
    sync = WeightSync(trainer_model, engine.sync_parameters())
    trainer = Trainer(trainer_model, learning_rate=1e-2, autocast_dtype=None)
    store = RolloutStore(tmp_path / "rollouts.sqlite")
    pool = _pool(store)
    admitted = [_rollout("a", 1.0, 0), _rollout("a", 0.0, 1)]
    store.add_rollouts([StoredRollout.from_rollout(r, author="peer", round=2, policy_version=0, own=False, received_at=1.0) for r in admitted])
    pool.admit("peer", 2, admitted, 0, born=time.time())
    counter = _Counter()
    counter.value = 5
    state = _node_state(tmp_path, trainer, sync, engine, store, pool, {"counter": counter})

    path = state.save(state.at(3))
    saved = {name: p.detach().clone() for name, p in trainer_model.named_parameters()}

    # Move everything on: a step (weights, optimizer, version), a sync, an emptied pool, a changed provider.
    samples = [TrainSample([1, 2, 3], [4, 5], [-0.5, -0.5], reward, "a") for reward in (1.0, 0.0)]
    behaviour = trainer.logprobs(samples)  # on-policy samples: every token kept by the importance filters
    samples = [TrainSample([1, 2, 3], [4, 5], logps, s.reward, "a") for s, logps in zip(samples, behaviour, strict=True)]
    trainer.step(samples)
    sync.sync(trainer.version)
    pool.select(3, own_count=4, policy_version=trainer.version)
    counter.value = 9
    assert len(pool) == 0 and trainer.version == 1 and sync.version == 1
    assert not all(torch.equal(saved[name], p) for name, p in trainer_model.named_parameters())

    restored = state.checkpoints.load_latest()
    assert restored.path == path and restored.next_round == 3
    state.restore(restored)
    assert trainer.version == 0 and sync.version == 0 and counter.value == 5
    assert all(torch.equal(saved[name], p) for name, p in trainer_model.named_parameters())
    assert sync.mismatched_elements() == 0  # the engine was recast from the restored trainer
    assert [(p.author, p.round, p.rollout.reward) for p in pool.pending] == [("peer", 2, 1.0), ("peer", 2, 0.0)]

    other = _node_state(tmp_path, trainer, sync, engine, store, pool, {}, fingerprint="fp-b")
    with pytest.raises(CheckpointError, match="fingerprint fp-a"):
        other.restore(restored)
    store.close()


def test_without_checkpoints_a_save_is_a_no_op(tmp_path):
    store = RolloutStore(":memory:")
    state = NodeState(None, trainer=None, sync=None, engine=None, store=store, pool=_pool(store), providers={}, fingerprint="fp", seed=1)
    assert state.save(state.at(0)) is None
    store.close()
