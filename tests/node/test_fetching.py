"""Fetcher's memory of what it fetched (node/swarm/fetching.py): bounded by time, not only by count."""

from __future__ import annotations

from collections import Counter

from hivespec.node.swarm.fetching import Fetcher


def test_fetched_claims_are_remembered_for_two_record_ttls_then_forgotten() -> None:
    """No record can offer a claim after record_ttl, so remembering it longer only grows memory on a small swarm."""
    clock = [0.0]
    fetcher = Fetcher(private=None, peers=None, request_timeout=1.0, stats=Counter(), record_ttl=600.0, clock=lambda: clock[0])
    old, new = (b"a" * 32, "hsa", 10), (b"b" * 32, "hsb", 10)
    fetcher.mark_done(old)
    clock[0] = 1199.0
    fetcher.mark_done(new)
    assert not fetcher.wanted(old) and not fetcher.wanted(new)  # both could still be offered again
    clock[0] = 1201.0
    fetcher.mark_done((b"c" * 32, "hsc", 10))
    assert fetcher.wanted(old) and not fetcher.wanted(new)
