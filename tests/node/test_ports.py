"""A fixed swarm.port another process listens on is refused before p2pd starts (p2pd would share it silently)."""

from __future__ import annotations

import logging
import socket
import tempfile
import threading
import time
from pathlib import Path

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


def test_two_nodes_started_at_once_on_one_fixed_port_do_not_both_take_it(caplog: pytest.LogCaptureFixture) -> None:
    """Both ask while neither p2pd listens yet (a script starting a node per GPU): the port goes to one, the other
    node listens elsewhere and says so, as it would have a second later."""
    import threading

    port = _free_port()
    nodes = [Gossip(Identity.generate(), SwarmConfig(swarm="ports-test", port=port)) for _ in range(2)]
    together = threading.Barrier(len(nodes))
    failures: list[BaseException] = []

    def start(node: Gossip) -> None:
        together.wait()
        try:
            node.start()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            failures.append(exc)

    threads = [threading.Thread(target=start, args=(node,)) for node in nodes]
    try:
        with caplog.at_level(logging.WARNING, logger="hivespec.node.swarm.gossip"):
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
        assert not failures, failures
        on_port = [node for node in nodes if any(f"/tcp/{port}/" in m for m in node.visible_maddrs)]
        assert len(on_port) == 1, [node.visible_maddrs for node in nodes]
        assert sum("is taken" in r.getMessage() for r in caplog.records) == 1
    finally:
        for node in nodes:
            node.shutdown()


def test_a_port_claim_is_held_by_one_process_at_a_time_and_let_go_on_release() -> None:
    from hivespec.node.swarm.ports import PortClaim

    port = _free_port()
    with PortClaim(port, timeout=1.0) as first:
        assert first.held
        waited = PortClaim(port, timeout=0.2)  # another open file of the lock: as another process would
        assert not waited.held  # held past its timeout: it goes on without a claim
    assert not first.held
    with PortClaim(port, timeout=0.2) as after:
        assert after.held
    assert not PortClaim(0, timeout=1.0).held  # any free port: nothing to claim
    assert not _claim_file(port).exists()  # a claim leaves no file behind


def _claim_file(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"hivespec-port-{port}.lock"


def test_a_claim_waiting_on_a_file_its_holder_removed_claims_the_file_now_at_that_path() -> None:
    from hivespec.node.swarm.ports import PortClaim

    port = _free_port()
    first = PortClaim(port, timeout=1.0)
    waiting: list[PortClaim] = []
    waiter = threading.Thread(target=lambda: waiting.append(PortClaim(port, timeout=5.0)))
    waiter.start()
    time.sleep(0.3)  # the waiter has opened the held file and polls its lock
    first.release()  # removes that file, then lets go: the waiter's lock is on a file no longer at the path
    waiter.join()
    second = waiting[0]
    assert second.held and _claim_file(port).exists()  # it started over on a file at the path, and holds it
    assert not PortClaim(port, timeout=0.2).held  # so a newcomer opening that path waits on the same claim
    second.release()
    assert not _claim_file(port).exists()


def test_a_claim_file_a_crashed_node_left_is_claimed_and_removed() -> None:
    from hivespec.node.swarm.ports import PortClaim

    port = _free_port()
    _claim_file(port).touch()  # its holder died: the OS let go of the lock, the file stayed
    with PortClaim(port, timeout=0.2) as claim:
        assert claim.held
    assert not _claim_file(port).exists()
