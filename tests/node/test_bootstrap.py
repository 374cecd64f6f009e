"""Bootstrap sources, the peer cache, the home lock, and `hivespec bootstrap` as a real process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hivespec.node.config import SwarmConfig
from hivespec.node.swarm.bootstrap import (
    PEERS_ENV,
    HomeLock,
    IdentityInUse,
    PeerCache,
    bootstrap_candidates,
    read_peers_file,
)
from hivespec.node.swarm.gossip import Gossip
from hivespec.node.swarm.private_files import load_private_swarm
from hivespec.protocol.identity import Identity

ROOT = Path(__file__).resolve().parents[2]
A = "/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWGAeBwmWNYQwRDrDzeVdFxeWDrou7MZ99wpNfUjFJzWJV"
B = "/dns4/boot.example.org/tcp/31337/p2p/12D3KooWCGpeCN815n2saDH1K93ukj4cpBWUJPi1RdQWV1nBZwfD"
C = "/ip4/127.0.0.1/tcp/5000/p2p/12D3KooWH9XFi1iYhnGKNPNWSe3H6PrThK6Yc1gGkoonjSs1pUYG"


def test_candidates_come_from_every_source_in_order_without_repeats(tmp_path: Path) -> None:
    peers_file = tmp_path / "peers.txt"
    peers_file.write_text(f"# lab bootstrap peers\n{B}\n\n{A}  # again\n")
    cache = PeerCache(tmp_path / "cache.json")
    cache.remember([C, "not a multiaddr"], now=100.0)
    got = bootstrap_candidates([A], peers_file=peers_file, cache=PeerCache.load(cache.path), environ={PEERS_ENV: f"{C}, {B}"})
    assert got == [("config", A), ("env", C), ("env", B)]
    assert bootstrap_candidates([], cache=PeerCache.load(cache.path), environ={}) == [("cache", C)]


def test_malformed_sources_fail_with_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "peers.txt"
    bad.write_text(f"{A}\n/ip4/1.2.3.4/tcp/1\n")
    with pytest.raises(ValueError, match="line 2"):
        read_peers_file(bad)
    with pytest.raises(ValueError, match="from env"):
        bootstrap_candidates([], environ={PEERS_ENV: "hello"})
    (tmp_path / "cache.json").write_text("[broken")
    assert PeerCache.load(tmp_path / "cache.json").maddrs() == []  # the cache is a hint: never fatal


@pytest.mark.parametrize("maddr, reason", [
    ("/ip4/boot.example.org/tcp/31337/p2p/12D3KooWGAeBwmWNYQwRDrDzeVdFxeWDrou7MZ99wpNfUjFJzWJV",
     "base address 'boot.example.org' is not IPv4; a host name goes under /dns4/ or /dns6/"),
    ("/ip4/1.2.3/tcp/31337/p2p/12D3KooWGAeBwmWNYQwRDrDzeVdFxeWDrou7MZ99wpNfUjFJzWJV", "base address '1.2.3' is not IPv4"),
    ("/ip4/1.2.3.4/tcp/31337/p2p/Qmbadbadbadbadbadbadbadbadbadbadbadbad", "the peer id after /p2p/ does not decode"),
])
def test_a_multiaddr_of_the_right_form_that_does_not_parse_is_refused_before_the_node_starts(maddr: str, reason: str) -> None:
    """Such an entry had passed the input checks and then stopped gossip's start, whatever other peers were listed."""
    from hivespec.node.config import InputError, load_config
    from hivespec.node.inputs import check_swarm_inputs
    from hivespec.node.swarm.bootstrap import is_bootstrap_maddr, maddr_problem

    assert not is_bootstrap_maddr(maddr) and maddr_problem(maddr) == reason
    with pytest.raises(ValueError, match="from config"):
        bootstrap_candidates([A, maddr], environ={})
    config = load_config("tiny", overrides={"swarm.initial_peers": f"[{A!r}, {maddr!r}]"})
    with pytest.raises(InputError, match=f"is not a peer's multiaddr \\({re.escape(reason)}\\)"):
        check_swarm_inputs(config)
    assert all(is_bootstrap_maddr(m) for m in (A, B, C))


def test_cache_keeps_the_newest_peers(tmp_path: Path) -> None:
    cache = PeerCache(tmp_path / "c.json")
    maddrs = [f"/ip4/10.0.0.{i}/tcp/4001/p2p/12D3KooWGAeBwmWNYQwRDrDzeVdFxeWDrou7MZ99wpNfUjFJzWJV" for i in range(100)]
    for i, m in enumerate(maddrs):
        cache.remember([m], now=float(i))
    assert PeerCache.load(cache.path).maddrs() == maddrs[::-1][:64]


def test_home_lock_refuses_a_second_holder(tmp_path: Path) -> None:
    lock = HomeLock(tmp_path)
    with pytest.raises(IdentityInUse, match="already running"):
        HomeLock(tmp_path)
    lock.close()
    HomeLock(tmp_path).close()


