"""A fixed swarm.port another process listens on is refused before p2pd starts (p2pd would share it silently)."""

from __future__ import annotations

import logging
import socket

import pytest

from hivespec.node.config import SwarmConfig
from hivespec.node.swarm.gossip import Gossip, GossipError
from hivespec.node.swarm.ports import port_in_use
from hivespec.protocol.identity import Identity


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_second_node_on_a_fixed_port_another_node_listens_on_takes_a_free_one_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As a node and a bootstrap peer of the `public` preset (both on 31337) on one machine: the second listens elsewhere
    and the two join; where swarm.announce_maddrs names the taken port, it refuses to start instead."""
    port = _free_port()
    first = Gossip(Identity.generate(), SwarmConfig(swarm="ports-test", port=port))
    first.start()
    nodes = [first]
    try:
        assert any(f"/tcp/{port}/" in m for m in first.visible_maddrs)
        with caplog.at_level(logging.WARNING, logger="hivespec.node.swarm.gossip"):
            second = Gossip(Identity.generate(), SwarmConfig(swarm="ports-test", port=port,
                                                             initial_peers=first.visible_maddrs))
            second.start()
            nodes.append(second)
        assert not any(f"/tcp/{port}/" in m for m in second.visible_maddrs)
        assert second.status()["joined_via"] and not second.status()["solo"]  # it reached the first node, not itself
        warned = [r.getMessage() for r in caplog.records if "is taken" in r.getMessage()]
        assert len(warned) == 1 and f"port {port} on 127.0.0.1 is taken" in warned[0], warned
        assert "listening on any free port instead (set swarm.port to choose one)" in warned[0]
        pinned = Gossip(Identity.generate(), SwarmConfig(swarm="ports-test", port=port,
                                                         announce_maddrs=[f"/ip4/203.0.113.7/tcp/{port}"]))
        with pytest.raises(GossipError, match="swarm.announce_maddrs tells peers to reach this node there"):
            pinned.start()
    finally:
        for node in nodes:
            node.shutdown()
    assert port_in_use("127.0.0.1", port) is None  # free again once the node stopped


def test_connections_of_an_earlier_run_in_time_wait_do_not_count_as_taken() -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert port_in_use("127.0.0.1", port)  # a listener: taken
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: its end of the connection waits in TIME_WAIT on `port`
        client.close()
    assert port_in_use("127.0.0.1", port) is None
    with socket.socket() as plain, pytest.raises(OSError):  # what a bind without SO_REUSEADDR would have said
        plain.bind(("127.0.0.1", port))


def test_a_node_restarted_at_once_after_a_crash_gets_its_fixed_port_back() -> None:
    """Its old p2pd still listens for a moment after the node is killed: the new node waits for it, briefly."""
    import subprocess
    import sys

    port = _free_port()
    crashed = subprocess.Popen([sys.executable, "-c", (
        "from hivespec.node.config import SwarmConfig\n"
        "from hivespec.node.swarm.gossip import Gossip\n"
        "from hivespec.protocol.identity import Identity\n"
        f"Gossip(Identity.generate(), SwarmConfig(swarm='ports-test', port={port})).start()\n"
        "print('up', flush=True)\n"
        "import time; time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert crashed.stdout.readline().strip() == "up" and port_in_use("127.0.0.1", port)
    finally:
        crashed.kill()
        crashed.wait()
    restarted = Gossip(Identity.generate(), SwarmConfig(swarm="ports-test", port=port))
    restarted.start()  # no "port in use": the killed node's p2pd let go within the grace
    try:
        assert any(f"/tcp/{port}/" in m for m in restarted.visible_maddrs)
    finally:
        restarted.shutdown()
