"""RolloutStore: dedupe, WAL, persistence, replay log, schema guard, concurrent writers, and a journal bounded in time."""

from __future__ import annotations

import dataclasses
import hashlib
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from hivespec.node.credits import journal_counts
from hivespec.node.training.store import SCHEMA_VERSION, RolloutStore, StoredRollout, StoreSchemaError


def make_rollout(i: int, *, round: int = 0, own: bool = False, prompt_id: str = "p0", t: float = 0.0) -> StoredRollout:
    payload = f"rollout-{i}".encode() * 10
    return StoredRollout(
        content_hash=hashlib.sha256(payload).digest(),
        author="me" if own else f"peer{i % 3}",
        round=round,
        prompt_id=prompt_id,
        policy_version=round,
        reward=0.5 * i,
        own=own,
        n_tokens=10 + i,
        payload=payload,
        received_at=t if t else float(i),
    )


def test_dedupe_by_content_hash() -> None:
    store = RolloutStore(":memory:")
    rows = [make_rollout(i) for i in range(5)]
    assert store.add_rollouts(rows) == 5
    assert store.add_rollouts(rows[:3] + [make_rollout(7)]) == 1
    assert store.add_rollouts([]) == 0
    assert store.has(rows[0].content_hash)
    assert not store.has(b"\x00" * 32)
    assert store.counts() == {"own": 0, "foreign": 6, "total": 6}
    store.close()


def test_round_recent_counts_and_roundtrip() -> None:
    store = RolloutStore(":memory:")
    rows = [make_rollout(i, round=i % 2, own=i < 2, prompt_id=f"p{i % 3}") for i in range(6)]
    store.add_rollouts(rows)
    assert store.rollouts_for_round(0) == [rows[0], rows[2], rows[4]]
    assert store.rollouts_for_round(9) == []
    assert store.recent(2) == [rows[5], rows[4]]
    assert store.recent(10, prompt_id="p1") == [rows[4], rows[1]]
    assert store.recent(10, prompt_id="p1", up_to_rowid=4) == [rows[1]]  # rows journaled after row 4 left out
    assert store.recent(2, up_to_rowid=3) == [rows[2], rows[1]]
    assert store.counts() == {"own": 2, "foreign": 4, "total": 6}
    assert isinstance(store.recent(1)[0].own, bool)
    with pytest.raises(ValueError, match="limit"):
        store.recent(-1)
    store.close()


def test_remember_envelope_rejects_replays() -> None:
    store = RolloutStore(":memory:")
    assert store.remember_envelope("alice", 1)
    assert store.remember_envelope("alice", 2)
    assert store.remember_envelope("bob", 1)
    assert not store.remember_envelope("alice", 1)
    store.close()


def test_wal_mode_and_persistence_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "rollouts.sqlite"
    store = RolloutStore(path)
    assert store.journal_mode == "wal"
    store.add_rollouts([make_rollout(i, own=True) for i in range(3)])
    store.remember_envelope("alice", 5)
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.counts()

    with RolloutStore(path) as again:
        assert again.journal_mode == "wal"
        assert again.counts() == {"own": 3, "foreign": 0, "total": 3}
        assert not again.remember_envelope("alice", 5)
        assert again.rollouts_for_round(0)[0] == make_rollout(0, own=True)
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    raw.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.sqlite"
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    with pytest.raises(StoreSchemaError, match="upgrade hivespec"):
        RolloutStore(path)


@pytest.mark.timeout(60)
def test_concurrent_adds_from_two_threads(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "rollouts.sqlite")
    # Both threads insert an overlapping range: every row lands exactly once.
    batches = [[make_rollout(i) for i in range(start, start + 300)] for start in (0, 150)]
    inserted: list[int] = []
    errors: list[BaseException] = []

    def writer(batch: list[StoredRollout]) -> None:
        try:
            for k in range(0, len(batch), 10):
                inserted.append(store.add_rollouts(batch[k : k + 10]))
                store.has(batch[k].content_hash)
        except BaseException as exc:  # noqa: BLE001 - surfaced below; a thread exception would otherwise vanish
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(inserted) == 450
    assert store.counts()["total"] == 450
    store.close()


def test_existing_answers_in_one_query_and_replay_log_is_pruned(tmp_path: Path) -> None:
    with RolloutStore(tmp_path / "s.sqlite") as store:
        rows = [make_rollout(i) for i in range(3)]
        store.add_rollouts(rows[:2])
        assert store.existing([r.content_hash for r in rows] * 300) == {rows[0].content_hash, rows[1].content_hash}
        for seq in range(10):
            assert store.remember_envelope("alice", seq, ts=1000.0 + seq)
        assert store.remember_envelope("bob", 1, ts=1000.0)
        assert store.prune_envelopes(older_than=1005.0) == 5  # alice's 0..4; bob's only (highest) row is kept
        assert store.envelope_count() == 6
        assert store.replay_high_water() == {"alice": 9, "bob": 1}
        assert not store.remember_envelope("alice", 9, ts=1009.0)  # still a replay


