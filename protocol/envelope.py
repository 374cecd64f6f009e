"""The signed envelope every peer message travels in.

Wire form: a msgpack map with exactly the keys
``{"v": int, "kind": str, "author": bin32, "seq": int, "ts": float, "body": bin, "sig": bin64}``.

What is signed: the design asks for a signature "over the exact body bytes"; we also bind the
header, so a relay cannot change the kind, sequence number or timestamp of a message it
forwards. The Ed25519 signature covers

    DOMAIN_TAG || u16le(version) || u8(len(kind)) || kind (ASCII) || author (32 B)
               || u64le(seq) || f64le(ts) || body

The tag keeps these signatures from being valid in any other hivespec context. All header
fields are fixed width or length-prefixed, so the byte string is unambiguous.

The wire form is canonical too: an envelope is accepted only in the exact bytes `seal` writes
(keys in the order above, the shortest int and length headers, ts as float64). msgpack has other
encodings of the same map, and without this a relay could re-encode an honest envelope into any
number of bodies with new sha256s, all verifying, that readers fetch and then drop as replays
(an "ignore" that costs the relay nothing).
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass, field
from enum import StrEnum

from .codec import pack, safe_unpack
from .identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_of, readable_name, verify_signature
from .limits import DEFAULT_LIMITS, Limits
from .verdict import Reason, Verdict

ENVELOPE_VERSION = 1
DOMAIN_TAG = b"hivespec/envelope/v1\0"
_KEYS = frozenset({"v", "kind", "author", "seq", "ts", "body", "sig"})
_MAX_SEQ = (1 << 64) - 1
# An envelope is one map of seven scalars; the bound refuses 4 MiB of tiny containers before they are built, with room
# for a map of other keys (another version's) to be refused by name.
_MAX_ITEMS = 256


class Kind(StrEnum):
    """What an envelope's body holds."""

    ROLLOUTS = "rollouts"
    ANNOUNCE = "announce"
    DELTA = "delta"


@dataclass(frozen=True)
class Envelope:
    """A decoded envelope whose signature has been verified (only `open_envelope` builds one from bytes)."""

    version: int
    kind: Kind
    author: bytes
    seq: int
    timestamp: float
    body: bytes = field(repr=False)  # up to 4 MiB: keep it out of log lines
    signature: bytes = field(repr=False)

    @property
    def peer_id(self) -> str:
        """Peer id of the author (see `identity.peer_id_of`)."""
        return peer_id_of(self.author)

    @property
    def author_name(self) -> str:
        """Readable name of the author, for logs."""
        return readable_name(self.author)


def signed_message(version: int, kind: str, author: bytes, seq: int, timestamp: float, body: bytes) -> bytes:
    """The exact bytes the envelope signature covers (see the module docstring)."""
    kind_bytes = kind.encode("ascii")
    return b"".join(
        (
            DOMAIN_TAG,
            struct.pack("<HB", version, len(kind_bytes)),
            kind_bytes,
            author,
            struct.pack("<Qd", seq, timestamp),
            body,
        )
    )


def seal(identity: Identity, kind: Kind, seq: int, body: bytes, *, timestamp: float | None = None) -> bytes:
    """Sign `body` as `identity` and return the envelope bytes.

    `seq` is the author's sequence number (non-negative, < 2**64; callers keep it increasing per
    kind so receivers can drop replays). `timestamp` defaults to `time.time()`. Raises ValueError
    on invalid arguments (TypeError for a body that is not bytes); the result is not checked against `Limits.max_envelope_bytes`.
    """
    kind = Kind(kind)
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= _MAX_SEQ:
        raise ValueError(f"seq must be an int in [0, 2**64), got {seq!r}")
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError(f"body must be bytes (encode it first), got {type(body).__name__}")
    ts = float(time.time() if timestamp is None else timestamp)
    if not math.isfinite(ts):
        raise ValueError(f"timestamp must be finite, got {ts!r}")
    body = bytes(body)
    sig = identity.sign(signed_message(ENVELOPE_VERSION, kind.value, identity.public_key, seq, ts, body))
    return _wire(ENVELOPE_VERSION, kind.value, identity.public_key, seq, ts, body, sig)


