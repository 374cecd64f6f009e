"""hivemind's DHT as attack surface: a record validator and limits on every DHT request and reply.

hivemind (1.1.12) lets any peer store any value under any key and subkey, keeps the value with the
newest expiration, stores without bound, and decodes dictionary values with its own msgpack
serializer (ext types included) before any validator sees them. This module closes that:

- `AnnounceValidator` (a `RecordValidatorBase`, run by hivemind on every store request and on
  every record a `find` returns): a record must be a signed `Kind.ANNOUNCE` envelope by the owner
  of its subkey, bound to its DHT key and expiration (see `protocol/announce.py`), under this
  swarm's key prefix, no larger than `RECORD_MAX_BYTES`, expiring at most `max_ttl` from now;
  in a private swarm its author must be on the allowlist and its body must decrypt.
- `harden(dht_node)`: wraps the node's `rpc_store`/`rpc_find`/`rpc_ping` handlers with
  `check_*_request` (counts, lengths, node ids, dictionary values parsed under hard limits) and
  every outgoing stub with `check_find_response`, so hivemind decodes only bytes that passed our
  limits; and bounds the node's local storage and cache: at most `MAX_STORED_KEYS` keys, and at
  most `MAX_RECORDS_PER_KEY` records under one key (first come: a holder already there may renew
  its record, a newcomer to a full key is refused, so a flood of identities cannot grow a key or
  evict the records before it).

The checks are plain functions over protobuf messages, so the fuzz tests drive them directly
and through a live node.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter, OrderedDict
from typing import Any

import msgpack
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.auth import AuthRole, AuthRPCWrapper

from hivespec.protocol.announce import (
    ANNOUNCE_MAX_BYTES,
    SWARM_PROTOCOL,
    Announce,
    decode_announce,
    is_peer_id,
    protocol_and_key,
)
from hivespec.protocol.codec import counting_hook, safe_unpack
from hivespec.protocol.envelope import Envelope, Kind, open_envelope
from hivespec.protocol.limits import DEFAULT_LIMITS, Limits
from hivespec.protocol.private import OVERHEAD, PrivateSwarm
from hivespec.protocol.verdict import Reason

logger = logging.getLogger(__name__)

RECORD_MAX_BYTES = ANNOUNCE_MAX_BYTES + OVERHEAD + 256  # announce + AEAD + envelope header and signature
MAX_KEYS_PER_REQUEST = 64  # hivemind batches at most chunk_size (16) keys per RPC
MAX_SUBKEYS_PER_VALUE = 4096  # what a dictionary value in a request or reply may hold before we decode it
MAX_RECORDS_PER_KEY = 64  # records our storage keeps under one key: a new subkey past this is refused (index keys hold 16)
MAX_DICTIONARY_BYTES = MAX_SUBKEYS_PER_VALUE * (RECORD_MAX_BYTES // 4)  # well under p2pd's 4 MiB cap
MAX_NEAREST = 64  # hivemind returns bucket_size (20) neighbours per key
MAX_STORED_KEYS = 65536  # local storage and cache bound: oldest expirations are dropped first
# Arrays and entries a dictionary value holds: [maxsize, latest, items] and 4 per item ([subkey, value, expiration]),
# twice over so a value a little over MAX_SUBKEYS_PER_VALUE is still refused by that name.
_MAX_DICTIONARY_ITEMS = 2 * (5 + 5 * MAX_SUBKEYS_PER_VALUE)
_NODE_ID_BYTES = DHTID.HASH_NBYTES
_DICT_EXT, _TUPLE_EXT = 0x50, 0x40
_VALIDATED_CACHE = 4096
_OTHER_PROTOCOL_HOLDERS = 1024  # holders of another protocol's records counted per protocol, at most
EXPIRY_SLACK_S = 30.0  # clock skew between peers that an expiration may carry on top of max_ttl


class AnnounceValidator(RecordValidatorBase):
    """Accepts only owner-signed, key-bound, TTL-capped announce records of one swarm (see the module docstring)."""

    def __init__(
        self,
        swarm: str,
        *,
        max_ttl: float,
        max_body_bytes: int,
        private: PrivateSwarm | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.prefix = f"hivespec/{swarm}/"
        self.max_ttl = max_ttl
        self.max_body_bytes = max_body_bytes
        self.private = private
        # A record may be read up to max_ttl after it was sealed.
        self.limits = Limits(
            max_envelope_bytes=RECORD_MAX_BYTES,
            max_depth=limits.max_depth,
            max_clock_skew_s=limits.max_clock_skew_s + max_ttl,
        )
        self.rejected: Counter[str] = Counter()
        self.other_protocols: dict[int, set[str]] = {}  # swarm protocol -> holders whose signed records speak it
        self._warned_secret = False  # a member's record that does not decrypt here was logged
        self._valid: OrderedDict[bytes, None] = OrderedDict()

    def validate(self, record: DHTRecord) -> bool:
        """hivemind's hook: True keeps the record; False drops it (and fails the store request)."""
        try:
            digest = hashlib.sha256(
                b"%d|%d|%r|" % (len(record.key), len(record.subkey), record.expiration_time)
                + record.key + record.subkey + record.value
            ).digest()
        except Exception:  # noqa: BLE001 - a record of unexpected field types is simply invalid
            self.rejected["bad_type"] += 1
            return False
        if digest in self._valid:
            self._valid.move_to_end(digest)
            return True
        reason, _ = self.check(record)
        if reason:
            self.rejected[reason] += 1
            logger.debug("DHT record refused: %s", reason)
            return False
        self._valid[digest] = None
        while len(self._valid) > _VALIDATED_CACHE:
            self._valid.popitem(last=False)
        return True

    def check(self, record: DHTRecord, *, now: float | None = None) -> tuple[str, tuple[Envelope, Announce] | None]:
        """("", (envelope, announce)) for a valid record, else (reason, None); never raises."""
        key, subkey, value, expiration = record.key, record.subkey, record.value, record.expiration_time
        if not all(isinstance(x, bytes) for x in (key, subkey, value)) or not isinstance(expiration, float):
            return "bad_type", None
        if len(value) > RECORD_MAX_BYTES:
            return "too_large", None
        now = get_dht_time() if now is None else now
        if not math.isfinite(expiration) or expiration > now + self.max_ttl + EXPIRY_SLACK_S:
            return "expiration_too_far", None
        verdict, owner = safe_unpack(subkey, max_size=64, max_depth=0)
        if not verdict.ok or not is_peer_id(owner):
            return "subkey_not_a_peer_id", None
        # hivemind stores values msgpack-serialized: ours is one bin, the sealed envelope.
        verdict, sealed = safe_unpack(value, max_size=RECORD_MAX_BYTES, max_depth=0)
        if not verdict.ok or not isinstance(sealed, bytes):
            return "value_not_bytes", None
        verdict, envelope = open_envelope(sealed, limits=self.limits, expected_kind=Kind.ANNOUNCE)
        if not verdict.ok or envelope is None:
            return f"envelope_{verdict.reason.value}", None
        if envelope.peer_id != owner:
            return "subkey_not_owned_by_signer", None
        body = envelope.body
        if self.private is not None:
            if not self.private.allows(envelope.author):
                return "not_on_allowlist", None
            verdict, body = self.private.open_index(body, context=key.hex())
            if not verdict.ok or body is None:
                self._secret_mismatch(envelope.peer_id)
                return "index_not_decryptable", None
        verdict, announce = decode_announce(body, max_body_bytes=self.max_body_bytes)
        if verdict.reason is Reason.BAD_VERSION:
            return self._other_protocol(protocol_and_key(body), envelope.peer_id), None
        if not verdict.ok or announce is None:
            return f"announce_{verdict.reason.value}", None
        if not announce.key.startswith(self.prefix):
            return "other_swarm", None
        if DHTID.generate(source=announce.key).to_bytes() != key:
            return "key_not_bound", None
        if announce.expires != expiration:
            return "expiration_not_bound", None
        return "", (envelope, announce)

    def _secret_mismatch(self, member: str) -> None:
        """Warn once that a member's signed record does not decrypt here: its swarm secret or name is not ours (only a
        member signs a record that gets this far), so nothing is shared between us, which nothing else would say."""
        if self._warned_secret:
            return
        self._warned_secret = True
        assert self.private is not None
        logger.warning(
            "index records of swarm member %s do not decrypt with this node's swarm secret (fingerprint %s) for swarm %r: "
            "one of you has another swarm.private.secret_file (or $HIVESPEC_SWARM_SECRET) or swarm name, and nothing is "
            "shared between you; give every member the same secret and swarm name (the fingerprint is the same where "
            "the secret is)", member, self.private.secret_fingerprint, self.private.swarm_id)

    def other_protocol_peers(self) -> dict[int, int]:
        """Swarm protocol -> holders seen announcing under it; safe to call from any thread (the DHT's loop adds to it)."""
        return {protocol: len(holders) for protocol, holders in list(self.other_protocols.items())}

    def _other_protocol(self, said: tuple[int, str] | None, holder: str) -> str:
        """Note a signed record of another swarm protocol, in this swarm (the first of each protocol is logged); the
        reason it is refused."""
        if said is None or not said[1].startswith(self.prefix):
            return "other_swarm" if said is not None else "announce_bad_version"
        protocol = said[0]
        side = "older" if protocol < SWARM_PROTOCOL else "newer"
        holders = self.other_protocols.get(protocol)
        if holders is None:
            holders = self.other_protocols[protocol] = set()
            who, advice = ("an older", " until they upgrade") if side == "older" else ("a newer", "; upgrade hivespec to join them")
            logger.warning("peers run %s hivespec (swarm protocol %d; this node speaks %d, first seen: %s): their index "
                           "records are refused, so this node shares no rollouts with them%s",
                           who, protocol, SWARM_PROTOCOL, holder, advice)
        if len(holders) < _OTHER_PROTOCOL_HOLDERS:
            holders.add(holder)
        return f"{side}_protocol"


