"""``hivespec demo``: N real node processes on 127.0.0.1, one table row per node per round.

The parent prepares the model cache once (the first run converts the embedded GGUF), starts the
first node, reads its multiaddrs from its event log, starts the others bootstrapped from it, and
tails every node's JSON-lines events. Each node is a separate process with its own hivemind
DHT, identity, SQLite journal, engine and trainer; they share nothing but loopback sockets.
With ``--dashboard`` the parent shows the Textual dashboard instead of the table, reading each
node's status server (each child serves one on a free loopback port; ``n`` switches nodes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hivespec.node.cli import REPORT_HEADER, format_report_line
from hivespec.node.config import NodeConfig

# The first node on a machine also measures the verify-cost curve for speculation (cached
# afterwards), which takes minutes on a busy 2-core CPU; a crashed child fails at once anyway.
READY_TIMEOUT_S = 600.0
TRACE_KEY = "speculation.trace_file"


@dataclass
class _Child:
    name: str
    home: Path
    process: subprocess.Popen
    events_path: Path
    offset: int = 0
    ready: dict | None = None
    done: bool = False
    reports: list[dict] = field(default_factory=list)

    def poll_events(self) -> list[dict]:
        if not self.events_path.exists():
            return []
        with self.events_path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def log_tail(self, lines: int = 20) -> str:
        log = self.home / "node.log"
        if not log.exists():
            return "(no log)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def run_demo(
    config: NodeConfig,
    *,
    nodes: int,
    preset: str,
    overrides: Mapping[str, str],
    workdir: str | None = None,
    dashboard: bool = False,
) -> int:
    """Run the local swarm to completion; returns a process exit code."""
    if nodes < 1:
        print("hivespec demo: --nodes must be >= 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
    root = Path(workdir) if workdir else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    print(f"hivespec demo: {nodes} nodes x {config.rounds} rounds, model {config.model.name}, data in {root}/", flush=True)
    _prepare_model(config.model.name)

    children: list[_Child] = []
    try:
        first = _spawn(0, root, preset, overrides, nodes, initial_peers=[])
        children.append(first)
        maddrs = _wait_ready(first)
        for index in range(1, nodes):
            children.append(_spawn(index, root, preset, overrides, nodes, initial_peers=maddrs))
        for child in children[1:]:
            _wait_ready(child)
        print(f"all {nodes} nodes up after {time.perf_counter() - started:.1f}s; bootstrap {maddrs[0]}", flush=True)
        if dashboard:
            _dashboard(children)
        else:
            print(REPORT_HEADER, flush=True)
            _tail(children, config.rounds)
    except _DemoFailure as failure:
        print(f"hivespec demo: {failure}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hivespec demo: interrupted, stopping nodes", file=sys.stderr)
        return 130
    finally:
        for child in children:
            if child.process.poll() is None:
                child.process.terminate()
        for child in children:
            try:
                child.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.process.kill()
    _summary(children, time.perf_counter() - started)
    return 0


class _DemoFailure(RuntimeError):
    pass


def _prepare_model(name: str) -> None:
    """Convert the embedded GGUF once, in the parent, so the N nodes do not all wait on it.

    ``tiny`` needs it too (it uses the embedded tokenizer); a local HF folder needs nothing.
    """
    from hivespec.node.model import EMBEDDED_MODEL, TINY_MODEL, ensure_embedded_cache

    if name not in (EMBEDDED_MODEL, TINY_MODEL):
        return
    mark = time.perf_counter()
    print("preparing the embedded model (the first run converts its GGUF, ~20 s) ...", flush=True)
    ensure_embedded_cache()
    print(f"model ready in {time.perf_counter() - mark:.1f}s", flush=True)


def _spawn(index: int, root: Path, preset: str, overrides: Mapping[str, str], nodes: int, *, initial_peers: list[str]) -> _Child:
    name = f"node-{index}"
    home = root / name
    home.mkdir(parents=True, exist_ok=True)
    events = home / "events.jsonl"
    command = [
        sys.executable, "-P", "-m", "hivespec.node.cli", "-v", "join",
        "--config", preset, "--home", str(home), "--name", name,
        "--events", str(events), "--local-nodes", str(nodes),
        "--set", f"swarm.expected_peers={nodes - 1}",
        "--set", "status.port=0",  # N nodes on one machine: each status server on a free port
        # Keep serving our last batch until every node is done; the parent stops us then.
        "--linger", "-1",
    ]
    for key, value in overrides.items():
        if key == TRACE_KEY:  # one trace file per node: t.jsonl -> t.node-0.jsonl
            value = json.dumps(str(node_trace_path(yaml.safe_load(value), index)))
        if key not in ("home", "name", "swarm.initial_peers"):
            command += ["--set", f"{key}={value}"]
    for maddr in initial_peers:
        command += ["--initial-peer", maddr]
    log = (home / "node.log").open("ab")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return _Child(name=name, home=home, process=process, events_path=events)


def node_trace_path(path: str, index: int) -> Path:
    """Node `index`'s trace file in a demo: ``t.jsonl`` -> ``t.node-<index>.jsonl`` (``.jsonl.gz`` kept whole)."""
    base = Path(path)
    suffixes = "".join(base.suffixes[-2:]) if base.name.endswith(".jsonl.gz") else base.suffix
    stem = base.name[: len(base.name) - len(suffixes)] if suffixes else base.name
    return base.with_name(f"{stem}.node-{index}{suffixes}")


