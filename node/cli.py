"""The ``hivespec`` command line: demo, join, status, dash, doctor, identity, config.

``status`` and ``dash`` only read a node's status server: they must never import torch, so
everything heavy is imported inside the command that needs it, after the inputs it can check
without it (`inputs.py`).

Errors: a `UserError` (hivespec.protocol.errors; `ConfigError` and `InputError` are two of
them) raised anywhere in a command, in whichever phase (parsing, building the node, the first
round), ends as one line ``hivespec <command>: <what>, <why>; <fix>`` on stderr and exit 2;
argparse's usage errors look the same. One exit status differs: a home another running node
holds (`build.HomeInUse`, in join, follow and bootstrap) exits 3. Anything else keeps its
traceback: it is a bug.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

from hivespec.node.cli_numbers import number, seconds_or_forever
from hivespec.node.config import InputError, NodeConfig, describe, load_config, node_home, parse_override
from hivespec.node.report import REPORT_HEADER, format_bytes, format_report_line
from hivespec.protocol.errors import UserError, one_line


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    """--set's pairs, then the flags that set a key; a flag's text is taken as text, quoted for the YAML --set reads
    (as YAML, --home 'run #2' was the folder 'run', --name 'gpu box #2' the name 'gpu box' and --name yes a boolean)."""
    pairs = dict(parse_override(text) for text in (args.set or []))
    if getattr(args, "rounds", None) is not None:
        pairs["rounds"] = str(args.rounds)
    if getattr(args, "model", None):
        pairs["model.name"] = json.dumps(args.model)
    if getattr(args, "home", None):
        pairs["home"] = json.dumps(str(args.home))
    if getattr(args, "name", None):
        pairs["name"] = json.dumps(args.name)
    peers = getattr(args, "initial_peer", None)
    if peers:
        pairs["swarm.initial_peers"] = json.dumps(peers)
    if getattr(args, "resume", None) is not None:
        pairs["checkpoint.resume"] = "true" if args.resume else "false"
    if getattr(args, "trace", None):
        pairs["speculation.trace_file"] = json.dumps(str(args.trace))
    return pairs


def _config(args: argparse.Namespace) -> NodeConfig:
    return load_config(args.config, overrides=_overrides(args))


def _add_config_flags(parser: argparse.ArgumentParser, default_preset: str, *, rounds: bool = True, model: bool = True) -> None:
    """--config and --set; --rounds and --model only for the commands that use them (a flag shown in --help must act)."""
    parser.add_argument("--config", default=default_preset, help=f"YAML preset name or path (default: {default_preset})")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. train.learning_rate=1e-5 (repeatable)")
    if rounds:
        parser.add_argument("--rounds", type=int, help="rounds to run (0 = forever)")
    if model:
        parser.add_argument("--model", help="model: smollm2-135m-instruct, tiny, a local HF folder or a Hugging Face id (model.revision pins it)")


def cmd_join(args: argparse.Namespace) -> int:
    from hivespec.node.inputs import check_node_inputs, check_swarm_inputs

    config = _config(args)
    check_node_inputs(config)
    check_swarm_inputs(config)
    events = _EventLog.open(args.events) if args.events else None
    # Heavy imports (torch, transformers, hivemind) only once the inputs are known to be good.
    from hivespec.node.build import build_node
    from hivespec.node.swarm.gossip import GossipError

    logging.getLogger(__name__).info("resolved config: %s", json.dumps(config.to_dict(), sort_keys=True))
    phases = _PhaseLog(events)
    try:
        node = build_node(config, local_nodes=args.local_nodes, on_phase=phases)
    except GossipError as exc:  # nothing to join through (port taken, peers unreachable): the user's input
        print(f"hivespec join: {exc}", file=sys.stderr)
        return 2
    _stop_at_safe_point(node)
    _stop_with_parent()
    try:
        status_url = node.serve_status()
        ready = {
            "event": "ready", "name": node.name, "peer_id": node.identity.peer_id,
            "maddrs": node.gossip.visible_maddrs, "status_url": status_url,
            "precision": node.precision.describe() if node.precision is not None else "",
            "attention": list(node.attention),
        }
        if events:
            events.write(ready)
        if args.dashboard:
            return _join_with_dashboard(node, events, node_home(config))
        print(f"node {node.name} ({node.identity.peer_id}) listening on:", flush=True)
        for maddr in node.gossip.visible_maddrs:
            print(f"  {maddr}", flush=True)
        if status_url:
            print(f"status: {status_url}/status (dashboard: hivespec dash --node {status_url})", flush=True)
        if node.precision is not None:
            print(f"precision: {node.precision.describe()}", flush=True)
        if node.attention:
            print(f"attention: {'; '.join(node.attention)}", flush=True)
        status = node.gossip.status()
        line = _swarm_line(config, status, bool(node.gossip.bootstrap))
        if line is not None:
            print(line, flush=True)
        _warn_if_unreachable("join", config, status)
        print(REPORT_HEADER, flush=True)

        def on_report(report) -> None:
            if events:
                events.write({"event": "round", **report.to_dict()})
            print(format_report_line(report.to_dict()), flush=True)

        node.run(on_report, keep=0)  # each report went out as it was made: a node run for days keeps none
        _keep_policy(node)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        if node.stop_report:
            print(f"hivespec: {node.name}: {node.stop_report}", file=sys.stderr, flush=True)
        lingering = not node.control.stopping
        if lingering:  # its last phase event comes before "done", the demo's cue that this node finished
            phases("done", "serving its last batch to peers until stopped" if args.linger < 0 else "")
        if events:
            if not lingering:
                events.write({"event": "stopped", "name": node.name, "detail": node.stop_report or "stopped after a round"})
            events.write({"event": "done", "name": node.name})
        if lingering:
            _linger(args.linger)
    finally:
        node.close()
    return 0


def _keep_policy(node) -> None:
    """When the rounds are over: say where `Node.run` kept the node's latest policy (node/latest_policy.py)."""
    if node.kept_policy is not None:
        print(f"policy kept in {node_home(node.config)} (export it: hivespec export --home {node_home(node.config)} --out DIR)",
              flush=True)


