"""Local swarm harness for the benches with real nodes (churn, soak, hetero_swarm, nat_nodes): `hivespec join` processes.

Each node is a child process with its own home (identity, journal, checkpoints), an events file
(JSON lines: ready, round, done) and a log; on 127.0.0.1 unless a subclass runs its command
elsewhere (bench/nat_nodes.py: in a network namespace). `watch_steps` collects their steps as they come. A node can be SIGKILLed, SIGSTOPped and restarted with
the same home (so it resumes from its checkpoint), optionally with `HIVESPEC_FAULTS` armed so it
kills itself at an exact point (mid-save, mid-store). Imported by the bench scripts from their
own folder; never put the repository root on sys.path.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

READY_TIMEOUT_S = 240.0
# The most one demo-model node process takes while it trains (fp32 trainer + Adam + bf16 engine + interpreter + a micro
# batch's activations): its resident size was 3.7-4.1 GB in bench/swarm_vs_solo.py's runs, 4.9 GB at a 2 x 4 step with
# 8 foreign samples (the kernel's count of the one it killed when five nodes ran on a 24 GiB machine). Measured, for the
# benches' shapes on this machine kind; the product sizes a node by node/model/footprint.py's upper bound instead.
NODE_GB = 4.9
POLL_S = 0.5
PRINT_EVERY_S = 30.0


@dataclass
class Incarnation:
    """One process lifetime of a node."""

    process: subprocess.Popen
    started: float
    faults: str = ""
    ready_at: float | None = None
    first_round_at: float | None = None


@dataclass
class SwarmNode:
    name: str
    home: Path
    sets: list[str]
    local_nodes: int
    lives: list[Incarnation] = field(default_factory=list)
    _offset: int = 0
    events: list[dict] = field(default_factory=list)
    preset: ClassVar[str] = "tiny"
    join_flags: ClassVar[tuple[str, ...]] = ("--rounds", "0", "--linger", "0")  # run until stopped, then exit

    @property
    def process(self) -> subprocess.Popen | None:
        return self.lives[-1].process if self.lives else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self, initial_peers: list[str]) -> list[str]:
        """The `hivespec join` command line of this node's next incarnation."""
        command = [
            sys.executable, "-P", "-m", "hivespec.node.cli", "-v", "join", "--config", self.preset,
            "--home", str(self.home), "--name", self.name, "--events", str(self.home / "events.jsonl"),
            "--local-nodes", str(self.local_nodes), *self.join_flags,
        ]
        for item in self.sets:
            command += ["--set", item]
        for maddr in initial_peers:
            command += ["--initial-peer", maddr]
        return command

    def start(self, initial_peers: list[str], faults: str = "") -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        log = (self.home / "node.log").open("ab")
        env = dict(os.environ, HIVESPEC_FAULTS=faults)
        process = subprocess.Popen(
            self.command(initial_peers), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        self.lives.append(Incarnation(process, time.monotonic(), faults))

    def poll(self) -> list[dict]:
        """New events since the last call (also appended to `events`, tagged with the incarnation)."""
        path = self.home / "events.jsonl"
        if not path.exists():
            return []
        with path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        new = [json.loads(line) for line in complete.splitlines() if line.strip()]
        life = self.lives[-1] if self.lives else None
        for event in new:
            event["life"] = len(self.lives) - 1
            if life is not None and event["event"] == "ready" and life.ready_at is None:
                life.ready_at = time.monotonic()
            if life is not None and event["event"] == "round" and life.first_round_at is None:
                life.first_round_at = time.monotonic()
        self.events.extend(new)
        return new

    def maddrs(self) -> list[str]:
        ready = [e for e in self.events if e["event"] == "ready" and e["life"] == len(self.lives) - 1]
        return ready[-1]["maddrs"] if ready else []

    def rounds(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "round"]

    def kill(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self, timeout: float = 90.0) -> None:
        """SIGTERM (finish the round, checkpoint), then SIGKILL after `timeout`."""
        if not self.alive():
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def journal(self) -> dict[str, int]:
        """Rows in the node's rollout journal (read-only; call with the node stopped)."""
        path = self.home / "rollouts.sqlite"
        if not path.exists():
            return {"own": 0, "foreign": 0}
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            total, own = conn.execute("SELECT COUNT(*), COALESCE(SUM(own), 0) FROM rollouts").fetchone()
        finally:
            conn.close()
        return {"own": own, "foreign": total - own}

    def log_text(self) -> str:
        path = self.home / "node.log"
        return path.read_text(errors="replace") if path.exists() else ""


def check_memory(processes: int, node_gb: float = NODE_GB) -> None:
    """Refuse to start `processes` nodes that would not fit in the memory available now (a node's own measure,
    `process_memory.available_bytes`: a container's limit counts): past it the kernel kills one mid-run (or a
    swapping box stalls every job on it, not just this bench)."""
    from hivespec.node.process_memory import available_bytes

    available = available_bytes() / 2**30
    if available < processes * node_gb:
        raise SystemExit(f"{processes} nodes need ~{processes * node_gb:.0f} GB ({node_gb:g} GB each at most), "
                         f"{available:.1f} GB available: run fewer nodes or wait for other jobs to finish")


def wait_ready(node: SwarmNode, timeout: float = READY_TIMEOUT_S) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        node.poll()
        if node.maddrs():
            return node.maddrs()
        if not node.alive():
            raise RuntimeError(f"{node.name} exited with {node.process.returncode} before it was ready:\n{node.log_text()[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"{node.name} not ready after {timeout:.0f} s:\n{node.log_text()[-3000:]}")


def watch_steps(nodes: list[SwarmNode], minutes: float, *, started: float, label: str = "",
                until: Callable[[dict[str, list[tuple[float, dict]]]], bool] | None = None) -> dict[str, list[tuple[float, dict]]]:
    """Each node's steps as they come, with their arrival time, for `minutes` or until `until(arrivals)` holds.

    Says every 30 s how many steps each node has run and how many of them trained on foreign samples
    (seconds since `started`, after `label`); raises where a node exits.
    """
    arrivals: dict[str, list[tuple[float, dict]]] = {n.name: [] for n in nodes}
    end = time.monotonic() + minutes * 60
    next_print = time.monotonic() + PRINT_EVERY_S
    while time.monotonic() < end and not (until is not None and until(arrivals)):
        for node in nodes:
            for event in node.poll():
                if event["event"] == "round":
                    arrivals[node.name].append((time.monotonic(), event))
            if not node.alive():
                raise RuntimeError(f"{node.name} exited ({node.process.returncode}):\n{node.log_text()[-3000:]}")
        if time.monotonic() >= next_print:
            next_print += PRINT_EVERY_S
            counts = ", ".join(f"{n}: {len(a)} steps, {sum(e['foreign_trained'] > 0 for _, e in a)} with foreign"
                               for n, a in arrivals.items())
            print(f"[{label}{time.monotonic() - started:5.0f}s] {counts}", flush=True)
        time.sleep(POLL_S)
    return arrivals


def steady(arrivals: dict[str, list[tuple[float, dict]]], end: float) -> tuple[float, dict[str, list[dict]]]:
    """The window from the moment every node has finished (so published) a step, and each node's steps that ended in it."""
    firsts = [records[0][0] for records in arrivals.values() if records]
    if len(firsts) < len(arrivals):
        return 0.0, {name: [] for name in arrivals}
    start = max(firsts)
    return end - start, {name: [e for t, e in records if t > start] for name, records in arrivals.items()}


def median_p95(values: list[float]) -> dict[str, float | None]:
    """Median and 95th percentile of `values` (None where there are none), and how many."""
    if not values:
        return {"median": None, "p95": None, "samples": 0}
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 2), "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 2),
            "samples": len(ordered)}


