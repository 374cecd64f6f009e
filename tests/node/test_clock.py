"""A node's clock against its peers': the rule that warns (pure), then real nodes on loopback, one of them skewed."""

from __future__ import annotations

import logging
import random
import time

import pytest

from hivespec.node.swarm.clock import KEPT_PEERS, ClockCheck


def _answers(check: ClockCheck, offsets: dict[str, float], *, rtt: float = 0.02) -> None:
    now = 1.8e9
    for peer, offset in offsets.items():
        check.add(peer, now, now + rtt / 2 + offset, now + rtt)
    check.judge()  # as `ask_time` does after each round of questions


def test_a_peers_offset_is_taken_at_the_midpoint_of_the_round_trip() -> None:
    check = ClockCheck(30.0)
    check.add("a", 100.0, 160.5, 101.0)  # asked at 100, answered 160.5, heard at 101: the peer is 60 s ahead of us
    assert check.offset_s == pytest.approx(60.0) and check.peers == 1
    check.add("b", 100.0, 500.0, 106.0)  # a 6-s round trip says little about when the answer was made: dropped
    check.add("c", 100.0, float("nan"), 100.1)  # nor does a time that is no number
    check.add("d", 100.0, 100.0, 99.0)  # nor an answer heard before the question (our clock stepped back)
    assert check.peers == 1


def test_most_peers_must_see_the_clock_off_the_same_way_before_it_warns(caplog: pytest.LogCaptureFixture) -> None:
    check = ClockCheck(30.0)  # tolerance: a third of a bucket, 10 s
    with caplog.at_level(logging.WARNING, logger="hivespec.node.swarm.clock"):
        _answers(check, {"a": 0.3, "b": -62.0})  # one peer far off (drifting or lying) of two: no majority
        assert check.warning == ""
        _answers(check, {"c": 0.1})
        assert check.warning == "" and check.offset_s == pytest.approx(0.1)
        _answers(check, {"a": 61.0, "c": 59.0})  # now two of three see us a minute behind
        assert "about 60 s behind its peers' (2 of 3 peers measured)" in check.warning
        assert "index buckets of 30 s" in check.warning and "timedatectl set-ntp true" in check.warning
        _answers(check, {"d": 60.5})  # the same episode: no second warning
        _answers(check, {"a": 0.2, "c": -0.4, "d": 0.1})  # the clock was fixed
        assert check.warning == ""
        _answers(check, {"a": -45.0, "c": -44.0, "d": -46.0})  # a new episode, the other way (b's -62 still counts)
        assert "about 46 s ahead of its peers' (4 of 4 peers measured)" in check.warning  # the median of -44..-62
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3, warnings
    assert "behind" in warnings[0] and "agrees with its peers' again" in warnings[1] and "ahead of" in warnings[2]


def test_one_peer_gives_no_verdict_since_either_clock_may_be_off() -> None:
    check = ClockCheck(30.0)
    _answers(check, {"a": 60.0})
    assert check.warning == "" and check.offset_s == pytest.approx(60.0)
    _answers(check, {"b": 60.0})
    assert "about 60 s behind its peers' (2 of 2 peers measured)" in check.warning


def test_offsets_under_a_third_of_a_bucket_never_warn_and_only_the_last_peers_count() -> None:
    check = ClockCheck(30.0)
    _answers(check, {f"p{i}": 9.0 for i in range(20)})
    assert check.warning == "" and check.peers == KEPT_PEERS
    _answers(check, {f"q{i}": 12.0 for i in range(KEPT_PEERS // 2 + 1)})  # the newest peers: a majority of the kept
    assert "about 12 s behind" in check.warning


def test_peers_not_measured_yet_are_asked_first_three_at_join_then_one_at_a_time() -> None:
    from hivemind.p2p import PeerID

    peers = [PeerID.from_base58(p) for p in (
        "QmcRvbhjF1j4pz3LXyBgfspZ4t4MPg6DxYAa44cc6cyqFP", "QmQsrBZVDjxH49A8DWLbyDxPdExS3Rb8PNNM6TB3wo5PAY",
        "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")]
    check = ClockCheck(30.0)
    rng = random.Random(0)
    assert len(check.choose(peers[:1], rng)) == 1 and len(check.choose(peers, rng)) == 3  # at join: three, where there are
    _answers(check, {peers[0].to_base58(): 0.0})  # joined through one peer of a small swarm, the only one it knew
    for _ in range(20):  # the peers it met since come first, whatever the draw
        assert check.choose(peers, rng)[0] != peers[0] and len(check.choose(peers, rng)) == 2
    _answers(check, {p.to_base58(): 0.0 for p in peers[1:3]})
    assert [p.to_base58() for p in check.choose(peers, rng)] == [peers[3].to_base58()]  # then one a round, the new one
    _answers(check, {peers[3].to_base58(): 0.0})
    assert len({check.choose(peers, rng)[0].to_base58() for _ in range(40)}) == 4  # all measured: any of them, at random


def test_a_bucket_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_s must be > 0"):
        ClockCheck(0.0)


def test_a_node_whose_clock_is_a_minute_behind_is_told_so_at_join_and_its_peers_are_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real nodes on loopback: the skewed node measures its peers at join (the reach stream's ping carries their time);
    a peer that measures it among the others does not take the skew for its own."""
    from hivespec.node.config import SwarmConfig
    from hivespec.node.swarm.clock import ask_time
    from hivespec.node.swarm.gossip import Gossip
    from hivespec.protocol.identity import Identity

    def node(initial_peers: list[str], *, skew_s: float = 0.0) -> Gossip:
        gossip = Gossip(Identity.generate(), SwarmConfig(swarm="clock-test", initial_peers=list(initial_peers),
                                                         bootstrap_timeout=10.0, request_timeout=5.0),
                        clock=lambda: time.time() + skew_s)  # what it measures with and answers pings with
        gossip.start()
        return gossip

    first = node([])
    nodes = [first]
    try:
        nodes += [node(first.visible_maddrs), node(first.visible_maddrs)]
        with caplog.at_level(logging.WARNING, logger="hivespec.node.swarm.clock"):
            skewed = node(first.visible_maddrs, skew_s=-60.0)
            nodes.append(skewed)
            for _ in range(5):  # measured while it joined; again as at its re-bootstraps, where it knew one peer then
                if skewed.clock_check.peers >= 2:
                    break
                skewed.check_clock()
            status = skewed.status()
            assert status["clock_peers"] >= 2, status
            assert 59.0 < status["clock_offset_s"] < 61.0 and "about 60 s behind its peers'" in status["clock_warning"]
            others = nodes[:3]
            for other in others:  # each measures every peer, the skewed one included
                peers = list(other._dht.protocol.routing_table.uid_to_peer_id.values())
                other._call(ask_time(other._p2p, peers, other.clock_check, 5.0), 20)
        for other in others:  # one skewed peer of two or three: no warning (with three, the median is a good one's)
            status = other.status()
            assert status["clock_warning"] == "" and (status["clock_peers"] < 3 or abs(status["clock_offset_s"]) < 1.0), status
        assert any(other.clock_check.peers == 3 for other in others)  # someone measured all three
        warned = [r.getMessage() for r in caplog.records if "clock is about" in r.getMessage()]
        assert len(warned) == 1 and "60 s behind" in warned[0], warned
    finally:
        for gossip in nodes:
            gossip.shutdown()
