"""node/swarm/nat.py's address handling (pure)."""

from hivemind.p2p import PeerID

from hivespec.node.swarm.nat import circuit_maddr, listen_ports, relay_candidates, to_transport

RELAY = "/ip4/203.0.113.10/tcp/31337/p2p/QmS7nAbcy4J9msTgYy1y2mKLnsRFwE4CPb5crSZjVZCCqo"
TARGET = "12D3KooWFzTYQLCFbyKSq27JYw868N2b12KbkavryJTsQM5eYC4w"


def test_circuit_addresses_carry_peer_ids_as_multihashes():
    circuit = circuit_maddr(RELAY)
    assert str(circuit) == RELAY + "/p2p-circuit"
    relay_mh = PeerID.from_base58(RELAY.rsplit("/", 1)[1]).to_bytes()
    # /p2p (0xa5 0x03), the multihash's length, the multihash itself, then /p2p-circuit (0xa2 0x02):
    # hivemind's own encoder writes a CID here, which p2pd rejects.
    assert circuit.to_bytes().endswith(b"\xa5\x03" + bytes([len(relay_mh)]) + relay_mh + b"\xa2\x02")
    assert str(circuit_maddr(RELAY, TARGET)) == f"{RELAY}/p2p-circuit/p2p/{TARGET}"


def test_transport_addresses_drop_the_peer_id_and_keep_circuits():
    assert str(to_transport(f"/ip4/10.1.0.2/tcp/4001/p2p/{TARGET}")) == "/ip4/10.1.0.2/tcp/4001"
    assert to_transport(f"{RELAY}/p2p-circuit").to_bytes() == circuit_maddr(RELAY).to_bytes()
    assert str(to_transport("/ip4/10.1.0.2/tcp/4001")) == "/ip4/10.1.0.2/tcp/4001"


def test_only_direct_bootstrap_addresses_become_relays():
    assert relay_candidates([RELAY, f"{RELAY}/p2p-circuit", "/ip4/1.2.3.4/tcp/1"]) == [RELAY]


def test_listen_ports_are_deduplicated_and_capped():
    maddrs = [f"/ip4/10.1.0.2/tcp/{p}/p2p/{TARGET}" for p in (5, 5, 6, 7, 8, 9)] + ["/ip4/1.2.3.4/udp/3"]
    assert listen_ports(maddrs) == [5, 6, 7, 8]



def test_a_via_request_never_has_our_p2pd_dial_a_relay_on_our_own_network_it_is_not_connected_to():
    """`via` dials the circuits a peer names: any peer could have aimed our p2pd at hosts and ports of our LAN (a port
    scan, timed by the reply). A relay must be connected to us or at a global address; here a listener on loopback
    named as a relay (real p2pd) must see no connection, and the answer is simply no."""
    import asyncio

    from hivemind.p2p import P2P

    from hivespec.node.swarm.nat import REACH_STREAM, ReachService, ask

    async def scenario() -> tuple[dict, int, list[str]]:
        dialled = []

        async def count(reader, writer) -> None:
            dialled.append("connection")
            writer.close()

        listener = await asyncio.start_server(count, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        service_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        asker = await P2P.create(initial_peers=[str(m) for m in await service_p2p.get_visible_maddrs()],
                                 host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        try:
            service = ReachService(service_p2p)
            await service_p2p.add_binary_stream_handler(REACH_STREAM, service.handle)
            scan = f"/ip4/127.0.0.1/tcp/{port}/p2p/{RELAY.rsplit('/', 1)[1]}/p2p-circuit"
            # a target we are not connected to: p2pd would otherwise answer from the connection it has, dialling nothing
            reply = await ask(asker, service_p2p.peer_id, {"op": "via", "target": TARGET, "circuits": [scan]}, 30.0)
            await asyncio.sleep(0.5)  # a dial already under way would have arrived by now
            connected_relay = f"/ip4/127.0.0.1/tcp/1/p2p/{asker.peer_id.to_base58()}/p2p-circuit"
            global_relay = RELAY.replace("203.0.113.10", "8.8.8.8") + "/p2p-circuit"  # 203.0.113/24 is documentation's
            kept = await service._relays_we_may_dial([scan, connected_relay, global_relay, "/dns4/x.org/tcp/1/p2p/" + TARGET + "/p2p-circuit"])
            return reply, len(dialled), kept
        finally:
            await asker.shutdown()
            await service_p2p.shutdown()
            listener.close()

    reply, dialled, kept = asyncio.run(scenario())
    assert reply == {"ok": False} and dialled == 0
    assert len(kept) == 2 and "/tcp/1/p2p/" in kept[0] and "/8.8.8.8/" in kept[1]  # connected, or at a global address


def test_idle_reach_streams_hold_no_answering_slot():
    """A reach request takes one of the service's 4 answering slots once it is read: a peer holding 4 streams that
    send nothing (each would hold a slot until its read timeout) delays no other peer's ping (real p2pd)."""
    import asyncio

    from hivemind.p2p import P2P

    from hivespec.node.swarm.nat import REACH_STREAM, ReachService, ask

    async def scenario() -> tuple[dict, list[bool]]:
        service_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        maddrs = [str(m) for m in await service_p2p.get_visible_maddrs()]
        idler, asker = [await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
                        for _ in range(2)]
        try:
            # a read timeout far longer than the test: a ping queued behind the idle streams would not come in time
            service = ReachService(service_p2p, clock=lambda: 42.0, read_timeout=120.0)
            await service_p2p.add_binary_stream_handler(REACH_STREAM, service.handle)
            idle = [await idler.call_binary_stream_handler(service_p2p.peer_id, REACH_STREAM) for _ in range(4)]
            reply = await ask(asker, service_p2p.peer_id, {"op": "ping"}, 30.0)
            closed = [reader.at_eof() for _, reader, _ in idle]  # a ping queued behind them would still wait
            for _, _, writer in idle:
                writer.close()
            return reply, closed
        finally:
            await asker.shutdown()
            await idler.shutdown()
            await service_p2p.shutdown()

    reply, closed = asyncio.run(scenario())
    assert reply == {"ok": True, "time": 42.0}
    assert not any(closed), "the idle streams were still open when the ping was answered"
