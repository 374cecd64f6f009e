"""The swarm protocol's number guards its formats: a change to a record's, a rollout batch's or the body fetch's bytes
fails here until `SWARM_PROTOCOL` is bumped (and these digests with it), so nodes of two versions tell each other apart
(`protocol/announce.py`) instead of refusing each other's records or batches as malformed."""

import hashlib

import numpy as np

from hivespec.node.swarm.transfer import STREAM_NAME
from hivespec.protocol.announce import SWARM_PROTOCOL, Announce, AnnouncedBody, encode_announce
from hivespec.protocol.rollout import Rollout, RolloutBatch, encode_batch

# What protocol 2 looks like on the wire. Changed a format? Bump SWARM_PROTOCOL, then put the new digests here.
PROTOCOL = 2
RECORD_SHA256 = "bd480ab9753d29892650b977c807bd8fc6c745959e849838724caada08ace35a"
BATCH_SHA256 = "ba96c00dbc4af863317aee01e52490cb94f5ad0f6839a5a9b2cd91701181fd5f"
FETCH_STREAM = "hivespec.rollouts.v1"  # the body fetch's stream; its framing is versioned in the name


def _record() -> bytes:
    item = AnnouncedBody("hs0123456789abcdef", bytes(range(32)), 1_000, 1.7e9, 3, 2)
    return encode_announce(Announce("hivespec/s/rollouts/1/0/0", 1.7e9 + 600.0, "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
                                    ("/ip4/127.0.0.1/tcp/1",), (item,)))


def _batch() -> bytes:
    ids = np.array([5, 6, 7], dtype=np.uint32)
    rollouts = (Rollout("p0", 0, 11, ids, ids[:2], np.array([-0.5, -1.25], dtype=np.float32), 1.0, "stop"),
                Rollout("p0", 1, 12, ids, ids[:1], np.array([-2.0], dtype=np.float32), 0.0, "length"))
    return encode_batch(RolloutBatch(round=4, policy_version=9, fingerprint="f" * 16, rollouts=rollouts))


def test_the_wire_formats_are_protocol_2s_until_the_number_is_bumped() -> None:
    assert SWARM_PROTOCOL == PROTOCOL, "update this test's digests to the new protocol's formats"
    seen = {"record": hashlib.sha256(_record()).hexdigest(), "batch": hashlib.sha256(_batch()).hexdigest(), "fetch": STREAM_NAME}
    assert seen == {"record": RECORD_SHA256, "batch": BATCH_SHA256, "fetch": FETCH_STREAM}, (
        f"a swarm format changed: bump SWARM_PROTOCOL in protocol/announce.py, then set this test's digests to {seen}")