def test_an_old_replay_log_gains_timestamps(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE envelopes (author TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (author, seq)) WITHOUT ROWID")
    conn.execute("INSERT INTO envelopes VALUES ('alice', 1)")
    conn.commit()
    conn.close()
    with RolloutStore(path) as store:
        assert not store.remember_envelope("alice", 1)
        assert store.prune_envelopes(older_than=0.0) == 0  # migrated rows count as seen now


def test_old_rollouts_are_pruned_and_the_counts_stay(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.sqlite"
    now = time.time()
    with RolloutStore(path, keep_seconds=3600) as store:
        # received_at: 3 rows two hours old, 3 rows a minute old; the add prunes the old ones at once.
        old = [make_rollout(i, own=i == 0, t=now - 7200 + i) for i in range(3)]
        young = [make_rollout(i, own=i == 3, t=now - 60 + i) for i in range(3, 6)]
        assert store.add_rollouts(old + young) == 6
        assert [r.content_hash for r in store.recent(10)] == [r.content_hash for r in reversed(young)]
        assert store.counts() == {"own": 2, "foreign": 4, "total": 6}  # every rollout ever journaled
        high_water = store.journal_high_water()
        assert store.prune_rollouts(older_than=now + 3600) == 2  # all old now: the newest row stays...
        assert store.journal_high_water() == high_water  # ...so row numbers never start over
        store.add_rollouts([make_rollout(9, t=now)])
        assert [r.content_hash for r in store.foreign_after(high_water)] == [make_rollout(9).content_hash]
        assert store.counts() == {"own": 2, "foreign": 5, "total": 7}
    foreign, own = journal_counts(path)  # the model card's credits read the same totals
    assert own == 2 and foreign == {"peer0": 1, "peer1": 2, "peer2": 2}


def test_a_journal_grown_large_before_it_had_a_bound_shrinks_a_slice_at_a_time() -> None:
    now = time.time()
    with RolloutStore(":memory:") as store:  # no keep_seconds: nothing is pruned on insert
        store.add_rollouts([make_rollout(i, t=now - 7200 + i) for i in range(10)] + [make_rollout(10, t=now)])
        assert [store.prune_rollouts(older_than=now - 3600, max_rows=4) for _ in range(4)] == [4, 4, 2, 0]
        assert [r.content_hash for r in store.recent(10)] == [make_rollout(10).content_hash]
        assert store.counts()["total"] == 11


def test_a_failed_prune_is_logged_and_the_insert_stands(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "rollouts.sqlite"
    now = time.time()
    with RolloutStore(path) as store:
        store.add_rollouts([make_rollout(i, t=now - 7200 + i) for i in range(3)])
    conn = sqlite3.connect(path)  # what a full disk would do to the DELETE
    conn.execute("CREATE TRIGGER no_room BEFORE DELETE ON rollouts BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
    conn.commit()
    conn.close()
    with RolloutStore(path, keep_seconds=3600) as store:
        assert store.add_rollouts([make_rollout(5, t=now)]) == 1
        assert store.counts()["total"] == 4 and len(store.recent(10)) == 4
    assert "pruning the rollout journal" in caplog.text and "disk is full" in caplog.text


def test_a_journal_of_schema_1_gains_its_totals(tmp_path: Path) -> None:
    path = tmp_path / "v1.sqlite"
    with RolloutStore(path) as store:
        store.add_rollouts([make_rollout(i, own=i == 0) for i in range(4)])
    conn = sqlite3.connect(path)  # as a version 1 store left it: no totals table, no trigger
    conn.executescript("DROP TRIGGER rollouts_totals; DROP TABLE totals; PRAGMA user_version = 1;")
    conn.close()
    assert journal_counts(path) == ({"peer1": 1, "peer2": 1, "peer0": 1}, 1)  # read from the rows themselves
    with RolloutStore(path) as store:
        assert store.counts() == {"own": 1, "foreign": 3, "total": 4}
        store.add_rollouts([make_rollout(7)])
        assert store.counts() == {"own": 1, "foreign": 4, "total": 5}


def test_a_journal_from_before_born_was_kept_gains_the_column_and_its_rows_read_as_unknown(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with RolloutStore(path) as store:
        store.add_rollouts([make_rollout(1)])
    conn = sqlite3.connect(path)  # as a store from before it was kept left it
    conn.execute("ALTER TABLE rollouts DROP COLUMN born")
    conn.commit()
    conn.close()
    signed = dataclasses.replace(make_rollout(2), born=1.5)
    with RolloutStore(path) as store:
        store.add_rollouts([signed])
        assert [(r.received_at, r.born) for r in store.foreign_after(0)] == [(1.0, None), (2.0, 1.5)]
