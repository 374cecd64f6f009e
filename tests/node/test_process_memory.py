"""A node's view of memory (node/process_memory.py): what it holds, its high-water mark, and what it may still take.

The container case is run for real where this process may make a control group (root, a writable
memory controller): a child process moved into a group limited to 1 GiB must see at most that,
whatever the machine has free. Skipped, with the reason, elsewhere.
"""

import os
import subprocess
import sys
import uuid

import psutil
import pytest

from hivespec.node.process_memory import _memory_cgroups, available_bytes

GIB = 1 << 30
_CHILD = (
    "import os, sys\n"
    "open(sys.argv[1], 'w').write(str(os.getpid()))  # into the limited group before anything is measured\n"
    "from hivespec.node.process_memory import available_bytes\n"
    "print(available_bytes())\n"
)


def _writable_group():
    for folder in _memory_cgroups():
        limit = "memory.max" if (folder / "memory.max").exists() else "memory.limit_in_bytes"
        if (folder / limit).exists() and os.access(folder, os.W_OK):
            return folder, limit
    return None, None


def test_what_a_node_may_take_is_at_most_what_the_machine_has_free():
    assert 0 < available_bytes() <= psutil.virtual_memory().available


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="control groups are Linux's")
def test_a_node_in_a_container_sizes_itself_by_the_container_s_limit():
    parent, limit_file = _writable_group()
    if parent is None:
        pytest.skip("no memory control group this process may create a group in (not root, or a read-only cgroupfs)")
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
