"""A step's exchange with a live swarm (real hivemind DHT and p2pd on loopback): it fetches what the pool has room for."""

import logging
from collections.abc import Iterator

import numpy as np
import psutil
import pytest

from hivespec.node.config import NodeConfig, SwarmConfig
from hivespec.node.exchange import RoundExchange
from hivespec.node.model.loader import load_tokenizer
from hivespec.node.speculation.feed import DrafterFeed
from hivespec.node.swarm.gossip import Gossip
from hivespec.node.tasks.source import TaskSource
from hivespec.node.training.foreign_pool import ForeignPool
from hivespec.node.training.intake import Intake
from hivespec.node.training.store import RolloutStore
from hivespec.protocol.identity import Identity
from hivespec.protocol.rollout import Rollout

FINGERPRINT = "0123456789abcdef"
pytestmark = pytest.mark.timeout(180)


def _swarm_config(initial_peers: list[str] = ()) -> SwarmConfig:
    return SwarmConfig(swarm="test-exchange", initial_peers=list(initial_peers), bootstrap_timeout=10.0, request_timeout=5.0)


def _exchange(identity: Identity, tasks: TaskSource, tokenizer, swarm: SwarmConfig) -> RoundExchange:
    store = RolloutStore(":memory:")
    intake = Intake.from_config(NodeConfig().train, fingerprint=FINGERPRINT, vocab_size=len(tokenizer), tasks=tasks,
                                tokenizer=tokenizer, store=store, private=None)
    pool = ForeignPool(foreign_fraction=0.5, still_fresh=intake.still_fresh)
    return RoundExchange(identity=identity, fingerprint=FINGERPRINT, store=store, intake=intake, pool=pool, feed=DrafterFeed(),
                         swarm=swarm)