def _node_id_ok(info: dht_pb2.NodeInfo) -> bool:
    return not info.node_id or len(info.node_id) == _NODE_ID_BYTES


def check_ping_request(request: dht_pb2.PingRequest) -> str | None:
    """None if hivemind may handle this ping, else why not."""
    return None if _node_id_ok(request.peer) else "bad_node_id"


def check_store_request(request: dht_pb2.StoreRequest) -> str | None:
    """None if hivemind may handle this store request, else why not (before it decodes anything)."""
    n = len(request.keys)
    if n > MAX_KEYS_PER_REQUEST:
        return "too_many_keys"
    if not n == len(request.subkeys) == len(request.values) == len(request.expiration_time) == len(request.in_cache):
        return "misaligned"
    if not _node_id_ok(request.peer):
        return "bad_node_id"
    for key, tag, value, expiration in zip(request.keys, request.subkeys, request.values, request.expiration_time):
        if len(key) != _NODE_ID_BYTES:
            return "bad_key"
        if not math.isfinite(expiration):
            return "bad_expiration"
        if tag == b"":  # a whole dictionary: hivemind unpacks it before validating
            reason = check_dictionary_value(value)
            if reason:
                return reason
        elif len(tag) > 64 or len(value) > RECORD_MAX_BYTES:
            return "too_large"
    return None


