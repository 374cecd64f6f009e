"""Fuzz targets for every message type a peer can send us, shared by the hypothesis tests and `fuzz_run.py`.

Each target takes untrusted bytes and returns "ok" (refused cleanly, or accepted and legitimate)
or "accepted" (accepted although it differs from every legitimate message: a forgery got in).
Any exception that escapes is a crash. Seeds are valid messages; inputs are seeds mutated
(bit flips, truncation, splices, inserted bytes, re-encoded fields) or raw random bytes.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer

from hivespec.node.swarm.dht_guard import (
    AnnounceValidator,
    check_dictionary_value,
    check_find_request,
    check_find_response,
    check_store_request,
)
from hivespec.protocol.announce import (
    Announce,
    AnnouncedBody,
    decode_announce,
    encode_announce,
)
from hivespec.protocol.delta import PolicyHead, decode_head, encode_head, read_header
from hivespec.protocol.envelope import Kind, open_envelope, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.keys import rollout_index_key
from hivespec.protocol.private import PrivateSwarm
from hivespec.protocol.rollout import Rollout, RolloutBatch, decode_batch, encode_batch

VOCAB = 1000
SWARM = "fuzz"
KEY = rollout_index_key(SWARM, 3, 0, 0)  # the root key of time bucket 3's rollout index
ROLLOUT_CONTEXT = f"hivespec/{SWARM}/rollouts"  # a private swarm's AEAD context of rollout bodies (RolloutGossip.context)
P2P_ID = "12D3KooWGAeBwmWNYQwRDrDzeVdFxeWDrou7MZ99wpNfUjFJzWJV"
_ALICE = Identity.from_private_bytes(bytes(range(32)))
_NOW = time.time()


@dataclass(frozen=True)
class Target:
    name: str
    seeds: list[bytes]
    run: Callable[[bytes], str]


def _batch() -> bytes:
    rollouts = tuple(
        Rollout("arith:d1:7", i, 42, np.arange(1, 9, dtype=np.uint32), np.array([5, 6, 7], dtype=np.uint32),
                np.array([-0.5, -1.0, -0.1], dtype=np.float32), 1.0, "stop")
        for i in range(2)
    )
    return encode_batch(RolloutBatch(3, 1, "ab" * 8, rollouts))


def _announce(expires: float) -> bytes:
    item = AnnouncedBody(_ALICE.peer_id, hashlib.sha256(b"body").digest(), 1234, _NOW, 1)
    return encode_announce(Announce(KEY, expires, P2P_ID, ("/ip4/127.0.0.1/tcp/1",), (item,)))


_ENVELOPE = seal(_ALICE, Kind.ROLLOUTS, 7, _batch(), timestamp=_NOW)
_EXPIRES = _NOW + 300.0
_RECORD = seal(_ALICE, Kind.ANNOUNCE, 8, _announce(_EXPIRES), timestamp=_NOW)
_PRIVATE = PrivateSwarm.create(SWARM, b"\x07" * 32, {_ALICE.public_key})
_SEALED_BODY = _PRIVATE.seal_body(_ENVELOPE, context=ROLLOUT_CONTEXT)
_VALIDATOR = AnnounceValidator(SWARM, max_ttl=600, max_body_bytes=4 << 20)
_KEY_ID = DHTID.generate(source=KEY).to_bytes()
_SUBKEY = MSGPackSerializer.dumps(_ALICE.peer_id)


def _envelope(data: bytes) -> str:
    verdict, env = open_envelope(data, now=_NOW)
    if not verdict.ok:
        return "ok"
    legit = (env.author, env.kind, env.seq, env.timestamp, env.body) == (_ALICE.public_key, Kind.ROLLOUTS, 7, _NOW, _batch())
    return "ok" if legit else "accepted"


def _batch_target(data: bytes) -> str:
    verdict, batch = decode_batch(data, vocab_size=VOCAB)
    if not verdict.ok:
        return "ok"
    # Accepted bodies are unsigned here: they must at least satisfy every invariant intake relies on.
    for r in batch.rollouts:
        if len(r.completion_ids) != len(r.behaviour_logprobs) or not len(r.prompt_ids):
            return "accepted"
        ids = np.concatenate([r.prompt_ids, r.completion_ids])
        if ids.size and int(ids.max()) >= VOCAB:
            return "accepted"
        lp = r.behaviour_logprobs
        if lp.size and (not np.isfinite(lp).all() or (lp > 0).any()):
            return "accepted"
        if not np.isfinite(r.reward) or r.finish_reason not in ("stop", "length"):
            return "accepted"
    return "ok"


def _announce_target(data: bytes) -> str:
    verdict, announce = decode_announce(data, max_body_bytes=4 << 20)
    if not verdict.ok:
        return "ok"
    sane = (0 < len(announce.items) <= 9 and len(announce.maddrs) <= 8
            and all(len(i.sha256) == 32 and i.size > 0 and math.isfinite(i.born) and i.born >= 0 and -1 <= i.version < 2**53
                    for i in announce.items))
    return "ok" if sane else "accepted"


def _record_target(data: bytes) -> str:
    # The DHT record validator on the value path: any accepted value must be Alice's exact record.
    value = MSGPackSerializer.dumps(data) if not data.startswith(b"\xc5") else data
    ok = _VALIDATOR.validate(DHTRecord(_KEY_ID, _SUBKEY, value, _EXPIRES))
    if not ok:
        return "ok"
    return "ok" if msgpack.unpackb(value) == _RECORD else "accepted"


def _record_fields_target(data: bytes) -> str:
    # Every field of a record from the wire: key, subkey, value and expiration all fuzzed at once.
    rng = random.Random(data)
    key = data[:20] if rng.random() < 0.5 else _KEY_ID
    subkey = data[20:40] if rng.random() < 0.5 else _SUBKEY
    exp = rng.choice([_EXPIRES, _EXPIRES + 1, _NOW + 1e9, float("nan"), float("inf"), -1.0])
    ok = _VALIDATOR.validate(DHTRecord(key, subkey, MSGPackSerializer.dumps(_RECORD), exp))
    legit = key == _KEY_ID and subkey == _SUBKEY and exp == _EXPIRES
    return "accepted" if ok and not legit else "ok"


def _private_target(data: bytes) -> str:
    verdict, plain = _PRIVATE.open_body(data, context=ROLLOUT_CONTEXT)
    return "accepted" if verdict.ok and plain != _ENVELOPE else "ok"


def _delta_target(data: bytes) -> str:
    read_header(data)
    decode_head(data)
    return "ok"


def _store_request_target(data: bytes) -> str:
    try:
        request = dht_pb2.StoreRequest.FromString(data)
    except Exception:  # noqa: BLE001 - hivemind's handler fails the same way, before any of our code
        return "ok"
    if check_store_request(request) is None:
        # Passed the guard: every value it carries must now pass the validator for hivemind to keep it.
        for key, tag, value, exp in zip(request.keys, request.subkeys, request.values, request.expiration_time):
            if tag == b"":
                continue
            if _VALIDATOR.validate(DHTRecord(key, tag, value, exp)) and (key, tag, value, exp) != (
                _KEY_ID, _SUBKEY, MSGPackSerializer.dumps(_RECORD), _EXPIRES
            ):
                return "accepted"
    return "ok"


def _find_target(data: bytes) -> str:
    try:
        request = dht_pb2.FindRequest.FromString(data)
        response = dht_pb2.FindResponse.FromString(data)
    except Exception:  # noqa: BLE001
        return "ok"
    check_find_request(request)
    check_find_response(response, len(request.keys))
    for result in response.results:
        check_dictionary_value(result.value)
    return "ok"


def _seed_store_request() -> bytes:
    return dht_pb2.StoreRequest(
        keys=[_KEY_ID], subkeys=[_SUBKEY], values=[MSGPackSerializer.dumps(_RECORD)], expiration_time=[_EXPIRES],
        in_cache=[False], peer=dht_pb2.NodeInfo(node_id=b"\x01" * 20),
    ).SerializeToString()


def _seed_find() -> bytes:
    dictionary = MSGPackSerializer.dumps(msgpack.ExtType(0x50, msgpack.packb([None, _EXPIRES, [[_ALICE.peer_id, MSGPackSerializer.dumps(_RECORD), _EXPIRES]]])))
    return dht_pb2.FindResponse(
        results=[dht_pb2.FindResult(type=dht_pb2.FOUND_DICTIONARY, value=dictionary, expiration_time=_EXPIRES,
                                    nearest_node_ids=[b"\x02" * 20], nearest_peer_ids=[b"\x03" * 34])],
        peer=dht_pb2.NodeInfo(node_id=b"\x01" * 20),
    ).SerializeToString()


TARGETS = [
    Target("envelope", [_ENVELOPE], _envelope),
    Target("rollout_batch", [_batch()], _batch_target),
    Target("announce", [_announce(_EXPIRES)], _announce_target),
    Target("dht_record_value", [_RECORD], _record_target),
    Target("dht_record_fields", [_RECORD[:64]], _record_fields_target),
    Target("private_body", [_SEALED_BODY], _private_target),
    Target("delta_header", [encode_head(PolicyHead(5, b"\x01" * 32, 4)), msgpack.packb({"v": 1})], _delta_target),
    Target("dht_store_request", [_seed_store_request()], _store_request_target),
    Target("dht_find_request_response", [_seed_find()], _find_target),
]


def mutate(seed: bytes, rng: random.Random) -> bytes:
    """One structure-blind mutation of `seed`: flips, truncation, splices, inserted junk or random bytes."""
    data = bytearray(seed)
    for _ in range(rng.choice((1, 1, 2, 4, 8))):
        op = rng.randrange(7)
        if op == 0 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == 2 and data:
            del data[rng.randrange(len(data)) :]
        elif op == 3:
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.choice((1, 2, 4, 9, 64)))
        elif op == 4 and data:
            at = rng.randrange(len(data))
            data[at:at] = data[rng.randrange(len(data)) :][: rng.randrange(1, 64)]
        elif op == 5:
            # msgpack headers with huge lengths / deep nesting
            data[rng.randrange(len(data) + 1):][:0] = rng.choice((b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\x91" * 2000, b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00", b"\xc7\x05\xff"))
        else:
            return rng.randbytes(rng.randrange(0, 512))
    return bytes(data)
