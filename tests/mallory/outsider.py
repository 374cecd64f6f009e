"""An outsider of a private swarm, as a real process: it knows a member's address and the DHT key, not the secret.

Usage: python -P outsider.py <member maddr> <swarm> <index key> <ciphertext sha256 hex> <marker hex> <size>

It tries to read (the raw DHT records under the rollout index key the member wrote, and the body
by its hash from the member) and to inject (its own signed rollout, announced in the swarm's
current index bucket). It prints one JSON line: what it saw and what the members' DHT accepted
from it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from hivespec.node.config import SwarmConfig
from hivespec.node.swarm.gossip import Gossip
from hivespec.node.swarm.transfer import download
from hivespec.protocol.envelope import Kind, seal
from hivespec.protocol.identity import Identity


async def snoop(maddr: str, key: str, digest: bytes, size_hint: int, marker: bytes) -> dict:
    # A bare hivemind node without any validator: it sees whatever the members' DHT returns.
    p2p = await P2P.create(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    dht = await DHTNode.create(p2p=p2p, initial_peers=[maddr])
    found = await dht.get(key, latest=True)
    values = [] if found is None or not isinstance(found.value, dict) else [v.value for v in found.value.values()]
    raw = b"".join(v for v in values if isinstance(v, bytes))
    peer = PeerID.from_base58(Multiaddr(maddr).value_for_protocol("p2p"))
    try:
        body = await asyncio.wait_for(download(p2p, peer, [maddr], digest, size_hint, timeout=10), 15)
    except Exception as exc:  # noqa: BLE001
        body = f"{type(exc).__name__}".encode()
    await dht.shutdown()
    await p2p.shutdown()
    return {
        "records_seen": len(values),
        "marker_in_records": marker in raw,
        "body_bytes": len(body),
        "marker_in_body": marker in body,
    }


def main() -> None:
    maddr, swarm, key, digest_hex, marker_hex, size = sys.argv[1:7]
    result = asyncio.run(snoop(maddr, key, bytes.fromhex(digest_hex), int(size), bytes.fromhex(marker_hex)))
    # Inject: a public-mode node of the same swarm name publishes its own signed rollout.
    me = Identity.generate()
    gossip = Gossip(me, SwarmConfig(swarm=swarm, initial_peers=[maddr], request_timeout=5.0, bootstrap_timeout=10.0))
    gossip.start()
    try:
        gossip.publish_rollouts(seal(me, Kind.ROLLOUTS, 1, b"outsider rollout " + os.urandom(64)), version=0)
        result["injected_store_failed"] = gossip.stats().get("announce_store_failed", 0)
    finally:
        gossip.shutdown()
    result["outsider"] = me.peer_id
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
