"""Index records on the wire: an announced batch's informative count, and how any holder computes it from the body."""

import hashlib

import msgpack
import numpy as np
import pytest

from hivespec.protocol.advantages import group_advantages, informative_samples
from hivespec.protocol.announce import MAX_INFORMATIVE, Announce, AnnouncedBody, decode_announce, encode_announce
from hivespec.protocol.identity import Identity
from hivespec.protocol.rollout import Rollout
from hivespec.protocol.verdict import Reason

AUTHOR = Identity.generate().peer_id
P2P = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def _record(informative: int) -> Announce:
    item = AnnouncedBody(AUTHOR, hashlib.sha256(b"batch").digest(), 1_000, 1.7e9, 3, informative)
    return Announce("hivespec/s/rollouts/1/0/0", 1.7e9 + 600, P2P, ("/ip4/127.0.0.1/tcp/1",), (item,))


@pytest.mark.parametrize("informative", [-1, 0, 7, MAX_INFORMATIVE])
def test_an_items_informative_count_round_trips(informative: int) -> None:
    verdict, decoded = decode_announce(encode_announce(_record(informative)), max_body_bytes=1_000)
    assert verdict.ok and decoded == _record(informative)


@pytest.mark.parametrize("value", [-2, MAX_INFORMATIVE + 1, True, 2.0, "3", None])
def test_an_informative_count_outside_its_range_or_type_is_refused(value: object) -> None:
    obj = msgpack.unpackb(encode_announce(_record(0)))
    obj["items"][0]["informative"] = value
    verdict, decoded = decode_announce(msgpack.packb(obj, use_bin_type=True), max_body_bytes=1_000)
    assert decoded is None and verdict.reason == Reason.BAD_VALUE and "informative" in verdict.detail


def test_an_item_without_an_informative_count_is_refused() -> None:
    obj = msgpack.unpackb(encode_announce(_record(0)))
    del obj["items"][0]["informative"]
    verdict, decoded = decode_announce(msgpack.packb(obj, use_bin_type=True), max_body_bytes=1_000)
    assert decoded is None and verdict.reason == Reason.BAD_KEYS


def _rollouts(groups: dict[str, list[float]]) -> list[Rollout]:
    ids = np.array([1, 2], dtype=np.uint32)
    return [Rollout(prompt, i, 0, ids, ids, np.zeros(2, dtype=np.float32), reward, "stop")
            for prompt, rewards in groups.items() for i, reward in enumerate(rewards)]


@pytest.mark.parametrize(("groups", "expected"), [
    ({"a": [0.0, 1.0, 1.0, 0.0]}, 4),  # a reward spread: every sample has a gradient
    ({"a": [1.0, 1.0], "b": [0.0, 0.0, 0.0, 0.0]}, 0),  # all right, all wrong: a flat batch
    ({"a": [0.0, 1.0], "b": [1.0, 1.0]}, 2),  # one group of each kind
    ({"a": [1.0], "b": [0.0]}, 0),  # groups of one have no baseline
    ({"a": [0.0, 0.5, 1.0]}, 2),  # the sample at its group's mean has a zero advantage
    ({}, 0),
])
def test_informative_samples_counts_the_nonzero_grpo_advantages_of_a_batch(groups: dict[str, list[float]], expected: int) -> None:
    rollouts = _rollouts(groups)
    assert informative_samples(rollouts) == expected
    advantages = group_advantages([r.reward for r in rollouts], [r.prompt_id for r in rollouts])
    assert sum(a != 0.0 for a in advantages) == expected  # the trainer's and the pool's rule, exactly
