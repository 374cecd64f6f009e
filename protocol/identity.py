"""Node identity: an Ed25519 key, the peer id and readable name derived from its public key.

No file I/O here; `hivespec.node.identity_file` owns the key file.

- `peer_id_of(pk)`  = "hs" + first 16 hex digits of sha256(pk): 18 chars, 64 bits, stable.
- `readable_name(pk)` = "<adjective>-<animal>-<4 hex>" from the same hash, for logs and the
  dashboard only; it is not unique enough to identify a peer, the peer id is.
"""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_BYTES = 32
PRIVATE_KEY_BYTES = 32
SIGNATURE_BYTES = 64
PEER_ID_PREFIX = "hs"

# 64 words each: a byte of the hash picks one (256 % 64 == 0, so no bias).
_ADJECTIVES = (
    "amber", "brave", "bright", "calm", "clever", "cosmic", "crisp", "curious",
    "dapper", "daring", "eager", "electric", "fancy", "fierce", "fluffy", "gentle",
    "giddy", "golden", "grand", "happy", "hazy", "humble", "icy", "jolly",
    "keen", "kind", "lively", "lucky", "lunar", "merry", "mighty", "misty",
    "nimble", "noble", "odd", "plucky", "polite", "proud", "quick", "quiet",
    "rapid", "rosy", "rustic", "shy", "silent", "silver", "sleek", "smooth",
    "snowy", "solar", "spry", "steady", "stormy", "sunny", "swift", "tidy",
    "tiny", "vivid", "wandering", "warm", "wild", "wise", "witty", "zesty",
)
_ANIMALS = (
    "albatross", "alpaca", "badger", "bat", "beaver", "bison", "bobcat", "camel",
    "caribou", "cheetah", "cobra", "condor", "coyote", "crane", "dingo", "dolphin",
    "eagle", "falcon", "ferret", "finch", "fox", "gazelle", "gecko", "gibbon",
    "heron", "hornet", "ibex", "ibis", "jackal", "jaguar", "koala", "lemur",
    "leopard", "llama", "lynx", "magpie", "marmot", "mole", "moose", "newt",
    "ocelot", "octopus", "orca", "otter", "owl", "panda", "panther", "pelican",
    "penguin", "puffin", "quail", "rabbit", "raven", "salmon", "seal", "shrike",
    "sparrow", "squid", "swan", "tapir", "tiger", "walrus", "wombat", "yak",
)
assert len(_ADJECTIVES) == 64 and len(_ANIMALS) == 64


def _key_hash(public_key: bytes) -> bytes:
    if not isinstance(public_key, (bytes, bytearray)) or len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(
            f"an Ed25519 public key is {PUBLIC_KEY_BYTES} raw bytes, got "
            f"{type(public_key).__name__} of length {len(public_key) if hasattr(public_key, '__len__') else '?'}"
        )
    return hashlib.sha256(bytes(public_key)).digest()


def peer_id_of(public_key: bytes) -> str:
    """Peer id of a raw 32-byte Ed25519 public key: "hs" + 16 hex digits of its sha256."""
    return PEER_ID_PREFIX + _key_hash(public_key)[:8].hex()


def readable_name(public_key: bytes) -> str:
    """Deterministic human-friendly name, e.g. "swift-otter-3fa2"; for display, not identification."""
    digest = _key_hash(public_key)
    # Bytes 8.. are used so the name is independent of the bits shown in the peer id.
    return f"{_ADJECTIVES[digest[8] % 64]}-{_ANIMALS[digest[9] % 64]}-{digest[10:12].hex()}"


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when `signature` is a valid Ed25519 signature of `message` by `public_key`; never raises."""
    try:
        if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
            return False
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), bytes(message))
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False
    except Exception:  # noqa: BLE001 - a verifier fed peer bytes must answer, not raise
        return False


class Identity:
    """A node's Ed25519 private key and what derives from it; sign with `.sign(message)`."""

    __slots__ = ("_key", "_public_key")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self._public_key = private_key.public_key().public_bytes_raw()

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> Identity:
        """Load from the raw 32-byte private key (seed); raises ValueError on any other length."""
        if not isinstance(raw, (bytes, bytearray)) or len(raw) != PRIVATE_KEY_BYTES:
            raise ValueError(
                f"an Ed25519 private key is {PRIVATE_KEY_BYTES} raw bytes, got "
                f"{type(raw).__name__} of length {len(raw) if hasattr(raw, '__len__') else '?'}"
            )
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(raw)))

    def private_bytes(self) -> bytes:
        """The raw 32-byte private key; keep it secret (the node writes it with mode 0600)."""
        return self._key.private_bytes_raw()

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte public key."""
        return self._public_key

    @property
    def peer_id(self) -> str:
        """See `peer_id_of`."""
        return peer_id_of(self._public_key)

    @property
    def name(self) -> str:
        """See `readable_name`."""
        return readable_name(self._public_key)

    def sign(self, message: bytes) -> bytes:
        """Ed25519 signature (64 bytes) of `message`."""
        return self._key.sign(bytes(message))

    def __repr__(self) -> str:
        # Never print key material.
        return f"Identity(peer_id={self.peer_id!r}, name={self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other._public_key == self._public_key

    def __hash__(self) -> int:
        return hash(self._public_key)
