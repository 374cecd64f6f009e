"""Foreign samples' policy-version window (intake) and the SAPO-style per-step mix (the foreign pool)."""

import dataclasses

import numpy as np
import pytest

from hivespec.node.config import NodeConfig
from hivespec.node.exchange import batches_to_fetch
from hivespec.node.model.loader import load_tokenizer
from hivespec.node.tasks.source import TaskSource
from hivespec.node.training.foreign_pool import ForeignPool
from hivespec.node.training.intake import Intake
from hivespec.node.training.store import RolloutStore, StoredRollout
from hivespec.node.training.trainer import TrainSample
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
    [(6, "accept", "ok"), (2, "accept", "ok"), (1, "ignore", "stale_version"), (10, "accept", "ok"), (11, "ignore", "stale_version")],
)
def test_policy_version_window(tokenizer, claimed, outcome, reason):
    tasks, store = TaskSource(), RolloutStore(":memory:")
    intake = Intake(fingerprint=FINGERPRINT, vocab_size=len(tokenizer), tasks=tasks, tokenizer=tokenizer, store=store,
                    staleness_seconds=240, staleness_versions=4)
    peer = Identity.generate()
    admission = intake.admit(peer.peer_id, _envelope(tasks, tokenizer, peer, policy_version=claimed), current_version=6)
    assert (admission.outcome, admission.reason) == (outcome, reason)
    store.close()


NOW = 1_800_000_000.0


def _pending(author, prompt, rewards, *, round=5, version=74, age=10.0):
    return [(author, round, Rollout(prompt, i, 0, np.zeros(2, np.uint32), np.zeros(1, np.uint32), np.zeros(1, np.float32), r, "stop"), version,
             NOW - age)
            for i, r in enumerate(rewards)]


def test_by_default_a_newcomer_and_a_veteran_take_each_others_rollouts(tokenizer):
    # Versions count each node's own steps: a node that joins a swarm days old starts thousands behind,
    # and a fast node gains on a slow one every minute. No version window by default, or they part for good.
    tasks = TaskSource()
    veteran, newcomer = Identity.generate(), Identity.generate()
    for author, ours, theirs in ((veteran, 0, 5000), (newcomer, 5000, 0)):
        store = RolloutStore(":memory:")
        intake = Intake.from_config(NodeConfig().train, fingerprint=FINGERPRINT, vocab_size=len(tokenizer), tasks=tasks,
                                    tokenizer=tokenizer, store=store, private=None)
        admission = intake.admit(author.peer_id, _envelope(tasks, tokenizer, author, policy_version=theirs), current_version=ours)
        assert (admission.outcome, admission.reason) == ("accept", "ok")
        assert intake.version_window(ours)(theirs)  # gossip's pre-filter fetches it
        assert intake.still_fresh(NOW, theirs, current_version=ours, now=NOW + 10)  # and a step trains on it
        store.close()


def _pool(pending, *, fraction=0.5, versions=64, take_flat=False):
    # The intake owns the staleness window (240 s by default; a version window only where one is set); the pool asks it.
    train = dataclasses.replace(NodeConfig().train, staleness_versions=versions)
    intake = Intake.from_config(train, fingerprint=FINGERPRINT, vocab_size=1, tasks=TaskSource(), tokenizer=None,
                                store=RolloutStore(":memory:"), private=None)
    pool = ForeignPool(foreign_fraction=fraction, still_fresh=intake.still_fresh, take_flat=take_flat)
    batches: dict[tuple, list[Rollout]] = {}  # one admitted batch per author and prompt group, as intake hands them over
    for author, round_index, rollout, version, born in pending:
        batches.setdefault((author, round_index, version, born, rollout.prompt_id), []).append(rollout)
    for (author, round_index, version, born, _), rollouts in batches.items():
        pool.admit(author, round_index, rollouts, version, born=born)
    return pool


def test_mix_is_balanced_informative_first_and_drops_stale_versions():
    pool = _pool(
        _pending("peer-a", "a-flat", [1.0, 1.0])
        + _pending("peer-a", "a-mixed", [1.0, 0.0])
        + _pending("peer-b", "b-mixed", [0.0, 1.0])
        + _pending("peer-b", "b-old", [0.0, 1.0], version=5)  # 69 versions behind 74: dropped
        + _pending("peer-b", "b-ahead", [0.0, 1.0], version=200)  # a much faster node, 126 versions ahead: dropped
        + _pending("peer-c", "c-stale", [0.0, 1.0], age=300)  # signed 300 s ago: dropped
        + _pending("peer-c", "c-other-round", [0.0, 1.0], round=900, age=200)  # its round means nothing to us: kept
    )
    chosen = pool.select(round_index=6, own_count=6, policy_version=74, now=NOW)  # budget: 6 foreign samples
    assert sorted({p.rollout.prompt_id for p in chosen}) == ["a-mixed", "b-mixed", "c-other-round"]
    assert pool.pending == ()  # a-flat was never queued: this trainer does not run flat samples


