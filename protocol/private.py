"""Private lab swarm: a swarm id, an allowlist of Ed25519 public keys and a 32-byte swarm secret.

What it protects, on top of the public swarm's signatures:
- **Membership**: index records and bodies are accepted only from authors on the allowlist
  (checked by the DHT record validator on store and on read, and by intake).
- **Confidentiality**: bodies and index records are encrypted with ChaCha20-Poly1305
  (`cryptography`'s AEAD). An outsider that reaches the DHT sees ciphertext only: it cannot
  learn which bodies exist, fetch one it can read, or forge a record a member would accept.

Keys: one 256-bit key per purpose, HKDF-SHA256(secret, info = "hivespec/private/v1/<purpose>/"
+ swarm id), so the body and index keys are independent and a secret reused for another swarm
id gives unrelated keys.

Nonces: 96 random bits from `os.urandom` per message, sent in front of the ciphertext. The
rule for ChaCha20-Poly1305 is never to reuse a (key, nonce) pair; with random nonces the chance
of any repeat after n messages under one key is about n^2 / 2^97, i.e. below 2^-33 even after
2^32 messages, far beyond what a lab swarm sends before it rotates its secret. Random nonces need
no counter state, so restarts and many writers sharing one key are safe.

Associated data binds each ciphertext to its swarm id and to a context chosen by the caller
(the DHT key for index records and bodies), so a ciphertext moved to another slot or swarm
fails authentication instead of being read in the wrong place.

Wire form: ``b"\\x01" || nonce (12 B) || ciphertext || tag (16 B)``.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .identity import PUBLIC_KEY_BYTES
from .verdict import Reason, Verdict

SECRET_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
FORMAT_VERSION = 1
OVERHEAD = 1 + NONCE_BYTES + TAG_BYTES
_AAD_TAG = b"hivespec/private/aead/v1\0"


@dataclass(frozen=True)
class PrivateSwarm:
    """Membership and keys of one private swarm; build it with `PrivateSwarm.create`."""

    swarm_id: str
    allowlist: frozenset[bytes]
    _body: ChaCha20Poly1305 = field(repr=False, compare=False)
    _index: ChaCha20Poly1305 = field(repr=False, compare=False)
    secret_fingerprint: str = ""  # first 8 hex of an HMAC of the secret: tells two configs apart in logs

    @classmethod
    def create(cls, swarm_id: str, secret: bytes, allowlist: frozenset[bytes] | set[bytes]) -> PrivateSwarm:
        """Derive the swarm's keys; raises ValueError on a short secret or a malformed public key."""
        if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
            raise ValueError(
                f"the swarm secret must be exactly {SECRET_BYTES} bytes (64 hex digits), got "
                f"{len(secret) if isinstance(secret, bytes) else type(secret).__name__}; create one with "
                "`python -c 'import secrets; print(secrets.token_hex(32))'`"
            )
        keys = frozenset(allowlist)
        bad = [k for k in keys if not isinstance(k, bytes) or len(k) != PUBLIC_KEY_BYTES]
        if bad:
            raise ValueError(f"allowlist entries must be {PUBLIC_KEY_BYTES}-byte Ed25519 public keys, got {bad[0]!r:.80}")
        if not keys:
            raise ValueError("the allowlist is empty: a private swarm needs its members' public keys")
        fingerprint = hmac.new(secret, b"hivespec/private/fingerprint", "sha256").hexdigest()[:8]
        return cls(
            swarm_id,
            keys,
            ChaCha20Poly1305(_derive(secret, "body", swarm_id)),
            ChaCha20Poly1305(_derive(secret, "index", swarm_id)),
            fingerprint,
        )

    def allows(self, public_key: bytes) -> bool:
        """Whether `public_key` is a member."""
        return public_key in self.allowlist

    def seal_body(self, plaintext: bytes, *, context: str) -> bytes:
        """Encrypt a body (a sealed envelope) for members; `context` is the DHT key it is announced under."""
        return self._seal(self._body, plaintext, context)

    def open_body(self, data: bytes, *, context: str) -> tuple[Verdict, bytes | None]:
        """Decrypt a body; a reject verdict when it was not sealed with this swarm's key for `context`."""
        return self._open(self._body, data, context)

    def seal_index(self, plaintext: bytes, *, context: str) -> bytes:
        """Encrypt an index record body (see `announce.py`)."""
        return self._seal(self._index, plaintext, context)

    def open_index(self, data: bytes, *, context: str) -> tuple[Verdict, bytes | None]:
        """Decrypt an index record body."""
        return self._open(self._index, data, context)

    def _aad(self, context: str) -> bytes:
        swarm, ctx = self.swarm_id.encode(), context.encode()
        return _AAD_TAG + len(swarm).to_bytes(2, "little") + swarm + ctx

    def _seal(self, aead: ChaCha20Poly1305, plaintext: bytes, context: str) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return bytes([FORMAT_VERSION]) + nonce + aead.encrypt(nonce, bytes(plaintext), self._aad(context))

    def _open(self, aead: ChaCha20Poly1305, data: bytes, context: str) -> tuple[Verdict, bytes | None]:
        if not isinstance(data, (bytes, bytearray)):
            return Verdict.reject(Reason.BAD_TYPE, f"expected bytes, got {type(data).__name__}"), None
        if len(data) < OVERHEAD:
            return Verdict.reject(Reason.BAD_LENGTH, f"{len(data)} bytes is shorter than the AEAD overhead {OVERHEAD}"), None
        if data[0] != FORMAT_VERSION:
            return Verdict.reject(Reason.BAD_VERSION, f"private format {data[0]}, this node speaks {FORMAT_VERSION}"), None
        nonce = bytes(data[1 : 1 + NONCE_BYTES])
        try:
            plaintext = aead.decrypt(nonce, bytes(data[1 + NONCE_BYTES :]), self._aad(context))
        except InvalidTag:
            return Verdict.reject(
                Reason.BAD_SIGNATURE,
                f"AEAD tag does not verify for swarm {self.swarm_id!r} (secret {self.secret_fingerprint}): "
                "sealed by an outsider, for another slot, or with another secret",
            ), None
        return Verdict.accept(), plaintext


def _derive(secret: bytes, purpose: str, swarm_id: str) -> bytes:
    info = f"hivespec/private/v1/{purpose}/{swarm_id}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def parse_allowlist(text: str) -> frozenset[bytes]:
    """Public keys from an allowlist file: one 64-hex-digit key per line; blank lines and # comments skipped.

    Raises ValueError naming the line that is not a key.
    """
    keys = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        token = line.split()[0]
        try:
            key = bytes.fromhex(token)
        except ValueError:
            key = b""
        if len(key) != PUBLIC_KEY_BYTES:
            raise ValueError(
                f"allowlist line {number}: {token[:80]!r} is not a {PUBLIC_KEY_BYTES}-byte hex public key "
                "(`hivespec identity show` prints a node's public_key)"
            )
        keys.add(key)
    return frozenset(keys)


def parse_secret(text: str) -> bytes:
    """The swarm secret from its hex form (64 hex digits, surrounding whitespace ignored); raises ValueError."""
    token = text.strip()
    try:
        secret = bytes.fromhex(token)
    except ValueError:
        raise ValueError("the swarm secret is not hex; expected 64 hex digits") from None
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"the swarm secret is {len(secret)} bytes, expected {SECRET_BYTES} (64 hex digits)")
    return secret