def check_find_request(request: dht_pb2.FindRequest) -> str | None:
    """None if hivemind may handle this find request, else why not."""
    if len(request.keys) > MAX_KEYS_PER_REQUEST:
        return "too_many_keys"
    if not _node_id_ok(request.peer):
        return "bad_node_id"
    if any(len(key) != _NODE_ID_BYTES for key in request.keys):
        return "bad_key"
    return None


def check_find_response(response: dht_pb2.FindResponse, n_keys: int) -> str | None:
    """None if hivemind may decode this reply to a find of `n_keys` keys, else why not."""
    if len(response.results) != n_keys or not _node_id_ok(response.peer):
        return "misaligned"
    for result in response.results:
        if len(result.nearest_node_ids) != len(result.nearest_peer_ids) or len(result.nearest_node_ids) > MAX_NEAREST:
            return "bad_nearest"
        if any(len(n) != _NODE_ID_BYTES for n in result.nearest_node_ids):
            return "bad_node_id"
        if any(not 0 < len(p) <= 64 for p in result.nearest_peer_ids):
            return "bad_peer_id"
        if result.type == dht_pb2.FOUND_DICTIONARY:
            reason = check_dictionary_value(result.value)
            if reason:
                return reason
        elif result.type == dht_pb2.FOUND_REGULAR:
            # We never store regular values; the validator refuses them (their subkey is not a peer id).
            if len(result.value) > RECORD_MAX_BYTES:
                return "too_large"
        elif result.type != dht_pb2.NOT_FOUND:
            return "bad_result_type"
    return None


def check_dictionary_value(data: bytes) -> str | None:
    """None if `data` is a hivemind DictionaryDHTValue of our shape within limits, else why not.

    The shape: ext 0x50 holding [maxsize, latest_expiration, [[subkey: str, value: bin, expiration: float], ...]].
    hivemind's own decoder would accept any msgpack there, ext types and nesting included.
    """
    if len(data) > MAX_DICTIONARY_BYTES:
        return "too_large"
    outer = _unpack(data, allow_ext=True)
    if not isinstance(outer, msgpack.ExtType) or outer.code != _DICT_EXT:
        return "not_a_dictionary"
    inner = _unpack(outer.data, allow_ext=False, max_items=_MAX_DICTIONARY_ITEMS)
    if not isinstance(inner, list) or len(inner) != 3:
        return "bad_dictionary"
    maxsize, latest, items = inner
    if not _is_number(maxsize) or not _is_number(latest) or not isinstance(items, list):
        return "bad_dictionary"
    if len(items) > MAX_SUBKEYS_PER_VALUE:
        return "too_many_subkeys"
    for item in items:
        if not isinstance(item, list) or len(item) != 3:
            return "bad_dictionary_item"
        subkey, value, expiration = item
        if not isinstance(subkey, str) or len(subkey) > 64 or not isinstance(value, bytes):
            return "bad_dictionary_item"
        if len(value) > RECORD_MAX_BYTES or not isinstance(expiration, float) or not math.isfinite(expiration):
            return "bad_dictionary_item"
    return None


