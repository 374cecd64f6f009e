"""Who a node's policy owes: the peers whose signed rollouts it accepted and trained on, with counts.

Two sources in the node's home, both read-only:

- the rollout journal ``rollouts.sqlite`` (node/training/store.py): its counts of every foreign
  rollout the intake accepted (signature, schema, fingerprint, staleness and reward checks passed),
  by author peer id, and of the node's own rollouts (kept when old rows are pruned);
- the events log ``events.jsonl`` (``hivespec join --events``; every demo node keeps one): per
  round, the samples of each source the training step trained on, with a gradient (``importance_by_source``;
  a group whose rewards are all equal carries none).
  A round re-run after a crash appears twice there; the last event of each round is the one
  counted. Without an events log the trained counts are unknown (None), never guessed.

The journal is opened read-only (SQLite URI ``mode=ro``), so reading it beside a running node
neither locks nor changes it.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

JOURNAL_FILE = "rollouts.sqlite"
EVENTS_FILE = "events.jsonl"
OWN = "own"


@dataclass(frozen=True)
class PeerCredit:
    """One peer's share in a policy: rollouts of theirs the node accepted, and samples it trained on."""

    peer_id: str
    accepted: int
    trained: int | None  # None: the home keeps no events log


@dataclass(frozen=True)
class Credits:
    """Every peer's credit, most accepted first, plus the node's own rollouts and trained samples."""

    peers: list[PeerCredit]
    own_rollouts: int
    own_trained: int | None
    journal: bool  # the home has a journal (False: nothing could be counted)

    @property
    def foreign_accepted(self) -> int:
        return sum(p.accepted for p in self.peers)


def journal_counts(path: Path) -> tuple[dict[str, int], int]:
    """Accepted foreign rollouts per author and the own rollout count in the journal at ``path``.

    Raises ValueError naming the file when it is not a readable rollout journal.
    """
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0)
    except sqlite3.Error as exc:
        raise ValueError(f"cannot open the rollout journal {path}: {exc}") from None
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        # `totals` counts every rollout ever journaled (the journal itself keeps only recent ones);
        # a journal written before it had one holds them all.
        query = ("SELECT author, own, rollouts FROM totals" if "totals" in tables
                 else "SELECT author, own, COUNT(*) FROM rollouts GROUP BY author, own")
        rows = conn.execute(query).fetchall()
    except sqlite3.Error as exc:
        raise ValueError(f"{path} is not a readable rollout journal: {exc}") from None
    finally:
        conn.close()
    foreign = {str(author): int(n) for author, own, n in rows if not own}
    return foreign, sum(int(n) for _, own, n in rows if own)


def trained_counts(path: Path, *, rounds: int | None = None) -> dict[str, int]:
    """Samples per source ("own" or a peer id) over the round events in the events log at ``path``.

    The last event of each round counts (a round re-run after a crash is logged twice); with
    ``rounds``, only rounds below it (the rounds the policy holds). Unparsable lines are skipped.
    """
    by_round: dict[int, dict] = {}
    with path.open(errors="replace") as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "round" and isinstance(event.get("round"), int):
                by_round[event["round"]] = event.get("importance_by_source") or {}
    totals: dict[str, int] = {}
    for round_index, sources in by_round.items():
        if rounds is not None and round_index >= rounds:
            continue
        for source, stats in sources.items():
            samples = stats.get("samples", 0) if isinstance(stats, dict) else 0
            if isinstance(samples, int) and samples > 0:
                totals[source] = totals.get(source, 0) + samples
    return totals


def peer_credits(home: Path, *, rounds: int | None = None) -> Credits:
    """The credits a policy trained in ``home`` owes, from its journal and (where kept) its events log."""
    journal = home / JOURNAL_FILE
    foreign, own = journal_counts(journal) if journal.is_file() else ({}, 0)
    events = home / EVENTS_FILE
    trained = trained_counts(events, rounds=rounds) if events.is_file() else None
    peers = set(foreign) | ({s for s in trained if s != OWN} if trained else set())
    credits = [
        PeerCredit(peer, foreign.get(peer, 0), None if trained is None else trained.get(peer, 0))
        for peer in peers
    ]
    credits.sort(key=lambda c: (-c.accepted, -(c.trained or 0), c.peer_id))
    return Credits(credits, own, None if trained is None else trained.get(OWN, 0), journal.is_file())
