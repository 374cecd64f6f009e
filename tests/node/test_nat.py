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