def test_private_swarm_settings_are_checked(tmp_path: Path) -> None:
    allow = tmp_path / "allow.txt"
    allow.write_text(Identity.generate().public_key.hex() + "  # alice\n")
    assert load_private_swarm("lab", allowlist_file=None, secret_file=None, environ={}) is None
    with pytest.raises(ValueError, match="no secret"):
        load_private_swarm("lab", allowlist_file=str(allow), secret_file=None, environ={})
    with pytest.raises(ValueError, match="allowlist_file is not"):
        load_private_swarm("lab", allowlist_file=None, secret_file=None, environ={"HIVESPEC_SWARM_SECRET": "00" * 32})
    swarm = load_private_swarm("lab", allowlist_file=str(allow), secret_file=None, environ={"HIVESPEC_SWARM_SECRET": "ab" * 32})
    assert swarm is not None and len(swarm.allowlist) == 1
    allow.write_text("deadbeef\n")
    with pytest.raises(ValueError, match="line 1"):
        load_private_swarm("lab", allowlist_file=str(allow), secret_file=None, environ={"HIVESPEC_SWARM_SECRET": "ab" * 32})


def test_a_secret_file_every_user_can_read_is_refused(tmp_path: Path) -> None:
    """`print(secrets.token_hex(32)) > secret` under the usual umask 022 leaves it 0644: any user of a shared lab machine
    could read the swarm's secret, and the node had started with it without a word."""
    allow, secret = tmp_path / "allow.txt", tmp_path / "secret.txt"
    allow.write_text(Identity.generate().public_key.hex() + "\n")
    secret.write_text("ab" * 32 + "\n")
    for mode in (0o644, 0o604):
        secret.chmod(mode)
        with pytest.raises(ValueError, match=rf"secret_file '{secret}' has mode {mode:04o}: every user .* `chmod 600 {secret}`"):
            load_private_swarm("lab", allowlist_file=str(allow), secret_file=str(secret), environ={})
    for mode in (0o600, 0o640):  # the owner only, or a lab's group
        secret.chmod(mode)
        assert load_private_swarm("lab", allowlist_file=str(allow), secret_file=str(secret), environ={}) is not None


def test_a_bad_swarm_file_is_named(tmp_path: Path) -> None:
    """A raw secret (`openssl rand 32 > secret`) had ended in "'utf-8' codec can't decode byte ...", naming no file; a
    short secret or a bad allowlist line named no file either, where a lab has several."""
    allow, secret = tmp_path / "allow.txt", tmp_path / "secret.bin"
    allow.write_text(Identity.generate().public_key.hex() + "\n")
    secret.write_bytes(b"\xa3" * 32)
    secret.chmod(0o600)
    with pytest.raises(ValueError, match=rf"swarm.private.secret_file '{secret}' is not text: it must hold hex digits"):
        load_private_swarm("lab", allowlist_file=str(allow), secret_file=str(secret), environ={})
    secret.write_text("ab" * 16)
    with pytest.raises(ValueError, match=rf"swarm.private.secret_file '{secret}': the swarm secret is 16 bytes, expected 32"):
        load_private_swarm("lab", allowlist_file=str(allow), secret_file=str(secret), environ={})
    with pytest.raises(ValueError, match=r"\$HIVESPEC_SWARM_SECRET: the swarm secret is not hex"):
        load_private_swarm("lab", allowlist_file=str(allow), secret_file=None, environ={"HIVESPEC_SWARM_SECRET": "secret"})
    allow.write_bytes(b"\xff\xfe" + allow.read_bytes())
    with pytest.raises(ValueError, match=rf"swarm.private.allowlist_file '{allow}' is not text"):
        load_private_swarm("lab", allowlist_file=str(allow), secret_file=None, environ={"HIVESPEC_SWARM_SECRET": "ab" * 32})
    allow.write_text("deadbeef\n")
    with pytest.raises(ValueError, match=rf"swarm.private.allowlist_file '{allow}': allowlist line 1"):
        load_private_swarm("lab", allowlist_file=str(allow), secret_file=None, environ={"HIVESPEC_SWARM_SECRET": "ab" * 32})


@pytest.mark.timeout(120)
def test_bootstrap_command_prints_maddrs_and_refuses_a_second_instance(tmp_path: Path) -> None:
    command = [sys.executable, "-P", "-m", "hivespec.node.cli", "bootstrap", "--config", "tiny", "--home", str(tmp_path),
               "--set", "swarm.swarm=test-bootstrap", "--duration", "60"]
    first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [first.stdout.readline() for _ in range(2)]
        assert "bootstrap peer" in lines[0], lines
        maddr = lines[1].strip()
        assert maddr.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in maddr

        second = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert second.returncode == 3
        assert "already running with the identity" in second.stderr

        # A node joins through it.
        node = Gossip(Identity.generate(), SwarmConfig(swarm="test-bootstrap", initial_peers=[maddr], bootstrap_timeout=10.0))
        node.start()
        try:
            status = node.status()
            assert not status["solo"] and status["joined_via"] == f"config {maddr}"
        finally:
            node.shutdown()
    finally:
        first.terminate()
        first.wait(timeout=30)
