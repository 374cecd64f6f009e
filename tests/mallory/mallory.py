"""Mallory: a hostile peer as a real process (real hivemind, real Ed25519 keys, our own code turned against us).

Usage: python -P mallory.py <honest maddr> <swarm> <victim peer id> <victim libp2p id> <honest peer id> <linger s> <out.json>

It joins the swarm through the honest node and announces in the rollout index (by recency, like
any node: `publish_rollouts` into the current bucket, but as a modified client that lists all its
batches in one record, as many as a record may hold, where ours lists its 2 newest) and serves: rollouts signed by itself with
NaN / inf / positive log-probs, out-of-vocabulary ids, mismatched lengths, a false reward, a
batch signed long ago but announced as fresh, and a batch from a far-future policy version
announced as version 0 (the victim sets a version window); an envelope that claims the honest node as author with a forged
signature. In a second record, under the root keys of the previous and the next bucket (a reader
in either bucket sees one), it announces the honest node's own envelopes as its own (replays)
and a body whose announced size does not match what it serves. In the DHT it tries to overwrite
the honest node's and the victim's records under the current bucket's root key, to store a
far-future expiration, an oversized and a malformed value, and sends raw garbage to the victim's
DHT handlers and body stream. It writes what it attempted to `out.json` and keeps serving for
`linger` seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time

import numpy as np
from hivemind.p2p import PeerID

from hivespec.node.config import SwarmConfig, load_config
from hivespec.node.model.loader import load_model, load_tokenizer, model_fingerprint
from hivespec.node.swarm import rollouts as rollouts_module
from hivespec.node.swarm.gossip import Gossip
from hivespec.node.swarm.index import bucket_of, placement_path
from hivespec.node.swarm.transfer import STREAM_NAME
from hivespec.node.tasks.source import TaskSource
from hivespec.protocol.announce import MAX_ITEMS, Announce, AnnouncedBody, encode_announce
from hivespec.protocol.codec import pack
from hivespec.protocol.envelope import Kind, open_envelope, seal, signed_message
from hivespec.protocol.identity import Identity
from hivespec.protocol.rollout import Rollout, RolloutBatch, encode_batch


def rollouts(tasks: TaskSource, tokenizer, round_: int, count: int = 2) -> list[Rollout]:
    """Rollouts that pass every check: real prompts, a real completion, the verifier's own reward."""
    out = []
    for i, task in enumerate(tasks.prompts(seed=666, round=round_, count=count)):
        completion = tokenizer.encode(" 42", add_special_tokens=False) or [1]
        text = tokenizer.decode(completion, skip_special_tokens=True)
        out.append(Rollout(task.prompt_id, i, 7, np.asarray(tasks.chat_prompt_ids(tokenizer, task), dtype=np.uint32),
                           np.asarray(completion, dtype=np.uint32), np.full(len(completion), -0.5, dtype=np.float32),
                           float(tasks.reward(task, text)), "stop"))
    return out


