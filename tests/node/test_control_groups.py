"""The control groups a node runs in (node/control_groups.py): the cores a CPU quota allows.

A container run with `docker --cpus 2` on a 64-core host has all 64 cores in its affinity and 2 cores' worth of
time: a node that ran 64 torch threads there was throttled in every forward. The quota's files are read as the
kernel writes them (v1 and v2); a child moved into a real group with a one-core quota, where this process may make
one (root, a writable cpu controller), must run one thread. Skipped, with the reason, elsewhere.
"""

import os
import subprocess
import sys
import uuid

import pytest

from hivespec.node import control_groups
from hivespec.node.control_groups import _quota_in


@pytest.mark.parametrize(("text", "cores"), [("max 100000", None), ("250000 100000", 3), ("50000 100000", 1),
                                             ("200000 100000", 2), ("garbage", None)])
def test_a_cgroup_v2_quota_is_read_in_cores_rounded_up(tmp_path, text, cores):
    (tmp_path / "cpu.max").write_text(text + "\n")
    assert _quota_in(tmp_path) == cores


@pytest.mark.parametrize(("quota", "cores"), [("-1", None), ("200000", 2), ("150000", 2), ("10000", 1)])
def test_a_cgroup_v1_quota_is_read_in_cores_rounded_up(tmp_path, quota, cores):
    (tmp_path / "cpu.cfs_quota_us").write_text(quota + "\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert _quota_in(tmp_path) == cores


def test_a_group_without_quota_files_has_no_quota(tmp_path):
    assert _quota_in(tmp_path) is None


def test_this_process_s_quota_is_none_or_at_least_one_core():
    assert control_groups.quota_cores() is None or control_groups.quota_cores() >= 1


def _writable_cpu_group():
    if not sys.platform.startswith("linux"):
        return None
    for folder in control_groups.folders("cpu"):
        if ((folder / "cpu.max").exists() or (folder / "cpu.cfs_quota_us").exists()) and os.access(folder, os.W_OK):
            return folder
    return None


@pytest.mark.slow
def test_a_node_under_a_one_core_quota_runs_one_thread():
    parent = _writable_cpu_group()
    if parent is None:
        pytest.skip("no cpu control group this process may create a group in (not Linux, not root, or a read-only cgroupfs)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core in this process's affinity: a one-core quota would not be the smaller")
    group = parent / f"hivespec-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"cannot make a cpu group here: {error}")
    try:
        if (group / "cpu.max").exists():
            (group / "cpu.max").write_text("100000 100000")
        else:
            (group / "cpu.cfs_quota_us").write_text("100000")  # the default period is 100000 us
        code = ("import os, sys; open(sys.argv[1], 'w').write(str(os.getpid()))\n"
                "from hivespec.node.model.loader import node_threads; print(node_threads())")
        out = subprocess.run([sys.executable, "-P", "-c", code, str(group / "cgroup.procs")], check=True,
                             capture_output=True, text=True, timeout=120)
        assert out.stdout.split() == ["1"], out.stderr
    finally:
        group.rmdir()  # the child has exited: the group is empty
