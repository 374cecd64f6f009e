"""Sparse weight deltas on the wire: round trip, index codings, and every rejection before any scatter."""

import dataclasses
import zlib

import msgpack
import numpy as np
import pytest

from hivespec.protocol.codec import pack
from hivespec.protocol.delta import TensorDelta, WeightDelta, decode_delta, dense_nbytes, encode_delta
from hivespec.protocol.limits import DEFAULT_LIMITS
from hivespec.protocol.verdict import Reason

EXPECTED = {
    "embed.weight": ((16, 8), "bfloat16"),
    "norm.weight": ((8,), "float32"),
    "head.weight": ((4, 4), "float16"),
    "huge": ((2**33,), "bfloat16"),  # never allocated: only its element count is used
}


def make_delta() -> WeightDelta:
    return WeightDelta(
        base_version=3,
        version=4,
        tensors=(
            TensorDelta("embed.weight", (16, 8), "bfloat16", np.array([0, 5, 6, 127]), np.array([1, 0x3F80, 0xBF80, 7], np.uint16)),
            TensorDelta("norm.weight", (8,), "float32", np.array([7]), np.array([0x3F800000], np.uint32)),
            TensorDelta("head.weight", (4, 4), "float16", np.array([], np.int64), np.array([], np.uint16)),
        ),
    )


def inner_of(data: bytes) -> dict:
    outer = msgpack.unpackb(data, raw=False)
    return msgpack.unpackb(zlib.decompress(outer["payload"]), raw=False)


def wrap(inner: dict, *, compression="zlib", fmt=1) -> bytes:
    payload = pack(inner)
    if compression == "zlib":
        payload = zlib.compress(payload)
    return pack({"format": fmt, "compression": compression, "payload": payload})


def with_tensor_field(key, value, index=0) -> bytes:
    inner = inner_of(encode_delta(make_delta()))
    inner["tensors"][index][key] = value
    return wrap(inner)


def check(data: bytes, reason: Reason, **kwargs):
    verdict, delta = decode_delta(data, expected=kwargs.pop("expected", EXPECTED), **kwargs)
    assert verdict.reason is reason, verdict
    assert delta is None and verdict.detail
    return verdict


@pytest.mark.parametrize("compress", [True, False])
def test_round_trip(compress):
    delta = make_delta()
    verdict, out = decode_delta(encode_delta(delta, compress=compress), expected=EXPECTED)
    assert verdict.ok and out == delta
    assert out.tensors[0].indices.dtype == np.int64 and out.tensors[0].values.dtype == np.uint16
    assert out.tensors[1].values.dtype == np.uint32
    assert all(t.indices.flags.writeable and t.values.flags.writeable for t in out.tensors)  # torch.from_numpy-safe
    assert out.num_changed == 5


def test_gap_coding_is_used_and_i64_when_gaps_overflow():
    assert inner_of(encode_delta(make_delta()))["tensors"][0]["index_coding"] == "gap_u32"
    assert inner_of(encode_delta(make_delta()))["tensors"][0]["indices"] == np.array([0, 5, 1, 121], "<u4").tobytes()
    far = TensorDelta("huge", (2**33,), "bfloat16", np.array([1, 2**32 + 5, 2**33 - 1]), np.array([1, 2, 3], np.uint16))
    data = encode_delta(WeightDelta(0, 1, (far,)))
    assert inner_of(data)["tensors"][0]["index_coding"] == "i64"
    verdict, out = decode_delta(data, expected=EXPECTED)
    assert verdict.ok and out.tensors[0] == far


def test_signed_value_arrays_keep_their_bits():
    t = TensorDelta("embed.weight", (16, 8), "bfloat16", np.array([1]), np.array([-16512], np.int16))  # 0xBF80
    out = decode_delta(encode_delta(WeightDelta(0, 1, (t,))), expected=EXPECTED)[1]
    assert out.tensors[0].values.tolist() == [0xBF80]


def test_dense_nbytes():
    assert dense_nbytes(make_delta()) == 16 * 8 * 2 + 8 * 4 + 16 * 2
    assert dense_nbytes({"a": ((3, 3), "float32")}) == 36


def test_encode_refuses_invalid_local_data():
    bad = [
        TensorDelta("a", (4,), "bfloat16", np.array([2, 1]), np.array([1, 2], np.uint16)),
        TensorDelta("a", (4,), "bfloat16", np.array([1, 1]), np.array([1, 2], np.uint16)),
        TensorDelta("a", (4,), "bfloat16", np.array([1]), np.array([1], np.uint32)),
        TensorDelta("a", (4,), "bfloat16", np.array([1, 2]), np.array([1], np.uint16)),
        TensorDelta("a", (4,), "int8", np.array([1]), np.array([1], np.uint8)),
    ]
    for t in bad:
        with pytest.raises(ValueError):
            encode_delta(WeightDelta(0, 1, (t,)))


def test_unknown_tensor_wrong_shape_wrong_dtype():
    check(with_tensor_field("name", "lm_head.weight"), Reason.UNKNOWN_TENSOR)
    check(with_tensor_field("shape", [8, 16]), Reason.BAD_SHAPE)
    check(with_tensor_field("shape", [1] * 9), Reason.BAD_SHAPE)
    check(with_tensor_field("dtype", "float16"), Reason.BAD_DTYPE)
    check(with_tensor_field("dtype", "int8"), Reason.BAD_DTYPE)


