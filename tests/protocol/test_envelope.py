"""Signed envelopes: round trip, and every way a forged, stale or malformed one is refused."""

import dataclasses
import tracemalloc

import msgpack
import pytest

from hivespec.protocol.codec import pack
from hivespec.protocol.envelope import ENVELOPE_VERSION, Kind, open_envelope, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.limits import DEFAULT_LIMITS
from hivespec.protocol.verdict import Reason

NOW = 1_700_000_000.0
ALICE = Identity.from_private_bytes(bytes(range(32)))
MALLORY = Identity.from_private_bytes(bytes(range(1, 33)))


def sealed(body=b"payload", kind=Kind.ROLLOUTS, seq=7, ts=NOW, ident=ALICE) -> bytes:
    return seal(ident, kind, seq, body, timestamp=ts)


def fields(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)


def repack(data: bytes, **changes) -> bytes:
    m = fields(data)
    m.update(changes)
    return pack(m)


def check(data: bytes, reason: Reason, **kwargs):
    verdict, env = open_envelope(data, now=NOW, **kwargs)
    assert verdict.reason is reason, verdict
    assert env is None
    assert verdict.detail
    return verdict


def test_round_trip():
    data = sealed(body=b"\x00\x01body", kind=Kind.DELTA, seq=42)
    verdict, env = open_envelope(data, now=NOW + 10, expected_kind=Kind.DELTA)
    assert verdict.ok
    assert (env.version, env.kind, env.seq, env.timestamp, env.body) == (ENVELOPE_VERSION, Kind.DELTA, 42, NOW, b"\x00\x01body")
    assert env.author == ALICE.public_key and env.peer_id == ALICE.peer_id and env.author_name == ALICE.name
    assert len(env.signature) == 64
    assert b"body" not in repr(env).encode()  # bodies stay out of log lines
    assert set(fields(data)) == {"v", "kind", "author", "seq", "ts", "body", "sig"}


def test_default_timestamp_is_now():
    verdict, env = open_envelope(seal(ALICE, Kind.ANNOUNCE, 0, b""))
    assert verdict.ok and env.kind is Kind.ANNOUNCE and env.body == b""


def test_each_kind_round_trips():
    for kind in Kind:
        assert open_envelope(sealed(kind=kind), now=NOW, expected_kind=kind)[0].ok


def test_too_large():
    small = dataclasses.replace(DEFAULT_LIMITS, max_envelope_bytes=200)
    check(sealed(body=b"x" * 300), Reason.TOO_LARGE, limits=small)
    check(b"\x00" * (DEFAULT_LIMITS.max_envelope_bytes + 1), Reason.TOO_LARGE)


def test_malformed_bytes():
    data = sealed()
    check(data[:-5], Reason.MALFORMED)
    check(data + b"\x00", Reason.MALFORMED)
    check(b"", Reason.MALFORMED)


def test_not_a_map_and_wrong_keys():
    check(pack([1, 2, 3]), Reason.BAD_TYPE)
    m = fields(sealed())
    del m["sig"]
    assert "missing ['sig']" in check(pack(m), Reason.BAD_KEYS).detail
    check(repack(sealed(), extra=1), Reason.BAD_KEYS)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("v", "1"), ("v", True), ("kind", b"rollouts"), ("author", "a" * 32), ("seq", 7.0), ("seq", "7"),
        ("seq", True), ("ts", int(NOW)), ("ts", None), ("body", "payload"), ("sig", [0] * 64),
    ],
)
def test_wrong_field_types(key, value):
    check(repack(sealed(), **{key: value}), Reason.BAD_TYPE)


def test_wrong_lengths():
    check(repack(sealed(), author=ALICE.public_key[:31]), Reason.BAD_LENGTH)
    check(repack(sealed(), author=ALICE.public_key + b"\x00"), Reason.BAD_LENGTH)
    check(repack(sealed(), sig=b"\x00" * 63), Reason.BAD_LENGTH)


def test_version_and_kind():
    check(repack(sealed(), v=2), Reason.BAD_VERSION)
    check(repack(sealed(), kind="gradients"), Reason.UNKNOWN_KIND)
    check(sealed(kind=Kind.ANNOUNCE), Reason.WRONG_KIND, expected_kind=Kind.ROLLOUTS)


def test_bad_seq_value():
    check(repack(sealed(), seq=-1), Reason.BAD_VALUE)


