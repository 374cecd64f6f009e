"""Waiting for an exclusive flock (`node/file_lock.py`), and the model cache's lock built on it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hivespec.node.file_lock import flock_within
from hivespec.node.model.loader import CacheLockTimeout, _exclusive_lock


def test_a_lock_another_open_file_holds_is_waited_for_until_the_timeout_then_taken_once_free(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    holder, waiter = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644), os.open(path, os.O_RDONLY)
    try:
        assert flock_within(holder, timeout=0.0, poll_s=0.01)
        assert not flock_within(waiter, timeout=0.1, poll_s=0.01)  # another open file of it holds it: as another process
        os.close(holder)
        holder = -1
        assert flock_within(waiter, timeout=0.0, poll_s=0.01)
    finally:
        for fd in (holder, waiter):
            if fd >= 0:
                os.close(fd)


def test_the_cache_lock_names_itself_and_its_work_when_held_past_its_timeout(tmp_path: Path) -> None:
    path = tmp_path / "cache.lock"
    with _exclusive_lock(path, what="exporting the model", timeout=0.0):
        with (pytest.raises(CacheLockTimeout, match="held by another process exporting the model") as caught,
              _exclusive_lock(path, what="exporting the model", timeout=0.1)):
            pass
        assert str(path) in str(caught.value)
    with _exclusive_lock(path, timeout=0.0):  # released on the way out
        pass