def _stop_with_parent() -> None:
    """A demo node: SIGTERM (a stop at the next safe point) when the demo parent dies (Linux prctl)."""
    from hivespec.node.demo import PARENT_ENV

    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if str(os.getppid()) != parent:  # the parent died before the line above: stop now
        os.kill(os.getpid(), signal.SIGTERM)


def _swarm_line(config: NodeConfig, status: dict, had_peers: bool) -> str | None:
    """Where a joining node stands in its swarm: joined (through whom, peers known), waiting on its peers, or the first.

    None where the user named bootstrap peers and none answered: `_warn_if_unreachable` says so, with the addresses."""
    swarm = f"swarm {config.swarm.swarm!r}"
    if not status["solo"]:
        return f"{swarm}: joined via {status['joined_via'] or '-'}; {status['known_peers']} peer(s) known"
    if config.swarm.initial_peers:
        return None
    if had_peers:  # from the environment, a peers file or the peer cache
        return f"{swarm}: no peer answered yet; training alone and retrying in the background"
    return f"{swarm}: no initial peers, so this node starts it and trains alone; others join with --initial-peer ADDRESS (above)"


def _warn_if_unreachable(command: str, config: NodeConfig, status: dict) -> None:
    """One line when the user named bootstrap peers and none answered: the node goes on solo, retrying."""
    peers = config.swarm.initial_peers
    if peers and status.get("solo"):
        print(
            f"hivespec {command}: no bootstrap peer answered ({', '.join(p[:80] for p in peers[:3])}); running solo and "
            "retrying in the background. Check the address and that the peer is running and reachable "
            "(or set swarm.require_peers=true to fail instead)",
            file=sys.stderr, flush=True,
        )


