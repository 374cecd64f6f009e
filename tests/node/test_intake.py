"""Admission of foreign rollouts: every check, with a real tokenizer, task source and SQLite store."""

import dataclasses
import time

import numpy as np
import pytest

from hivespec.node.model.loader import load_tokenizer
from hivespec.node.tasks.source import TaskSource
from hivespec.node.training.foreign_pool import ForeignPool
from hivespec.node.training.intake import Intake
from hivespec.node.training.store import RolloutStore
from hivespec.protocol.envelope import Kind, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.rollout import Rollout, RolloutBatch, encode_batch

FINGERPRINT = "0123456789abcdef"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture
def world(tokenizer):
    tasks = TaskSource()
    store = RolloutStore(":memory:")
    intake = Intake(
        fingerprint=FINGERPRINT, vocab_size=len(tokenizer), tasks=tasks, tokenizer=tokenizer, store=store, staleness_seconds=240
    )
    yield tasks, intake, store
    store.close()


def _rollouts(tasks, tokenizer, *, answer_right=True, count=2):
    task = tasks.prompts(seed=7, round=0, count=1)[0]
    text = f"{task.answer}" if answer_right else "I do not know."
    completion = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return [
        Rollout(
            prompt_id=task.prompt_id,
            sample_index=i,
            seed=11,
            prompt_ids=np.asarray(tasks.chat_prompt_ids(tokenizer, task), dtype=np.uint32),
            completion_ids=np.asarray(completion, dtype=np.uint32),
            behaviour_logprobs=np.full(len(completion), -0.5, dtype=np.float32),
            reward=tasks.reward(task, text),
            finish_reason="stop",
        )
        for i in range(count)
    ]


def _envelope(peer, rollouts, *, seq=1, round=3, fingerprint=FINGERPRINT, age=0.0):
    batch = RolloutBatch(round=round, policy_version=5, fingerprint=fingerprint, rollouts=tuple(rollouts))
    return seal(peer, Kind.ROLLOUTS, seq, encode_batch(batch), timestamp=time.time() - age)


def test_an_honest_batch_is_accepted_and_journaled(world, tokenizer):
    tasks, intake, store = world
    peer = Identity.generate()
    rollouts = _rollouts(tasks, tokenizer)
    admission = intake.admit(peer.peer_id, _envelope(peer, rollouts))
    assert (admission.outcome, admission.reason) == ("accept", "ok")
    assert len(admission.rollouts) == 2 and admission.policy_version == 5
    assert rollouts[0].reward == 1.0
    assert store.counts()["foreign"] == 2


def test_replays_and_duplicates_are_ignored_not_penalised(world, tokenizer):
    tasks, intake, _ = world
    peer = Identity.generate()
    rollouts = _rollouts(tasks, tokenizer)
    envelope = _envelope(peer, rollouts)
    assert intake.admit(peer.peer_id, envelope).outcome == "accept"
    replay = intake.admit(peer.peer_id, envelope)
    assert (replay.outcome, replay.reason) == ("ignore", "replay")
    again = intake.admit(peer.peer_id, _envelope(peer, rollouts, seq=2))
    assert (again.outcome, again.reason) == ("ignore", "duplicate")


def test_a_rollout_sent_twice_in_one_batch_is_admitted_once(world, tokenizer):
    """A peer repeating its right answer in a batch had each copy pooled (the journal kept one) and drawn into one step."""
    tasks, intake, store = world
    peer = Identity.generate()
    right, wrong = _rollouts(tasks, tokenizer, count=1)[0], _rollouts(tasks, tokenizer, answer_right=False, count=2)[1]
    admission = intake.admit(peer.peer_id, _envelope(peer, [right, right, right, wrong]))
    assert admission.outcome == "accept" and [r.sample_index for r in admission.rollouts] == [0, 1]
    pool = ForeignPool(foreign_fraction=0.5, still_fresh=intake.still_fresh)
    pool.admit(admission.author, 0, admission.rollouts, admission.policy_version, born=admission.born)
    assert sorted(p.rollout.sample_index for p in pool.select(0, own_count=8, policy_version=5)) == [0, 1]
    assert store.counts()["foreign"] == 2


def test_a_batch_signed_in_the_future_is_no_younger_than_its_arrival(world, tokenizer):
    """A peer whose clock runs 250 s fast signs within the clock window: its batch had stayed fresh, and been trained on,
    250 s past staleness_seconds (in the pool and in the journal a resume rebuilds the pool from)."""
    tasks, intake, store = world
    peer = Identity.generate()
    before = time.time()
    admission = intake.admit(peer.peer_id, _envelope(peer, _rollouts(tasks, tokenizer), age=-250))
    assert admission.outcome == "accept" and before <= admission.born <= time.time()
    assert not intake.still_fresh(admission.born, 5, current_version=5, now=time.time() + intake.staleness_seconds + 1)
    assert {row.born for row in store.foreign_after(0)} == {admission.born}


