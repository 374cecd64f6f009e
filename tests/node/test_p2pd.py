"""node/swarm/p2pd.py: p2pd's flags as it receives them, and its unix sockets (a real p2pd)."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from hivespec.node.swarm.p2pd import _RelayedP2P, socket_dir, start_p2pd, sweep_stale_sockets

RELAY = "/ip4/203.0.113.10/tcp/31337/p2p/QmS7nAbcy4J9msTgYy1y2mKLnsRFwE4CPb5crSZjVZCCqo"


def test_relayed_p2pd_gets_static_relays_and_no_discovery():
    args = _RelayedP2P._make_process_args("p2pd", autoRelay=True, trustedRelays=RELAY, forceReachabilityPrivate=1)
    assert "-relayDiscovery=0" in args and "-autoRelay=1" in args and f"-trustedRelays={RELAY}" in args


def _start():
    return start_p2pd(host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=None, use_relay=False, nat_port_map=False,
                      relays=(), identity_path=None, startup_timeout=30)


def _sockets(p2p) -> list[Path]:
    return [Path(p2p._daemon_listen_maddr["unix"]), Path(p2p._client_listen_maddr["unix"])]


def test_p2pd_sockets_are_ours_and_go_with_it_even_when_p2pd_died_first():
    directory = socket_dir()
    assert directory is not None and directory.stat().st_mode & 0o777 == 0o700

    async def run(kill_first: bool) -> list[Path]:
        p2p = await _start()
        await p2p.add_binary_stream_handler("hivespec.test.v1", lambda *_: None)  # the client's socket comes with one
        sockets = _sockets(p2p)
        assert all(s.parent == directory and s.name.startswith(f"{os.getpid()}-") and s.exists() for s in sockets)
        if kill_first:  # as the OOM killer would; hivemind then left p2pd's socket behind
            p2p._child.kill()
            await p2p._child.wait()
        await p2p.shutdown()
        return sockets

    for kill_first in (False, True):
        assert not [s for s in asyncio.run(run(kill_first)) if s.exists()], kill_first


def test_the_sockets_of_processes_that_are_gone_are_swept_and_no_others():
    directory = socket_dir()
    assert directory is not None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = [directory / f"{gone.pid}-p2pd-sweeptest01.sock", directory / f"{gone.pid}-p2pclient-sweeptest01.sock"]
    alive = directory / f"{os.getpid()}-p2pd-sweeptest02.sock"
    other = directory / "notes-p2p.sock"  # not named after a process: not ours to judge
    for path in (*stale, alive, other):
        path.touch()
    try:
        assert sorted(sweep_stale_sockets(directory)) == sorted(stale)
        assert not any(s.exists() for s in stale) and alive.exists() and other.exists()
        for path in stale:  # and a node's start sweeps them
            path.touch()

        async def start_and_stop() -> None:
            await (await _start()).shutdown()

        asyncio.run(start_and_stop())
        assert not any(s.exists() for s in stale) and alive.exists()
    finally:
        for path in (*stale, alive, other):
            path.unlink(missing_ok=True)


def test_a_torn_p2p_key_is_replaced_and_p2pd_starts_with_the_same_key_after(tmp_path, caplog):
    """A node killed (or a laptop losing power) just after its first start left p2p.key empty or cut short: p2pd then
    refused every later start ("proto: cannot parse invalid wire-format data"). Such a file holds no key to keep."""
    key = tmp_path / "p2p.key"

    async def peer_id() -> str:
        p2p = await start_p2pd(host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=None, use_relay=False,
                               nat_port_map=False, relays=(), identity_path=str(key), startup_timeout=30)
        try:
            return p2p.peer_id.to_base58()
        finally:
            await p2p.shutdown()

    first = asyncio.run(peer_id())  # a new key: written whole, never readable by others
    assert key.stat().st_mode & 0o077 == 0 and not list(tmp_path.glob(".p2p.key.*"))
    whole = key.read_bytes()
    assert asyncio.run(peer_id()) == first and key.read_bytes() == whole  # a good key is kept
    for torn in (b"", whole[: len(whole) // 2], b"\xff" * 40):
        key.chmod(0o600)
        key.write_bytes(torn)
        caplog.clear()
        replaced = asyncio.run(peer_id())
        assert replaced != first and "holds no libp2p key" in caplog.text
        assert asyncio.run(peer_id()) == replaced  # and the new key is kept from then on