class _PhaseLog:
    """`on_phase` for a node: each phase as a JSON-lines event (the demo parent prints them) and a log line."""

    def __init__(self, events: _EventLog | None) -> None:
        self._events = events
        self._log = logging.getLogger("hivespec.node")

    def __call__(self, phase: str, detail: str = "") -> None:
        self._log.info("%s%s", phase, f": {detail}" if detail else "")
        if self._events is not None:
            self._events.write({"event": "phase", "phase": phase, "detail": detail})


def _stop_at_safe_point(node) -> None:
    """First SIGINT/SIGTERM: stop at the round's next safe point (seconds), save a checkpoint where
    configured, exit. A second one exits at once."""

    def handler(signum: int, _frame) -> None:
        if node.control.stopping:
            print(f"hivespec: {signal.Signals(signum).name} again: exiting now", file=sys.stderr, flush=True)
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
        saving = node.checkpoints is not None and node.config.checkpoint.at_exit
        print(
            f"hivespec: {signal.Signals(signum).name}: stopping at the next safe point of round {node.next_round}"
            f"{' and saving a checkpoint' if saving else ''} (send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )
        node.control.stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def cmd_doctor(args: argparse.Namespace) -> int:
    from hivespec.node.inputs import check_swarm_inputs

    config = _config(args)
    check_swarm_inputs(config)
    from hivespec.node.doctor import run_checks

    checks = run_checks(config, network=not args.offline, timeout=args.timeout,
                        on_check=None if args.json else lambda check: print(check.line(), flush=True))
    failed = [c for c in checks if c.status == "fail"]
    if args.json:
        print(json.dumps([{"name": c.name, "status": c.status, "detail": c.detail} for c in checks], indent=2))
    else:
        print(f"{len(failed)} check(s) failed" if failed else "all checks passed", flush=True)
    return 1 if failed else 0


def _join_with_dashboard(node, events: _EventLog | None, home: Path) -> int:
    """Run the node's rounds in a thread and the dashboard in the foreground; q stops at the round's next safe point."""
    import threading

    from hivespec.dashboard.app import DashboardApp
    from hivespec.dashboard.source import LocalSource

    log_path = home / "node.log"
    root = logging.getLogger()
    terminal = [h for h in root.handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    file_handler = logging.FileHandler(log_path)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    for handler in terminal:  # log lines would tear the full-screen app apart
        root.removeHandler(handler)
    root.addHandler(file_handler)
    failed: list[BaseException] = []

    def run_rounds() -> None:
        try:
            node.run(lambda report: events.write({"event": "round", **report.to_dict()}) if events else None, keep=0)
            _keep_policy(node)
            if events:
                events.write({"event": "done", "name": node.name})
        except UserError as exc:  # the dashboard's log shows it; after the dashboard, the one line
            failed.append(exc)
            logging.getLogger(__name__).error("node %s stopped: %s", node.name, one_line(exc))
            node.status.failed()  # else the header goes on saying "training round N"
        except Exception as exc:  # shown in the dashboard's log; the exit code says so too
            failed.append(exc)
            logging.getLogger(__name__).exception("node %s stopped", node.name)
            node.status.failed()

    worker = threading.Thread(target=run_rounds, name="hivespec-rounds", daemon=True)
    worker.start()
    try:
        DashboardApp([LocalSource(node.name, node.status.snapshot_bytes, node.control.set_paused)]).run()
    finally:
        root.removeHandler(file_handler)
        for handler in terminal:
            root.addHandler(handler)
    if worker.is_alive():
        print(f"{node.name}: stopping at the round's next safe point (Ctrl-C twice aborts); log in {log_path}", flush=True)
        node.control.stop()
        worker.join()
    if failed and isinstance(failed[0], UserError):
        raise failed[0]
    return 1 if failed else 0


def _linger(seconds: float) -> None:
    """Keep gossip serving after the last round, so peers still fetching our last batch get it."""
    if seconds < 0:
        signal.pause()  # until the demo parent (or the user) stops us
    elif seconds > 0:
        time.sleep(seconds)


def cmd_follow(args: argparse.Namespace) -> int:
    from hivespec.node.inputs import check_home, check_leader, check_model_inputs, check_swarm_inputs

    config = _config(args)
    check_leader(args.leader)
    check_home(config)
    check_model_inputs(config.model)
    check_swarm_inputs(config)
    from hivespec.node.build import open_follower
    from hivespec.node.swarm.gossip import GossipError
    from hivespec.node.weights.follower import follow

    def on_report(report, follower) -> None:
        if report.applied or report.snapshot is not None or report.rejected:
            got = (f"snapshot {report.snapshot} + " if report.snapshot is not None else "") + f"deltas {report.applied}"
            print(
                f"version {report.version} (leader {report.leader_version}): {got}, {format_bytes(report.delta_bytes)} "
                f"in {report.seconds:.1f}s, weights {follower.engine.hash.hex()[:16]}"
                + (f"; rejected {report.rejected}" if report.rejected else ""),
                flush=True,
            )

    try:
        with open_follower(config, args.leader) as follower:
            follow(follower, poll_interval=config.sync.poll_interval, until_version=args.until_version, on_report=on_report,
                   leader_timeout=config.sync.leader_timeout)
    except GossipError as exc:
        print(f"hivespec follow: {exc}", file=sys.stderr)
        return 2
    return 0 if args.until_version is None or follower.engine.version >= args.until_version else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from hivespec.node.demo import run_demo
    from hivespec.node.inputs import check_model_inputs, check_swarm_inputs, check_trace_file

    config = _config(args)
    check_model_inputs(config.model)
    if config.speculation.trace_file:
        check_trace_file(config.speculation.trace_file)
    check_swarm_inputs(config)
    return run_demo(
        config, nodes=args.nodes, preset=args.config, overrides=_overrides(args), workdir=args.dir, dashboard=args.dashboard,
    )


def _node_url(args: argparse.Namespace) -> str:
    """--node, else the URL a local node wrote to <home>/status.json, else (no --home given) the default port.

    A --home without status.json is refused: the default port may be another node's, whose status would pass for this one's.
    """
    from hivespec.node.config import DEFAULT_STATUS_PORT, default_home
    from hivespec.node.status.server import STATUS_FILE, read_status_url

    if getattr(args, "node", None):
        return args.node if isinstance(args.node, str) else args.node[0]
    home = Path(args.home).expanduser() if args.home else default_home()
    url = read_status_url(home)
    if url is None and args.home:
        what = "is not a folder" if not home.is_dir() else f"has no {STATUS_FILE} (no node with a status server has run there)"
        raise InputError(f"--home {str(home)!r} {what}; pass the home of a running node, or its status URL with --node")
    return url or f"http://127.0.0.1:{DEFAULT_STATUS_PORT}"


def cmd_status(args: argparse.Namespace) -> int:
    from hivespec.dashboard.source import HttpSource
    from hivespec.dashboard.text import render_text
    from hivespec.protocol.status import encode_status

    snapshot = HttpSource(_node_url(args)).fetch()  # SourceError (a UserError): not a URL, or no node answers
    if args.json:
        print(json.dumps(json.loads(encode_status(snapshot)), indent=2))
    else:
        print(render_text(snapshot))
    return 0


def _terminal_size(text: str) -> tuple[int, int]:
    """``--size WIDTHxHEIGHT`` as two positive integers, else `InputError`."""
    try:
        width, height = (int(n) for n in text.lower().split("x"))
    except ValueError:
        raise InputError(f"--size must be WIDTHxHEIGHT, e.g. 100x30, got {text!r}") from None
    if width < 1 or height < 1:
        raise InputError(f"--size {text!r} has no room to draw in; give WIDTHxHEIGHT of at least 1x1, e.g. 100x30")
    return width, height


SCREENSHOT_SIZE = "100x30"  # dash --screenshot's terminal, WIDTHxHEIGHT
SCREENSHOT_AFTER_S = 1.0  # and how long after the first snapshot it is taken


def cmd_dash(args: argparse.Namespace) -> int:
    from hivespec.dashboard.app import PANELS, DashboardApp
    from hivespec.dashboard.source import HttpSource, SourceError

    urls = args.node or [_node_url(args)]
    if args.panel not in PANELS:
        raise InputError(f"--panel must be one of {', '.join(PANELS)}, got {args.panel!r}")
    if not args.screenshot and (args.size is not None or args.after is not None):
        raise InputError("--size and --after go with --screenshot (a headless run); the live dashboard takes the "
                         "terminal's size and shows every snapshot as it comes")
    sources = [HttpSource(url) for url in urls]  # SourceError: a malformed URL
    size = _terminal_size(args.size or SCREENSHOT_SIZE)
    screenshot = Path(args.screenshot).expanduser() if args.screenshot else None
    if screenshot is not None:
        _check_output_file(screenshot, "--screenshot")
    for source in sources:  # like `status`: a node that is not there ends here, not in an empty dashboard
        source.fetch()
    after = SCREENSHOT_AFTER_S if args.after is None else args.after
    app = DashboardApp(sources, screenshot=screenshot, screenshot_after=after, initial_panel=args.panel)
    if screenshot is None:
        app.run()
        return 0
    app.run(headless=True, size=size)
    if not screenshot.exists():  # a node that stopped answering after the first fetch: the app gave up waiting
        raise SourceError(
            f"no screenshot written: no snapshot from {', '.join(urls)} within {app.screenshot_timeout:g} s; "
            "is the node still running? (`hivespec status --node URL` says)")
    print(f"screenshot: {screenshot}")
    return 0


def _check_output_file(path: Path, flag: str) -> None:
    """`InputError` unless ``path`` can be written: its folder exists and is writable, and it is not a folder itself."""
    if path.is_dir():
        raise InputError(f"{flag} {str(path)!r} is a folder; give a file name in it, e.g. {path / 'out'}")
    folder = path.parent
    if not folder.is_dir():
        raise InputError(f"{flag} {str(path)!r}: the folder {str(folder)!r} does not exist; create it (mkdir -p {folder}) "
                         "or pick another path")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{flag} {str(path)!r}: the folder {str(folder)!r} is not writable; pick another path")


def cmd_bootstrap(args: argparse.Namespace) -> int:
    """A DHT-only peer (no model, no training) that others bootstrap from; prints its multiaddrs."""
    from hivespec.node.inputs import check_home, check_swarm_inputs

    config = _config(args)
    check_home(config)
    check_swarm_inputs(config)
    from hivespec.node.build import open_bootstrap_peer
    from hivespec.node.swarm.gossip import GossipError

    swarm = config.swarm
    try:
        with open_bootstrap_peer(config) as peer:
            status = peer.gossip.status()
            print(f"bootstrap peer {peer.identity.name} ({peer.identity.peer_id}) for swarm {swarm.swarm!r}"
                  f"{' (private)' if peer.private else ''}; pass one of these as --initial-peer:", flush=True)
            for maddr in peer.gossip.visible_maddrs:
                print(f"  {maddr}", flush=True)
            print(f"joined via: {status['joined_via'] or '-'}; solo: {status['solo']}", flush=True)
            _warn_if_unreachable("bootstrap", config, status)
            _linger(args.duration)
    except GossipError as exc:
        print(f"hivespec bootstrap: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_identity_show(args: argparse.Namespace) -> int:
    from hivespec.node.identity_file import load_or_create_identity
    from hivespec.node.inputs import check_home

    config = load_config(None, overrides={"home": args.home} if args.home else None)
    path = check_home(config) / "identity.key"
    existed = path.exists()
    identity = load_or_create_identity(path)
    info = {
        "name": identity.name,
        "peer_id": identity.peer_id,
        "public_key": identity.public_key.hex(),
        "key_file": str(path),
        "created_now": not existed,
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key:>11}: {value}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    config = _config(args)
    if args.keys:
        for key, default, text in describe():
            print(f"{key:<32} {default:<26} {text}")
        return 0
    print(json.dumps(config.to_dict(), indent=2, sort_keys=True))
    return 0


class _EventLog:
    """Append-only JSON-lines file the demo parent tails."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)

    @classmethod
    def open(cls, name: str) -> _EventLog:
        """The event log at ``--events name``; `InputError` when it cannot be opened for appending."""
        path = Path(name).expanduser()
        try:
            return cls(path)
        except OSError as exc:
            raise InputError(f"--events {name!r}: cannot open it for appending ({exc.strerror}); pick a file you can write") from None

    def write(self, event: dict) -> None:
        self._file.write(json.dumps({"t": time.time(), **event}) + "\n")
        self._file.flush()


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (what was wrong and where to read more), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hivespec", description="Peer-to-peer swarm RL post-training client.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a local swarm of N nodes on 127.0.0.1 with the embedded model")
    _add_config_flags(demo, "demo")
    demo.add_argument("--nodes", type=int, default=None,
                      help="number of local nodes (default 3, in smaller micro batches or fewer where the memory available does not hold 3)")
    demo.add_argument("--dir", default=None, help="working directory for the nodes' data and logs (default: runs/demo-<time>)")
    demo.add_argument("--dashboard", action="store_true", help="show the swarm in the terminal dashboard (n switches nodes)")
    demo.add_argument("--trace", metavar="FILE", help="record each node's rollout trace: FILE=t.jsonl gives t.node-0.jsonl, t.node-1.jsonl, ...")
    demo.set_defaults(func=cmd_demo)

    join = sub.add_parser("join", help="run one node and join a swarm")
    _add_config_flags(join, "public")
    join.add_argument("--initial-peer", action="append", metavar="MULTIADDR", help="bootstrap peer (repeatable)")
    join.add_argument("--home", help="data directory (identity, store); default $HIVESPEC_HOME or the user data dir")
    join.add_argument("--name", help="display name")
    join.add_argument("--trace", metavar="FILE", help="append a rollout trace (JSON lines; .gz for gzip) for bench/drafter_replay.py")
    join.add_argument("--events", help="append JSON-lines events (ready, round, done) to this file")
    join.add_argument("--linger", type=seconds_or_forever, default=15.0, help="seconds to keep serving after the last round (-1: until stopped)")
    join.add_argument("--local-nodes", type=number(int, low=1), default=1, help="nodes sharing this machine (sets torch threads)")
    join.add_argument("--dashboard", action="store_true", help="show the terminal dashboard while the node runs (q stops it)")
    join.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                      help="resume from the newest good checkpoint in the home (default: checkpoint.resume, on)")
    join.set_defaults(func=cmd_join)

    follow = sub.add_parser("follow", help="mirror a leader's policy (peer id) from the base checkpoint and its published deltas")
    _add_config_flags(follow, "public", rounds=False)  # a follower has no rounds: --until-version ends it
    follow.add_argument("leader", metavar="PEER", help="the leader's hivespec peer id (`hivespec identity show` on the leader)")
    follow.add_argument("--initial-peer", action="append", metavar="MULTIADDR", help="bootstrap peer (repeatable)")
    follow.add_argument("--home", help="data directory (identity); default $HIVESPEC_HOME or the user data dir")
    follow.add_argument("--until-version", type=number(int, low=0),
                        help="stop once this policy version is reached (default: follow forever)")
    follow.set_defaults(func=cmd_follow)

    status = sub.add_parser("status", help="print a running node's status (from its local status server)")
    status.add_argument("--node", help="status URL, e.g. http://127.0.0.1:4483 (default: the local node's, from its home)")
    status.add_argument("--home", help="data directory of the local node (default $HIVESPEC_HOME or the user data dir)")
    status.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    status.set_defaults(func=cmd_status)

    dash = sub.add_parser("dash", help="terminal dashboard attached to a running node")
    dash.add_argument("--node", action="append", metavar="URL", help="status URL (repeat for several nodes; n switches)")
    dash.add_argument("--home", help="data directory of the local node (default $HIVESPEC_HOME or the user data dir)")
    dash.add_argument("--panel", default="swarm", help="panel shown first: swarm, throughput, training or sync")
    dash.add_argument("--screenshot", metavar="SVG", help="run headless, save one SVG screenshot and exit")
    dash.add_argument("--size", help=f"terminal size for --screenshot (default {SCREENSHOT_SIZE})")
    dash.add_argument("--after", type=number(float, low=0),
                      help=f"seconds after the first snapshot to take --screenshot (default {SCREENSHOT_AFTER_S:g})")
    dash.set_defaults(func=cmd_dash)

    boot = sub.add_parser("bootstrap", help="run a DHT-only peer (no model) that others join through; prints its multiaddrs")
    _add_config_flags(boot, "public", rounds=False, model=False)  # no model, no rounds: --duration ends it
    boot.add_argument("--initial-peer", action="append", metavar="MULTIADDR", help="another bootstrap peer to join (repeatable)")
    boot.add_argument("--home", help="data directory (identity, peer cache); default $HIVESPEC_HOME or the user data dir")
    boot.add_argument("--duration", type=seconds_or_forever, default=-1, help="seconds to run (-1: until stopped)")
    boot.set_defaults(func=cmd_bootstrap)

    identity = sub.add_parser("identity", help="the node's Ed25519 identity")
    identity_sub = identity.add_subparsers(dest="identity_command", required=True)
    show = identity_sub.add_parser("show", help="print name, peer id and public key (creates the key on first run)")
    show.add_argument("--home", help="data directory (default $HIVESPEC_HOME or the user data dir)")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=cmd_identity_show)

    doctor = sub.add_parser("doctor", help="check this machine and config: torch/CUDA, memory, p2pd, ports, peers, identity, disk, clock")
    _add_config_flags(doctor, "public", rounds=False)  # it checks the machine and config; it runs no rounds
    doctor.add_argument("--home", help="data directory to check (default $HIVESPEC_HOME or the user data dir)")
    doctor.add_argument("--initial-peer", action="append", metavar="MULTIADDR", help="bootstrap peer to test (repeatable)")
    doctor.add_argument("--offline", action="store_true", help="skip the checks that start p2pd and contact peers")
    doctor.add_argument("--timeout", type=number(float, low=0, strict=True), default=10.0,
                        help="seconds per network step (default 10)")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(func=cmd_doctor)

    config = sub.add_parser("config", help="print the resolved config, or every key with its help")
    _add_config_flags(config, "public")
    config.add_argument("--keys", action="store_true", help="list every config key, its default and its meaning")
    config.set_defaults(func=cmd_config)

    from hivespec.node.results_cli import add_result_commands

    add_result_commands(sub)  # export, report, eval: what a run leaves behind
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return args.func(args)
    except UserError as exc:  # the user's to fix: one line; anything else is a bug and keeps its traceback
        print(f"hivespec {args.command}: {one_line(exc)}", file=sys.stderr, flush=True)
        return exc.exit_status
    except KeyboardInterrupt:
        print("hivespec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_is_gone():
            raise
        return 141  # as a command killed by SIGPIPE: `hivespec config --keys | head` stops quietly, like `yes | head`


def _stdout_is_gone() -> bool:
    """Whether stdout's reader went away (the BrokenPipeError was stdout's, not a socket's); if so, stdout goes to
    /dev/null so the interpreter's last flush at exit cannot fail again."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poll.poll(0))  # a pipe with no reader left
    except (AttributeError, OSError, ValueError):  # no poll (Windows) or no stdout file
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return gone


if __name__ == "__main__":
    sys.exit(main())
