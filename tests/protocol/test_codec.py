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


def test_max_items_counts_every_array_map_and_entry_while_decoding():
    obj = {"a": [1, 2], "b": {}}  # the outer map (1 + 2), the list (1 + 2), the empty map (1): 7
    assert safe_unpack(pack(obj), max_size=LIMIT, max_depth=8, max_items=7) == (Verdict.accept(), obj)
    for data in (pack(obj), pack([{}] * 3), pack([[]] * 3)):
        verdict, out = safe_unpack(data, max_size=LIMIT, max_depth=8, max_items=6)
        assert verdict.reason is Reason.TOO_LARGE and out is None, verdict
    # A header over the budget is refused before msgpack allocates for it; so is the first container past it.
    assert "max_array_len" in safe_unpack(b"\xdd\x00\x10\x00\x00" + b"\x80" * (1 << 20), max_size=2 * LIMIT,
                                          max_depth=8, max_items=100)[0].detail
    deep = pack([[{}] * 50] * 50)
    assert "more than 100" in safe_unpack(deep, max_size=LIMIT, max_depth=8, max_items=100)[0].detail


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
