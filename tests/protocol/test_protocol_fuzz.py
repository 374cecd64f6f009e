"""Decoders never raise: arbitrary bytes, arbitrary msgpack trees, and mutations of valid messages."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hivespec.protocol.codec import pack, safe_unpack
from hivespec.protocol.delta import TensorBits, TensorDelta, WeightDelta, decode_delta
from hivespec.protocol.delta_encode import encode_delta
from hivespec.protocol.envelope import Envelope, Kind, open_envelope, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.rollout import Rollout, RolloutBatch, decode_batch, decode_rollout, encode_batch
from hivespec.protocol.verdict import Verdict
from hivespec.protocol.weights_hash import state_hash

NOW = 1_700_000_000.0
IDENT = Identity.from_private_bytes(b"\x07" * 32)

BATCH = encode_batch(
    RolloutBatch(
        1, 1, "abcdef01",
        (Rollout("p", 0, 1, np.arange(1, 6, dtype=np.uint32), np.arange(3, dtype=np.uint32),
                 np.array([-1.0, -0.5, -2.0], np.float32), 0.5, "stop"),),
    )
)
ENVELOPE = seal(IDENT, Kind.ROLLOUTS, 9, BATCH, timestamp=NOW)
BASE = {
    "w": TensorBits("bfloat16", np.arange(0x3F00, 0x3F40, dtype=np.uint16).reshape(8, 8)),
    "b": TensorBits("float32", np.full(8, 0x3F800000, np.uint32)),
}
BASE_HASH = state_hash(BASE)
DELTA = encode_delta(
    WeightDelta(0, 1, BASE_HASH, b"\x01" * 32,
                (TensorDelta("w", (8, 8), "bfloat16", np.array([1, 9, 63]), np.array([1, 2, 3], np.uint16)),
                 TensorDelta("b", (8,), "float32", np.array([0]), np.array([5], np.uint32)))),
    BASE,
)[0]
DELTA_DENSE = encode_delta(
    WeightDelta(0, 1, BASE_HASH, b"\x01" * 32,
                (TensorDelta("w", (8, 8), "bfloat16", np.arange(64), np.arange(0x3F01, 0x3F41, dtype=np.uint16)),)),
    BASE,
)[0]

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

msgpack_trees = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30,
)


def decode_all(data: bytes) -> None:
    """Run every decoder; each must return (Verdict, value-or-None) without raising."""
    verdict, _ = safe_unpack(data, max_size=1 << 20, max_depth=8)  # a valid msgpack nil decodes to None
    assert isinstance(verdict, Verdict)
    results = [
        open_envelope(data, now=NOW),
        decode_batch(data, vocab_size=100),
        decode_rollout(data),
        decode_delta([data], base=BASE, base_hash=BASE_HASH),
    ]
    for verdict, value in results:
        assert isinstance(verdict, Verdict)
        if verdict.ok:
            assert value is not None
        else:
            assert value is None and verdict.detail


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes(data):
    decode_all(data)


@FUZZ
@given(msgpack_trees)
def test_arbitrary_msgpack_trees(tree):
    decode_all(pack(tree))


def mutate(data: bytes, draw) -> bytes:
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and buf:
            del buf[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del buf[pos:]
    return bytes(buf)


@FUZZ
@given(st.data())
def test_mutated_valid_messages(data):
    original = data.draw(st.sampled_from([ENVELOPE, BATCH, DELTA, DELTA_DENSE]))
    mutated = mutate(original, data.draw)
    decode_all(mutated)
    if original is ENVELOPE and mutated != ENVELOPE:
        verdict, env = open_envelope(mutated, now=NOW)
        # A mutation that still verifies must decode to the very same signed content.
        if verdict.ok:
            assert isinstance(env, Envelope) and (env.body, env.seq, env.timestamp) == (BATCH, 9, NOW)


def test_valid_fixtures_are_accepted():
    assert open_envelope(ENVELOPE, now=NOW)[0].ok
    assert decode_batch(BATCH, vocab_size=100)[0].ok
    assert decode_delta([DELTA], base=BASE, base_hash=BASE_HASH)[0].ok
    assert decode_delta([DELTA_DENSE], base=BASE, base_hash=BASE_HASH)[0].ok
