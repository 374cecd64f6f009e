"""Gossip over real hivemind on 127.0.0.1 (no mocks): announce, fetch, tamper, chunking, shutdown."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from hivespec.node.gossip import CHUNK_BYTES, Gossip, GossipError
from hivespec.protocol.codec import pack
from hivespec.protocol.envelope import Kind, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.keys import rollout_round_key

SWARM = "test-gossip"
pytestmark = pytest.mark.timeout(180)


def start_node(initial_peers: list[str] = (), **kwargs) -> Gossip:
    node = Gossip(Identity.generate(), swarm=SWARM, initial_peers=initial_peers, request_timeout=5.0, **kwargs)
    node.start()
    return node


def p2pd_pid(node: Gossip) -> int:
    return node._p2p._child.pid


def gossip_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hivespec-gossip"]


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[Gossip]]:
    """Three nodes, the second and third bootstrapped from the first; torn down with a leak check."""
    first = start_node()
    nodes = [first, start_node(first.visible_maddrs), start_node(first.visible_maddrs)]
    pids = [p2pd_pid(n) for n in nodes]
    yield nodes
    for node in nodes:
        node.shutdown()
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_every_node_gets_every_other_body(swarm: list[Gossip]) -> None:
    bodies = {node.identity.peer_id: os.urandom(200_000) for node in swarm}
    t0 = time.perf_counter()
    for node in swarm:
        node.publish(0, bodies[node.identity.peer_id])
    publish_s = time.perf_counter() - t0

    for node in swarm:
        t0 = time.perf_counter()
        got = node.wait_for_round(0, peers=2, timeout=30)
        fetch_s = time.perf_counter() - t0
        expected = {pid: body for pid, body in bodies.items() if pid != node.identity.peer_id}
        assert {f.author_peer_id: f.body for f in got} == expected
        print(f"3 nodes x 200 KB: publish x3 {publish_s * 1e3:.0f} ms, wait_for_round {fetch_s * 1e3:.0f} ms")
        # Already fetched: a second poll returns nothing new.
        assert node.fetch_round(0, timeout=5) == []
        assert node.stats()["bodies_fetched"] >= 2

    stats = swarm[0].stats()
    assert stats["bytes_in"] >= 400_000 and stats["bytes_out"] >= 400_000
    assert stats["bodies_served"] >= 2 and stats["bad_records"] == 0
    assert stats["known_peers"] >= 2


def test_body_over_one_chunk_goes_through(swarm: list[Gossip]) -> None:
    author, reader = swarm[0], swarm[1]
    body = os.urandom(3 * CHUNK_BYTES + 12345)
    author.publish(1, body)
    got = reader.wait_for_round(1, peers=1, timeout=30)
    assert [(f.author_peer_id, f.body) for f in got] == [(author.identity.peer_id, body)]
    with pytest.raises(ValueError, match="max_body_bytes"):
        author.publish(1, b"\0" * (author.max_body_bytes + 1))


def test_topics_are_separate_key_spaces(swarm: list[Gossip]) -> None:
    author, reader = swarm[0], swarm[2]
    author.publish(7, b"delta for version 7", topic="delta")
    got = reader.wait_for_round(7, peers=1, timeout=30, topic="delta")
    assert [f.body for f in got] == [b"delta for version 7"]
    assert reader.fetch_round(7, timeout=2) == []  # nothing under rollouts/7
    with pytest.raises(ValueError, match="unknown gossip topic"):
        author.publish(7, b"x", topic="gradients")


def announce(identity: Identity, round: int, body: bytes, mallory: Gossip, *, seq: int = 1) -> bytes:
    payload = {
        "round": round,
        "sha256": hashlib.sha256(body).digest(),
        "size": len(body),
        "p2p": mallory._p2p.peer_id.to_base58(),
        "maddrs": mallory.visible_maddrs,
    }
    return seal(identity, Kind.ANNOUNCE, seq, pack(payload))


def test_tampered_announces_are_skipped(swarm: list[Gossip], caplog: pytest.LogCaptureFixture) -> None:
    honest, victim, reader = swarm
    mallory = start_node(honest.visible_maddrs)
    try:
        round = 2
        key = rollout_round_key(SWARM, round)
        bogus = os.urandom(50_000)
        impostor = Identity.generate()
        bad_sig = bytearray(announce(impostor, round, bogus, mallory))
        bad_sig[-5] ^= 0xFF  # inside the signature, the last field of the msgpack map
        # A signed announce whose body does not hash to the announced sha256.
        liar = Identity.generate()
        lie_digest = hashlib.sha256(b"what was announced").digest()
        lie = seal(
            liar,
            Kind.ANNOUNCE,
            1,
            pack({"round": round, "sha256": lie_digest, "size": len(bogus), "p2p": mallory._p2p.peer_id.to_base58(),
                  "maddrs": mallory.visible_maddrs}),
        )
        records = {
            victim.identity.peer_id: announce(mallory.identity, round, bogus, mallory),  # someone else's subkey
            impostor.peer_id: bytes(bad_sig),
            "hs-garbage": b"\x92\x01\x02 not an envelope",
            mallory.identity.peer_id: announce(mallory.identity, round + 1, bogus, mallory),  # wrong round
            liar.peer_id: lie,
        }

        async def plant() -> None:
            mallory._bodies[lie_digest] = (round, bogus)  # mallory serves other bytes than announced
            for subkey, value in records.items():
                assert await mallory._dht.store(key, value, time.time() + 60, subkey=subkey)

        mallory._call(plant(), 30)
        body = os.urandom(100_000)
        honest.publish(round, body)

        before = reader.stats()["bad_records"]
        with caplog.at_level(logging.DEBUG, logger="hivespec.node.gossip"):
            got = reader.wait_for_round(round, peers=1, timeout=30)
            assert [(f.author_peer_id, f.body) for f in got] == [(honest.identity.peer_id, body)]
            # The liar's body is fetched concurrently with the honest one; give it time to be judged.
            deadline = time.monotonic() + 10
            while reader.stats()["bad_records"] - before < len(records) and time.monotonic() < deadline:
                assert reader.fetch_round(round, timeout=5) == []
            assert reader.stats()["bad_records"] - before == len(records)
            assert reader.fetch_round(round, timeout=5) == []  # bad records are counted and logged once
        assert reader.stats()["bad_records"] - before == len(records)
        skipped = [r.getMessage() for r in caplog.records if "skipped bad gossip record" in r.getMessage()]
        assert len(skipped) == len(records)
        assert any("stored under subkey" in m for m in skipped)
        assert any("bad_signature" in m for m in skipped)
        assert any("does not match" in m for m in skipped)
    finally:
        mallory.shutdown()


def test_shutdown_is_clean_and_idempotent() -> None:
    threads_before = len(gossip_threads())
    first = start_node()
    second = start_node(first.visible_maddrs)
    pids = [p2pd_pid(first), p2pd_pid(second)]
    assert all(psutil.pid_exists(pid) for pid in pids)
    assert len(gossip_threads()) == threads_before + 2
    second.publish(0, b"x" * 1000)
    assert first.wait_for_round(0, peers=1, timeout=30)[0].body == b"x" * 1000

    for node in (first, second, first):
        node.shutdown()
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert len(gossip_threads()) == threads_before
    with pytest.raises(GossipError, match="start"):
        first.publish(1, b"y")


def test_bad_arguments_fail_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="swarm name"):
        Gossip(Identity.generate(), swarm="Not A Swarm!")
    with pytest.raises(ValueError, match="request_timeout"):
        Gossip(Identity.generate(), swarm=SWARM, request_timeout=0)
    with pytest.raises(GossipError, match="start"):
        Gossip(Identity.generate(), swarm=SWARM).fetch_round(0, timeout=1)


def test_start_fails_clearly_when_no_initial_peer_answers() -> None:
    # A peer id with nothing listening behind it: bootstrap must fail, not hang, and leak nothing.
    live = start_node()
    dead_maddr = live.visible_maddrs[0]
    live.shutdown()
    children_before = {p.pid for p in psutil.Process().children()}
    node = Gossip(Identity.generate(), swarm=SWARM, initial_peers=[dead_maddr], request_timeout=2.0, start_timeout=20)
    with pytest.raises(GossipError, match="initial peers"):
        node.start()
    assert {p.pid for p in psutil.Process().children() if p.is_running() and p.status() != "zombie"} <= children_before
    node.shutdown()



def test_fetch_dials_an_author_it_never_met() -> None:
    # The reader's p2pd knows nothing about the author (separate DHTs), so the first stream
    # open fails and the fetch must dial the addresses from the signed announce.
    author, loner = start_node(), start_node()
    try:
        body = os.urandom(10_000)
        author.publish(0, body)
        record = seal(author.identity, Kind.ANNOUNCE, 1, pack({
            "round": 0, "sha256": hashlib.sha256(body).digest(), "size": len(body),
            "p2p": author._p2p.peer_id.to_base58(), "maddrs": author.visible_maddrs,
        }))

        async def fetch_directly() -> bytes:
            announce = loner._parse_announce(0, author.identity.peer_id, record)
            return await loner._download(announce)

        assert loner._call(fetch_directly(), 30) == body
    finally:
        author.shutdown()
        loner.shutdown()
