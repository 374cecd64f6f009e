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


def rollout_round_key(swarm: str, round: int) -> str:  # noqa: A002 - "round" is the domain word
    """Key whose subkeys (one per peer) announce that peer's rollouts for `round`."""
    return f"{_prefix(swarm)}/rollouts/{_non_negative(round, 'round')}"


def delta_key(swarm: str, version: int) -> str:
    """Key announcing the sparse weight delta that produces policy `version`."""
    return f"{_prefix(swarm)}/delta/{_non_negative(version, 'version')}"


def peers_key(swarm: str) -> str:
    """Key whose subkeys (one per peer) hold each live peer's announce record."""
    return f"{_prefix(swarm)}/peers"


TOPIC_KEYS = {"rollouts": rollout_round_key, "delta": delta_key}
"""Gossip topics: each maps a slot number (a round, a policy version) to its DHT key."""


def topic_key(swarm: str, topic: str, slot: int) -> str:
    """The DHT key of `slot` in `topic` ("rollouts": slot = round; "delta": slot = policy version)."""
    try:
        build = TOPIC_KEYS[topic]
    except KeyError:
        raise ValueError(f"unknown gossip topic {topic!r}; known: {sorted(TOPIC_KEYS)}") from None
    return build(swarm, slot)
