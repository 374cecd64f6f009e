"""Foreign samples' policy-version window (intake) and the SAPO-style per-step mix (runtime)."""

import numpy as np
import pytest

from hivespec.node.config import NodeConfig
from hivespec.node.model.loader import load_tokenizer
from hivespec.node.runtime import Node, _Pending
from hivespec.node.tasks.source import TaskSource
from hivespec.node.training.intake import Intake
from hivespec.node.training.store import RolloutStore
from hivespec.protocol.envelope import Kind, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.rollout import Rollout, RolloutBatch, encode_batch

FINGERPRINT = "0123456789abcdef"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


def _envelope(tasks, tokenizer, peer, *, policy_version, round=3):
    task = tasks.prompts(seed=7, round=0, count=1)[0]
    completion = tokenizer.encode(str(task.answer), add_special_tokens=False) + [tokenizer.eos_token_id]
    rollout = Rollout(
        prompt_id=task.prompt_id, sample_index=0, seed=11,
        prompt_ids=np.asarray(tasks.chat_prompt_ids(tokenizer, task), dtype=np.uint32),
        completion_ids=np.asarray(completion, dtype=np.uint32),
        behaviour_logprobs=np.full(len(completion), -0.5, dtype=np.float32),
        reward=tasks.reward(task, str(task.answer)), finish_reason="stop",
    )
    batch = RolloutBatch(round=round, policy_version=policy_version, fingerprint=FINGERPRINT, rollouts=(rollout,))
    return seal(peer, Kind.ROLLOUTS, 1, encode_batch(batch))


@pytest.mark.parametrize(
    ("claimed", "outcome", "reason"),
    [(6, "accept", "ok"), (2, "accept", "ok"), (1, "ignore", "stale_version"), (10, "accept", "ok"), (11, "reject", "future_version")],
)
def test_policy_version_window(tokenizer, claimed, outcome, reason):
    tasks, store = TaskSource(), RolloutStore(":memory:")
    intake = Intake(fingerprint=FINGERPRINT, vocab_size=len(tokenizer), tasks=tasks, tokenizer=tokenizer, store=store,
                    staleness_rounds=2, staleness_versions=4)
    peer = Identity.generate()
    admission = intake.admit(peer.peer_id, _envelope(tasks, tokenizer, peer, policy_version=claimed), current_round=3, current_version=6)
    assert (admission.outcome, admission.reason) == (outcome, reason)
    store.close()


class _Trainer:
    version = 10


def _pending(author, prompt, rewards, *, round=5, version=9):
    return [
        _Pending(author, round, Rollout(prompt, i, 0, np.zeros(2, np.uint32), np.zeros(1, np.uint32),
                                        np.zeros(1, np.float32), r, "stop"), version)
        for i, r in enumerate(rewards)
    ]


def _selector(pending, *, fraction=0.5):
    node = Node.__new__(Node)  # only the selection's state: config, trainer version, pending pool
    node.config = NodeConfig()
    node.config.train.foreign_fraction = fraction
    node.trainer = _Trainer()
    node.intake = Intake.from_config(node.config.train, fingerprint=FINGERPRINT, vocab_size=1, tasks=TaskSource(), tokenizer=None,
                                     store=RolloutStore(":memory:"), private=None)
    node._pending = list(pending)
    return node


def test_mix_is_balanced_informative_first_and_drops_stale_versions():
    pool = (
        _pending("peer-a", "a-flat", [1.0, 1.0])
        + _pending("peer-a", "a-mixed", [1.0, 0.0])
        + _pending("peer-b", "b-mixed", [0.0, 1.0])
        + _pending("peer-b", "b-old", [0.0, 1.0], version=5)  # 5 versions behind 10: dropped
        + _pending("peer-c", "c-stale-round", [0.0, 1.0], round=1)  # outside the round window: dropped
    )
    node = _selector(pool)
    chosen = node._select_foreign(round_index=6, own_count=4)  # budget: 4 foreign samples
    assert sorted({p.rollout.prompt_id for p in chosen}) == ["a-mixed", "b-mixed"]
    assert [p.rollout.prompt_id for p in node._pending] == ["a-flat", "a-flat"]


def test_mix_rotates_which_peer_goes_first():
    firsts = set()
    for round_index in (6, 7):
        pool = _pending("peer-a", "a", [1.0, 0.0]) + _pending("peer-b", "b", [1.0, 0.0])
        chosen = _selector(pool, fraction=1 / 3)._select_foreign(round_index=round_index, own_count=4)  # budget 2: one group
        assert len({p.author for p in chosen}) == 1
        firsts.add(chosen[0].author)
    assert firsts == {"peer-a", "peer-b"}
