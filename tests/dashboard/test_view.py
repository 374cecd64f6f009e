"""dashboard.view and dashboard.plot: the health answers and the drawing helpers, as pure functions."""

from dataclasses import replace

import pytest
from fakes import PEER_A, PEER_B, crowded, make_snapshot

from hivespec.dashboard.plot import Series, braille_canvas, value_range
from hivespec.dashboard.text import render_text
from hivespec.dashboard.view import (
    PEER_ROWS,
    active_peers,
    flow_health,
    fmt_bytes,
    fmt_duration,
    listed_peers,
    peers_health,
    reward_health,
    reward_trend,
    speculation_health,
    unlisted_peers_line,
)
from hivespec.protocol.status import GossipStatus, IntakeStatus


def test_connected_peers_are_those_that_sent_rollouts_recently():
    snapshot = make_snapshot()
    assert [p.peer_id for p in active_peers(snapshot)] == [PEER_A]  # PEER_B was last seen 700 s ago
    answer = peers_health(snapshot)
    assert answer.level == "good" and answer.text.startswith("1 connected")
    stale = replace(snapshot, peers=[replace(p, last_seen=snapshot.time - 3600) for p in snapshot.peers])
    assert peers_health(stale).level == "bad" and peers_health(stale).text.startswith("0 connected: 2 seen")
    # Nothing fetched lately, but the last round trained on foreign samples from the pool: not a lost swarm.
    fed = replace(stale, rounds=[replace(stale.rounds[-1], finished_at=stale.time - 5, foreign_used=8)])
    assert peers_health(fed).level == "good" and "the pool held what the steps could train on" in peers_health(fed).text
    long_ago = replace(fed, rounds=[replace(fed.rounds[-1], finished_at=fed.time - 3600)])
    assert peers_health(long_ago).level == "bad"
    assert peers_health(replace(snapshot, peers=[], rounds=[])).level == "unknown"


def test_flow_says_whether_rollouts_move_both_ways():
    snapshot = make_snapshot()
    both = flow_health(snapshot)
    assert both.level == "good" and both.text.startswith("both ways") and "in 176 from 2 peers" in both.text
    only_in = replace(snapshot, gossip=GossipStatus(bodies_served=0))
    assert flow_health(only_in).level == "warn" and "one way only" in flow_health(only_in).text
    nothing = replace(snapshot, gossip=GossipStatus(), intake=IntakeStatus(), peers=[])
    assert flow_health(nothing).level == "bad"


def test_speculation_pays_only_above_one_token_per_target_forward():
    assert speculation_health(make_snapshot()).text.startswith("pays: 2.30 tokens/target forward")
    plain = make_snapshot(speculation=False)
    assert speculation_health(plain).level == "unknown"
    snapshot = make_snapshot()
    flat = replace(snapshot, rounds=[replace(r, tokens_per_target_forward=1.0) for r in snapshot.rounds])
    assert speculation_health(flat).level == "warn" and speculation_health(flat).text.startswith("not paying")


def test_reward_trend_is_a_least_squares_fit():
    assert reward_trend([0.0, 1.0, 2.0]) == pytest.approx(1.0)
    assert reward_trend([0.5, 0.5, 0.5, 0.5]) == 0.0
    assert reward_trend([0.3]) == 0.0
    snapshot = make_snapshot()
    assert reward_health(snapshot).level == "good" and reward_health(snapshot).text.startswith("rising: 0.25 -> 0.56")
    falling = replace(snapshot, rounds=[replace(r, reward_mean=1.0 - 0.1 * r.round) for r in snapshot.rounds])
    assert reward_health(falling).level == "bad"
    flat = replace(snapshot, rounds=[replace(r, reward_mean=0.4 + 0.001 * (r.round % 2)) for r in snapshot.rounds])
    assert reward_health(flat).level == "warn"
    assert reward_health(make_snapshot(rounds=2)).text.startswith("too early: 2 rounds")
    noisy = replace(snapshot, rounds=[replace(r, reward_mean=[0.1, 0.6, 0.0, 0.5, 0.2, 0.7][r.round]) for r in snapshot.rounds])
    assert reward_health(noisy).text.startswith("no clear trend yet (noisy)")
    # the real demo's node-0 after four rounds (see the closing note): a clear rise
    real = replace(snapshot, rounds=[replace(r, reward_mean=v) for r, v in zip(snapshot.rounds, [0.12, 0.25, 0.25, 0.5])])
    assert reward_health(real).text.startswith("rising: 0.12 -> 0.50 over 4 rounds")


def test_formatting():
    assert fmt_bytes(None) == "-" and fmt_bytes(999) == "999B" and fmt_bytes(16_500_000) == "16.5MB"
    assert fmt_duration(42) == "42s" and fmt_duration(185) == "3m05s" and fmt_duration(7620) == "2h07m"
    assert fmt_duration(3 * 86400 + 4 * 3600) == "3d04h"


def test_braille_canvas_draws_a_rising_line_corner_to_corner():
    canvas = braille_canvas([Series("r", [0.0, 1.0], "green")], width=4, height=2, low=0.0, high=1.0)
    assert len(canvas) == 2 and all(len(row) == 4 for row in canvas)
    # bottom-left and top-right cells are drawn by series 0; the other corners stay blank
    assert canvas[1][0][1] == 0 and canvas[0][3][1] == 0
    assert canvas[0][0] == ("\u2800", None) and canvas[1][3] == ("\u2800", None)
    gap = braille_canvas([Series("r", [0.5, None, 0.5], "green")], width=3, height=1, low=0.0, high=1.0)
    assert gap[0][1] == ("\u2800", None)  # a missing value leaves a gap instead of a segment
    assert value_range([Series("r", [None, None], "")]) is None
    assert value_range([Series("r", [0.3, 0.3], "")]) == pytest.approx((0.27, 0.33))


def test_a_large_swarm_lists_the_peers_heard_from_last_senders_first():
    swarm = crowded(make_snapshot(), 300, newcomer=True)  # peer i heard from 2i s ago, peers 0-82 sending; one just now
    listed = listed_peers(swarm)
    names = [p.name for p in listed]
    assert len(listed) == PEER_ROWS and names[:3] == ["aaa-newcomer", "peer-000", "peer-001"]
    assert names[83] == "peer-082" and names[84] == "peer-083" and names[-1] == "peer-098"  # then the quiet ones
    assert unlisted_peers_line(swarm, listed) == "and 201 more peers, heard from less recently"
    text = render_text(swarm)
    assert "peer-098" in text and "peer-099" not in text and "and 201 more peers, heard from less recently (all of them: --json)" in text
    assert unlisted_peers_line(make_snapshot(), listed_peers(make_snapshot())) == ""


def test_status_text_answers_the_four_questions():
    text = render_text(make_snapshot())
    for expected in ("node-0 (hs00112233)", "peers  1 connected", "rollouts  both ways", "speculation  pays",
                     "reward  rising", "swift-otter-3fa2", "calm-heron-07b1", "last round 5: reward 0.56",
                     "memory: 2.8 GB now, 5.3 GB at most"):
        assert expected in text, expected
    assert PEER_B not in text  # names, not raw ids, when the node knows them
    assert "micro batches" not in text  # its config's: nothing to say
    snapshot = make_snapshot()
    short = replace(snapshot, supervision=replace(snapshot.supervision, micro_batch_size=1, micro_batch_wanted=8))
    assert "memory: 2.8 GB now, 5.3 GB at most; micro batches of 1 sample, not 8, to fit the memory" in render_text(short)
