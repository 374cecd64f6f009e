"""A node's view of memory (node/process_memory.py): what it holds, its high-water mark, and what it may still take.

The container cases are run for real where this process may make a control group (root, a writable
memory controller): a child process moved into a group limited to 1 GiB must see at most that,
whatever the machine has free; a real node whose group's limit drops below what its step may take
between two rounds must train the next step in micro batches of one and say so, and its config's
micro batch again once the limit is lifted (node/supervise.py `MicroBatchFit`). Skipped, with the
reason, elsewhere.
"""

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from hivespec.node import control_groups
from hivespec.node.process_memory import _room_in, available_bytes

GIB = 1 << 30
_CHILD = (
    "import os, sys\n"
    "open(sys.argv[1], 'w').write(str(os.getpid()))  # into the limited group before anything is measured\n"
    "from hivespec.node.process_memory import available_bytes\n"
    "print(available_bytes())\n"
)


def _writable_group():
    if not sys.platform.startswith("linux"):
        return None, None
    for folder in control_groups.folders("memory"):
        limit = "memory.max" if (folder / "memory.max").exists() else "memory.limit_in_bytes"
        if (folder / limit).exists() and os.access(folder, os.W_OK):
            return folder, limit
    return None, None


def test_what_a_node_may_take_is_at_most_what_the_machine_has_free():
    assert 0 < available_bytes() <= psutil.virtual_memory().available


def test_a_cgroup_v2_group_s_throttling_limit_counts_as_its_limit(tmp_path):
    """cgroup v2 (this machine may mount v1, so its files are written here as the kernel shows them): past
    `memory.high` the kernel throttles the group, past `memory.max` it stops a process; a node sizes by the lower."""
    files = {"memory.max": "max", "memory.high": str(3 * GIB), "memory.current": str(GIB),
             "memory.stat": f"anon {GIB // 2}\ninactive_file {GIB // 4}\nactive_file 0\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text + "\n")
    assert _room_in(tmp_path) == 3 * GIB - GIB + GIB // 4
    (tmp_path / "memory.max").write_text(f"{2 * GIB}\n")
    assert _room_in(tmp_path) == 2 * GIB - GIB + GIB // 4
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.high").write_text("max\n")
    assert _room_in(tmp_path) is None  # no limit: the machine's available memory decides


def _group_or_skip():
    parent, limit_file = _writable_group()
    if parent is None:
        pytest.skip("no memory control group this process may create a group in (not Linux, not root, or a read-only cgroupfs)")
    return parent, limit_file


def test_a_node_in_a_container_sizes_itself_by_the_container_s_limit():
    parent, limit_file = _group_or_skip()
    if psutil.virtual_memory().available < 2 * GIB:
        pytest.skip("the machine has less than 2 GiB free: a 1 GiB limit would not be the smaller")
    group = parent / f"hivespec-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / limit_file).write_text(str(GIB))
        out = subprocess.run([sys.executable, "-P", "-c", _CHILD, str(group / "cgroup.procs")], check=True,
                             capture_output=True, text=True, timeout=120)
        assert 0 < int(out.stdout) <= GIB  # the group's limit, not the machine's free memory
    finally:
        group.rmdir()  # the child has exited: the group is empty


def _remove(group: Path) -> None:
    """Remove a group once its processes are gone (the node's p2pd may take a moment after the node); what is still
    there after 30 s is killed: nothing of the test's may outlive it."""
    deadline = time.monotonic() + 30
    while procs := (group / "cgroup.procs").read_text().split():
        assert time.monotonic() < deadline + 10, f"processes {procs} of the test's group would not die"
        if time.monotonic() > deadline:
            for pid in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    psutil.Process(int(pid)).kill()
        time.sleep(0.1)
    group.rmdir()


def _rounds(events: Path) -> list[dict]:
    lines = events.read_text().splitlines() if events.exists() else []
    return [e for e in map(json.loads, lines) if e.get("event") == "round"]


@pytest.mark.slow  # ~30-60 s: a tiny node's start-up and three rounds of 8 s waits
@pytest.mark.timeout(400)
def test_a_node_whose_memory_is_taken_mid_run_trains_in_smaller_micro_batches_then_in_its_own_again(tmp_path):
    parent, limit_file = _group_or_skip()
    if available_bytes() < 3 * GIB:
        pytest.skip("less than 3 GiB free: the tiny node would start in smaller micro batches already")
    group = parent / f"hivespec-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    home, events = tmp_path / "node", tmp_path / "node" / "events.jsonl"
    home.mkdir()
    # Each round waits 8 s for a peer who never comes, then trains alone: time to move the limit between rounds.
    command = [sys.executable, "-P", "-m", "hivespec.node.cli", "-v", "join", "--config", "tiny", "--home", str(home),
               "--events", str(events), "--linger", "0", "--rounds", "3", "--set", "status.enabled=false",
               "--set", "swarm.expected_peers=1", "--set", "swarm.round_timeout=8"]
    procs = group / "cgroup.procs"
    with (home / "node.log").open("wb") as out:
        # In the group from its start: the shell moves itself in, then becomes the node.
        child = subprocess.Popen(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *command], stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_for_round(index: int) -> dict:
        deadline = time.monotonic() + 240
        while len(rounds := _rounds(events)) <= index:
            assert child.poll() is None and time.monotonic() < deadline, (home / "node.log").read_text()[-3000:]
            time.sleep(0.05)
        return rounds[index]

    v2 = limit_file == "memory.max"

    def in_use() -> int:
        """The group's memory less the page cache it can drop (what `available_bytes` counts as free)."""
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
        usage = int((group / ("memory.current" if v2 else "memory.usage_in_bytes")).read_text())
        return usage - int(stat["inactive_file" if v2 else "total_inactive_file"])

    try:
        assert wait_for_round(0)["micro_batch_size"] == 8  # the tiny preset's, with room to spare
        # Another program takes the memory: what the group has left is under what even one sample's step may take.
        (group / limit_file).write_text(str(in_use() + 256 * 2**20))
        assert wait_for_round(1)["micro_batch_size"] == 1
        (group / limit_file).write_text("max" if v2 else "-1")  # ... and lets it go
        assert wait_for_round(2)["micro_batch_size"] == 8
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        _remove(group)
    log = (home / "node.log").read_text()
    assert "the kernel may stop it mid-round" in log  # said once, where it shrank
    assert "memory: training in micro batches of 8 samples again" in log