def test_fresher_groups_go_first():
    pool = _pool(_pending("peer-a", "a-older", [1.0, 0.0], age=100) + _pending("peer-a", "a-newer", [1.0, 0.0], age=5), fraction=1 / 3)
    chosen = pool.select(round_index=0, own_count=4, policy_version=74, now=NOW)  # budget 2: one group
    assert {p.rollout.prompt_id for p in chosen} == {"a-newer"}


def test_mix_rotates_which_peer_goes_first():
    firsts = set()
    for round_index in (6, 7):
        pool = _pool(_pending("peer-a", "a", [1.0, 0.0]) + _pending("peer-b", "b", [1.0, 0.0]), fraction=1 / 3)
        chosen = pool.select(round_index=round_index, own_count=4, policy_version=74, now=NOW)  # budget 2: one group
        assert len({p.author for p in chosen}) == 1
        firsts.add(chosen[0].author)
    assert firsts == {"peer-a", "peer-b"}


def test_a_stopped_step_puts_its_rollouts_back():
    pool = _pool(_pending("peer-a", "a", [1.0, 0.0]))
    chosen = pool.select(round_index=5, own_count=4, policy_version=74, now=NOW)
    assert len(chosen) == 2 and len(pool) == 0
    pool.put_back(chosen)
    assert pool.pending == tuple(chosen)


def test_restore_reads_the_checkpointed_pool_and_what_was_journaled_after_it():
    store = RolloutStore(":memory:")
    saved = _pool(_pending("peer-a", "a", [1.0, 0.0], round=3))
    rows = [StoredRollout.from_rollout(p.rollout, author=p.author, round=p.round, policy_version=9, own=False, received_at=1.0)
            for p in saved.pending]
    store.add_rollouts(rows)
    entries, mark = ForeignPool.entries(saved.pending), store.journal_high_water()
    later = _pending("peer-b", "b", [0.0, 1.0], round=4)
    store.add_rollouts([StoredRollout.from_rollout(item[2], author="peer-b", round=4, policy_version=9, own=False, received_at=2.0)
                        for item in later])
    restored = _pool([])
    restored.restore(entries, mark, store)
    store.close()
    assert [(p.author, p.round, p.rollout.prompt_id, p.rollout.reward) for p in restored.pending] == [
        ("peer-a", 3, "a", 1.0), ("peer-a", 3, "a", 0.0), ("peer-b", 4, "b", 0.0), ("peer-b", 4, "b", 1.0)
    ]


def test_what_was_journaled_after_a_checkpoint_restores_as_old_as_its_author_signed_it():
    # Signed 300 s before it arrived (the window is 240 s): it ages out after a resume as it would have without one.
    store = RolloutStore(":memory:")
    mark = store.journal_high_water()
    late = _pending("peer-b", "b", [0.0, 1.0], age=300.0)
    store.add_rollouts([StoredRollout.from_rollout(rollout, author=author, round=round_index, policy_version=version, own=False,
                                                   received_at=NOW, born=born)
                        for author, round_index, rollout, version, born in late])
    pool = _pool([])
    pool.restore([], mark, store)
    store.close()
    assert [p.born for p in pool.pending] == [NOW - 300.0] * 2
    assert pool.select(round_index=6, own_count=4, policy_version=74, now=NOW) == []


def test_a_group_larger_than_the_budget_gives_part_of_itself_with_whole_group_advantages():
    # A fast node's step of 2 own samples takes 2 of a slow peer's 4-sample group, not all 4:
    # its training cost stays what foreign_fraction says, and the advantages stay those of the whole group.
    pool = _pool(_pending("peer-a", "a", [1.0, 0.0, 0.0, 0.0]))
    whole = [p.advantage for p in pool.pending]
    assert whole[0] > 0 > whole[1] == whole[2] == whole[3]
    chosen = pool.select(round_index=0, own_count=2, policy_version=74, now=NOW)  # budget 2
    assert len(chosen) == 2 and chosen[0].advantage == whole[0]  # the most informative sample first
    assert len(pool) == 2 and all(p.advantage == whole[1] for p in pool.pending)
    samples = [TrainSample.from_rollout(p.rollout, p.author, advantage=p.advantage) for p in chosen]
    assert [s.advantage for s in samples] == [p.advantage for p in chosen]


def test_room_is_the_budget_less_the_informative_samples_still_fresh():
    pool = _pool([])
    assert pool.room(own_count=8, policy_version=74, now=NOW) == 8  # fraction 0.5: as many foreign as own
    informative = pool.admit("peer-a", 5, [r for _, _, r, _, _ in _pending("peer-a", "a", [1.0, 0.0, 0.0, 1.0])], 74, born=NOW - 10)
    flat = pool.admit("peer-b", 5, [r for _, _, r, _, _ in _pending("peer-b", "b", [1.0, 1.0])], 74, born=NOW - 10)
    assert (informative, flat) == (4, 0)  # a group without a reward spread carries no gradient
    assert pool.room(own_count=8, policy_version=74, now=NOW) == 4  # the flat group does not fill the step
    assert pool.room(own_count=2, policy_version=74, now=NOW) == 0
    # What aged out does not count, and room drops it, as select would.
    assert pool.room(own_count=8, policy_version=74, now=NOW + 300) == 8 and len(pool) == 0