def start_swarm(root: Path, count: int, sets: list[str]) -> list[SwarmNode]:
    """Start `count` nodes: the first alone, the rest bootstrapped from it."""
    nodes = [SwarmNode(f"node-{i}", root / f"node-{i}", sets, local_nodes=count) for i in range(count)]
    nodes[0].start([])
    first = wait_ready(nodes[0])
    for node in nodes[1:]:
        node.start(first)
    for node in nodes[1:]:
        wait_ready(node)
    return nodes


def live_maddrs(nodes: list[SwarmNode], exclude: SwarmNode | None = None) -> list[str]:
    """Bootstrap addresses of the nodes that are up now (for a restarted node to join through)."""
    found = []
    for node in nodes:
        if node is not exclude and node.alive():
            found += node.maddrs()[:1]
    return found


@contextmanager
def work_dir(given: str | Path | None, prefix: str) -> Iterator[Path]:
    """The bench's folder for node homes and logs: `given` as it is, or a new temporary one.

    A temporary one is removed when the bench returns: each node home holds a copy of the policy
    (0.5 GB at 135M parameters), so a few runs would otherwise fill the disk. A bench that raises
    keeps it for its logs, and says where.
    """
    if given:
        yield Path(given)
        return
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    except BaseException:
        print(f"kept {root} for its logs (remove it when done)", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(root, ignore_errors=True)


def prepare_model() -> None:
    """Convert the embedded GGUF once (the tiny model uses its tokenizer) before N nodes start."""
    from hivespec.node.model.loader import ensure_embedded_cache

    ensure_embedded_cache()