def test_out_of_range_indices():
    check(with_tensor_field("indices", np.array([0, 5, 1, 122], "<u4").tobytes()), Reason.OUT_OF_RANGE)  # 128
    check(with_tensor_field("indices", np.array([128], "<u4").tobytes(), index=1), Reason.OUT_OF_RANGE)
    inner = inner_of(encode_delta(make_delta()))
    inner["tensors"][0].update(index_coding="i64", indices=np.array([-1, 5, 6, 7], "<i8").tobytes())
    check(wrap(inner), Reason.OUT_OF_RANGE)


def test_unsorted_and_duplicate_indices():
    check(with_tensor_field("indices", np.array([0, 5, 0, 3], "<u4").tobytes()), Reason.UNSORTED)  # zero gap
    for indices in ([0, 6, 5, 7], [0, 5, 5, 7]):
        inner = inner_of(encode_delta(make_delta()))
        inner["tensors"][0].update(index_coding="i64", indices=np.array(indices, "<i8").tobytes())
        check(wrap(inner), Reason.UNSORTED)


def test_first_gap_may_be_zero():
    t = TensorDelta("norm.weight", (8,), "float32", np.array([0, 1]), np.array([1, 2], np.uint32))
    assert decode_delta(encode_delta(WeightDelta(0, 1, (t,))), expected=EXPECTED)[0].ok


def test_count_and_length_mismatches():
    check(with_tensor_field("values", np.array([1, 2, 3], "<u2").tobytes()), Reason.BAD_LENGTH)
    check(with_tensor_field("values", b"\x00" * 7), Reason.BAD_LENGTH)
    check(with_tensor_field("indices", b"\x00" * 6), Reason.BAD_LENGTH)


@pytest.mark.parametrize(
    ("index", "bits"),
    [(0, np.array([0x7F80, 0, 0, 0], "<u2")), (0, np.array([0, 0xFFC1, 0, 0], "<u2")), (1, np.array([0x7FC00000], "<u4"))],
)
def test_non_finite_values(index, bits):
    check(with_tensor_field("values", bits.tobytes(), index=index), Reason.NOT_FINITE)


def test_float16_inf_is_rejected():
    inner = inner_of(encode_delta(make_delta()))
    inner["tensors"][2].update(indices=np.array([3], "<u4").tobytes(), values=np.array([0x7C00], "<u2").tobytes())
    check(wrap(inner), Reason.NOT_FINITE)


@pytest.mark.parametrize(
    ("key", "value"),
    [("name", 5), ("shape", "16x8"), ("shape", [16.0, 8]), ("dtype", 2), ("index_coding", 1), ("indices", [0]), ("values", "ab")],
)
def test_tensor_field_types(key, value):
    check(with_tensor_field(key, value), Reason.BAD_TYPE)


def test_bad_values_and_keys():
    check(with_tensor_field("index_coding", "varint"), Reason.BAD_VALUE)
    inner = inner_of(encode_delta(make_delta()))
    inner["tensors"][1] = dict(inner["tensors"][0])
    assert "more than once" in check(wrap(inner), Reason.BAD_VALUE).detail
    inner = inner_of(encode_delta(make_delta()))
    inner["version"] = inner["base_version"]
    check(wrap(inner), Reason.BAD_VALUE)
    inner["base_version"] = -1
    check(wrap(inner), Reason.BAD_VALUE)
    inner = inner_of(encode_delta(make_delta()))
    del inner["tensors"][0]["values"]
    check(wrap(inner), Reason.BAD_KEYS)
    check(wrap({"base_version": 0, "version": 1}), Reason.BAD_KEYS)
    check(wrap({"base_version": 0, "version": 1, "tensors": {}}), Reason.BAD_TYPE)
    check(wrap([1]), Reason.BAD_TYPE)


def test_outer_envelope_checks():
    inner = inner_of(encode_delta(make_delta()))
    check(wrap(inner, fmt=2), Reason.BAD_VERSION)
    check(wrap(inner, fmt="1"), Reason.BAD_TYPE)
    check(wrap(inner, compression="lz4"), Reason.BAD_VALUE)
    check(pack({"format": 1, "compression": "zlib", "payload": b"not zlib"}), Reason.MALFORMED)
    full = zlib.compress(pack(inner))
    check(pack({"format": 1, "compression": "zlib", "payload": full[:-4]}), Reason.MALFORMED)  # truncated
    check(pack({"format": 1, "compression": "zlib", "payload": full + b"junk"}), Reason.MALFORMED)  # trailing
    check(pack({"format": 1, "compression": "zlib", "payload": "text"}), Reason.BAD_TYPE)
    check(pack({"format": 1, "payload": b""}), Reason.BAD_KEYS)
    check(encode_delta(make_delta())[:-1], Reason.MALFORMED)
    check(pack({"format": 1, "compression": "none", "payload": b"\xc1"}), Reason.MALFORMED)


def test_size_limits_and_zip_bomb():
    data = encode_delta(make_delta())
    check(data, Reason.TOO_LARGE, limits=dataclasses.replace(DEFAULT_LIMITS, max_delta_bytes=len(data) - 1))
    bomb = pack({"format": 1, "compression": "zlib", "payload": zlib.compress(b"\x00" * (8 << 20))})
    assert len(bomb) < 16 << 10
    check(bomb, Reason.TOO_LARGE, limits=dataclasses.replace(DEFAULT_LIMITS, max_delta_raw_bytes=1 << 20))
    raw = encode_delta(make_delta(), compress=False)
    check(raw, Reason.TOO_LARGE, limits=dataclasses.replace(DEFAULT_LIMITS, max_delta_raw_bytes=100))
    check(data, Reason.TOO_LARGE, limits=dataclasses.replace(DEFAULT_LIMITS, max_delta_tensors=2))
