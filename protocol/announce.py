"""The index record a node keeps in the DHT per (topic, slot): which bodies it holds and where to get them.

One record per holder per DHT key, stored under subkey = the holder's peer id and sealed as a
`Kind.ANNOUNCE` envelope by that holder. Body (msgpack map, exact keys):

    {"protocol": int,     # SWARM_PROTOCOL: the swarm protocol its holder speaks (records without the key: 1)
     "key": str,          # the DHT key this record is stored under (binds it to its topic and slot)
     "expires": float,    # the DHT expiration it is stored with (binds it: nobody can extend it)
     "p2p": str,          # the holder's libp2p peer id (base58), to open a body stream to
     "maddrs": [str],     # the holder's multiaddrs, at most MAX_MADDRS
     "items": [{"author": str, "sha256": bin32, "size": int,          # 1..MAX_ITEMS bodies
                "born": float,      # when its author sealed it (unix s): readers pick by recency
                "version": int,     # the author's policy version then (-1: not a policy's output)
                "informative": int}]}  # its samples with a GRPO gradient (`advantages.informative_samples`); -1: not said

A holder is the author of its first item or a peer that fetched and verified the body and now
serves it too, so a body outlives its author. `informative` is a count any holder can check
against the body (the batch's rewards, which every reader recomputes): a relay copies the claim
only once the body it fetched bears it out, so a false one is its record's signer's lie.

A record says which swarm protocol its holder speaks, and a reader checks that first: a record
of another protocol is refused as `BAD_VERSION`, not as malformed, and says whether its holder is
older or newer (`protocol_and_key`), so a node can tell its user that some peers run another hivespec
version instead of silently seeing fewer peers. The record is the only way to the bodies, so one
number covers the whole swarm protocol: bump `SWARM_PROTOCOL` with any change to the record, a
rollout batch or the body fetch (tests/protocol/test_swarm_protocol.py pins those formats' bytes to the
number and fails until it is bumped), and nodes of the two versions each see only their own side.

Binding the key and the expiration into the signed bytes is what hivemind's own
`RSASignatureValidator` does (it signs key, subkey, value and expiration): without it anyone
could copy a valid record under another slot or re-store it with a far-future expiration, which
the DHT would prefer over the owner's newer record.

In a private swarm the whole body is AEAD-encrypted (see `private.py`) before sealing; decoding
takes the already-decrypted bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .codec import Reject, check_keys, pack, safe_unpack
from .identity import PEER_ID_PREFIX
from .limits import KIB
from .verdict import Reason, Verdict

ANNOUNCE_MAX_BYTES = 4 * KIB  # a sealed record with MAX_ITEMS items is ~1.5 KiB
MAX_ITEMS = 9  # own body plus up to 8 relayed ones: a key's value stays ~N x 1.5 KiB for N peers
MAX_MADDRS = 8
MAX_KEY_LEN = 256
MAX_MADDR_LEN = 256
SWARM_PROTOCOL = 2
"""The swarm protocol this node speaks. 1: records before it was named (2026-11-28 and before, with or without the
items' `informative`); 2: records that say their protocol."""
_KEYS = frozenset({"protocol", "key", "expires", "p2p", "maddrs", "items"})
_KEYS_BEFORE_PROTOCOL = _KEYS - {"protocol"}
# Nesting a record of any protocol may have, so a newer one is read as far as its protocol; ours nests 3 deep (record,
# items, item), and the schema's type checks refuse anything deeper where it would be.
_MAX_DEPTH = 8
_ITEM_KEYS = frozenset({"author", "sha256", "size", "born", "version", "informative"})
MAX_VERSION = 2**53
MAX_INFORMATIVE = 2**16  # above any batch's rollouts (limits.max_rollouts_per_batch)
_PEER_ID = re.compile(rf"{PEER_ID_PREFIX}[0-9a-f]{{16}}")
_BASE58 = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,64}")


@dataclass(frozen=True)
class AnnouncedBody:
    """One body a holder serves: its author's peer id, sha256, size in bytes, when the author made it, from which
    policy, and how many of its samples carry a gradient.

    `born`, `version` and `informative` are the holder's claim (an author's own, or copied by a relay); intake
    checks the signed envelope's timestamp and the batch's version, and the fetcher the informative count
    (`rollouts.RolloutGossip`), so a lie here wastes one fetch and costs its holder's score. `informative`
    is -1 where the holder does not say (a body that is not a rollout batch).
    """

    author: str
    sha256: bytes
    size: int
    born: float = 0.0
    version: int = -1
    informative: int = -1


@dataclass(frozen=True)
class Announce:
    """A decoded, schema-checked index record (its envelope signature is checked separately)."""

    key: str
    expires: float
    p2p: str
    maddrs: tuple[str, ...]
    items: tuple[AnnouncedBody, ...]


def encode_announce(announce: Announce) -> bytes:
    """Encode an announce body; raises ValueError if it would not pass `decode_announce`."""
    data = pack(
        {
            "protocol": SWARM_PROTOCOL,
            "key": announce.key,
            "expires": float(announce.expires),
            "p2p": announce.p2p,
            "maddrs": list(announce.maddrs[:MAX_MADDRS]),
            "items": [
                {"author": i.author, "sha256": i.sha256, "size": int(i.size), "born": float(i.born), "version": int(i.version),
                 "informative": int(i.informative)}
                for i in announce.items
            ],
        }
    )
    verdict, _ = decode_announce(data, max_body_bytes=max((i.size for i in announce.items), default=1))
    if not verdict.ok:
        raise ValueError(f"announce would be rejected by peers: {verdict}")
    return data