def _wait_ready(child: _Child) -> list[str]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for event in child.poll_events():
            if event["event"] == "ready":
                child.ready = event
        if child.ready:
            return child.ready["maddrs"]
        if child.process.poll() is not None:
            raise _DemoFailure(f"{child.name} exited with code {child.process.returncode} before it was ready:\n{child.log_tail()}")
        time.sleep(0.2)
    raise _DemoFailure(f"{child.name} not ready after {READY_TIMEOUT_S:.0f}s; log:\n{child.log_tail()}")


def _tail(children: list[_Child], rounds: int) -> None:
    """Print rows as nodes report; on a terminal, a progress line shows rounds done per node."""
    interactive = sys.stdout.isatty()
    last_progress = ""
    while not all(child.done for child in children):
        for child in children:
            for event in child.poll_events():
                if event["event"] == "round":
                    child.reports.append(event)
                    if interactive:
                        print("\r\033[K", end="")
                        last_progress = ""
                    print(format_report_line(event), flush=True)
                elif event["event"] == "done":
                    child.done = True
            if not child.done and child.process.poll() is not None:
                raise _DemoFailure(f"{child.name} exited with code {child.process.returncode}:\n{child.log_tail()}")
        progress = "rounds done: " + "  ".join(f"{c.name} {len(c.reports)}/{rounds or '-'}" for c in children)
        if interactive and progress != last_progress:
            print(f"\r\033[K{progress}", end="", flush=True)
            last_progress = progress
        time.sleep(0.25)
    if interactive:
        print("\r\033[K", end="", flush=True)


def _dashboard(children: list[_Child]) -> None:
    """The dashboard over every node's status server until the user quits; then collect their rounds."""
    from hivespec.dashboard.app import DashboardApp
    from hivespec.dashboard.source import HttpSource

    urls = [(child.name, (child.ready or {}).get("status_url")) for child in children]
    missing = [name for name, url in urls if not url]
    if missing:
        raise _DemoFailure(f"{', '.join(missing)} serve no status (status.enabled is false?); run without --dashboard")
    DashboardApp([HttpSource(url, label=name) for name, url in urls]).run()
    for child in children:
        for event in child.poll_events():
            if event["event"] == "round":
                child.reports.append(event)
            elif event["event"] == "done":
                child.done = True
    if not all(child.done for child in children):
        print("dashboard closed before every node finished: stopping the nodes", flush=True)


def _summary(children: list[_Child], wall: float) -> None:
    if not children or not any(c.reports for c in children):
        return
    rounds = max(len(c.reports) for c in children)
    print(f"\ndemo finished in {wall:.1f}s")
    for index in range(rounds):
        rows = [c.reports[index] for c in children if len(c.reports) > index]
        slowest = max(r["seconds"]["round"] for r in rows)
        accepted = all(r["accepted"] > 0 for r in rows)
        reward = sum(r["reward_mean"] for r in rows) / len(rows)
        print(
            f"  round {index}: {slowest:6.1f}s  mean reward {reward:.2f}  "
            f"foreign rollouts accepted by every node: {'yes' if accepted else 'no'}"
        )