def _is_number(value: object) -> bool:
    # hivemind writes maxsize = inf for an unbounded dictionary and latest = -inf for an empty one.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not (isinstance(value, float) and math.isnan(value))


def _unpack(data: bytes, *, allow_ext: bool, max_items: int | None = None) -> Any:
    """`data` decoded, or None; with `max_items`, None as soon as its arrays and their entries number more (counted
    while decoding: 4 MiB of one-byte empty arrays is 4 million lists, 320 MiB and seconds of the DHT's loop)."""
    def hook(code: int, payload: bytes) -> Any:
        if not allow_ext:
            raise ValueError("nested ext type")
        return msgpack.ExtType(code, payload)

    n = len(data)
    budget = n if max_items is None else min(n, max_items)
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=hook, max_str_len=n, max_bin_len=n,
            max_array_len=budget, max_map_len=0, max_ext_len=n, list_hook=None if max_items is None else counting_hook(budget),
        )
    except Exception:  # noqa: BLE001 - any decoding failure makes the value invalid
        return None


class _GuardedStub:
    """An outgoing DHT stub whose find replies pass `check_find_response` before hivemind decodes them."""

    def __init__(self, stub: Any, stats: Counter) -> None:
        self._stub, self._stats = stub, stats

    async def rpc_find(self, request: dht_pb2.FindRequest, *args: Any, **kwargs: Any) -> dht_pb2.FindResponse:
        response = await self._stub.rpc_find(request, *args, **kwargs)
        reason = check_find_response(response, len(request.keys))
        if reason:
            self._stats[f"dht_reply_refused_{reason}"] += 1
            # hivemind's call_find treats an exception as "peer did not answer" and drops the peer.
            raise ValueError(f"find reply refused: {reason}")
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


async def harden(node: DHTNode, stats: Counter) -> None:
    """Install the request/reply checks on a running DHTNode and bound its storage (see the module docstring).

    hivemind binds handlers when they are registered, so they are removed, wrapped and added again.
    Refused requests are counted in `stats` as ``dht_request_refused_<reason>``.
    """
    protocol = node.protocol
    for storage in (protocol.storage, protocol.cache):
        storage.maxsize = MAX_STORED_KEYS
        _cap_records_per_key(storage, stats)
    await protocol.remove_p2p_handlers(protocol.p2p)

    def guarded(handler: Any, check: Any, refuse: Any) -> Any:
        async def wrapper(request: Any, context: Any) -> Any:
            reason = check(request)
            if reason:
                stats[f"dht_request_refused_{reason}"] += 1
                return refuse(request)
            return await handler(request, context)

        return wrapper

    info = protocol.node_info
    protocol.rpc_ping = guarded(protocol.rpc_ping, check_ping_request, lambda r: dht_pb2.PingResponse(peer=info))
    protocol.rpc_store = guarded(
        protocol.rpc_store,
        check_store_request,
        lambda r: dht_pb2.StoreResponse(store_ok=[False] * min(len(r.keys), MAX_KEYS_PER_REQUEST), peer=info),
    )
    protocol.rpc_find = guarded(protocol.rpc_find, check_find_request, lambda r: dht_pb2.FindResponse(peer=info))
    await protocol.add_p2p_handlers(protocol.p2p, AuthRPCWrapper(protocol, AuthRole.SERVICER, protocol.authorizer))

    make_stub = protocol.get_stub
    protocol.get_stub = lambda peer: _GuardedStub(make_stub(peer), stats)


def _cap_records_per_key(storage: DHTLocalStorage, stats: Counter) -> None:
    """Refuse a new subkey under a key that already holds MAX_RECORDS_PER_KEY records (see the module docstring)."""
    store_subkey = storage.store_subkey

    def capped(key: DHTID, subkey: Any, value: bytes, expiration_time: float) -> bool:
        current = storage.get(key)
        if current is not None and isinstance(current.value, DictionaryDHTValue):
            records = current.value
            if subkey not in records and len(records) >= MAX_RECORDS_PER_KEY:
                stats["dht_key_full_refused"] += 1
                return False
        return store_subkey(key, subkey, value, expiration_time)

    storage.store_subkey = capped
