"""SQLite (WAL) journal of own and accepted foreign rollouts, plus the envelope replay log.

One connection shared by every thread, guarded by a lock: SQLite serialises writers anyway, and a
single connection keeps ":memory:" stores coherent across threads. WAL lets a second process (a
dashboard, a debugging shell) read while the node writes.

The journal is bounded in time: with `keep_seconds`, rows older than that are deleted as new ones
arrive (about 1 KB a rollout; a `public` step takes up to 160, its own and K peers' batches).
Everything that reads rows reads recent ones: intake's dedupe (a batch arrives twice within
minutes, from its author and from relays; envelopes signed over 300 s ago are refused), a
resume's foreign pool (older than `train.staleness_seconds` is never trained on), the drafter's
warm-up (its newest rows). The counts per author survive pruning in `totals`, kept by a trigger
on every insert: `counts` and the model card's credits read them.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from hivespec.node.faults import fault_point
from hivespec.protocol.rollout import Rollout, encode_rollout, rollout_content_hash

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: the totals table and its trigger
BUSY_TIMEOUT_S = 10.0
PRUNE_EVERY_S = 60.0  # with keep_seconds: at most one prune a minute, after an insert
PRUNE_MAX_ROWS = 20_000  # per prune (~20 MB): a journal grown large before it had a bound shrinks over minutes, not in one stall

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    content_hash   BLOB PRIMARY KEY,
    author         TEXT NOT NULL,
    round          INTEGER NOT NULL,
    prompt_id      TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    reward         REAL NOT NULL,
    own            INTEGER NOT NULL,
    n_tokens       INTEGER NOT NULL,
    payload        BLOB NOT NULL,
    received_at    REAL NOT NULL,
    born           REAL
);
CREATE INDEX IF NOT EXISTS rollouts_round ON rollouts(round);
CREATE INDEX IF NOT EXISTS rollouts_prompt ON rollouts(prompt_id);
CREATE TABLE IF NOT EXISTS envelopes (
    author TEXT NOT NULL,
    seq    INTEGER NOT NULL,
    ts     REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (author, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS totals (
    author   TEXT NOT NULL,
    own      INTEGER NOT NULL,
    rollouts INTEGER NOT NULL,
    PRIMARY KEY (author, own)
) WITHOUT ROWID;
"""
# Its own statement: the body's semicolons would split _SCHEMA. Fires for rows really inserted (not a duplicate ignored).
_TOTALS_TRIGGER = """
CREATE TRIGGER IF NOT EXISTS rollouts_totals AFTER INSERT ON rollouts BEGIN
    INSERT INTO totals (author, own, rollouts) VALUES (NEW.author, NEW.own, 1)
    ON CONFLICT (author, own) DO UPDATE SET rollouts = rollouts + 1;
END
"""

_COLUMNS = "content_hash, author, round, prompt_id, policy_version, reward, own, n_tokens, payload, received_at, born"


@dataclass(frozen=True)
class StoredRollout:
    """One journaled rollout; `payload` is opaque bytes (an encoded rollout), `own` marks our own.

    `born` is when its author signed the batch (None in rows from before it was kept): a foreign rollout's
    age for the staleness window is counted from it, not from when it arrived.
    """

    content_hash: bytes
    author: str
    round: int
    prompt_id: str
    policy_version: int
    reward: float
    own: bool
    n_tokens: int
    payload: bytes
    received_at: float
    born: float | None = None

    @classmethod
    def from_rollout(
        cls, rollout: Rollout, *, author: str, round: int, policy_version: int, own: bool, received_at: float,
        born: float | None = None,
    ) -> StoredRollout:
        """Journal row for a validated rollout; the payload is protocol's rollout encoding."""
        return cls(
            content_hash=rollout_content_hash(rollout),
            author=author,
            round=round,
            prompt_id=rollout.prompt_id,
            policy_version=policy_version,
            reward=rollout.reward,
            own=own,
            n_tokens=len(rollout.completion_ids),
            payload=encode_rollout(rollout),
            received_at=received_at,
            born=born,
        )

    def _row(self) -> tuple:
        return (
            bytes(self.content_hash),
            self.author,
            int(self.round),
            self.prompt_id,
            int(self.policy_version),
            float(self.reward),
            int(bool(self.own)),
            int(self.n_tokens),
            bytes(self.payload),
            float(self.received_at),
            None if self.born is None else float(self.born),
        )

    @classmethod
    def _from_row(cls, row: tuple) -> StoredRollout:
        h, author, rnd, prompt_id, version, reward, own, n_tokens, payload, received_at, born = row
        return cls(h, author, rnd, prompt_id, version, reward, bool(own), n_tokens, payload, received_at, born)


class StoreSchemaError(RuntimeError):
    """The database was written by a newer hivespec than this one."""