def _group(tasks: TaskSource, tokenizer, seed: int, *, flat: bool = False) -> list[Rollout]:
    """Two completions of one prompt, one right and one wrong: an informative group (rewards the reader's verifier agrees
    with); `flat`: both wrong, a group with one reward (no gradient)."""
    task = tasks.prompts(seed=seed, round=0, count=1)[0]
    prompt = np.asarray(tasks.chat_prompt_ids(tokenizer, task), dtype=np.uint32)
    rollouts = []
    for index, text in enumerate((str(task.answer) + "2" if flat else str(task.answer), str(task.answer) + "1")):
        completion = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        rollouts.append(Rollout(
            prompt_id=task.prompt_id, sample_index=index, seed=seed, prompt_ids=prompt,
            completion_ids=np.asarray(completion, dtype=np.uint32),
            behaviour_logprobs=np.full(len(completion), -0.5, dtype=np.float32),
            reward=tasks.reward(task, text), finish_reason="stop",
        ))
    assert sorted(r.reward for r in rollouts) == ([0.0, 0.0] if flat else [0.0, 1.0])
    return rollouts


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[Gossip]]:
    """Two authors and a reader, bootstrapped from the first author; torn down with a leak check."""
    first = Gossip(Identity.generate(), _swarm_config())
    first.start()
    nodes = [first]
    for _ in range(2):
        node = Gossip(Identity.generate(), _swarm_config(first.visible_maddrs))
        node.start()
        nodes.append(node)
    pids = [n._p2p._child.pid for n in nodes]
    yield nodes
    for node in nodes:
        node.shutdown()
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_a_step_fetches_what_the_pool_has_room_for(swarm: list[Gossip]) -> None:
    tokenizer, tasks = load_tokenizer("smollm2-135m-instruct"), TaskSource()
    *authors, reader = swarm
    exchanges = {node: _exchange(node.identity, tasks, tokenizer, node.config) for node in swarm}
    for seed, author in enumerate(authors * 2):  # two batches each, of one informative group
        exchanges[author].publish(author, round_index=seed // 2, rollouts=_group(tasks, tokenizer, seed), policy_version=seed // 2)
    ours = exchanges[reader]
    assert ours.collect(reader, 0, 0, need=0) == [] and reader.stats()["bodies_fetched"] == 0  # room for nothing: no download
    # Nothing fetched yet, so the yield per batch is unknown: up to K = 4 (one of each author's, then a second of each:
    # with two authors in sight nobody is crowded out).
    first = ours.collect(reader, 0, 0, need=ours.pool.room(own_count=4, policy_version=0))
    assert [a.outcome for a in first] == ["accept"] * 4 and ours.informative_per_batch == 2.0
    assert ours.pool.room(own_count=4, policy_version=0) == 0  # 8 informative samples pending fill a step of 4 own
    assert ours.collect(reader, 1, 0, need=ours.pool.room(own_count=4, policy_version=0)) == []
    # Room for 2 more at 2 a batch: one batch, though each author has a new one to give.
    for seed, author in enumerate(authors, start=4):
        exchanges[author].publish(author, round_index=2, rollouts=_group(tasks, tokenizer, seed), policy_version=2)
    ours.pool.select(1, own_count=6, policy_version=0)  # a step of 6 own samples took 6 foreign ones
    assert ours.pool.room(own_count=4, policy_version=0) == 2
    second = ours.collect(reader, 1, 0, need=2)
    assert len(second) == 1 and second[0].outcome == "accept" and reader.stats()["bodies_fetched"] == 5
    # need=None (or a swarm that waits for expected_peers) fetches up to K, as before: the last batch.
    assert len(ours.collect(reader, 2, 0)) == 1 and reader.stats()["bodies_fetched"] == 6


def test_a_step_whose_batches_fell_short_fetches_again_at_once_within_k(swarm: list[Gossip], caplog: pytest.LogCaptureFixture) -> None:
    """A step that waits for nobody fetches for its pool's room at the yield seen lately; where the batches it got held
    fewer informative samples than that (here 2 where 4 a batch were seen), it fetches again in the same call, within
    K, instead of training on less than it has room for, and says so in its log."""
    tokenizer, tasks = load_tokenizer("smollm2-135m-instruct"), TaskSource()
    *authors, reader = swarm
    public = SwarmConfig(swarm="test-exchange", request_timeout=5.0)
    exchanges = {node: _exchange(node.identity, tasks, tokenizer, public) for node in swarm}
    ours = exchanges[reader]
    for trial in range(4):
        for seed, author in enumerate(authors, start=300 + 10 * trial):
            exchanges[author].publish(author, round_index=trial, rollouts=_group(tasks, tokenizer, seed), policy_version=trial)
        ours.informative_per_batch = 4.0  # the yield seen lately: one batch for a room of 4
        assert ours.pool.room(own_count=4, policy_version=trial) == 4
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hivespec.node.exchange"):
            admissions = ours.collect(reader, trial, trial, need=4)
        assert len(admissions) == 2 and all(a.outcome == "accept" for a in admissions)
        assert ours.pool.room(own_count=4, policy_version=trial) == 0  # the room was filled by the second pass
        again = [r.getMessage() for r in caplog.records if "fetching again" in r.getMessage()]
        line = (f"round {trial}: the batches fetched left room for 2 informative foreign samples; fetching again "
                f"(3 of {public.max_foreign_batches} batches left this step)")
        assert again == [line]
        ours.pool.select(trial, own_count=100, policy_version=trial)
        assert len(ours.pool) == 0


def test_a_step_fetching_to_train_skips_a_batch_announced_as_flat(swarm: list[Gossip]) -> None:
    """A batch whose groups all had one reward brings nothing to train; its author says so in its record, so a step
    fetching for its pool's room never spends one of its K on it (a slow node's step had spent all four on such
    batches), while a call that fetches as many as allowed still takes it. Each trial: one author's new batch is flat,
    the other's informative; room for 2 at 2 a batch."""
    tokenizer, tasks = load_tokenizer("smollm2-135m-instruct"), TaskSource()
    *authors, reader = swarm
    public = SwarmConfig(swarm="test-exchange", request_timeout=5.0)
    exchanges = {node: _exchange(node.identity, tasks, tokenizer, public) for node in swarm}
    ours = exchanges[reader]
    for trial in range(4):
        flat_author, informative_author = authors if trial % 2 else authors[::-1]
        exchanges[flat_author].publish(flat_author, round_index=trial, rollouts=_group(tasks, tokenizer, 100 + trial, flat=True),
                                       policy_version=trial)
        exchanges[informative_author].publish(informative_author, round_index=trial,
                                              rollouts=_group(tasks, tokenizer, 200 + trial), policy_version=trial)
        ours.informative_per_batch = 2.0
        fetched = reader.stats()["bodies_fetched"]
        admissions = ours.collect(reader, trial, trial, need=2)
        assert [a.author for a in admissions] == [informative_author.identity.peer_id] and admissions[0].outcome == "accept"
        assert reader.stats()["bodies_fetched"] == fetched + 1 and ours.pool.room(own_count=2, policy_version=trial) == 0
        rest = ours.collect(reader, trial, trial)  # need=None: as many as allowed, the flat one too
        assert [a.author for a in rest] == [flat_author.identity.peer_id]
        ours.pool.select(trial, own_count=100, policy_version=trial)
        assert len(ours.pool) == 0


def test_a_step_that_waits_for_its_peers_takes_one_batch_an_author(swarm: list[Gossip]) -> None:
    """With `swarm.expected_peers` a step waits for each peer's next batch; an author's second batch is the one the next
    step waits for, so a step takes one an author even with K to spare (the demo's equal nodes, one running ahead)."""
    tokenizer, tasks = load_tokenizer("smollm2-135m-instruct"), TaskSource()
    *authors, reader = swarm
    waiting = SwarmConfig(swarm="test-exchange", request_timeout=5.0, expected_peers=2, round_timeout=20.0)
    exchanges = {node: _exchange(node.identity, tasks, tokenizer, waiting) for node in swarm}
    for seed, author in enumerate(authors * 2, start=10):  # two new batches each: the author ran a step ahead
        exchanges[author].publish(author, round_index=seed // 2, rollouts=_group(tasks, tokenizer, seed), policy_version=5)
    ours = exchanges[reader]
    for step in (5, 6):  # each step one of each author's, whatever room the pool has
        admissions = ours.collect(reader, step, 5)
        assert sorted(a.author for a in admissions) == sorted(a.identity.peer_id for a in authors)
        assert all(a.outcome == "accept" for a in admissions)


def test_a_batch_over_the_body_cap_goes_out_as_several_each_group_whole(swarm: list[Gossip]) -> None:
    """A lab's round (32 prompts x 16 completions of 1024 tokens) is over gossip's 4 MiB a body: publish had raised
    ValueError out of the round, and the node ended after generating it. Here the cap holds two of the four groups."""
    from hivespec.protocol.envelope import Kind, seal
    from hivespec.protocol.rollout import RolloutBatch, encode_batch

    tokenizer, tasks = load_tokenizer("smollm2-135m-instruct"), TaskSource()
    reader = swarm[-1]
    groups = [_group(tasks, tokenizer, seed) for seed in range(500, 504)]
    identity = Identity.generate()
    two = seal(identity, Kind.ROLLOUTS, 1, encode_batch(RolloutBatch(0, 0, FINGERPRINT, tuple(groups[0] + groups[1]))))
    author = Gossip(identity, _swarm_config(swarm[0].visible_maddrs), max_body_bytes=len(two) + 64)
    author.start()
    try:
        public = SwarmConfig(swarm="test-exchange", request_timeout=5.0)
        assert _exchange(identity, tasks, tokenizer, public).publish(author, 0, [r for g in groups for r in g], 0)
        assert author.stats()["published"] == 2
        ours = _exchange(reader.identity, tasks, tokenizer, public)
        admissions = [a for a in ours.collect(reader, 0, 0) if a.author == identity.peer_id]
        assert [a.outcome for a in admissions] == ["accept", "accept"]
        got = sorted(r.prompt_id for a in admissions for r in a.rollouts)
        assert got == sorted(r.prompt_id for g in groups for r in g)
        for admission in admissions:  # each group whole in one batch or the other
            prompts = [r.prompt_id for r in admission.rollouts]
            assert all(prompts.count(p) == 2 for p in prompts)
    finally:
        author.shutdown()