def attacks(me: Identity, honest_key: bytes, fingerprint: str, vocab: int, base: list[Rollout], round_: int, seq: int) -> dict[str, bytes]:
    """name -> sealed envelope bytes, one per content attack (nine: one index record's worth, `MAX_ITEMS`).

    A batch's round is only its author's own counter (nodes share no round numbers), so a "future
    round" is no attack any more; a stale signature announced as fresh is.
    """
    def batch(rs: list[Rollout], *, rnd: int = round_, version: int = 0) -> bytes:
        return encode_batch(RolloutBatch(rnd, version, fingerprint, tuple(rs)))

    def with_logprob(value: float) -> list[Rollout]:
        r = base[0]
        lp = np.array(r.behaviour_logprobs, dtype=np.float32)
        lp[0] = value
        return [Rollout(r.prompt_id, r.sample_index, r.seed, r.prompt_ids, r.completion_ids, lp, r.reward, r.finish_reason)]

    r = base[0]
    oov = Rollout(r.prompt_id, r.sample_index, r.seed, r.prompt_ids, np.array([vocab + 5], dtype=np.uint32),
                  np.array([-0.1], dtype=np.float32), r.reward, "stop")
    false_reward = Rollout(r.prompt_id, r.sample_index, r.seed, r.prompt_ids, r.completion_ids, r.behaviour_logprobs,
                           1e9 if r.reward != 1e9 else 0.0, "stop")
    mismatched = pack({"round": round_, "policy_version": 0, "fingerprint": fingerprint, "rollouts": [{
        "prompt_id": r.prompt_id, "sample_index": 0, "seed": 7, "prompt_ids": r.prompt_ids.tobytes(),
        "completion_ids": r.completion_ids.tobytes(), "behaviour_logprobs": b"\x00\x00\x00\xbf" * (len(r.completion_ids) + 3),
        "reward": r.reward, "finish_reason": "stop"}]})
    bodies = {
        "nan_logprob": batch(with_logprob(float("nan"))),
        "inf_logprob": batch(with_logprob(float("-inf"))),
        "positive_logprob": batch(with_logprob(0.7)),
        "out_of_vocab": batch([oov]),
        "mismatched_lengths": mismatched,
        "false_reward": batch([false_reward]),
        "future_policy_version": batch(base, version=10_000),  # announced as version 0: the reader's filter passes it
    }
    out = {name: seal(me, Kind.ROLLOUTS, seq + i, body) for i, (name, body) in enumerate(bodies.items())}
    # Valid content signed 250 s ago (past staleness_seconds, within the clock window), announced as born now.
    out["stale_signature"] = seal(me, Kind.ROLLOUTS, seq + 50, batch(base), timestamp=time.time() - 250)
    # Claims the honest node wrote it; signed with Mallory's key.
    body = batch(base)
    ts = time.time()
    bad_sig = me.sign(signed_message(1, "rollouts", honest_key, seq + 99, ts, body))
    out["forged_signature"] = pack({"v": 1, "kind": "rollouts", "author": honest_key, "seq": seq + 99, "ts": ts,
                                    "body": body, "sig": bad_sig})
    return out


async def raw_attacks(g: Gossip, victim_p2p: PeerID) -> dict[str, str]:
    """Garbage straight at the victim's DHT handlers and body stream; returns what each attempt got back."""
    results = {}
    client = g._p2p._client
    for name, handle in (("dht_store_garbage", "DHTProtocol.rpc_store"), ("dht_find_garbage", "DHTProtocol.rpc_find"),
                         ("dht_ping_garbage", "DHTProtocol.rpc_ping")):
        try:
            await asyncio.wait_for(client.call_unary_handler(victim_p2p, handle, os.urandom(3000)), 10)
            results[name] = "answered"
        except Exception as exc:  # noqa: BLE001 - an error reply is the expected outcome
            results[name] = type(exc).__name__
    for name, payload in (("stream_short", b"\x01\x02"), ("stream_junk", os.urandom(32) + os.urandom(1000))):
        try:
            _, _reader, writer = await asyncio.wait_for(g._p2p.call_binary_stream_handler(victim_p2p, STREAM_NAME), 10)
            writer.write(payload)
            await writer.drain()
            writer.close()
            results[name] = "sent"
        except Exception as exc:  # noqa: BLE001
            results[name] = type(exc).__name__
    return results