def decode_announce(data: bytes, *, max_body_bytes: int) -> tuple[Verdict, Announce | None]:
    """Decode and validate an announce body from a peer; never raises.

    `max_body_bytes` bounds each item's announced size. Whether the key is the expected one,
    the expiration within the allowed TTL and the signer owns the subkey is the caller's check.
    """
    verdict, obj = safe_unpack(data, max_size=ANNOUNCE_MAX_BYTES, max_depth=_MAX_DEPTH)
    if not verdict.ok:
        return verdict, None
    try:
        protocol = _protocol(obj)
        if protocol != SWARM_PROTOCOL:
            side = "an older" if protocol < SWARM_PROTOCOL else "a newer"
            raise Reject(Reason.BAD_VERSION, f"record of swarm protocol {protocol}, this node speaks {SWARM_PROTOCOL}: "
                                             f"its holder runs {side} hivespec")
        m = check_keys(obj, _KEYS, "announce")
        key = _text(m["key"], "key", MAX_KEY_LEN)
        expires = m["expires"]
        if not isinstance(expires, float) or not math.isfinite(expires) or expires <= 0:
            raise Reject(Reason.BAD_VALUE, f"expires must be a positive finite float, got {expires!r:.40}")
        p2p = _text(m["p2p"], "p2p", 64)
        if not _BASE58.fullmatch(p2p):
            raise Reject(Reason.BAD_VALUE, f"p2p {p2p!r} is not a base58 libp2p peer id")
        maddrs = m["maddrs"]
        if not isinstance(maddrs, list) or len(maddrs) > MAX_MADDRS:
            raise Reject(Reason.BAD_LENGTH, f"maddrs must be a list of at most {MAX_MADDRS}")
        maddrs = tuple(_text(a, "maddr", MAX_MADDR_LEN) for a in maddrs)
        items = m["items"]
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_ITEMS:
            raise Reject(Reason.BAD_LENGTH, f"items must be a list of 1..{MAX_ITEMS}")
        parsed = tuple(_item(item, max_body_bytes) for item in items)
        if len({i.sha256 for i in parsed}) != len(parsed):
            raise Reject(Reason.BAD_VALUE, "items repeat a sha256")
    except Reject as rejected:
        return rejected.verdict, None
    return Verdict.accept(), Announce(key, expires, p2p, maddrs, parsed)


def protocol_and_key(data: bytes) -> tuple[int, str] | None:
    """The swarm protocol a record body says it is of (1: a record of protocol 1's keys, which did not say) and the DHT
    key it names, or None where the body is no record of any protocol: what a reader tells its user about a record
    it refused as another protocol's (`BAD_VERSION`)."""
    verdict, obj = safe_unpack(data, max_size=ANNOUNCE_MAX_BYTES, max_depth=_MAX_DEPTH)
    if not verdict.ok:
        return None
    try:
        protocol = _protocol(obj)
    except Reject:
        return None
    key = obj.get("key")
    return (protocol, key) if isinstance(key, str) else None


def _protocol(obj: object) -> int:
    if not isinstance(obj, dict):
        raise Reject(Reason.BAD_TYPE, f"announce must be a map, got {type(obj).__name__}")
    if "protocol" not in obj:
        if obj.keys() == _KEYS_BEFORE_PROTOCOL:
            return 1
        check_keys(obj, _KEYS, "announce")  # raises: names what is missing and what is extra
    protocol = obj["protocol"]
    if isinstance(protocol, bool) or not isinstance(protocol, int) or not 0 < protocol < 2**31:
        raise Reject(Reason.BAD_VALUE, f"protocol {protocol!r:.40} is not a positive int")
    return protocol


def _text(value: object, what: str, max_len: int) -> str:
    if not isinstance(value, str):
        raise Reject(Reason.BAD_TYPE, f"{what} must be str, got {type(value).__name__}")
    if not 0 < len(value) <= max_len or not value.isprintable():
        raise Reject(Reason.BAD_VALUE, f"{what} {value[:64]!r} is empty, longer than {max_len} or unprintable")
    return value


def _item(obj: object, max_body_bytes: int) -> AnnouncedBody:
    m = check_keys(obj, _ITEM_KEYS, "announce item")
    author, digest, size, born, version, informative = (m["author"], m["sha256"], m["size"], m["born"], m["version"],
                                                        m["informative"])
    if not isinstance(author, str) or not _PEER_ID.fullmatch(author):
        raise Reject(Reason.BAD_VALUE, f"item author {author!r:.40} is not a hivespec peer id")
    if not isinstance(digest, bytes) or len(digest) != 32:
        raise Reject(Reason.BAD_LENGTH, "item sha256 must be 32 bytes")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= max_body_bytes:
        raise Reject(Reason.BAD_VALUE, f"item size {size!r:.40} outside (0, {max_body_bytes}]")
    if not isinstance(born, float) or not math.isfinite(born) or born < 0:
        raise Reject(Reason.BAD_VALUE, f"item born {born!r:.40} is not a finite time")
    if isinstance(version, bool) or not isinstance(version, int) or not -1 <= version < MAX_VERSION:
        raise Reject(Reason.BAD_VALUE, f"item version {version!r:.40} outside -1..2^53")
    if isinstance(informative, bool) or not isinstance(informative, int) or not -1 <= informative <= MAX_INFORMATIVE:
        raise Reject(Reason.BAD_VALUE, f"item informative {informative!r:.40} outside -1..{MAX_INFORMATIVE}")
    return AnnouncedBody(author, digest, size, born, version, informative)


def is_peer_id(value: object) -> bool:
    """Whether `value` is a well-formed hivespec peer id (``hs`` + 16 hex digits)."""
    return isinstance(value, str) and _PEER_ID.fullmatch(value) is not None