@pytest.mark.parametrize(
    "mutate, outcome, reason",
    [
        (lambda r, t: {"reward": 1.0 - r.reward}, "reject", "reward_mismatch"),
        (lambda r, t: {"prompt_ids": np.append(r.prompt_ids, np.uint32(5))}, "reject", "prompt_mismatch"),
        (lambda r, t: {"completion_ids": np.append(r.completion_ids[:-1], np.uint32(len(t) + 10)),
                       "behaviour_logprobs": r.behaviour_logprobs}, "reject", "out_of_range"),
    ],
)
def test_lies_about_a_rollout_are_rejected(world, tokenizer, mutate, outcome, reason):
    tasks, intake, store = world
    peer = Identity.generate()
    honest, = _rollouts(tasks, tokenizer, count=1)
    forged = dataclasses.replace(honest, **mutate(honest, tokenizer))
    admission = intake.admit(peer.peer_id, _envelope(peer, [honest, forged]))
    assert (admission.outcome, admission.reason) == (outcome, reason)
    assert store.counts()["foreign"] == 0, "nothing of a rejected batch is kept"


def test_a_false_claim_of_success_is_rejected(world, tokenizer):
    tasks, intake, _ = world
    peer = Identity.generate()
    wrong = _rollouts(tasks, tokenizer, answer_right=False, count=1)[0]
    assert wrong.reward == 0.0
    lie = dataclasses.replace(wrong, reward=1.0)
    admission = intake.admit(peer.peer_id, _envelope(peer, [lie]))
    assert (admission.outcome, admission.reason) == ("reject", "reward_mismatch")


def test_a_claim_within_rounding_is_admitted_with_the_reward_we_computed(world, tokenizer):
    """A group verified flat (no gradient) and claimed `[0, 1e-7]` must not train as informative."""
    tasks, intake, store = world
    peer = Identity.generate()
    flat = _rollouts(tasks, tokenizer, answer_right=False)
    assert {r.reward for r in flat} == {0.0}
    nudged = [flat[0], dataclasses.replace(flat[1], reward=1e-7)]
    admission = intake.admit(peer.peer_id, _envelope(peer, nudged))
    assert (admission.outcome, admission.reason) == ("accept", "ok")
    assert [r.reward for r in admission.rollouts] == [0.0, 0.0]
    pool = ForeignPool(foreign_fraction=0.5, still_fresh=intake.still_fresh)
    assert pool.admit(peer.peer_id, 3, admission.rollouts, 5, born=admission.born) == 0
    assert len(pool) == 0, "a flat group is not queued"
    assert [row.reward for row in store.foreign_after(0)] == [0.0, 0.0], "the journal keeps our reward, not the claim"


def test_envelope_level_checks(world, tokenizer):
    tasks, intake, _ = world
    peer, mallory = Identity.generate(), Identity.generate()
    rollouts = _rollouts(tasks, tokenizer)
    good = _envelope(peer, rollouts)
    flipped = bytearray(good)
    flipped[-10] ^= 0x01
    cases = {
        "bad_signature": (peer.peer_id, bytes(flipped)),
        "author_mismatch": (peer.peer_id, _envelope(mallory, rollouts)),
        "malformed": (peer.peer_id, b"\xc1garbage"),
    }
    for expected, (announced_by, data) in cases.items():
        admission = intake.admit(announced_by, data)
        assert admission.outcome == "reject", expected
        assert admission.reason == expected, (expected, admission.reason, admission.detail)
    assert intake.counters.outcomes["reject"] == 3


def test_fingerprint_and_staleness_in_seconds_whatever_the_round(world, tokenizer):
    tasks, intake, _ = world
    peer = Identity.generate()
    rollouts = _rollouts(tasks, tokenizer)
    other_model = intake.admit(peer.peer_id, _envelope(peer, rollouts, fingerprint="ffffffffffffffff"))
    assert (other_model.outcome, other_model.reason) == ("ignore", "fingerprint_mismatch")
    stale = intake.admit(peer.peer_id, _envelope(peer, rollouts, seq=2, age=250))  # signed 250 s ago, window 240 s
    assert (stale.outcome, stale.reason) == ("ignore", "stale")
    # Nodes share no round numbers: a peer far ahead of us (a faster machine) is as welcome as one behind.
    ahead = intake.admit(peer.peer_id, _envelope(peer, rollouts, seq=3, round=900, age=30))
    assert ahead.outcome == "accept" and time.time() - 31 < ahead.born < time.time() - 29