def main() -> None:
    maddr, swarm, victim_id, victim_p2p, honest_id, linger_s, out_path = sys.argv[1:8]
    round_ = 1  # the batches' own round field: Mallory's counter, which no reader compares with its own
    config = load_config("tiny")
    tokenizer = load_tokenizer(config.model.name)
    model = load_model(config.model.name)
    fingerprint = model_fingerprint(model.config, tokenizer)
    tasks = TaskSource.from_config(config.tasks)
    me = Identity.generate()
    rollouts_module._OWN_ANNOUNCED = MAX_ITEMS  # a hostile client: every attack in one record, where a reader meets them all
    g = Gossip(me, SwarmConfig(swarm=swarm, initial_peers=[maddr], request_timeout=5.0, bootstrap_timeout=10.0))
    g.start()
    tally: dict[str, object] = {"mallory": me.peer_id, "announced": [], "dht": {}}
    try:
        # The honest node's public key and envelopes, read like any peer would.
        honest = [f for f in g.sample_rollouts(k=8, max_age_s=240.0, timeout=10.0) if f.author_peer_id == honest_id]
        honest_key = Identity.generate().public_key
        if honest:
            _, env = open_envelope(honest[0].body, limits=g.fetcher.limits)
            honest_key = env.author
        seq = time.time_ns() // 1000
        bodies = attacks(me, honest_key, fingerprint, model.config.vocab_size, rollouts(tasks, tokenizer, round_), round_, seq)
        for name, data in bodies.items():
            g.publish_rollouts(data, version=0)
            tally["announced"].append(name)

        junk = os.urandom(2000)
        lying = AnnouncedBody(me.peer_id, hashlib.sha256(junk).digest(), 3_000_000, time.time(), 0)  # announced size != served

        async def extra_record() -> list[str]:
            """Replays and the size lie in a second record, under the previous and the next bucket's root keys."""
            items = [(lying, junk)]
            # Replays: the honest node's own envelopes, announced and served again by Mallory as their author.
            items += [(AnnouncedBody(me.peer_id, hashlib.sha256(f.body).digest(), len(f.body), time.time(), 0), f.body) for f in honest]
            bucket = bucket_of(time.time(), g.config.index_bucket_s)
            stored = []
            for b in (bucket - 1, bucket + 1):
                key = await g.rollouts.placed_key(b)
                for item, wire in items:
                    g.bodies.keep(item.sha256, wire)
                    g.records.hold(key, item, first=True)
                if await g.records.store(key):
                    stored.append(key)
            return stored

        tally["extra_record_keys"] = g._call(extra_record(), 30)
        tally["announced"] += ["size_lie"] + ["replay"] * len(honest)

        async def dht_attacks() -> dict[str, bool]:
            out = {}
            key = placement_path(swarm, bucket_of(time.time(), g.config.index_bucket_s), me.peer_id)[0]  # the bucket's root key
            exp = time.time() + 60
            item = lying

            def record(expires: float, items=(item,)) -> bytes:
                body = encode_announce(Announce(key, expires, g._p2p.peer_id.to_base58(), tuple(g.visible_maddrs), items))
                return seal(me, Kind.ANNOUNCE, time.time_ns() // 1000, body)

            out["overwrite_honest"] = await g._dht.store(key, record(exp), exp, subkey=honest_id)
            out["overwrite_victim"] = await g._dht.store(key, record(exp), exp, subkey=victim_id)
            far = time.time() + 3e8
            out["far_future_expiration"] = await g._dht.store(key, record(far), far, subkey=me.peer_id)
            out["oversized_value"] = await g._dht.store(key, os.urandom(200_000), exp, subkey=me.peer_id)
            out["malformed_value"] = await g._dht.store(key, b"\xc1\xc1 not msgpack", exp, subkey=me.peer_id)
            out["regular_key_value"] = await g._dht.store(key, b"no subkey", exp)
            # Mallory's own node keeps what it stored: it will hand these to anyone who asks.
            return out

        tally["dht"] = g._call(dht_attacks(), 60)
        tally["raw"] = g._call(raw_attacks(g, PeerID.from_base58(victim_p2p)), 60)
        with open(out_path, "w") as f:
            json.dump(tally, f)
        time.sleep(float(linger_s))
    finally:
        g.shutdown()


if __name__ == "__main__":
    main()