class RolloutStore:
    """Thread-safe rollout journal over one SQLite connection.

    `path` is a file path or ":memory:". Opening a database written by a newer schema raises
    `StoreSchemaError` instead of guessing at its layout.
    """

    def __init__(self, path: Path | str, *, keep_seconds: float | None = None) -> None:
        self.path = str(path)
        self.keep_seconds = keep_seconds
        self._pruned_at = 0.0
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we issue BEGIN/COMMIT ourselves so a batch is exactly one transaction.
        self._conn = sqlite3.connect(
            self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None
        )
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._open_schema()
        except BaseException:
            self._conn.close()
            self._closed = True
            raise

    def _open_schema(self) -> None:
        conn = self._conn
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreSchemaError(
                f"rollout store {self.path!r} has schema version {version}, but this hivespec reads up to "
                f"version {SCHEMA_VERSION}: upgrade hivespec, or point the store at a new file"
            )
        self.journal_mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        # FULL: an accepted rollout is journaled before the round reports it accepted, so it must
        # survive an OS crash or power loss too, not only a killed process (NORMAL's guarantee).
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in filter(str.strip, _SCHEMA.split(";")):
                conn.execute(statement)
            conn.execute(_TOTALS_TRIGGER)
            if version < 2:  # totals was just created: count what the journal already holds
                conn.execute(
                    "INSERT INTO totals (author, own, rollouts) SELECT author, own, COUNT(*) FROM rollouts GROUP BY author, own"
                )
            if "ts" not in {row[1] for row in conn.execute("PRAGMA table_info(envelopes)")}:
                # Stores from before the bounded replay log: their rows count as seen now.
                conn.execute("ALTER TABLE envelopes ADD COLUMN ts REAL NOT NULL DEFAULT 0")
                conn.execute("UPDATE envelopes SET ts = ?", (time.time(),))
            if "born" not in {row[1] for row in conn.execute("PRAGMA table_info(rollouts)")}:
                conn.execute("ALTER TABLE rollouts ADD COLUMN born REAL")  # stores from before it was kept: NULL
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"rollout store {self.path!r} is closed; open a new RolloutStore")

    def add_rollouts(self, rows: Sequence[StoredRollout]) -> int:
        """Insert rows in one transaction; returns how many were new (duplicate content_hash is ignored)."""
        values = [row._row() for row in rows]
        if not values:
            return 0
        with self._lock:
            self._check_open()
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                # rowcount: the rows this statement inserted (total_changes would also count the trigger's).
                added = self._conn.executemany(
                    f"INSERT OR IGNORE INTO rollouts ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", values
                ).rowcount
                fault_point("store.before_commit")
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            now = time.time()
            if self.keep_seconds is not None and now - self._pruned_at >= PRUNE_EVERY_S:
                self._pruned_at = now
                try:
                    self._prune_rollouts(now - self.keep_seconds)
                except sqlite3.Error as exc:  # housekeeping: the insert is committed; the next prune tries again
                    log.warning("pruning the rollout journal %s failed (next try in %.0f s): %s", self.path, PRUNE_EVERY_S, exc)
            return added

    def has(self, content_hash: bytes) -> bool:
        """Whether a rollout with this content hash is already journaled."""
        with self._lock:
            self._check_open()
            row = self._conn.execute(
                "SELECT 1 FROM rollouts WHERE content_hash = ?", (bytes(content_hash),)
            ).fetchone()
        return row is not None

    def existing(self, content_hashes: Sequence[bytes]) -> set[bytes]:
        """The subset of ``content_hashes`` already journaled, in one query per 500 hashes."""
        hashes = [bytes(h) for h in content_hashes]
        found: set[bytes] = set()
        with self._lock:
            self._check_open()
            for start in range(0, len(hashes), 500):
                part = hashes[start : start + 500]
                marks = ",".join("?" * len(part))
                rows = self._conn.execute(f"SELECT content_hash FROM rollouts WHERE content_hash IN ({marks})", part)
                found.update(bytes(r[0]) for r in rows)
        return found

    def remember_envelope(self, author: str, seq: int, ts: float | None = None) -> bool:
        """Record (author, seq) with the envelope's timestamp `ts` (default: now); False if seen before (a replay)."""
        with self._lock:
            self._check_open()
            cursor = self._conn.execute(
                "INSERT OR IGNORE INTO envelopes (author, seq, ts) VALUES (?, ?, ?)",
                (author, seq, time.time() if ts is None else float(ts)),
            )
            return cursor.rowcount == 1

    def prune_envelopes(self, older_than: float) -> int:
        """Forget envelopes timestamped before `older_than`, keeping each author's highest seq; returns rows removed.

        Safe once `older_than` is past the receiver's clock window: such envelopes are refused by
        their timestamp before the replay log is consulted. Keeps the replay log bounded.
        """
        with self._lock:
            self._check_open()
            cursor = self._conn.execute(
                "DELETE FROM envelopes WHERE ts < ? AND seq < (SELECT MAX(e.seq) FROM envelopes e WHERE e.author = envelopes.author)",
                (older_than,),
            )
            return cursor.rowcount

    def prune_rollouts(self, older_than: float, *, max_rows: int = PRUNE_MAX_ROWS) -> int:
        """Delete up to `max_rows` of the rollouts journaled before `older_than` (unix time), oldest first; returns rows removed.

        The counts in `totals` stay. The newest row always stays, so row numbers never start over
        (a checkpoint's `journal_high_water` keeps meaning "rows after this one").
        """
        with self._lock:
            self._check_open()
            return self._prune_rollouts(older_than, max_rows)

    def _prune_rollouts(self, older_than: float, max_rows: int = PRUNE_MAX_ROWS) -> int:
        # Rows are appended as they arrive, so the old ones are a prefix in rowid order: the scan stops at the first
        # young row (or after max_rows) and the delete is a range, with no index on received_at to keep up.
        last = self._conn.execute(
            "SELECT MAX(rowid) FROM (SELECT rowid FROM rollouts ORDER BY rowid LIMIT ?)", (max_rows,)
        ).fetchone()[0]
        if last is None:
            return 0
        first_young = self._conn.execute(
            "SELECT rowid FROM rollouts WHERE rowid <= ? AND received_at >= ? ORDER BY rowid LIMIT 1", (last, older_than)
        ).fetchone()
        newest = self._conn.execute("SELECT MAX(rowid) FROM rollouts").fetchone()[0]
        cutoff = min(first_young[0] if first_young else last + 1, newest)
        return self._conn.execute("DELETE FROM rollouts WHERE rowid < ?", (cutoff,)).rowcount

    def envelope_count(self) -> int:
        """Rows in the replay log."""
        with self._lock:
            self._check_open()
            return self._conn.execute("SELECT COUNT(*) FROM envelopes").fetchone()[0]

    def rollouts_for_round(self, round: int) -> list[StoredRollout]:
        """All rollouts of a round, own and foreign, in arrival order."""
        with self._lock:
            self._check_open()
            rows = self._conn.execute(
                f"SELECT {_COLUMNS} FROM rollouts WHERE round = ? ORDER BY received_at, rowid", (round,)
            ).fetchall()
        return [StoredRollout._from_row(r) for r in rows]

    def recent(self, limit: int, prompt_id: str | None = None, *, up_to_rowid: int | None = None) -> list[StoredRollout]:
        """The `limit` most recently received rollouts, newest first, optionally for one prompt.

        `up_to_rowid` leaves out rows journaled after that row (a checkpoint's `journal_high_water`).
        """
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        query = f"SELECT {_COLUMNS} FROM rollouts"
        conditions, params = [], []
        if prompt_id is not None:
            conditions.append("prompt_id = ?")
            params.append(prompt_id)
        if up_to_rowid is not None:
            conditions.append("rowid <= ?")
            params.append(up_to_rowid)
        if conditions:
            query += " WHERE " + " AND ".join(conditions)
        query += " ORDER BY received_at DESC, rowid DESC LIMIT ?"
        with self._lock:
            self._check_open()
            rows = self._conn.execute(query, (*params, limit)).fetchall()
        return [StoredRollout._from_row(r) for r in rows]

    def journal_high_water(self) -> int:
        """The newest journal row number (0 when empty); rows after it arrived after this call."""
        with self._lock:
            self._check_open()
            return self._conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM rollouts").fetchone()[0]

    def foreign_after(self, rowid: int) -> list[StoredRollout]:
        """Foreign rollouts journaled after row ``rowid``, in journal order."""
        with self._lock:
            self._check_open()
            rows = self._conn.execute(
                f"SELECT {_COLUMNS} FROM rollouts WHERE rowid > ? AND own = 0 ORDER BY rowid", (rowid,)
            ).fetchall()
        return [StoredRollout._from_row(r) for r in rows]

    def get(self, content_hashes: Sequence[bytes]) -> dict[bytes, StoredRollout]:
        """The journaled rows among ``content_hashes``, by hash (missing ones are absent)."""
        found: dict[bytes, StoredRollout] = {}
        with self._lock:
            self._check_open()
            for h in content_hashes:
                row = self._conn.execute(f"SELECT {_COLUMNS} FROM rollouts WHERE content_hash = ?", (bytes(h),)).fetchone()
                if row is not None:
                    found[bytes(h)] = StoredRollout._from_row(row)
        return found

    def replay_high_water(self) -> dict[str, int]:
        """Per author, the highest envelope seq remembered: the replay high-water marks."""
        with self._lock:
            self._check_open()
            return dict(self._conn.execute("SELECT author, MAX(seq) FROM envelopes GROUP BY author").fetchall())

    def counts(self) -> dict[str, int]:
        """Rollouts ever journaled, pruned ones included: {"own", "foreign", "total"}."""
        with self._lock:
            self._check_open()
            total, own = self._conn.execute(
                "SELECT COALESCE(SUM(rollouts), 0), COALESCE(SUM(rollouts * own), 0) FROM totals"
            ).fetchone()
        return {"own": own, "foreign": total - own, "total": total}

    def close(self) -> None:
        """Close the connection (idempotent); later calls raise RuntimeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