def test_not_finite_timestamp():
    check(repack(sealed(), ts=float("nan")), Reason.NOT_FINITE)
    check(repack(sealed(), ts=float("inf")), Reason.NOT_FINITE)


def test_clock_skew_both_ways():
    skew = DEFAULT_LIMITS.max_clock_skew_s
    assert open_envelope(sealed(ts=NOW + skew), now=NOW)[0].ok
    assert "NTP" in check(sealed(ts=NOW + skew + 1), Reason.CLOCK_SKEW).detail
    check(sealed(ts=NOW - skew - 1), Reason.CLOCK_SKEW)


def test_flipped_body_byte():
    m = fields(sealed(body=b"payload"))
    m["body"] = b"Payload"
    check(pack(m), Reason.BAD_SIGNATURE)


@pytest.mark.parametrize(
    "changes",
    [{"seq": 8}, {"ts": NOW + 1.0}, {"kind": "announce"}, {"body": b"payload\x00"}, {"author": MALLORY.public_key}],
)
def test_header_and_body_are_bound_by_the_signature(changes):
    check(repack(sealed(), **changes), Reason.BAD_SIGNATURE)


def test_forged_and_flipped_signatures():
    m = fields(sealed())
    m["sig"] = bytes([m["sig"][0] ^ 0x01]) + m["sig"][1:]
    check(pack(m), Reason.BAD_SIGNATURE)
    # Mallory signs with her own key while claiming to be Alice.
    forged = fields(sealed(ident=MALLORY))
    forged["author"] = ALICE.public_key
    check(pack(forged), Reason.BAD_SIGNATURE)
    check(repack(sealed(), sig=b"\x00" * 64), Reason.BAD_SIGNATURE)


def _reencodings(data: bytes) -> list[bytes]:
    """The same fields, signature included, in other valid msgpack encodings than the one `seal` writes."""
    m = fields(data)
    body = pack(m["body"])  # bin 8: header c4 07
    assert body[:1] == b"\xc4"
    return [
        pack(dict(reversed(list(m.items())))),  # keys in another order
        data.replace(b"\xa3seq\x07", b"\xa3seq\xcf" + (7).to_bytes(8, "big")),  # seq in a uint64 header
        msgpack.packb(m, use_bin_type=True, use_single_float=True),  # ts as float32 (exact for NOW)
        data.replace(body, b"\xc5" + len(m["body"]).to_bytes(2, "big") + m["body"]),  # body in a bin 16 header
        b"\x88" + data[1:] + pack("body") + pack(m["body"]),  # a repeated key: the last value wins
    ]


def test_an_envelope_re_encoded_on_the_way_is_refused():
    # Each verifies with the author's signature; accepted, one signed message would travel as any number of bodies
    # with new sha256s that readers fetch again and drop as replays, at no cost to the relay that re-encoded them.
    data = sealed()
    assert open_envelope(data, now=NOW)[0].ok
    variants = _reencodings(data)
    assert len(set(variants) | {data}) == len(variants) + 1
    for variant in variants:
        assert fields(variant) == fields(data)
        assert "canonical" in check(variant, Reason.MALFORMED).detail


def test_an_envelope_of_millions_of_tiny_containers_is_refused_before_they_are_built():
    # 4 MiB of one-byte empty maps: 4 million dicts (570 MiB, seconds of CPU) were built and walked before the
    # check that an envelope is one map. Any stranger may send one.
    data = b"\xdd" + (DEFAULT_LIMITS.max_envelope_bytes - 5).to_bytes(4, "big") + b"\x80" * (DEFAULT_LIMITS.max_envelope_bytes - 5)
    tracemalloc.start()
    try:
        verdict = check(data, Reason.TOO_LARGE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(data), verdict


def test_seal_rejects_bad_arguments():
    with pytest.raises(ValueError, match="seq"):
        seal(ALICE, Kind.ROLLOUTS, -1, b"")
    with pytest.raises(ValueError, match="seq"):
        seal(ALICE, Kind.ROLLOUTS, 2**64, b"")
    with pytest.raises(TypeError, match="bytes"):
        seal(ALICE, Kind.ROLLOUTS, 0, "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        seal(ALICE, Kind.ROLLOUTS, 0, b"", timestamp=float("nan"))
    with pytest.raises(ValueError):
        seal(ALICE, "gradients", 0, b"")  # type: ignore[arg-type]
