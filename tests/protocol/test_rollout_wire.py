"""Rollout batches on the wire: round trip, content hash, and every schema rejection."""

import dataclasses
import struct
import tracemalloc

import msgpack
import numpy as np
import pytest

from hivespec.protocol.codec import pack
from hivespec.protocol.limits import DEFAULT_LIMITS
from hivespec.protocol.rollout import (
    Rollout,
    RolloutBatch,
    decode_batch,
    decode_rollout,
    encode_batch,
    encode_rollout,
    rollout_content_hash,
)
from hivespec.protocol.verdict import Reason


def make_rollout(**changes) -> Rollout:
    fields = {
        "prompt_id": "arith/00017",
        "sample_index": 3,
        "seed": 2**63 + 5,
        "prompt_ids": np.array([1, 2, 3, 49151], dtype=np.uint32),
        "completion_ids": np.array([7, 8, 9], dtype=np.uint32),
        "behaviour_logprobs": np.array([-0.5, 0.0, -12.25], dtype=np.float32),
        "reward": 1.0,
        "finish_reason": "stop",
    }
    fields.update(changes)
    return Rollout(**fields)


def make_batch(n: int = 2) -> RolloutBatch:
    return RolloutBatch(round=5, policy_version=2, fingerprint="0123abcd" * 2, rollouts=tuple(make_rollout(sample_index=i) for i in range(n)))


def wire_batch() -> dict:
    return msgpack.unpackb(encode_batch(make_batch(1)), raw=False)


def with_rollout_field(key, value) -> bytes:
    m = wire_batch()
    m["rollouts"][0][key] = value
    return pack(m)


def check(body: bytes, reason: Reason, **kwargs):
    verdict, batch = decode_batch(body, **kwargs)
    assert verdict.reason is reason, verdict
    assert batch is None and verdict.detail
    return verdict


def test_batch_round_trip():
    batch = make_batch(3)
    verdict, out = decode_batch(encode_batch(batch), vocab_size=49152)
    assert verdict.ok and out == batch
    r = out.rollouts[0]
    assert r.prompt_ids.dtype == np.uint32 and r.behaviour_logprobs.dtype == np.float32
    assert not r.prompt_ids.flags.writeable  # views of the message: nobody mutates peer data in place


def test_wire_arrays_are_compact_little_endian():
    r = wire_batch()["rollouts"][0]
    assert r["completion_ids"] == b"\x07\x00\x00\x00\x08\x00\x00\x00\x09\x00\x00\x00"
    assert r["behaviour_logprobs"] == np.array([-0.5, 0.0, -12.25], dtype="<f4").tobytes()


def test_empty_completion_and_empty_batch_are_valid():
    r = make_rollout(completion_ids=np.array([], np.uint32), behaviour_logprobs=np.array([], np.float32), finish_reason="length")
    batch = RolloutBatch(0, 0, "ab", (r,))
    assert decode_batch(encode_batch(batch))[1] == batch
    assert decode_batch(encode_batch(RolloutBatch(0, 0, "ab", ())))[0].ok


def test_single_rollout_round_trip_for_the_journal():
    r = make_rollout()
    verdict, out = decode_rollout(encode_rollout(r))
    assert verdict.ok and out == r
    assert decode_rollout(encode_rollout(r), vocab_size=100)[0].reason is Reason.OUT_OF_RANGE
    assert decode_rollout(b"\xc1")[0].reason is Reason.MALFORMED
    assert decode_rollout(pack({"prompt_id": "x"}))[0].reason is Reason.BAD_KEYS


def test_content_hash_identifies_content_not_claims():
    r = make_rollout()
    h = rollout_content_hash(r)
    assert len(h) == 32 and h == rollout_content_hash(make_rollout())
    assert h == rollout_content_hash(make_rollout(reward=0.0, behaviour_logprobs=np.zeros(3, np.float32)))
    assert h == rollout_content_hash(make_rollout(prompt_ids=np.array([1, 2, 3, 49151], dtype=np.int64)))
    for changes in (
        {"completion_ids": np.array([7, 8, 10], np.uint32)},
        {"prompt_ids": np.array([1, 2, 3], np.uint32)},
        {"sample_index": 4},
        {"seed": 1},
        {"prompt_id": "arith/00018"},
    ):
        assert rollout_content_hash(make_rollout(**changes)) != h, changes


def test_encode_refuses_invalid_local_data():
    with pytest.raises(ValueError, match="one per token"):
        encode_rollout(make_rollout(behaviour_logprobs=np.array([-1.0], np.float32)))
    with pytest.raises(ValueError, match="2\\*\\*32"):
        encode_rollout(make_rollout(prompt_ids=np.array([-1, 2])))
    with pytest.raises(ValueError, match="1-D"):
        encode_rollout(make_rollout(prompt_ids=np.ones((2, 2), np.uint32)))


@pytest.mark.parametrize(("key", "value"), [("round", -1), ("policy_version", -3)])
def test_negative_counters(key, value):
    m = wire_batch()
    m[key] = value
    check(pack(m), Reason.BAD_VALUE)


@pytest.mark.parametrize(
    ("key", "value"),
    [("round", "5"), ("round", True), ("policy_version", 2.0), ("fingerprint", b"abcd"), ("rollouts", {"a": 1})],
)
def test_batch_field_types(key, value):
    m = wire_batch()
    m[key] = value
    check(pack(m), Reason.BAD_TYPE)