def test_blame_goes_to_the_signer_or_to_the_holder_that_served_it(world, tokenizer):
    tasks, intake, _ = world
    peer, mallory = Identity.generate(), Identity.generate()
    rollouts = _rollouts(tasks, tokenizer)
    lie = [dataclasses.replace(rollouts[0], reward=1.0 - rollouts[0].reward)]
    signed_lie = intake.admit(peer.peer_id, _envelope(peer, lie, seq=2))
    assert signed_lie.outcome == "reject" and signed_lie.blame("hs-relay") == peer.peer_id  # the author signed it
    flipped = bytearray(_envelope(peer, rollouts, seq=3))
    flipped[-10] ^= 0x01
    forged = intake.admit(peer.peer_id, bytes(flipped))
    assert forged.signed_by == "" and forged.blame("hs-relay") == "hs-relay"  # unsigned junk: whoever served it
    claimed = intake.admit(peer.peer_id, _envelope(mallory, rollouts, seq=4))
    assert claimed.reason == "author_mismatch" and claimed.blame("hs-relay") == "hs-relay"


def test_private_swarm_allowlist(world, tokenizer):
    tasks, _, store = world
    member, outsider = Identity.generate(), Identity.generate()
    intake = Intake(fingerprint=FINGERPRINT, vocab_size=len(tokenizer), tasks=tasks, tokenizer=tokenizer, store=store,
                    staleness_seconds=240, allowlist=frozenset({member.public_key}))
    rollouts = _rollouts(tasks, tokenizer)
    assert intake.admit(outsider.peer_id, _envelope(outsider, rollouts)).reason == "not_on_allowlist"
    assert intake.admit(member.peer_id, _envelope(member, rollouts)).outcome == "accept"


@pytest.mark.parametrize(
    ("prompt_id", "reason"),
    [("arith:d1:not-a-seed", "malformed_spec"), ("nosuchfamily:d1:1", "unknown_family"), ("jsonl:0123abcd:4", "jsonl_other_source"),
     ("rg:leg_counting:0.1.25:0123abcd:0:1", "rg_unknown_dataset")],
)
def test_specs_we_cannot_regenerate_are_ignored_and_counted(world, tokenizer, prompt_id, reason):
    tasks, intake, store = world
    peer = Identity.generate()
    honest, = _rollouts(tasks, tokenizer, count=1)
    foreign = dataclasses.replace(honest, prompt_id=prompt_id, sample_index=1)
    alone = intake.admit(peer.peer_id, _envelope(peer, [foreign]))
    assert (alone.outcome, alone.reason, alone.detail) == ("ignore", "unknown_task", f"{reason} x1")
    assert store.counts()["foreign"] == 0, "an unregenerable rollout is never trusted"
    mixed = intake.admit(peer.peer_id, _envelope(peer, [foreign, honest], seq=2))
    assert (mixed.outcome, [r.prompt_id for r in mixed.rollouts]) == ("accept", [honest.prompt_id])
    assert store.counts()["foreign"] == 1
    assert intake.counters.reasons[f"spec:{reason}"] == 2


def _rg_rollout(tasks, tokenizer, task, text, reward):
    completion = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return Rollout(
        prompt_id=task.prompt_id, sample_index=0, seed=11,
        prompt_ids=np.asarray(tasks.chat_prompt_ids(tokenizer, task), dtype=np.uint32),
        completion_ids=np.asarray(completion, dtype=np.uint32),
        behaviour_logprobs=np.full(len(completion), -0.5, dtype=np.float32), reward=reward, finish_reason="stop",
    )


def test_reasoning_gym_rollouts_are_rescored_by_the_receiver(tokenizer):
    pytest.importorskip("reasoning_gym", reason="the rg extra is installed by `make install`")
    from hivespec.node.tasks import MixEntry

    mix = [MixEntry("rg", name="leg_counting", config={"min_animals": 1, "max_animals": 2, "max_instances": 2})]
    sender, receiver = TaskSource(mix), TaskSource(mix)
    store = RolloutStore(":memory:")
    intake = Intake(fingerprint=FINGERPRINT, vocab_size=len(tokenizer), tasks=receiver, tokenizer=tokenizer, store=store,
                    staleness_seconds=240)
    peer = Identity.generate()
    task = next(t for t in sender.prompts(seed=4, round=0, count=20) if int(t.answer) > 2)
    honest = _rg_rollout(sender, tokenizer, task, f"<answer>{task.answer}</answer>", 1.0)
    assert intake.admit(peer.peer_id, _envelope(peer, [honest])).outcome == "accept"
    # A forged answer: the peer claims success for a wrong answer (it cannot send the reference: we rebuild it).
    forged = _rg_rollout(sender, tokenizer, task, f"<answer>{int(task.answer) - 1}</answer>", 1.0)
    verdict = intake.admit(peer.peer_id, _envelope(peer, [forged], seq=2))
    assert (verdict.outcome, verdict.reason) == ("reject", "reward_mismatch")
    # Answer stuffing claiming reasoning-gym's partial credit: rejected, our verifier pays 0.
    stuffed = " ".join(str(n) for n in range(int(task.answer) + 2))
    partial = _rg_rollout(sender, tokenizer, task, f"<answer>{stuffed}</answer>", len(task.answer) / len(stuffed))
    verdict = intake.admit(peer.peer_id, _envelope(peer, [partial], seq=3))
    assert (verdict.outcome, verdict.reason) == ("reject", "reward_mismatch")
    store.close()
