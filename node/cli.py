"""The ``hivespec`` command line: demo, join, identity, config."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from hivespec.node.config import ConfigError, NodeConfig, describe, load_config, parse_override


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    pairs = dict(parse_override(text) for text in (args.set or []))
    if getattr(args, "rounds", None) is not None:
        pairs["rounds"] = str(args.rounds)
    if getattr(args, "model", None):
        pairs["model.name"] = args.model
    if getattr(args, "home", None):
        pairs["home"] = str(args.home)
    if getattr(args, "name", None):
        pairs["name"] = args.name
    peers = getattr(args, "initial_peer", None)
    if peers:
        pairs["swarm.initial_peers"] = json.dumps(peers)
    return pairs


def _config(args: argparse.Namespace) -> NodeConfig:
    return load_config(args.config, overrides=_overrides(args))


def _add_config_flags(parser: argparse.ArgumentParser, default_preset: str) -> None:
    parser.add_argument("--config", default=default_preset, help=f"YAML preset name or path (default: {default_preset})")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. train.learning_rate=1e-5 (repeatable)")
    parser.add_argument("--rounds", type=int, help="rounds to run (0 = forever)")
    parser.add_argument("--model", help="model: smollm2-135m-instruct, tiny, or a local HF folder")


def cmd_join(args: argparse.Namespace) -> int:
    from hivespec.node.runtime import build_node

    config = _config(args)
    events = _EventLog(Path(args.events)) if args.events else None
    logging.getLogger(__name__).info("resolved config: %s", json.dumps(config.to_dict(), sort_keys=True))
    node = build_node(config, local_nodes=args.local_nodes)
    try:
        ready = {"event": "ready", "name": node.name, "peer_id": node.identity.peer_id, "maddrs": node.gossip.visible_maddrs}
        if events:
            events.write(ready)
        print(f"node {node.name} ({node.identity.peer_id}) listening on:", flush=True)
        for maddr in node.gossip.visible_maddrs:
            print(f"  {maddr}", flush=True)

        def on_report(report) -> None:
            if events:
                events.write({"event": "round", **report.to_dict()})
            print(format_report_line(report.to_dict()), flush=True)

        node.run(on_report)
        if events:
            events.write({"event": "done", "name": node.name})
        _linger(args.linger)
    finally:
        node.close()
    return 0


def _linger(seconds: float) -> None:
    """Keep gossip serving after the last round, so peers still fetching our last batch get it."""
    if seconds < 0:
        signal.pause()  # until the demo parent (or the user) stops us
    elif seconds > 0:
        time.sleep(seconds)


def cmd_demo(args: argparse.Namespace) -> int:
    from hivespec.node.demo import run_demo

    config = _config(args)
    return run_demo(config, nodes=args.nodes, preset=args.config, overrides=_overrides(args), workdir=args.dir)


def cmd_identity_show(args: argparse.Namespace) -> int:
    from hivespec.node.config import node_home
    from hivespec.node.identity import load_or_create_identity

    config = load_config(None, overrides={"home": args.home} if args.home else None)
    path = node_home(config) / "identity.key"
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

    def write(self, event: dict) -> None:
        self._file.write(json.dumps({"t": time.time(), **event}) + "\n")
        self._file.flush()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}GB"


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


REPORT_HEADER = (
    f"{'rnd':>3} {'node':<16} {'made':>4} {'recv':>4} {'acc':>4} {'rej':>3} {'reward':>6} {'peer_r':>6} "
    f"{'w_own':>5} {'w_peer':>6} {'w_max':>5} {'kept':>4} {'delta / dense':>18} {'time':>6}"
)


def format_report_line(r: dict) -> str:
    """One fixed-width row per node per round (see REPORT_HEADER)."""
    delta = f"{_fmt_bytes(r['delta_bytes'])}/{_fmt_bytes(r['dense_bytes'])}"
    return (
        f"{r['round']:>3} {r['node'][:16]:<16} {r['made']:>4} {r['received']:>4} {r['accepted']:>4} {r['rejected']:>3} "
        f"{r['reward_mean']:>6.2f} {_fmt(r['foreign_reward_mean']):>6} {_fmt(r['own_weight_mean'], '.3f'):>5} "
        f"{_fmt(r['foreign_weight_mean'], '.3f'):>6} {_fmt(r['foreign_weight_max'], '.2f'):>5} {_fmt(r['foreign_kept'], '.2f'):>4} "
        f"{delta:>18} {r['seconds'].get('round', 0):>5.1f}s"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivespec", description="Peer-to-peer swarm RL post-training client.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a local swarm of N nodes on 127.0.0.1 with the embedded model")
    _add_config_flags(demo, "demo")
    demo.add_argument("--nodes", type=int, default=3, help="number of local nodes (default 3)")
    demo.add_argument("--dir", default=None, help="working directory for the nodes' data and logs (default: runs/demo-<time>)")
    demo.set_defaults(func=cmd_demo)

    join = sub.add_parser("join", help="run one node and join a swarm")
    _add_config_flags(join, "public")
    join.add_argument("--initial-peer", action="append", metavar="MULTIADDR", help="bootstrap peer (repeatable)")
    join.add_argument("--home", help="data directory (identity, store); default $HIVESPEC_HOME or the user data dir")
    join.add_argument("--name", help="display name")
    join.add_argument("--events", help="append JSON-lines events (ready, round, done) to this file")
    join.add_argument("--linger", type=float, default=15.0, help="seconds to keep serving after the last round (-1: until stopped)")
    join.add_argument("--local-nodes", type=int, default=1, help="nodes sharing this machine (sets torch threads)")
    join.set_defaults(func=cmd_join)

    identity = sub.add_parser("identity", help="the node's Ed25519 identity")
    identity_sub = identity.add_subparsers(dest="identity_command", required=True)
    show = identity_sub.add_parser("show", help="print name, peer id and public key (creates the key on first run)")
    show.add_argument("--home", help="data directory (default $HIVESPEC_HOME or the user data dir)")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=cmd_identity_show)

    config = sub.add_parser("config", help="print the resolved config, or every key with its help")
    _add_config_flags(config, "public")
    config.add_argument("--keys", action="store_true", help="list every config key, its default and its meaning")
    config.set_defaults(func=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"hivespec: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hivespec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