@pytest.mark.parametrize(
    ("fingerprint", "reason"),
    [("", Reason.BAD_LENGTH), ("a" * 65, Reason.BAD_LENGTH), ("ABCD", Reason.BAD_VALUE), ("xyz0", Reason.BAD_VALUE)],
)
def test_fingerprint_must_be_short_lowercase_hex(fingerprint, reason):
    m = wire_batch()
    m["fingerprint"] = fingerprint
    check(pack(m), reason)


def test_batch_keys_and_shape():
    check(pack([1]), Reason.BAD_TYPE)
    m = wire_batch()
    m["extra"] = 1
    check(pack(m), Reason.BAD_KEYS)
    check(pack({k: v for k, v in wire_batch().items() if k != "round"}), Reason.BAD_KEYS)
    check(pack({**wire_batch(), "rollouts": [5]}), Reason.BAD_TYPE)
    check(b"\x81", Reason.MALFORMED)


def test_too_many_rollouts_and_tokens():
    tight = dataclasses.replace(DEFAULT_LIMITS, max_rollouts_per_batch=2, max_prompt_tokens=3, max_completion_tokens=2)
    check(encode_batch(make_batch(3)), Reason.TOO_LARGE, limits=tight)
    one = encode_batch(make_batch(1))
    assert "prompt_ids" in check(one, Reason.TOO_LARGE, limits=dataclasses.replace(DEFAULT_LIMITS, max_prompt_tokens=3)).detail
    assert "completion_ids" in check(one, Reason.TOO_LARGE, limits=dataclasses.replace(DEFAULT_LIMITS, max_completion_tokens=2)).detail


def test_a_body_of_millions_of_tiny_containers_is_refused_before_they_are_built():
    # A stranger signs its own body, so this reaches decode_batch through a valid envelope. A batch head whose rollouts
    # are 1024 arrays of one-byte empty maps: 4 million dicts (570 MiB and seconds of CPU) were built, then walked,
    # before the schema refused the first one.
    per = DEFAULT_LIMITS.max_envelope_bytes // 1024 - 64
    rollouts = b"\xdc" + struct.pack(">H", 1024) + (b"\xdd" + struct.pack(">I", per) + b"\x80" * per) * 1024
    body = pack({**wire_batch(), "rollouts": []})[:-1] + rollouts  # the batch map with "rollouts" last
    assert len(body) <= DEFAULT_LIMITS.max_envelope_bytes
    tracemalloc.start()
    try:
        verdict, batch = decode_batch(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert verdict.reason is Reason.TOO_LARGE and batch is None, verdict
    assert peak < len(body)
    # The largest batch the limits allow still decodes, and one rollout more is refused.
    most = DEFAULT_LIMITS.max_rollouts_per_batch
    assert decode_batch(encode_batch(make_batch(most)))[0].ok
    check(encode_batch(make_batch(most + 1)), Reason.TOO_LARGE)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("prompt_id", 17), ("sample_index", "3"), ("seed", 1.5), ("prompt_ids", [1, 2]), ("completion_ids", "abc"),
        ("behaviour_logprobs", [-0.5]), ("reward", 1), ("reward", "1.0"), ("finish_reason", None),
    ],
)
def test_rollout_field_types(key, value):
    check(with_rollout_field(key, value), Reason.BAD_TYPE)


def test_rollout_keys():
    m = wire_batch()
    del m["rollouts"][0]["seed"]
    assert "seed" in check(pack(m), Reason.BAD_KEYS).detail


def test_lengths():
    check(with_rollout_field("prompt_ids", b""), Reason.BAD_LENGTH)  # empty prompt
    check(with_rollout_field("prompt_ids", b"\x01\x00\x00"), Reason.BAD_LENGTH)  # not a multiple of 4
    check(with_rollout_field("behaviour_logprobs", b"\x00" * 8), Reason.BAD_LENGTH)  # 3 tokens, 2 log-probs
    check(with_rollout_field("prompt_id", ""), Reason.BAD_LENGTH)
    check(with_rollout_field("prompt_id", "x" * 257), Reason.BAD_LENGTH)


@pytest.mark.parametrize(
    ("key", "value"),
    [("sample_index", -1), ("sample_index", 2**21), ("seed", -1), ("finish_reason", "eos"), ("prompt_id", "a\nb")],
)
def test_rollout_bad_values(key, value):
    check(with_rollout_field(key, value), Reason.BAD_VALUE)


def test_out_of_vocab_token_id():
    body = encode_batch(make_batch(1))
    assert decode_batch(body, vocab_size=49152)[0].ok
    assert "49151" in check(body, Reason.OUT_OF_RANGE, vocab_size=49151).detail
    check(body, Reason.OUT_OF_RANGE, vocab_size=9)  # completion id 9


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logprobs(bad):
    check(with_rollout_field("behaviour_logprobs", np.array([-0.5, bad, -1.0], "<f4").tobytes()), Reason.NOT_FINITE)


def test_positive_logprob():
    check(with_rollout_field("behaviour_logprobs", np.array([-0.5, 1e-7, -1.0], "<f4").tobytes()), Reason.BAD_VALUE)


def test_non_finite_reward():
    check(with_rollout_field("reward", float("nan")), Reason.NOT_FINITE)  # caught by the codec
    check(with_rollout_field("reward", float("inf")), Reason.NOT_FINITE)
