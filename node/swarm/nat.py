"""Behind NAT: relay circuit addresses and a truthful reachability check (the relay settings p2pd gets: `p2pd.py`).

What makes two NATed nodes talk (measured in network namespaces, tests/net/): each NATed node
reserves a slot on its bootstrap peers as circuit-relay-v2 relays and announces
``<relay maddr>/p2p-circuit`` in its index records; a peer that fetches from it dials that
address and p2pd splices the stream through the relay. hivemind's ``P2P.create`` cannot say
this by itself: its autorelay waits for relay *discovery* (four candidates or a 3-minute boot
delay) and for AutoNAT to call us private (a boot delay, often never with one peer). So
`p2pd.start_p2pd` adds ``-relayDiscovery=0`` (static relays: the bootstrap peers, reserved at once)
and forces reachability private. p2pd does not list relay addresses in `identify`, so we build
them (`circuit_maddrs`), as bytes: hivemind's multiaddr encodes ``/p2p/<id>`` as a CID, which
go-multiaddr rejects. Hole punching (DCUtR) is on in p2pd with AutoNAT, but it needs observed
addresses confirmed by several peers and is not relied on. The relay cuts each circuit after
~128 KiB (RELAYED_BODY_LIMIT): DHT traffic, reachability checks and small bodies go through it,
while rollout batches and deltas reach a NATed peer from a holder it can reach directly (the
public node, which fetched them over the NATed author's own outbound connection).

Reachability is measured, never assumed. hivemind's own dial-back ping reuses the connection we
opened, so it says "reachable" behind any NAT. Here a peer opens a *new* TCP connection to the
address it sees us at (the NAT's public side) on our listen ports (`ReachService`, stream
``hivespec.reach.v1``); if that fails, it asks a third peer connected to it to reach us through
our relay circuit (we cannot address NATed peers ourselves, it can):

- ``reachable``: a fresh TCP connection from a peer got through; others can dial us directly.
- ``relayed``: not directly, but a peer reached us through a relay; traffic goes via the relay.
- ``unreachable``: neither; we can fetch from others but nobody can fetch from us.
- ``unknown``: no peer answered the check (solo, or peers without this service).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)

REACH_STREAM = "hivespec.reach.v1"
# The bundled p2pd's relay resets a circuit after ~128 KiB per direction (measured: streams end at
# 96 KiB of payload, whatever -relayDataLimit says), so circuits carry control traffic and small
# bodies only; larger bodies reach NATed peers through a directly connected holder (gossip).
RELAYED_BODY_LIMIT = 64 * 1024
_MAX_REQUEST = 4096
_MAX_PORTS = 4
_DIAL_TIMEOUT_S = 2.0
_P2P_CODE, _CIRCUIT_CODE = 421, 290  # multicodec numbers of /p2p and /p2p-circuit


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def circuit_maddr(relay: str, target: str | None = None) -> Multiaddr:
    """``<relay>/p2p-circuit[/p2p/<target>]`` as a Multiaddr p2pd accepts (peer ids as multihashes, not CIDs)."""
    parsed = Multiaddr(relay)
    relay_id = parsed.value_for_protocol("p2p")
    raw = parsed.decapsulate(Multiaddr(f"/p2p/{relay_id}")).to_bytes()
    mh = PeerID.from_base58(relay_id).to_bytes()
    raw += _varint(_P2P_CODE) + _varint(len(mh)) + mh + _varint(_CIRCUIT_CODE)
    if target is not None:
        mh = PeerID.from_base58(target).to_bytes()
        raw += _varint(_P2P_CODE) + _varint(len(mh)) + mh
    return Multiaddr(raw)


def is_circuit(maddr: str) -> bool:
    return "/p2p-circuit" in maddr


def to_transport(maddr: str) -> Multiaddr:
    """`maddr` without its trailing ``/p2p/<id>``, in the byte form p2pd's connect accepts (circuits included)."""
    if is_circuit(maddr):
        relay = maddr.split("/p2p-circuit", 1)[0]
        return circuit_maddr(relay)
    parsed = Multiaddr(maddr)
    if "p2p" in [proto.name for proto in parsed.protocols()]:
        return parsed.decapsulate(Multiaddr(f"/p2p/{parsed.value_for_protocol('p2p')}"))
    return parsed