def _wire(version: int, kind: str, author: bytes, seq: int, ts: float, body: bytes, sig: bytes) -> bytes:
    """The one (canonical) encoding of an envelope's fields."""
    return pack({"v": version, "kind": kind, "author": author, "seq": seq, "ts": ts, "body": body, "sig": sig})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def open_envelope(
    data: bytes,
    *,
    limits: Limits = DEFAULT_LIMITS,
    now: float | None = None,
    expected_kind: Kind | None = None,
) -> tuple[Verdict, Envelope | None]:
    """Decode and verify envelope bytes from a peer; never raises.

    Checks, cheapest first: size, msgpack, exact key set, field types and lengths, version,
    kind (and `expected_kind` when given), seq range, finite timestamp within
    `limits.max_clock_skew_s` of `now` (default `time.time()`), canonical encoding, then the signature. The body is
    returned undecoded; decode it with the decoder for its kind.
    """
    verdict, obj = safe_unpack(data, max_size=limits.max_envelope_bytes, max_depth=limits.max_depth, max_items=_MAX_ITEMS)
    if not verdict.ok:
        return verdict, None
    if not isinstance(obj, dict):
        return Verdict.reject(Reason.BAD_TYPE, f"envelope must be a map, got {type(obj).__name__}"), None
    keys = set(obj)
    if keys != _KEYS:
        missing, extra = sorted(map(str, _KEYS - keys)), sorted(map(str, keys - _KEYS))
        return Verdict.reject(Reason.BAD_KEYS, f"envelope keys: missing {missing}, unexpected {extra}"), None

    version, kind, author, seq = obj["v"], obj["kind"], obj["author"], obj["seq"]
    ts, body, sig = obj["ts"], obj["body"], obj["sig"]
    if not _is_int(version):
        return Verdict.reject(Reason.BAD_TYPE, f"v must be int, got {type(version).__name__}"), None
    if version != ENVELOPE_VERSION:
        return Verdict.reject(
            Reason.BAD_VERSION, f"envelope version {version}, this node speaks {ENVELOPE_VERSION}; upgrade hivespec"
        ), None
    for name, value in (("author", author), ("body", body), ("sig", sig)):
        if not isinstance(value, bytes):
            return Verdict.reject(Reason.BAD_TYPE, f"{name} must be bin, got {type(value).__name__}"), None
    if not isinstance(kind, str):
        return Verdict.reject(Reason.BAD_TYPE, f"kind must be str, got {type(kind).__name__}"), None
    if not _is_int(seq):
        return Verdict.reject(Reason.BAD_TYPE, f"seq must be int, got {type(seq).__name__}"), None
    if not isinstance(ts, float):
        return Verdict.reject(Reason.BAD_TYPE, f"ts must be float, got {type(ts).__name__}"), None
    if len(author) != PUBLIC_KEY_BYTES:
        return Verdict.reject(Reason.BAD_LENGTH, f"author is {len(author)} bytes, expected {PUBLIC_KEY_BYTES}"), None
    if len(sig) != SIGNATURE_BYTES:
        return Verdict.reject(Reason.BAD_LENGTH, f"sig is {len(sig)} bytes, expected {SIGNATURE_BYTES}"), None
    try:
        kind_enum = Kind(kind)
    except ValueError:
        return Verdict.reject(Reason.UNKNOWN_KIND, f"kind {kind[: limits.max_str_len]!r} is not one of {[k.value for k in Kind]}"), None
    if expected_kind is not None and kind_enum is not Kind(expected_kind):
        return Verdict.reject(Reason.WRONG_KIND, f"expected kind {Kind(expected_kind).value!r}, got {kind!r}"), None
    if not 0 <= seq <= _MAX_SEQ:
        return Verdict.reject(Reason.BAD_VALUE, f"seq {seq} outside [0, 2**64)"), None
    if not math.isfinite(ts):  # safe_unpack already refuses non-finite floats; kept for direct callers
        return Verdict.reject(Reason.NOT_FINITE, f"ts {ts!r}"), None
    clock = time.time() if now is None else now
    if abs(ts - clock) > limits.max_clock_skew_s:
        return Verdict.reject(
            Reason.CLOCK_SKEW,
            f"timestamp {ts:.3f} is {ts - clock:+.1f} s from our clock (limit ±{limits.max_clock_skew_s:g} s); "
            "check that both machines sync their clocks (NTP)",
        ), None
    if _wire(version, kind, author, seq, ts, body, sig) != data:
        return Verdict.reject(
            Reason.MALFORMED, "envelope is not in the canonical encoding seal writes (key order, int and length headers, "
            "float64 ts): re-encoded on the way"
        ), None
    message = signed_message(version, kind, author, seq, ts, body)
    if not verify_signature(author, sig, message):
        return Verdict.reject(Reason.BAD_SIGNATURE, f"signature does not verify for author {peer_id_of(author)}"), None
    return Verdict.accept(), Envelope(version, kind_enum, author, seq, ts, body, sig)
