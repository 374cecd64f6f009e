"""Fetcher (node/swarm/fetching.py): its memory of what it fetched is bounded by time; behind NAT it offers only what it can fetch."""

from __future__ import annotations

import hashlib
import time
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


def test_sampling_chooses_only_what_some_holder_can_serve_behind_nat() -> None:
    """A large body held only by NATed peers we reach through a relay cannot be fetched: sampling must not spend
    one of K on it, while a directly connected holder or a small body (a circuit carries it) keeps it choosable."""
    from hivemind.p2p import PeerID

    from hivespec.node.swarm.index import Candidate
    from hivespec.node.swarm.nat import RELAYED_BODY_LIMIT
    from hivespec.node.swarm.records import Holder
    from hivespec.protocol.announce import AnnouncedBody

    relay = PeerID(hashlib.sha256(b"relay").digest()).to_base58()

    def holder(name: str, *, natted: bool) -> Holder:
        maddrs = (f"/ip4/203.0.113.10/tcp/31337/p2p/{relay}/p2p-circuit",) if natted else ("/ip4/203.0.113.10/tcp/4001",)
        return Holder(name, PeerID(hashlib.sha256(name.encode()).digest()), maddrs)

    def candidate(name: str, size: int, *holders: Holder) -> Candidate:
        item = AnnouncedBody(author=holders[0].peer, sha256=hashlib.sha256(name.encode()).digest(), size=size, born=1.0, version=0)
        return Candidate(item, holders=list(holders))

    large, small = RELAYED_BODY_LIMIT + 1, RELAYED_BODY_LIMIT
    author, other_home, public = holder("hsauthor", natted=True), holder("hshome", natted=True), holder("hspublic", natted=False)
    only_natted = candidate("large-natted", large, author, holder("hsthird", natted=True))
    relayed_by_public = candidate("large-relayed", large, author, public)
    small_natted = candidate("small-natted", small, author)
    connected = candidate("large-connected", large, other_home)
    stats = Counter()
    fetcher = Fetcher(private=None, peers=None, request_timeout=1.0, stats=stats)
    chosen = fetcher.fetchable([only_natted, relayed_by_public, small_natted, connected], direct={other_home.p2p_peer_id.to_base58()})
    assert chosen == [relayed_by_public, small_natted, connected]
    assert relayed_by_public.holders == [public]  # the NATed author is not asked for its large body
    assert connected.holders == [other_home] and small_natted.holders == [author]
    assert stats["unfetchable_skipped"] == 1


def test_a_natted_holders_stream_cut_before_the_body_is_asked_once_more() -> None:
    """The relay resets a circuit after ~128 KiB, cutting whatever stream it carries: a NATed holder's body is asked
    again on a new stream. Here a real holder (p2pd on loopback) cuts its first stream the way a reset circuit does."""
    import asyncio

    from hivemind.p2p import P2P

    from hivespec.node.swarm.records import Holder
    from hivespec.node.swarm.transfer import STREAM_NAME, serve_body

    body = b"rollouts" * 1000
    digest = hashlib.sha256(body).digest()
    claim = (digest, "hsauthor", len(body))

    async def scenario() -> tuple[list, int, Counter, Counter]:
        holder_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        reader_p2p = await P2P.create(initial_peers=[str(m) for m in await holder_p2p.get_visible_maddrs()],
                                      host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        streams = {"n": 0}

        async def handle(_context, reader, writer) -> None:
            streams["n"] += 1
            if streams["n"] % 2:  # every other stream ends before its answer, as over a reset circuit
                await reader.readexactly(32)
                writer.close()
                return
            await serve_body({digest: body}.get, reader, writer, timeout=5.0, stats=Counter())

        await holder_p2p.add_binary_stream_handler(STREAM_NAME, handle)
        maddrs = tuple(str(m) for m in await holder_p2p.get_visible_maddrs())
        circuit = f"/ip4/127.0.0.1/tcp/1/p2p/{holder_p2p.peer_id.to_base58()}/p2p-circuit"
        results, counters = [], []
        try:
            for natted in (True, False):
                stats = Counter()
                fetcher = Fetcher(private=None, peers=None, request_timeout=5.0, stats=stats)
                fetcher.attach(reader_p2p)
                holder = Holder("hsauthor", holder_p2p.peer_id, maddrs + ((circuit,) if natted else ()))
                results.append(await fetcher.fetch(claim, [holder], time.monotonic() + 20.0, context="rollouts"))
                counters.append(stats)
        finally:
            await reader_p2p.shutdown()
            await holder_p2p.shutdown()
        return results, streams["n"], *counters

    results, streams, natted_stats, reachable_stats = asyncio.run(scenario())
    natted, reachable = results
    assert natted is not None and natted[2] == body
    assert natted_stats["circuit_retries"] == 1 and natted_stats["fetch_failures"] == 0
    # A reachable holder's cut stream is a failure like any other: the next holder (none here) is asked instead.
    assert reachable is None and reachable_stats["fetch_failures"] == 1 and reachable_stats["circuit_retries"] == 0
    assert streams == 3


def test_a_peer_that_opens_streams_and_sends_nothing_delays_no_other_reader() -> None:
    """A holder's answers take a slot only once their request is read, and one peer has at most `per_peer` streams
    open: a peer holding every slot's worth of idle streams (real p2pd on loopback) delays no honest reader."""
    import asyncio

    from hivemind.p2p import P2P

    from hivespec.node.swarm.bodies import BodyStore
    from hivespec.node.swarm.transfer import STREAM_NAME, download

    body = b"rollouts" * 1000
    digest = hashlib.sha256(body).digest()
    stats = Counter()
    # request_timeout is far longer than the test: an answer queued behind the idle streams would not come in time.
    store = BodyStore(keep_seconds=600.0, keep_bytes=1 << 20, request_timeout=120.0, stats=stats, max_parallel=2, per_peer=2)
    store.keep(digest, body)

    async def scenario() -> bytes:
        holder = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        maddrs = [str(m) for m in await holder.get_visible_maddrs()]
        idler, reader = [await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
                         for _ in range(2)]
        try:
            await holder.add_binary_stream_handler(STREAM_NAME, store.serve)
            idle = [await idler.call_binary_stream_handler(holder.peer_id, STREAM_NAME) for _ in range(3)]
            # the third idle stream is over the idler's share: closed at once, the reader sees its end
            assert await asyncio.wait_for(idle[2][1].read(), 30.0) == b""
            got = await asyncio.wait_for(download(reader, holder.peer_id, maddrs, digest, len(body), timeout=30.0), 60.0)
            assert stats["serve_errors"] == 0, "the idle streams were still open while the reader was answered"
            for _, _, writer in idle:
                writer.close()
            return got
        finally:
            await reader.shutdown()
            await idler.shutdown()
            await holder.shutdown()

    assert asyncio.run(scenario()) == body
    assert stats["serve_busy_peer"] == 1 and stats["bodies_served"] == 1
