"""safe_unpack: every rejection path, and that accepted objects hold plain types only."""

import math

import msgpack
import pytest

from hivespec.protocol.codec import check_tree, pack, safe_unpack
from hivespec.protocol.verdict import Reason, Verdict

LIMIT = 1 << 20


def unpack(data, *, max_size=LIMIT, max_depth=8):
    return safe_unpack(data, max_size=max_size, max_depth=max_depth)


def nested_list(depth: int) -> list:
    obj: list = []
    for _ in range(depth - 1):
        obj = [obj]
    return obj


def test_round_trip_plain_types():
    obj = {"a": [1, -2, 3.5, None, True, "s", b"\x00\xff"], "b": {"c": []}, b"k": 2**64 - 1}
    verdict, out = unpack(pack(obj))
    assert verdict.ok and out == obj


def test_accepts_bytearray_and_memoryview():
    data = pack([1, 2])
    assert unpack(bytearray(data))[1] == [1, 2]
    assert unpack(memoryview(data))[1] == [1, 2]


@pytest.mark.parametrize(
    ("data", "kwargs", "reason"),
    [
        ("not bytes", {}, Reason.BAD_TYPE),
        (None, {}, Reason.BAD_TYPE),
        (b"", {}, Reason.MALFORMED),
        (pack(b"x" * 100), {"max_size": 50}, Reason.TOO_LARGE),
        (pack({"a": [1, 2, 3]})[:-1], {}, Reason.MALFORMED),  # truncated
        (pack({"a": 1}) + b"\x00", {}, Reason.MALFORMED),  # trailing bytes
        (b"\xc1", {}, Reason.MALFORMED),  # the one byte msgpack never uses
        (b"\xdd\xff\xff\xff\xff", {}, Reason.MALFORMED),  # array header claiming 4G items
        (b"\xc6\xff\xff\xff\xff", {}, Reason.MALFORMED),  # bin header claiming 4 GiB
        (b"\xa2\xff\xfe", {}, Reason.MALFORMED),  # invalid UTF-8 in a str
        (msgpack.packb({1: "int key"}), {}, Reason.MALFORMED),  # strict_map_key
        (msgpack.packb(msgpack.ExtType(5, b"abc")), {}, Reason.BAD_TYPE),
        (msgpack.packb(msgpack.Timestamp(1, 0)), {}, Reason.BAD_TYPE),  # ext -1 bypasses ext_hook
        (pack(nested_list(9)), {}, Reason.TOO_DEEP),
        (b"\x91" * 5000 + b"\x90", {}, Reason.TOO_DEEP),  # beyond msgpack's own stack
        (pack(float("nan")), {}, Reason.NOT_FINITE),
        (pack({"a": [1, {"b": float("inf")}]}), {}, Reason.NOT_FINITE),
        (pack([float("-inf")]), {}, Reason.NOT_FINITE),
        (msgpack.packb(float("nan"), use_single_float=True), {}, Reason.NOT_FINITE),
    ],
)
def test_rejections(data, kwargs, reason):
    verdict, obj = unpack(data, **kwargs)
    assert verdict.reason is reason, verdict
    assert obj is None
    assert verdict.detail


def test_depth_limit_is_inclusive():
    assert unpack(pack(nested_list(8)))[0].ok
    assert unpack(pack({"a": {"b": 1}}), max_depth=2)[0].ok
    assert unpack(pack({"a": {"b": 1}}), max_depth=1)[0].reason is Reason.TOO_DEEP
    assert unpack(pack(5), max_depth=0)[0].ok


def test_check_tree_rejects_non_msgpack_types():
    assert check_tree({"a": object()}, max_depth=4).reason is Reason.BAD_TYPE
    assert check_tree({1: 2}, max_depth=4).reason is Reason.BAD_TYPE
    assert check_tree([1.0, math.nan], max_depth=4).reason is Reason.NOT_FINITE


def test_verdict_api():
    assert Verdict.accept().ok and Verdict.accept().reason is Reason.OK
    rejected = Verdict.reject(Reason.BAD_VALUE, "seq = -1")
    assert not rejected.ok and str(rejected) == "bad_value: seq = -1"
    with pytest.raises(ValueError, match="accept"):
        Verdict.reject(Reason.OK)
