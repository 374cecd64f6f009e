"""Ed25519 identity, peer ids, readable names and signature checks."""

import re

import pytest

from hivespec.protocol.identity import Identity, peer_id_of, readable_name, verify_signature


def test_generate_and_reload_from_private_bytes():
    ident = Identity.generate()
    raw = ident.private_bytes()
    assert len(raw) == 32 and len(ident.public_key) == 32
    again = Identity.from_private_bytes(raw)
    assert again.public_key == ident.public_key and again == ident
    assert again.peer_id == ident.peer_id and again.name == ident.name


def test_peer_id_and_name_format_and_stability():
    pk = bytes(range(32))
    assert peer_id_of(pk) == peer_id_of(bytes(range(32)))
    assert re.fullmatch(r"hs[0-9a-f]{16}", peer_id_of(pk))
    assert re.fullmatch(r"[a-z]+-[a-z]+-[0-9a-f]{4}", readable_name(pk))
    assert readable_name(pk) == readable_name(bytes(range(32)))
    # Pinned so a change to the derivation (which would rename every peer) is deliberate.
    assert peer_id_of(b"\x00" * 32) == "hs66687aadf862bd77"
    ids = {Identity.generate().peer_id for _ in range(50)}
    assert len(ids) == 50


@pytest.mark.parametrize("bad", [b"", b"\x00" * 31, b"\x00" * 33, "x" * 32])
def test_bad_key_lengths_raise_value_error(bad):
    with pytest.raises(ValueError, match="32 raw bytes"):
        peer_id_of(bad)
    with pytest.raises(ValueError, match="32 raw bytes"):
        Identity.from_private_bytes(bad)


def test_sign_and_verify():
    ident, other = Identity.generate(), Identity.generate()
    sig = ident.sign(b"message")
    assert len(sig) == 64
    assert verify_signature(ident.public_key, sig, b"message")
    assert not verify_signature(ident.public_key, sig, b"messagE")
    assert not verify_signature(other.public_key, sig, b"message")
    flipped = bytes([sig[0] ^ 1]) + sig[1:]
    assert not verify_signature(ident.public_key, flipped, b"message")


@pytest.mark.parametrize(
    ("pk", "sig", "msg"),
    [(b"", b"\x00" * 64, b"m"), (b"\x00" * 32, b"\x00" * 63, b"m"), (None, None, None), ("pk", 3, object()),
     (b"\xff" * 32, b"\xff" * 64, b"m")],
)
def test_verify_never_raises(pk, sig, msg):
    assert verify_signature(pk, sig, msg) is False


def test_repr_hides_key_material():
    ident = Identity.generate()
    text = repr(ident)
    assert ident.peer_id in text and ident.private_bytes().hex() not in text