def relay_candidates(bootstrap: Sequence[str]) -> list[str]:
    """Bootstrap multiaddrs usable as static relays: direct ip/tcp addresses ending in /p2p/<id>."""
    return [m for m in bootstrap if not is_circuit(m) and "/tcp/" in m and "/p2p/" in m]


# ----- the reachability check -----------------------------------------------------------------


@dataclass(frozen=True)
class Reach:
    """A reachability verdict and how it was found."""

    state: str  # reachable / relayed / unreachable / unknown
    detail: str


def _observed_ip(addr: Any) -> str | None:
    text = str(addr)
    if is_circuit(text):
        return None
    parts = text.strip("/").split("/")
    for proto, value in zip(parts[::2], parts[1::2]):
        if proto in ("ip4", "ip6"):
            return value
    return None


async def _tcp_open(ip: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), _DIAL_TIMEOUT_S)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


class ReachService:
    """Answers peers' reachability questions on REACH_STREAM; one instance per node.

    Requests (msgpack maps, at most 4 KiB): ``{"op": "dialback", "ports": [...]}`` opens fresh
    TCP connections to the requester's observed IP only (no third party can be aimed at), at
    most 4 ports; ``{"op": "via", "circuits": [...]}`` dials the requester through the given
    relay circuits (addresses of the form ``<relay>/p2p-circuit``) and pings it there, only
    through relays we are connected to or at a global address (`_relays_we_may_dial`: else any
    peer could have our p2pd probe hosts and ports of our own network for it);
    ``{"op": "relaycheck", "circuits": [...]}`` forwards a "via" for the requester to up to 3
    other peers we are connected to (``{"ok": null}`` when there are none);
    ``{"op": "ping"}`` answers ``{"ok": true, "time": <our wall clock>}`` (peers check their clocks against it:
    node/swarm/clock.py).
    """

    def __init__(self, p2p: P2P, *, clock: Callable[[], float] = time.time, read_timeout: float = 5.0) -> None:
        self.p2p = p2p
        self.clock = clock
        self.read_timeout = read_timeout  # seconds a requester has to send its request
        self._slots = asyncio.Semaphore(4)

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            # read before a slot is taken: a peer that opens streams and sends nothing holds none
            request = msgpack.unpackb(await asyncio.wait_for(_read_frame(reader), self.read_timeout), raw=False)
            if not isinstance(request, dict):
                raise TypeError("request is not a map")
            async with self._slots:
                reply = await self._answer(info, request)
            await _write_frame(writer, msgpack.packb(reply))
        except Exception as exc:  # noqa: BLE001 - a bad or dropped request ends that stream only
            logger.debug("reach request from %s failed: %s: %s", getattr(info, "peer_id", "?"), type(exc).__name__, exc)
        finally:
            writer.close()

    async def _answer(self, info: Any, request: dict) -> dict:
        op = request.get("op")
        if op == "ping":
            return {"ok": True, "time": float(self.clock())}
        if op == "dialback":
            ip = _observed_ip(info.addr)
            ports = [p for p in request.get("ports", []) if isinstance(p, int) and 0 < p < 65536][:_MAX_PORTS]
            if ip is None:
                return {"direct": False, "observed": str(info.addr)}
            results = await asyncio.gather(*(_tcp_open(ip, p) for p in ports))
            return {"direct": any(results), "observed": ip}
        circuits = [c for c in request.get("circuits", []) if isinstance(c, str) and is_circuit(c)][:_MAX_PORTS]
        if op == "via":
            circuits = await self._relays_we_may_dial(circuits)
            target = PeerID.from_base58(request["target"]) if isinstance(request.get("target"), str) else info.peer_id
            return {"ok": await ping_through(self.p2p, target, circuits, timeout=2 * _DIAL_TIMEOUT_S)}
        if op == "relaycheck":
            peers = [p.peer_id for p in await self.p2p.list_peers() if p.peer_id != info.peer_id][:3]
            for other in peers:
                try:
                    reply = await ask(self.p2p, other, {"op": "via", "target": info.peer_id.to_base58(), "circuits": circuits},
                                      3 * _DIAL_TIMEOUT_S)
                except Exception:  # noqa: BLE001, S112 - that peer cannot help; the next may
                    continue
                if reply.get("ok"):
                    return {"ok": True, "by": other.to_base58()}
            return {"ok": False if peers else None}
        raise ValueError(f"unknown op {op!r}")

    async def _relays_we_may_dial(self, circuits: list[str]) -> list[str]:
        """`circuits` whose relay is a peer we are connected to, or at a global IP (not our LAN, loopback, ...)."""
        connected = {str(p.peer_id) for p in await self.p2p.list_peers()}
        allowed = []
        for circuit in circuits:
            try:
                relay = Multiaddr(circuit.split("/p2p-circuit", 1)[0])
                relay_id = relay.value_for_protocol("p2p")
            except (LookupError, ValueError):  # multiaddr's parse and lookup errors
                continue
            if relay_id in connected or _is_global(relay):
                allowed.append(circuit)
        return allowed


