"""A new user's first run: the README's main command on the embedded model from empty caches and homes.

`hivespec demo --rounds 2` as a subprocess with fresh HIVESPEC_CACHE_DIR, HIVESPEC_HOME,
XDG_CACHE_HOME and XDG_DATA_HOME, so the GGUF conversion and the speculation calibration run
as they do on a fresh machine. It must finish, every node must accept foreign rollouts in every
round, and it must never go quiet for long: a regression on the user's first path fails CI.

Nothing here depends on the CPU's speed: which phase a 10-s status line happens to catch does
(a fast CPU calibrates between two lines), so phases are read from each node's own events file,
where every phase is written as it starts.
"""

import itertools
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from hivespec.node.config import load_config
from hivespec.node.model.footprint import config_peak_bytes, model_shape
from hivespec.node.model.loader import EMBEDDED_MODEL

ROUNDS = 2
NODES = 3  # the demo's default where the machine's memory holds three (node/demo.py: nodes_to_run)
MAX_SILENCE_S = 30.0  # the demo prints every node's status every 10 s; allow for a loaded CI machine


@pytest.mark.slow  # ~4-8 min on a 2-core CPU: three real nodes, two rounds
@pytest.mark.real_model
@pytest.mark.timeout(1500)
def test_the_demo_runs_from_empty_caches_and_talks_throughout(tmp_path, monkeypatch):
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
    # Three nodes, or as many as this machine's memory holds, and then it says so.
    started = [line for line in texts if line.startswith("hivespec demo: ") and " nodes x " in line]
    assert len(started) == 1, output[-6000:]
    nodes = int(started[0].split()[2])
    assert nodes == NODES or any(line.startswith(f"hivespec demo: starting {nodes} node") for line in texts), output[-6000:]
    summary = [line for line in texts if line.strip().startswith("round ") and "accepted by every node" in line]
    assert len(summary) == ROUNDS, output[-6000:]
    if nodes > 1:
        assert all(line.endswith("foreign rollouts accepted by every node: yes") for line in summary), output[-6000:]
    # Every node reported every round, as it happened (one row per node per round).
    rows = [line for line in texts if line[:3].strip().isdigit() and " node-" in line]
    assert len(rows) == nodes * ROUNDS, output[-6000:]
    # Every node announced every phase of every round, and the first round measured the verify-cost curve.
    phases = {name: _phases(tmp_path / "demo" / name / "events.jsonl") for name in (f"node-{i}" for i in range(nodes))}
    for name, seen in phases.items():
        for phase in ("loading", "starting gossip"):
            assert phase in seen, (name, seen)
        for round_index in range(ROUNDS):
            # A lone node waits for nobody: it fetches what its step has room for.
            for phase in ("generating", "waiting for peers" if nodes > 1 else "fetching peers' batches", "training", "syncing"):
                assert f"round {round_index}" in seen.get(phase, []), (name, phase, seen)
    calibrated = [detail for seen in phases.values() for detail in seen.get("calibrating", []) if detail.startswith("done in")]
    assert calibrated, phases
    assert list((tmp_path / "hivespec_cache_dir" / "speculation").glob("verify-cost-*.json")), phases
    # Every node held at most what the demo sized the machine by (node/model/footprint.py).
    monkeypatch.setenv("HIVESPEC_CACHE_DIR", env["HIVESPEC_CACHE_DIR"])  # the model's config from the demo's own cache
    bound = config_peak_bytes(load_config("demo"), model_shape(EMBEDDED_MODEL))
    # In the preset's micro batches, or the smaller ones the demo said three nodes fit in here.
    shrunk = [line.split(" in micro batches of ")[1] for line in texts if line.startswith("hivespec demo: ") and " in micro batches of " in line]
    micro = int(shrunk[0].split()[0]) if shrunk else load_config("demo").train.micro_batch_size
    for name in phases:
        events = [json.loads(line) for line in (tmp_path / "demo" / name / "events.jsonl").read_text().splitlines()]
        rounds = [e for e in events if e["event"] == "round"]
        peak = max(e["peak_resident_mb"] for e in rounds)
        assert peak * 1e6 <= bound, (name, peak, bound)
        assert all(1 <= e["micro_batch_size"] <= micro for e in rounds), (name, micro, [e["micro_batch_size"] for e in rounds])
    # The demo never goes quiet for long.
    stamps = [0.0] + [t for t, _ in lines]
    silences = [b - a for a, b in itertools.pairwise(stamps)]
    assert max(silences) < MAX_SILENCE_S, output[-6000:]


def _phases(events: os.PathLike) -> dict[str, list[str]]:
    """Each phase a node announced in its events file, with every detail it gave (in order)."""
    seen: dict[str, list[str]] = {}
    with open(events) as f:
        for line in f:
            event = json.loads(line)
            if event["event"] == "phase":
                seen.setdefault(event["phase"], []).append(event.get("detail", ""))
    return seen