@pytest.mark.parametrize(
    ("need", "per_batch", "cap", "batches"),
    [(0, 8.0, 4, 0), (-3, None, 4, 0),  # the pool holds enough: nothing to fetch
     (16, None, 4, 4), (16, 0.0, 4, 4),  # nothing fetched yet, or only flat groups: as many as allowed
     (16, 16.0, 4, 1), (4, 12.5, 4, 1), (17, 8.0, 4, 3), (100, 8.0, 4, 4)],
)
def test_batches_to_fetch(need, per_batch, cap, batches):
    assert batches_to_fetch(need, per_batch, cap) == batches


def test_the_rest_of_a_part_taken_group_still_goes_before_a_flat_one():
    # A step of 2 takes the two right answers of a [1, 1, 0, 0] group; the two wrong ones left keep their advantages
    # (-1 each), though they now share one reward: the next step takes them, not a fresher group with no spread.
    pool = _pool(_pending("peer-a", "a", [1.0, 1.0, 0.0, 0.0], age=10) + _pending("peer-a", "flat", [0.0, 0.0], age=5))
    first = pool.select(round_index=0, own_count=2, policy_version=74, now=NOW)
    assert [(p.rollout.prompt_id, p.rollout.reward) for p in first] == [("a", 1.0), ("a", 1.0)]
    assert pool.room(own_count=2, policy_version=74, now=NOW) == 0  # the two left are informative
    second = pool.select(round_index=1, own_count=2, policy_version=74, now=NOW)
    assert [(p.rollout.prompt_id, round(p.advantage, 3)) for p in second] == [("a", -1.0), ("a", -1.0)]


def test_an_informative_group_of_any_author_goes_before_a_flat_one():
    # The rotation puts peer-a first at round 0, but its only group has no spread: the step takes peer-b's
    # informative group (it carries a gradient), and peer-a's flat one only fills a budget left over, for a
    # trainer that runs flat samples for their statistics (train.flat_sample_stats).
    for round_index in (0, 1):
        pool = _pool(_pending("peer-a", "a-flat", [0.0, 0.0], age=5) + _pending("peer-b", "b-mixed", [1.0, 0.0], age=100), fraction=1 / 3,
                     take_flat=True)
        chosen = pool.select(round_index=round_index, own_count=4, policy_version=74, now=NOW)  # budget 2: one group
        assert [p.rollout.prompt_id for p in chosen] == ["b-mixed", "b-mixed"]
    for take_flat, taken in ((True, ["b-mixed", "b-mixed", "a-flat", "a-flat"]), (False, ["b-mixed", "b-mixed"])):
        pool = _pool(_pending("peer-a", "a-flat", [0.0, 0.0]) + _pending("peer-b", "b-mixed", [1.0, 0.0]), take_flat=take_flat)
        chosen = pool.select(round_index=0, own_count=4, policy_version=74, now=NOW)  # budget 4: room for both groups
        assert [p.rollout.prompt_id for p in chosen] == taken
    assert pool.pending == ()  # a trainer that does not run a flat group never queues it


def test_a_flat_group_is_queued_only_for_a_trainer_that_runs_it():
    flat, mixed = _pending("peer-a", "a-flat", [1.0, 1.0]), _pending("peer-a", "a-mixed", [1.0, 0.0])
    for take_flat, queued in ((False, ["a-mixed"] * 2), (True, ["a-flat"] * 2 + ["a-mixed"] * 2)):
        pool = _pool(flat + mixed, take_flat=take_flat)
        assert [p.rollout.prompt_id for p in pool.pending] == queued
        assert pool.room(own_count=8, policy_version=74, now=NOW) == 6  # only informative samples fill a step either way
    # A restore (here: all of it journaled after the checkpoint) leaves flat groups out the same way.
    store = RolloutStore(":memory:")
    mark = store.journal_high_water()
    store.add_rollouts([StoredRollout.from_rollout(rollout, author=author, round=round_index, policy_version=version, own=False,
                                                   received_at=born) for author, round_index, rollout, version, born in flat + mixed])
    for take_flat, queued in ((False, ["a-mixed"] * 2), (True, ["a-flat"] * 2 + ["a-mixed"] * 2)):
        pool = _pool([], take_flat=take_flat)
        pool.restore([], mark, store)
        assert [p.rollout.prompt_id for p in pool.pending] == queued
    store.close()


@pytest.mark.parametrize(("fraction", "own", "budget"), [(0.5, 8, 8), (1 / 3, 4, 2), (1 / 3, 5, 2), (0.6, 8, 12), (0.2, 8, 2), (0.0, 8, 0)])
def test_the_budget_is_the_foreign_fraction_of_the_step_exactly(fraction, own, budget):
    assert _pool([], fraction=fraction).budget(own) == budget
