"""Peer scoring: verdicts, graylist threshold, decay, rate limits, persistence across restarts."""

from __future__ import annotations

import json

import pytest

from hivespec.node.swarm.peers import PeerScores, ScoreParams


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_rejects_graylist_a_peer_and_ignores_do_not() -> None:
    clock = Clock()
    scores = PeerScores(clock=clock)
    for _ in range(50):
        scores.record("honest", "ignore", "stale")
    assert scores.score("honest") == 0 and not scores.graylisted("honest")
    for _ in range(5):
        scores.record("honest", "accept")
    assert scores.score("honest") == pytest.approx(5.0)

    scores.record("mallory", "reject", "bad_signature")
    scores.record("mallory", "reject", "bad_signature")
    assert scores.score("mallory") == pytest.approx(-40.0) and not scores.graylisted("mallory")
    scores.record("mallory", "reject", "reward_mismatch")  # the third reject crosses -50
    assert scores.score("mallory") == pytest.approx(-90.0) and scores.graylisted("mallory")
    assert not scores.allow("mallory", 1)
    row = scores.snapshot()["mallory"]
    assert row == {"score": -90.0, "graylisted": True, "accepted": 0, "ignored": 0, "rejected": 3, "last_reason": "reward_mismatch"}
    with pytest.raises(ValueError, match="outcome"):
        scores.record("x", "drop")


def test_deliveries_are_capped_so_good_history_cannot_buy_many_rejects() -> None:
    scores = PeerScores(clock=Clock())
    for _ in range(1000):
        scores.record("p", "accept")
    assert scores.score("p") == pytest.approx(20.0)
    for _ in range(3):
        scores.record("p", "reject")
    assert scores.graylisted("p")  # 20 - 90


def test_scores_decay_so_a_peer_recovers_slowly() -> None:
    clock = Clock()
    scores = PeerScores(clock=clock)
    for _ in range(3):
        scores.record("p", "reject")
    assert scores.graylisted("p")
    clock.now += 10 * 60
    assert scores.graylisted("p")  # ten minutes are not enough
    clock.now += 50 * 60
    assert not scores.graylisted("p")  # an hour later: 3 * 0.98^60 = 0.89 invalid, score -7.9
    assert scores.score("p") == pytest.approx(-10 * (3 * 0.98**60) ** 2, rel=1e-6)


def test_rate_limits_ignore_a_flood_then_refill() -> None:
    clock = Clock()
    params = ScoreParams(items_per_minute=60, item_burst=5, bytes_per_minute=6000, byte_burst=1000)
    scores = PeerScores(params=params, clock=clock)
    assert [scores.allow("p", 10) for _ in range(7)] == [True] * 5 + [False] * 2
    clock.now += 1.0  # one item per second refills
    assert scores.allow("p", 10) and not scores.allow("p", 10)
    assert not scores.allow("q", 1001)  # over the byte burst
    assert scores.allow("q", 1000)
    assert not scores.graylisted("p")  # being rate limited is not a penalty


def test_scores_survive_a_restart_and_keep_decaying(tmp_path) -> None:
    clock = Clock()
    path = tmp_path / "home" / "peers.json"
    scores = PeerScores(path, clock=clock, save_interval_s=0)
    for _ in range(3):
        scores.record("mallory", "reject", "bad_signature")
    scores.record("alice", "accept")
    scores.save()
    assert json.loads(path.read_text())["version"] == 1

    clock.now += 60
    again = PeerScores(path, clock=clock)
    assert again.graylisted("mallory") and again.snapshot()["mallory"]["rejected"] == 3
    assert again.score("alice") == pytest.approx(0.9)  # one minute of decay happened while we were down

    path.write_text("{not json")
    assert PeerScores(path, clock=clock).snapshot() == {}  # an unreadable file starts empty, never crashes


def test_bad_params_are_refused() -> None:
    with pytest.raises(ValueError, match="decay"):
        ScoreParams(invalid_decay_per_min=1.5)
    with pytest.raises(ValueError, match="negative"):
        ScoreParams(graylist_threshold=1.0)
