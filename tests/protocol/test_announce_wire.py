"""Index records on the wire: the swarm protocol they speak, an announced batch's informative count, and how any holder
computes that count from the body."""

import hashlib

import msgpack
import numpy as np
import pytest

from hivespec.protocol.advantages import group_advantages, informative_samples
from hivespec.protocol.announce import (
    MAX_INFORMATIVE,
    SWARM_PROTOCOL,
    Announce,
    AnnouncedBody,
    decode_announce,
    encode_announce,
    protocol_and_key,
)
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


def _repacked(change) -> bytes:
    obj = msgpack.unpackb(encode_announce(_record(3)))
    change(obj)
    return msgpack.packb(obj, use_bin_type=True)


def test_a_record_says_its_swarm_protocol() -> None:
    data = encode_announce(_record(3))
    assert msgpack.unpackb(data)["protocol"] == SWARM_PROTOCOL
    assert protocol_and_key(data) == (SWARM_PROTOCOL, _record(3).key)


def test_a_record_of_protocol_1_which_did_not_say_its_protocol_is_refused_as_an_older_versions() -> None:
    def protocol_1(obj: dict) -> None:  # 2026-11-28's records: the same keys, less "protocol"
        del obj["protocol"]
    data = _repacked(protocol_1)
    verdict, decoded = decode_announce(data, max_body_bytes=1_000)
    assert decoded is None and verdict.reason == Reason.BAD_VERSION and "an older hivespec" in verdict.detail
    assert protocol_and_key(data) == (1, _record(3).key)


def test_a_record_of_a_newer_protocol_is_refused_as_a_newer_versions_whatever_else_it_carries() -> None:
    def newer(obj: dict) -> None:
        obj["protocol"] = SWARM_PROTOCOL + 1
        obj["items"][0]["something_new"] = [1, 2]
        del obj["maddrs"]
    data = _repacked(newer)
    verdict, decoded = decode_announce(data, max_body_bytes=1_000)
    assert decoded is None and verdict.reason == Reason.BAD_VERSION and "a newer hivespec" in verdict.detail
    assert protocol_and_key(data) == (SWARM_PROTOCOL + 1, _record(3).key)


@pytest.mark.parametrize(("change", "reason"), [
    (lambda obj: obj.pop("protocol") and obj.pop("p2p"), Reason.BAD_KEYS),  # says no protocol and is no protocol 1 record
    (lambda obj: obj.update(protocol=0), Reason.BAD_VALUE),
    (lambda obj: obj.update(protocol=True), Reason.BAD_VALUE),
    (lambda obj: obj.update(protocol="2"), Reason.BAD_VALUE),
])
def test_a_record_whose_protocol_is_unreadable_is_malformed_not_another_versions(change, reason: Reason) -> None:
    data = _repacked(change)
    verdict, decoded = decode_announce(data, max_body_bytes=1_000)
    assert decoded is None and verdict.reason == reason
    assert protocol_and_key(data) is None


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


@pytest.mark.parametrize("rewards", [[1e200, -1e200], [1.7e308, 1.7e308, -1e308], [1e300, 5e299]])
def test_a_peers_rewards_whose_spread_overflows_count_no_informative_sample_and_raise_nothing(rewards: list[float]) -> None:
    # A fetcher counts a stranger's batch before any verifier has seen its rewards (`rollouts.claim_holds`): finite
    # rewards the wire accepts must not raise (an OverflowError there ended the node's whole fetch of the step).
    rollouts = _rollouts({"a": rewards})
    assert informative_samples(rollouts) == 0
    assert group_advantages(rewards, ["a"] * len(rewards)) == [0.0] * len(rewards)
