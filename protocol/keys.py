"""DHT key names: every key a node reads or writes is built here, so peers agree on them.

All keys live under ``hivespec/<swarm>/``; the swarm name keeps separate swarms on one DHT
(or one test machine) from reading each other's records.
"""

from __future__ import annotations

import re

_SWARM_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


def _prefix(swarm: str) -> str:
    if not isinstance(swarm, str) or not _SWARM_NAME.fullmatch(swarm):
        raise ValueError(
            f"swarm name {swarm!r} is invalid: use 1-64 characters of lowercase letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return f"hivespec/{swarm}"


def _non_negative(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return value


MAX_INDEX_LEVEL = 24
"""Deepest level of the rollout index tree (2^24 keys per bucket: far past any swarm's size)."""


def rollout_index_key(swarm: str, bucket: int, level: int, prefix: int) -> str:
    """Key of one node of a time bucket's rollout index tree (see `node/swarm/index.py`).

    `bucket` numbers a time bucket; `level` 0 is the bucket's root key, level l has 2^l keys and
    `prefix` (< 2^l) picks one: the first l bits of the sha256 of the holders' peer ids stored there.
    """
    _non_negative(bucket, "bucket")
    if not 0 <= _non_negative(level, "level") <= MAX_INDEX_LEVEL or not _non_negative(prefix, "prefix") < 2**level:
        raise ValueError(f"index level {level} / prefix {prefix} outside 0..{MAX_INDEX_LEVEL} / 0..2^level - 1")
    return f"{_prefix(swarm)}/rollouts/{bucket}/{level}/{prefix}"


def check_swarm_name(swarm: str) -> str:
    """`swarm` if it is a valid swarm name, else ValueError saying what one looks like."""
    _prefix(swarm)
    return swarm


def delta_key(swarm: str, slot: int) -> str:
    """Key announcing one chunk of the sparse weight delta producing a policy version (see `delta_slot`)."""
    return f"{_prefix(swarm)}/delta/{_non_negative(slot, 'slot')}"


def snapshot_key(swarm: str, slot: int) -> str:
    """Key announcing one chunk of a snapshot: the cumulative delta from the base checkpoint (see `delta_slot`)."""
    return f"{_prefix(swarm)}/snapshot/{_non_negative(slot, 'slot')}"


def head_key(swarm: str, slot: int) -> str:
    """Key whose subkeys (one per leader) hold each leader's latest policy version and snapshot (slot 0)."""
    return f"{_prefix(swarm)}/head/{_non_negative(slot, 'slot')}"


MAX_DELTA_CHUNKS = 4096
"""Chunks one delta may have; also the stride of `delta_slot` (matches Limits.max_delta_chunks)."""


def delta_slot(version: int, chunk: int) -> int:
    """Gossip slot of chunk `chunk` of the delta (or snapshot) producing `version`: one body per slot and author."""
    if not 0 <= chunk < MAX_DELTA_CHUNKS:
        raise ValueError(f"chunk index {chunk} outside 0..{MAX_DELTA_CHUNKS - 1}")
    return _non_negative(version, "version") * MAX_DELTA_CHUNKS + chunk


def peers_key(swarm: str) -> str:
    """Key whose subkeys (one per peer) hold each live peer's announce record."""
    return f"{_prefix(swarm)}/peers"


TOPIC_KEYS = {"delta": delta_key, "snapshot": snapshot_key, "head": head_key}
"""Slot topics: each maps a slot number (a delta chunk's `delta_slot`, 0 for the head) to its DHT key. Rollouts
are not a slot topic: nodes share no round numbers, they are found by recency (`rollout_index_key`)."""


def topic_key(swarm: str, topic: str, slot: int) -> str:
    """The DHT key of `slot` in `topic` ("delta"/"snapshot": `delta_slot`; "head": 0)."""
    try:
        build = TOPIC_KEYS[topic]
    except KeyError:
        raise ValueError(f"unknown gossip topic {topic!r}; known: {sorted(TOPIC_KEYS)}") from None
    return build(swarm, slot)
