"""A new user's first run: the README's main command on the embedded model from empty caches and homes.

`hivespec demo --rounds 2` as a subprocess with fresh HIVESPEC_CACHE_DIR, HIVESPEC_HOME,
XDG_CACHE_HOME and XDG_DATA_HOME, so the GGUF conversion and the speculation calibration run
as they do on a fresh machine. It must finish, every node must accept foreign rollouts in every
round, and it must never go quiet for long: a regression on the user's first path fails CI.
"""

import itertools
import os
import subprocess
import sys
import threading
import time

import pytest

ROUNDS = 2
NODES = 3
MAX_SILENCE_S = 30.0  # the demo prints every node's status every 10 s; allow for a loaded CI machine


@pytest.mark.slow  # ~4-8 min on a 2-core CPU: three real nodes, two rounds
@pytest.mark.real_model
@pytest.mark.timeout(1500)
def test_the_demo_runs_from_empty_caches_and_talks_throughout(tmp_path):
    env = dict(os.environ)
    for name in ("HIVESPEC_CACHE_DIR", "HIVESPEC_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        env[name] = str(tmp_path / name.lower())
    command = [
        sys.executable, "-P", "-m", "hivespec.node.cli", "demo", "--rounds", str(ROUNDS), "--dir", str(tmp_path / "demo"),
    ]
    started = time.monotonic()
    demo = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, text=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append((time.monotonic() - started, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = demo.wait(timeout=1400)
    finally:
        if demo.poll() is None:
            demo.kill()
    reader.join(timeout=10)
    output = "\n".join(f"{t:6.1f} {line}" for t, line in lines)
    assert code == 0, output[-6000:]

    texts = [line for _, line in lines]
    assert any(line.startswith("model ready in") for line in texts), output[-6000:]
    summary = [line for line in texts if line.strip().startswith("round ") and "accepted by every node" in line]
    assert len(summary) == ROUNDS, output[-6000:]
    assert all(line.endswith("foreign rollouts accepted by every node: yes") for line in summary), output[-6000:]
    # Every node reported every round, as it happened (one row per node per round).
    rows = [line for line in texts if line[:3].strip().isdigit() and " node-" in line]
    assert len(rows) == NODES * ROUNDS, output[-6000:]
    # Status lines say what the nodes are doing, and the demo never goes quiet for long.
    assert any("calibrating" in line for line in texts), output[-6000:]
    assert any("generating" in line for line in texts) and any("training" in line for line in texts), output[-6000:]
    stamps = [0.0] + [t for t, _ in lines]
    silences = [b - a for a, b in itertools.pairwise(stamps)]
    assert max(silences) < MAX_SILENCE_S, output[-6000:]
