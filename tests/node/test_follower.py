"""A follower mirrors a leader's policy over real hivemind on 127.0.0.1: dropped and reordered deltas, late joiners."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hivespec.node.config import SwarmConfig
from hivespec.node.swarm.gossip import Gossip
from hivespec.node.weights.follower import Follower
from hivespec.node.weights.publisher import DELTA_TOPIC, PolicyPublisher
from hivespec.node.weights.sync import EngineWeights, WeightSync
from hivespec.protocol.identity import Identity
from hivespec.protocol.weights_hash import state_hash

SWARM = "test-follow"
pytestmark = pytest.mark.timeout(240)


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def _engine_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    engine = copy.deepcopy(model).to(torch.bfloat16)
    return {name: p.detach() for name, p in engine.named_parameters()}


def _start(identity: Identity, initial_peers=()) -> Gossip:
    node = Gossip(identity, SwarmConfig(swarm=SWARM, initial_peers=list(initial_peers), request_timeout=5.0, bootstrap_timeout=10.0))
    node.start()
    return node


def _bits(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.view(torch.int16).clone() for name, t in params.items()}


def _leader(seed: int) -> tuple[torch.nn.Module, WeightSync, Callable[[int], list[bytes]]]:
    """A leader's trainer on the tiny model: the base model every node loads, its sync, and a step giving a version's chunks."""
    trainer = _tiny()
    base_model = copy.deepcopy(trainer)  # every node loads the same base checkpoint
    sync = WeightSync(trainer, _engine_copy(trainer))
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed))

    def train_step(version: int) -> list[bytes]:
        optimizer.zero_grad()
        trainer(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        return sync.sync(version)[1]

    return base_model, sync, train_step


def test_followers_end_bit_identical_after_dropped_and_reordered_deltas():
    base_model, sync, train_step = _leader(seed=1)
    leader_identity = Identity.generate()
    leader_gossip = _start(leader_identity)
    follower_gossip = _start(Identity.generate(), leader_gossip.visible_maddrs)
    late_gossip = None
    try:
        publisher = PolicyPublisher(leader_gossip, leader_identity, sync.engine, snapshot_every=4)
        follower = Follower(follower_gossip, EngineWeights(_engine_copy(base_model)), leader_identity.peer_id, fetch_timeout=3.0)
        assert follower.engine.hash == publisher.base_hash

        for version in (1, 2):
            publisher.publish_step(version, train_step(version))
        report = follower.poll()
        assert report.applied == [1, 2] and report.snapshot is None and not report.rejected
        assert follower.engine.hash == sync.engine.hash

        train_step(3)  # dropped: never published
        publisher.publish_step(4, train_step(4))  # also publishes the snapshot of version 4
        five, six = train_step(5), train_step(6)
        publisher.publish_delta(6, six)  # reordered: 6 goes out before 5
        publisher.publish_delta(5, five)
        publisher.publish_head()

        report = follower.poll()
        assert report.snapshot == 4, report
        assert report.applied == [5, 6] and report.version == 6 and report.behind == 0
        assert follower.engine.hash == sync.engine.hash == state_hash(follower.engine.state)
        for name, tensor in _bits(follower.engine.params).items():
            assert torch.equal(tensor, _bits(sync.engine_params)[name]), name

        # Nodes joining now start from the base checkpoint and catch up the same way: through the
        # deltas as far as they reach, or (more than max_lag behind) straight from the snapshot.
        for max_lag, applied in ((16, [1, 2, 5, 6]), (2, [5, 6])):
            late_gossip = _start(Identity.generate(), leader_gossip.visible_maddrs)
            late = Follower(late_gossip, EngineWeights(_engine_copy(base_model)), leader_identity.peer_id, fetch_timeout=3.0, max_lag=max_lag)
            report = late.poll()
            late_gossip.shutdown()
            assert report.snapshot == 4 and report.applied == applied and late.engine.hash == sync.engine.hash

        # Nothing new: a poll is a no-op.
        assert follower.poll().applied == []
    finally:
        for node in (leader_gossip, follower_gossip, late_gossip):
            if node is not None:
                node.shutdown()


def test_a_follower_ahead_of_a_leader_that_resumed_from_a_checkpoint_rejoins_its_history():
    """The leader published up to version 6, crashed and resumed from its checkpoint at 4: the follower, at 6 of a
    history the leader abandoned, must come back to the leader's 4 (its next deltas would fail on 6's weights), not
    keep 6 reporting itself up to date."""
    base_model, sync, train_step = _leader(seed=2)
    leader_identity = Identity.generate()
    leader_gossip = _start(leader_identity)
    follower_gossip = _start(Identity.generate(), leader_gossip.visible_maddrs)
    try:
        publisher = PolicyPublisher(leader_gossip, leader_identity, sync.engine, snapshot_every=8)
        follower = Follower(follower_gossip, EngineWeights(_engine_copy(base_model)), leader_identity.peer_id, fetch_timeout=3.0)
        checkpointed = None
        for version in range(1, 7):
            publisher.publish_step(version, train_step(version))
            if version == 4:
                checkpointed = (sync.engine.snapshot_bits(), sync.engine.hash)
        assert follower.poll().version == 6 and follower.engine.hash == sync.engine.hash

        # The restart: a publisher built on the base weights (as build_node does), then the checkpoint's version 4.
        resumed = EngineWeights(_engine_copy(base_model))
        restarted = PolicyPublisher(leader_gossip, leader_identity, resumed, snapshot_every=8)
        resumed.restore(checkpointed[0], version=4, digest=checkpointed[1])
        restarted.publish_resumed()
        report = follower.poll()
        assert report.leader_version == 4 and report.snapshot == 4 and report.behind == 0, report
        assert follower.engine.version == 4 and follower.engine.hash == checkpointed[1] == state_hash(follower.engine.state)
    finally:
        leader_gossip.shutdown()
        follower_gossip.shutdown()


def test_follower_ignores_deltas_signed_by_someone_else():
    trainer = _tiny()
    base_model = copy.deepcopy(trainer)
    sync = WeightSync(trainer, _engine_copy(trainer))
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01)
    _, chunks = sync.sync(1)

    leader, impostor = Identity.generate(), Identity.generate()
    impostor_gossip = _start(impostor)
    follower_gossip = _start(Identity.generate(), impostor_gossip.visible_maddrs)
    try:
        # The impostor publishes a valid delta and head under its own key; the follower follows `leader`.
        PolicyPublisher(impostor_gossip, impostor, sync.engine, snapshot_every=1).publish_step(1, chunks)
        follower = Follower(follower_gossip, EngineWeights(_engine_copy(base_model)), leader.peer_id, fetch_timeout=2.0)
        report = follower.poll()
        assert report.leader_version is None and report.applied == [] and follower.engine.version == 0
        # Even asked for the slot directly, the impostor's body is never used.
        assert follower._fetch(DELTA_TOPIC, 1) is None
        assert follower.engine.hash == state_hash(follower.engine.state) != sync.engine.hash
    finally:
        impostor_gossip.shutdown()
        follower_gossip.shutdown()
