"""Private swarm: AEAD bodies and index records, allowlist, and an outsider process that knows the DHT address."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hivespec.node.config import SwarmConfig
from hivespec.node.swarm.gossip import Fetched, Gossip
from hivespec.protocol.envelope import Kind, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.private import (
    OVERHEAD,
    PrivateSwarm,
    parse_allowlist,
    parse_secret,
)

ROOT = Path(__file__).resolve().parents[2]
SWARM = "test-private"


def lab(*members: Identity, secret: bytes = b"\x11" * 32) -> PrivateSwarm:
    return PrivateSwarm.create(SWARM, secret, {m.public_key for m in members})


def sample_until(node: Gossip, timeout: float) -> list[Fetched]:
    """Sample rollout batches until some arrive or `timeout` s pass (a record may take a moment to reach the DHT)."""
    deadline = time.monotonic() + timeout
    while True:
        got = node.sample_rollouts(k=4, max_age_s=600.0, timeout=5.0)
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_bodies_round_trip_and_fail_anywhere_else() -> None:
    alice = Identity.generate()
    swarm = lab(alice)
    sealed = swarm.seal_body(b"rollouts", context="hivespec/test-private/rollouts/0")
    assert len(sealed) == len(b"rollouts") + OVERHEAD
    assert sealed != swarm.seal_body(b"rollouts", context="hivespec/test-private/rollouts/0")  # fresh nonce each time
    verdict, plain = swarm.open_body(sealed, context="hivespec/test-private/rollouts/0")
    assert verdict.ok and plain == b"rollouts"
    assert not swarm.open_body(sealed, context="hivespec/test-private/rollouts/1")[0].ok  # moved to another slot
    assert not swarm.open_index(sealed, context="hivespec/test-private/rollouts/0")[0].ok  # index key differs
    assert not lab(alice, secret=b"\x22" * 32).open_body(sealed, context="hivespec/test-private/rollouts/0")[0].ok
    other = PrivateSwarm.create("other-lab", b"\x11" * 32, {alice.public_key})
    assert not other.open_body(sealed, context="hivespec/test-private/rollouts/0")[0].ok  # same secret, other swarm id
    for i in range(len(sealed)):
        flipped = bytearray(sealed)
        flipped[i] ^= 0x01
        assert not swarm.open_body(bytes(flipped), context="hivespec/test-private/rollouts/0")[0].ok
    for junk in (b"", b"\x01" * (OVERHEAD - 1), b"\x02" + sealed[1:], "text"):
        assert not swarm.open_body(junk, context="x")[0].ok


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        PrivateSwarm.create(SWARM, b"short", {Identity.generate().public_key})
    with pytest.raises(ValueError, match="empty"):
        PrivateSwarm.create(SWARM, b"\x00" * 32, set())
    with pytest.raises(ValueError, match="64 hex"):
        parse_secret("abcd")
    key = Identity.generate().public_key
    assert parse_allowlist(f"# members\n{key.hex()} alice\n\n") == {key}


@pytest.mark.timeout(180)
def test_an_outsider_can_neither_inject_nor_read(tmp_path: Path) -> None:
    alice, bob = Identity.generate(), Identity.generate()
    swarm = lab(alice, bob)
    a = Gossip(alice, SwarmConfig(swarm=SWARM, request_timeout=5.0), private=swarm)
    a.start()
    b = Gossip(bob, SwarmConfig(swarm=SWARM, initial_peers=a.visible_maddrs, request_timeout=5.0), private=swarm)
    b.start()
    try:
        marker = os.urandom(16)
        body = seal(alice, Kind.ROLLOUTS, 1, marker * 100)
        a.publish_rollouts(body, version=1)
        got = sample_until(b, timeout=30)
        assert [(f.author_peer_id, f.body) for f in got] == [(alice.peer_id, body)]  # members read each other
        digest = got[0].sha256
        wire = a.bodies.lookup(digest)
        assert len(a.bodies) == 1 and wire is not None
        assert marker not in wire and hashlib.sha256(wire).digest() == digest
        # The index key publish_rollouts announced under (the first alice placed a record under): the bucket's root
        # key in a swarm this small, which anyone who knows the swarm name and the clock can compute.
        key = next(iter(a.rollouts.placed.values()))
        assert key.startswith(f"hivespec/{SWARM}/rollouts/") and key.endswith("/0/0")

        # The outsider even gets the ciphertext's hash and size, which it could not learn itself.
        command = [sys.executable, "-P", str(ROOT / "tests/mallory/outsider.py"), a.visible_maddrs[0], SWARM, key,
                   digest.hex(), marker.hex(), str(len(wire))]
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=150, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        seen = json.loads(result.stdout.strip().splitlines()[-1])
        assert seen["records_seen"] >= 1  # the records are there, but sealed
        assert not seen["marker_in_records"] and not seen["marker_in_body"]
        assert seen["body_bytes"] == len(wire)  # what it downloaded is the ciphertext, useless without the secret

        # Its own announce was refused by the members' validators; members fetch nothing from it.
        assert seen["injected_store_failed"] == 1
        assert b.sample_rollouts(k=4, max_age_s=600.0, timeout=5.0) == []
        assert a.sample_rollouts(k=4, max_age_s=600.0, timeout=5.0) == []
        refused = a.validator.rejected + b.validator.rejected
        assert refused["not_on_allowlist"] >= 1, refused
        assert a.stats()["bodies_fetched"] == 0
    finally:
        b.shutdown()
        a.shutdown()


@pytest.mark.timeout(180)
def test_members_with_different_secrets_are_told_so(caplog) -> None:
    """A member whose secret file is stale (or whose swarm name differs) shared nothing, and nothing said why: each
    side's records were refused at debug. Each side now warns once, naming the member and its own secret's fingerprint."""
    alice, bob = Identity.generate(), Identity.generate()
    ours, stale = lab(alice, bob), lab(alice, bob, secret=b"\x22" * 32)
    caplog.set_level(logging.WARNING, logger="hivespec.node.swarm.dht_guard")
    a = Gossip(alice, SwarmConfig(swarm=SWARM, request_timeout=5.0), private=ours)
    a.start()
    b = Gossip(bob, SwarmConfig(swarm=SWARM, initial_peers=a.visible_maddrs, request_timeout=5.0), private=stale)
    b.start()
    try:
        a.publish_rollouts(seal(alice, Kind.ROLLOUTS, 1, b"alice" * 100), version=1)
        b.publish_rollouts(seal(bob, Kind.ROLLOUTS, 1, b"bob" * 100), version=1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert a.sample_rollouts(k=4, max_age_s=600.0, timeout=5.0) == []  # nothing crosses
            assert b.sample_rollouts(k=4, max_age_s=600.0, timeout=5.0) == []
            told = [r.getMessage() for r in caplog.records if "do not decrypt with this node's swarm secret" in r.getMessage()]
            if len(told) >= 2:
                break
            time.sleep(0.5)
        assert len(told) == 2, told  # once each, however many records each refuses
        by_alice = next(m for m in told if bob.peer_id in m)
        by_bob = next(m for m in told if alice.peer_id in m)
        assert f"fingerprint {ours.secret_fingerprint}" in by_alice and f"fingerprint {stale.secret_fingerprint}" in by_bob
        assert a.validator.rejected["index_not_decryptable"] >= 1 and b.validator.rejected["index_not_decryptable"] >= 1
    finally:
        b.shutdown()
        a.shutdown()