def _is_global(maddr: Multiaddr) -> bool:
    for proto in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(maddr.value_for_protocol(proto)).is_global
        except (LookupError, ValueError):  # no such part, or not an address
            continue
    return False  # a DNS name: where it points is not known here


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > _MAX_REQUEST:
        raise ValueError(f"frame of {size} bytes")
    return await reader.readexactly(size)


async def _write_frame(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(len(data).to_bytes(4, "big") + data)
    await writer.drain()


async def ask(p2p: P2P, peer: PeerID, request: dict, timeout: float) -> dict:
    """One request/reply on `peer`'s REACH_STREAM."""

    async def exchange() -> dict:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, REACH_STREAM)
        try:
            await _write_frame(writer, msgpack.packb(request))
            reply = msgpack.unpackb(await _read_frame(reader), raw=False)
        finally:
            writer.close()
        if not isinstance(reply, dict):
            raise TypeError("reply is not a map")
        return reply

    return await asyncio.wait_for(exchange(), timeout)


async def ping_through(p2p: P2P, peer: PeerID, circuits: Sequence[str], timeout: float) -> bool:
    """Whether `peer` answers a ping after we connect to it through `circuits` only."""
    if not circuits:
        return False
    try:
        await asyncio.wait_for(p2p._client.connect(peer, [circuit_maddr(c.split("/p2p-circuit", 1)[0]) for c in circuits]), timeout)
        return bool((await ask(p2p, peer, {"op": "ping"}, timeout)).get("ok"))
    except Exception as exc:  # noqa: BLE001 - not reachable that way is the answer
        logger.debug("ping through %s to %s failed: %s: %s", circuits, peer, type(exc).__name__, exc)
        return False


def listen_ports(maddrs: Sequence[str]) -> list[int]:
    ports = []
    for m in maddrs:
        parts = m.strip("/").split("/")
        for proto, value in zip(parts[::2], parts[1::2]):
            if proto == "tcp" and value.isdigit() and int(value) not in ports:
                ports.append(int(value))
    return ports[:_MAX_PORTS]


async def check_reachability(p2p: P2P, asked: PeerID, *, ports: Sequence[int], circuits: Sequence[str], timeout: float) -> Reach:
    """Ask `asked` to dial us back directly; failing that, to have another peer reach us through `circuits`."""
    try:
        reply = await ask(p2p, asked, {"op": "dialback", "ports": list(ports)}, timeout)
    except Exception as exc:  # noqa: BLE001
        return Reach("unknown", f"peer {asked} did not answer the dial-back check ({type(exc).__name__}: {exc})")
    if reply.get("direct"):
        return Reach("reachable", f"{asked} opened a new TCP connection to {reply.get('observed')} on port(s) {list(ports)}")
    observed = reply.get("observed", "?")
    if not circuits:
        return Reach("unreachable", f"{asked} sees us at {observed} but cannot open a connection to us there "
                                    "(NAT or firewall), and no relay is configured")
    try:
        reply = await ask(p2p, asked, {"op": "relaycheck", "circuits": list(circuits)}, 4 * timeout)
    except Exception as exc:  # noqa: BLE001
        reply = {"ok": False}
        logger.debug("relay check via %s failed: %s: %s", asked, type(exc).__name__, exc)
    if reply.get("ok"):
        return Reach("relayed", f"not dialable at {observed}; peer {reply.get('by')} reached us through {circuits[0]}")
    if reply.get("ok") is None:
        return Reach("unreachable", f"not dialable at {observed}; relay slot requested at {circuits[0]}, but no third "
                                    "peer is around yet to confirm it (checked again at the next re-bootstrap)")
    return Reach("unreachable", f"not dialable at {observed}, and no peer reached us through {', '.join(circuits)}: "
                                "the relay may refuse reservations (is it running with swarm.use_relay?)")
