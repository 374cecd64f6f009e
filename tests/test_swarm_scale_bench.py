"""The scale bench's supply bound: what k_fill could have been with every published batch in sight."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # the bench folder only; the repo root stays off sys.path

import light_nodes
import swarm_scale
from scale_networks import Network


def test_fill_ceiling_takes_one_an_author_then_their_further_batches():
    """A reader beside two authors, one of them loud: each step takes K = 4 as the sampling does (one an author, then
    further batches where that leaves slots), each batch once; only the reader's steps fall in the window."""
    assert swarm_scale.K == 4
    loud = {"index": 1, "steps": [{"t": float(t), "publish_s": 0.1} for t in (1, 2, 3)]}
    quiet = {"index": 2, "steps": [{"t": 1.0, "publish_s": 0.1}]}
    reader = {"index": 0, "steps": [{"t": 10.0, "publish_s": 0.1}, {"t": 20.0, "publish_s": 0.1}]}
    # At 10 s: one of each author's and the loud one's two more (4 of K); at 20 s nothing is left that the reader has
    # not taken (its own batches are never counted). 4 batches in 2 steps of K = 4.
    assert swarm_scale._fill_ceiling([loud, quiet, reader], measure_from=5.0, until=30.0) == 0.5
    # A batch older than MAX_AGE_S at the step's start is out of reach.
    late = {"index": 0, "steps": [{"t": 3.0 + swarm_scale.MAX_AGE_S + 1.0, "publish_s": 0.1}]}
    assert swarm_scale._fill_ceiling([loud, quiet, late], measure_from=5.0, until=1e9) == 0.0


def _node(index: int, steps: list[dict], **delta: int) -> dict:
    counters = dict.fromkeys((*light_nodes.COUNTERS, *light_nodes.RPC_COUNTS), 0) | delta
    return {"index": index, "peer": f"peer-{index}", "period": 2.0, "steps": steps, "errors": {}, "delta": counters,
            "max_records_per_key": 3, "known_peers": 1}


def _step(t: float, chosen: int, fetched: int) -> dict:
    return {"t": t, "publish_s": 0.1, "sample_s": 0.5, "chosen": chosen, "fetched": fetched, "bad": 0, "bytes": 10_000 * fetched,
            "relayed": 0, "ages": [1.0] * fetched, "authors": ["peer-1"] * fetched}


def test_summary_counts_every_dht_traversal_and_delivery_over_the_window_steps_chosen():
    # Two nodes, two steps each in the window [10, 20) and one before it. A store's replica lookup is a DHT traversal
    # as a read is: dht_requests_per_node_step left it out (0.23 a node-step at 8 light nodes, 6% of the count).
    a = _node(0, [_step(5.0, 4, 0), _step(11.0, 4, 4), _step(15.0, 4, 3)], dht_gets=6, dht_stores=2, replica_lookups=2)
    b = _node(1, [_step(12.0, 2, 2), _step(16.0, 0, 0)], dht_gets=4, dht_stores=2, replica_lookups=0)
    done = [{"nodes": [a, b], "rss": {"total_kb": 2048}, "cpu": None, "census": [], "key_reads": []}]
    summary = swarm_scale.summarize(2, Network(), done, [{"shutdown_s": 0.5}], {}, 10.0, 20.0, None, None, None, [], 1.0)
    assert summary["node_steps"] == 4
    assert summary["dht_requests_per_node_step"] == (6 + 2 + 2 + 4 + 2 + 0) / 4 == 4.0
    assert summary["replica_lookups_per_node_step"] == 0.5
    # Delivery: batches fetched over batches chosen by the window's steps (the step before it, 0 of 4, is not one).
    assert summary["delivery"] == round(9 / 10, 4)
    assert summary["clean_shutdowns"] is True


def test_a_p2pd_that_crashed_is_an_unclean_stop_though_its_worker_logged_nothing_unclean():
    # A light node whose p2pd died with a Go stack dump (SIGQUIT; a panic prints the same way and exits 2): hivemind logs
    # p2pd's own lines at debug, so its worker's log held only a shutdown stage cut short, and clean_shutdowns stayed true.
    log = ("2026-11-29 23:46:54,551 hivespec.node.swarm.gossip INFO gossip up: swarm 'p2pd-probe', peer hs886cc9899e1fc267\n"
           "2026-11-29 23:47:06,553 hivespec.node.swarm.gossip INFO gossip shutdown: removing the DHT handlers cut short after 10.0 s\n")
    assert swarm_scale.unclean_stops("w0.log", log, 0, [0, 2]) == ["w0.log: p2pd exit code 2"]
    # Stopped (0; 143 exiting on hivemind's SIGTERM, as a light node's p2pd did), killed at the shutdown's deadline
    # (counted as cut short), or not known: clean here.
    assert swarm_scale.unclean_stops("w0.log", log, 0, [0, 143, -15, -9, None]) == []
    assert swarm_scale.unclean_stops("w0.log", log + "Traceback (most recent call last):\n", -9, []) == [
        "w0.log: Traceback (most recent call last):", "w0.log: exit code -9"]
