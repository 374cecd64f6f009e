"""Every error a user can cause ends in one line, exit 2, no traceback: the real executable, every command.

Each case runs ``python -P -m hivespec.node.cli ...`` in a fresh process (as a user does) and
expects exactly one line on stderr, ``hivespec <command>: ...`` naming the input, exit code 2
and no "Traceback" anywhere, within the case's time limit (a hang is a failure, not a wait).
The classes: usage errors, config values and ranges (file, env, --set, flags), paths and files
(home, trace, events, checkpoint.dir, screenshot, config file, peers and private-swarm files),
model sources (a folder, a file, a name, a hub id not cached while offline), devices and
engines, key files, peers and leaders, status URLs and nodes that are not running, the
environment (HIVESPEC_FAULTS, HIVESPEC_INITIAL_PEERS). Cases run in parallel threads; all but
a few are refused before torch is imported, none loads a model but the tiny one (the follower's, and a completion
length past its positions).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-P", "-m", "hivespec.node.cli"]
PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmXdb6jVUaaTsWwhRxDBnMxtoWW6G5YwYuTuWEmdbSEDF8"
LEADER = "hs0123456789abcdef"
DEAD_URL = "http://127.0.0.1:9"  # port 9 (discard): nothing listens on loopback
# A hang detector, not a speed test: a refused input takes well under a second of CPU (a few seconds
# where the node is built first), but a machine shared with load 15x its cores stretches that to minutes.
CASE_TIMEOUT_S = 300
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class Case:
    argv: list[str]  # after `hivespec`; "{tmp}" is the case folder
    named: str  # text the one line must contain
    env: dict[str, str] = field(default_factory=dict)
    command: str = ""  # the line's "hivespec <command>:" (default: argv[0])

    @property
    def id(self) -> str:
        return " ".join([*(f"{k}={v}" for k, v in self.env.items()), *self.argv])

    def text(self, tmp: Path) -> tuple[list[str], dict[str, str], str]:
        """argv, env and the expected text with "{tmp}" made the case's folder."""
        def fill(value: str) -> str:
            return value.replace("{tmp}", str(tmp))
        return [fill(a) for a in self.argv], {k: fill(v) for k, v in self.env.items()}, fill(self.named)


def _cases() -> list[Case]:
    c = Case
    cases = [
        # ----- usage (argparse): one line too --------------------------------------------------
        c([], "the following arguments are required: command", command="hivespec:"),
        c(["identity"], "the following arguments are required: identity_command"),
        c(["join", "--rounds", "five"], "argument --rounds: invalid int value: 'five'"),
        c(["join", "--local-nodes", "0"], "argument --local-nodes: must be >= 1, got 0"),
        c(["doctor", "--offline", "--timeout", "soon"], "argument --timeout: invalid float value: 'soon'"),
        c(["doctor", "--offline", "--timeout", "-1"], "argument --timeout: must be > 0, got -1"),
        c(["doctor", "--offline", "--timeout", "0"], "argument --timeout: must be > 0, got 0"),
        c(["dash", "--after", "-1", "--node", DEAD_URL], "argument --after: must be >= 0, got -1"),
        c(["follow", LEADER, "--until-version", "-2"], "argument --until-version: must be >= 0, got -2"),
        c(["bootstrap", "--duration", "abc"], "argument --duration: invalid float value: 'abc'"),
        # Only -1 waits until stopped: inf overflowed time.sleep (a traceback), -5 waited forever, nan not at all.
        c(["bootstrap", "--duration", "inf"], "argument --duration: must be -1 (until stopped) or seconds from 0 to 1e+09, got inf"),
        c(["bootstrap", "--duration", "nan"], "argument --duration: must be -1 (until stopped)"),
        c(["bootstrap", "--duration", "-5"], "argument --duration: must be -1 (until stopped)"),
        c(["join", "--linger", "inf"], "argument --linger: must be -1 (until stopped) or seconds from 0 to 1e+09, got inf"),
        c(["join", "--linger", "nan"], "argument --linger: must be -1 (until stopped)"),
        c(["join", "--linger", "-5"], "argument --linger: must be -1 (until stopped)"),
        c(["join", "--linger", "1e20"], "argument --linger: must be -1 (until stopped)"),
        c(["demo", "--nodes", "0"], "--nodes must be >= 1, got 0"),
        # Flags a command would ignore are not offered (they were shown in --help and did nothing).
        c(["follow", LEADER, "--rounds", "5"], "unrecognized arguments: --rounds 5", command="hivespec:"),
        c(["bootstrap", "--rounds", "5"], "unrecognized arguments: --rounds 5", command="hivespec:"),
        c(["bootstrap", "--model", "tiny"], "unrecognized arguments: --model tiny", command="hivespec:"),
        # ----- config values: types, keys, ranges, from flags, --set, env and files -----------
        c(["join", "--rounds", "-1"], "rounds must be >= 0 (0 = forever), got -1"),
        c(["join", "--set", "train.micro_batch_size=-1"], "train.micro_batch_size must be >= 1, got -1"),
        c(["join", "--set", "train.foreign_fraction=1.5"], "train.foreign_fraction must be in [0, 1), got 1.5"),
        c(["join", "--set", "swarm.request_timeout=0"], "swarm.request_timeout must be > 0, got 0"),
        c(["join", "--set", "seed=-3"], "seed must be in 0..9223372036854775807"),
        c(["join", "--set", "swarm.port=99999"], "swarm.port must be in 0..65535"),
        c(["join", "--set", "swarm.port=abc"], "swarm.port must be an integer, got 'abc'"),
        c(["join", "--set", "swarm.host=my-laptop"], "swarm.host must be an IPv4 address"),
        c(["join", "--set", "rollout.max_batch_size=["], "--set rollout.max_batch_size='[' is not a valid value"),
        c(["join", "--set", "train.learning_rate=fast"], "train.learning_rate must be a number, got 'fast'"),
        c(["join", "--set", "checkpoint.resume=maybe"], "checkpoint.resume must be true or false"),
        c(["join", "--set", "rounds"], "--set expects section.field=value, got 'rounds'"),
        c(["join", "--set", "no.such.key=1"], "unknown config key(s) ['no']"),
        c(["join", "--set", "tasks.mix=[{family: foo}]"], "unknown task family 'foo'"),
        c(["join", "--set", "tasks.mix=[]"], "tasks.mix is empty"),
        c(["join", "--set", "model.engine=vllm", "--set", "model.engine_dtype=float64"], "model.engine vllm samples in bfloat16"),
        c(["join", "--config", "{tmp}/bad.yaml"], "bad.yaml is not valid YAML"),
        c(["join", "--config", "{tmp}/list.yaml"], "the top level must be a mapping"),
        c(["join", "--config", "{tmp}/missing.yaml"], "missing.yaml not found"),
        c(["config", "--set", "train.lr=1"], "unknown config key(s) ['lr'] in train"),
        c(["config"], "train.micro_batch_size must be >= 1, got 0", env={"HIVESPEC_TRAIN__MICRO_BATCH_SIZE": "0"}),
        c(["demo", "--set", "rollout.temperature=-1"], "rollout.temperature must be >= 0"),
        c(["demo", "--set", "status.port=70000"], "status.port must be in 0..65535"),
        c(["bootstrap", "--set", "swarm.port=-1"], "swarm.port must be in 0..65535"),
        c(["follow", LEADER, "--set", "sync.leader_timeout=0"], "sync.leader_timeout must be > 0"),
        c(["doctor", "--offline", "--set", "rollout.top_p=.nan"], "rollout.top_p must be in (0, 1]"),
        # ----- paths and files -------------------------------------------------------------------
        c(["join", "--home", "{tmp}/afile"], "--home (home) '{tmp}/afile' is a file, not a folder"),
        c(["join", "--home", "{tmp}/afile/sub"], "cannot create it (Not a directory)"),
        c(["identity", "show", "--home", "{tmp}/afile"], "is a file, not a folder"),
        c(["identity", "show"], "$HIVESPEC_HOME '{tmp}/afile' is a file", env={"HIVESPEC_HOME": "{tmp}/afile"}),
        c(["bootstrap", "--home", "{tmp}/afile"], "is a file, not a folder"),
        c(["follow", LEADER, "--home", "{tmp}/afile"], "is a file, not a folder"),
        c(["join", "--trace", "{tmp}/nodir/t.jsonl"], "the folder '{tmp}/nodir' does not exist"),
        c(["join", "--trace", "{tmp}/adir"], "--trace (speculation.trace_file) '{tmp}/adir' is a folder"),
        c(["demo", "--trace", "{tmp}/nodir/t.jsonl"], "the folder '{tmp}/nodir' does not exist"),
        c(["join", "--events", "{tmp}/afile/events.jsonl"], "--events '{tmp}/afile/events.jsonl': cannot open it"),
        c(["join", "--set", "checkpoint.dir={tmp}/afile"], "checkpoint.dir '{tmp}/afile' is a file, not a folder"),
        c(["join", "--set", "swarm.peers_file={tmp}/nope.txt"], "nope.txt': cannot read it (No such file or directory)"),
        c(["join", "--set", "swarm.peers_file={tmp}/peers.txt"], "line 2: 'not-a-peer' is not a multiaddr"),
        c(["join", "--set", "swarm.private.allowlist_file={tmp}/allow.txt", "--set", "swarm.private.secret_file={tmp}/secret.txt"],
          "secret.txt' (No such file or directory)"),
        c(["dash", "--node", DEAD_URL, "--screenshot", "{tmp}/nodir/x.svg"], "the folder '{tmp}/nodir' does not exist"),
        # ----- model sources ----------------------------------------------------------------------
        c(["join", "--model", "{tmp}/nofolder"], "--model (model.name) '{tmp}/nofolder': no such folder"),
        c(["join", "--model", "{tmp}/adir"], "is a folder without config.json"),
        c(["join", "--model", "{tmp}/afile"], "is a file, not a model folder"),
        c(["join", "--model", "not a model!"], "--model (model.name) 'not a model!' is none of"),
        c(["demo", "--model", "{tmp}/nofolder"], "no such folder"),
        c(["follow", LEADER, "--model", "{tmp}/nofolder"], "no such folder"),
        # Past the preflight (a hub id is only checked for its form): refused by the hub where it is
        # resolved, while the node is built, before any weights load.
        c(["join", "--model", "hivespec-test/absent-model", "--home", "{tmp}/hub-home"],
          "model 'hivespec-test/absent-model' is not in the Hugging Face cache", env={"HF_HUB_OFFLINE": "1"}),
        # ----- devices and engines ----------------------------------------------------------------
        c(["join", "--set", "model.device=gpu"], "model.device 'gpu' is not a torch device"),
        c(["join", "--set", "model.device=cuda:99"], "model.device 'cuda:99'"),
        c(["join", "--set", "model.device=mps"], "model.device 'mps': hivespec samples in float64, which Apple GPUs (MPS) do not support"),
        # ----- key files ------------------------------------------------------------------------------
        c(["identity", "show", "--home", "{tmp}/garbage-key"], "is not a hivespec key file"),
        c(["identity", "show", "--home", "{tmp}/open-key"], "chmod 600"),
        # Found while the node is built (the key is read after the heavy imports).
        c(["join", "--model", "tiny", "--home", "{tmp}/garbage-key"], "is not a hivespec key file"),
        # ----- tasks, found while the node is built ----------------------------------------------------
        c(["join", "--model", "tiny", "--home", "{tmp}/tasks-home", "--set", "tasks.mix=[{family: arith, difficulty: 9}]"],
          "difficulty must be in 1..6, got 9"),
        c(["join", "--model", "tiny", "--home", "{tmp}/tasks-home-2", "--set", "tasks.mix=[{family: jsonl, name: {tmp}/nope.jsonl}]"],
          "is neither an existing file nor a Hugging Face dataset id"),
        # Found once the model's positions are known (it had been the first round's ValueError traceback).
        c(["join", "--model", "tiny", "--home", "{tmp}/long-home", "--set", "rollout.max_completion_length=2048"],
          "rollout.max_completion_length 2048 leaves no room for a prompt in the model's 2048 positions (tiny)"),
        # ----- peers and leaders --------------------------------------------------------------------
        c(["join", "--initial-peer", "garbage"], "'garbage' is not a peer's multiaddr"),
        c(["join", "--initial-peer", PEER.replace("31337", "99999")], "port 99999; a TCP port is 1..65535"),
        c(["join", "--initial-peer", PEER.replace("127.0.0.1", "boot.example.org")], "a host name goes under /dns4/ or /dns6/"),
        c(["join"], "$HIVESPEC_INITIAL_PEERS 'garbage' is not a peer's multiaddr", env={"HIVESPEC_INITIAL_PEERS": "garbage"}),
        c(["follow", "notapeer"], "leader 'notapeer' is not a hivespec peer id"),
        c(["follow", LEADER, "--initial-peer", "/ip4/1.2.3.4/tcp/x"], "'/ip4/1.2.3.4/tcp/x' is not a peer's multiaddr"),
        c(["bootstrap", "--initial-peer", "garbage"], "'garbage' is not a peer's multiaddr"),
        c(["doctor", "--offline", "--initial-peer", "garbage"], "'garbage' is not a peer's multiaddr"),
        # A leader that never answers: the follower (tiny model, gossip on loopback) gives up and says so.
        c(["follow", LEADER, "--model", "tiny", "--home", "{tmp}/follower", "--set", "sync.leader_timeout=1",
           "--set", "swarm.bootstrap_timeout=0", "--set", "sync.poll_interval=0.2", "--set", "model.engine_dtype=float32"], f"no policy head from leader {LEADER} within 1 s"),
        # ----- status URLs and nodes that are not running -------------------------------------------
        c(["status", "--node", "garbage"], "node URL must start with http://"),
        c(["status", "--node", "http://127.0.0.1:abc"], "node URL 'http://127.0.0.1:abc' is malformed"),
        c(["status", "--node", "http://127.0.0.1"], "needs a host and a port"),
        c(["status", "--node", DEAD_URL], f"no answer from {DEAD_URL}"),
        c(["status", "--node", f"{DEAD_URL}/status"], f"no answer from {DEAD_URL} "),  # the URL `join` prints: /status is the page
        c(["status", "--node", f"{DEAD_URL}/metrics"], "has a path; pass the node's http://HOST:PORT alone"),
        # An explicit home with no status.json had fallen back to the default port: maybe another node's status, as if this one's.
        c(["status", "--home", "{tmp}/typo"], "--home '{tmp}/typo' is not a folder; pass the home of a running node"),
        c(["status", "--home", "{tmp}/adir"], "--home '{tmp}/adir' has no status.json"),
        c(["dash", "--home", "{tmp}/adir"], "--home '{tmp}/adir' has no status.json"),
        c(["dash", "--node", DEAD_URL], f"no answer from {DEAD_URL}"),
        c(["dash", "--node", DEAD_URL, "--screenshot", "{tmp}/x.svg"], f"no answer from {DEAD_URL}"),
        c(["dash", "--node", DEAD_URL, "--screenshot", "{tmp}/x.svg", "--size", "0x0"], "--size '0x0' has no room to draw in"),
        c(["dash", "--node", DEAD_URL, "--size", "huge", "--screenshot", "{tmp}/x.svg"], "--size must be WIDTHxHEIGHT"),
        c(["dash", "--node", "http://[::1", "--screenshot", "{tmp}/x.svg"], "'http://[::1' is malformed (Invalid IPv6 URL)"),
        c(["dash", "--panel", "everything"], "--panel must be one of"),
        c(["dash", "--node", DEAD_URL, "--size", "80x24"], "--size and --after go with --screenshot"),
        c(["dash", "--node", DEAD_URL, "--after", "2"], "--size and --after go with --screenshot"),
        c(["doctor", "--rounds", "3"], "unrecognized arguments: --rounds 3", command="hivespec:"),
        # ----- what a run leaves behind: export, report, eval ------------------------------------------
        c(["export", "--home", "{tmp}/adir", "--checkpoint", "{tmp}/adir", "--out", "{tmp}/out"], "not both"),
        c(["export", "--home", "{tmp}/nohome", "--out", "{tmp}/out"], "--home {tmp}/nohome is not a folder"),
        c(["export", "--home", "{tmp}/adir"], "the following arguments are required: --out"),
        c(["export", "--home", "{tmp}/adir", "--out", "{tmp}/out", "--revision", "abc"], "--revision goes with --model"),
        c(["export", "--home", "{tmp}/adir", "--out", "{tmp}/out", "--private"], "--private goes with --push-to-hub"),
        # --push-to-hub is checked before the export (it had been after it: minutes, then a folder in the way of a retry).
        c(["export", "--home", "{tmp}/nohome", "--out", "{tmp}/out", "--push-to-hub", "notarepo"], "'notarepo' is not a Hub repo id"),
        c(["export", "--home", "{tmp}/nohome", "--out", "{tmp}/out", "--push-to-hub", "a/b/c"], "'a/b/c' is not a Hub repo id"),
        c(["export", "--home", "{tmp}/nohome", "--out", "{tmp}/out", "--push-to-hub", "alice/p"], "no Hugging Face token to upload",
          env={"HF_TOKEN": "", "HF_HOME": "{tmp}/hf"}),
        c(["export", "--home", "{tmp}/nohome", "--out", "{tmp}/out", "--push-to-hub", "alice/p"], "HF_HUB_OFFLINE is set",
          env={"HF_TOKEN": "hf_not_a_real_token"}),
        # A bad --out: one line naming it (a traceback before), and for export before the home is read.
        c(["export", "--home", "{tmp}/nohome", "--out", "{tmp}/afile"], "--out {tmp}/afile already exists and is not an empty folder"),
        c(["export", "--home", "{tmp}/nohome", "--out", "{tmp}/afile/sub"], "--out '{tmp}/afile/sub': its folder '{tmp}/afile' is a file"),
        c(["report", "{tmp}/run", "--out", "{tmp}/afile"], "--out '{tmp}/afile' is a file, not a folder"),
        c(["report", "{tmp}/run", "--out", "{tmp}/afile/sub"], "--out '{tmp}/afile/sub': cannot create it (Not a directory)"),
        c(["report", "{tmp}/run", "--out", "/proc/hivespec-report"], "--out '/proc/hivespec-report'"),
        c(["report", "{tmp}/nothere"], "run directory {tmp}/nothere does not exist"),
        c(["report", "{tmp}/adir"], "holds no round events"),
        c(["report", "{tmp}/afile"], "run directory {tmp}/afile is a file, not a folder"),
        c(["export", "--checkpoint", "{tmp}/nothere", "--out", "{tmp}/out"], "--checkpoint {tmp}/nothere does not exist"),
        c(["eval", "--home", "{tmp}/adir", "--model", "{tmp}/adir"], "not both"),
        c(["eval", "--home", "{tmp}/nohome"], "--home {tmp}/nohome is not a folder"),
        c(["eval", "--model", "{tmp}/nothere"], "--model {tmp}/nothere does not exist"),
        c(["eval", "--home", "{tmp}/bad-policy"], "evaluate a checkpoint instead: `hivespec export --checkpoint DIR"),
        c(["eval", "--model", "{tmp}/adir"], "--model {tmp}/adir has no config.json"),
        # Number flags are refused as they are parsed: they had failed with a traceback, one after the base's greedy pass.
        c(["eval", "--device", "gpu"], "--device 'gpu' is not a torch device; use cpu, cuda or cuda:N"),
        c(["eval", "--n", "0"], "argument --n: must be >= 1, got 0"),
        c(["eval", "--samples", "-1"], "argument --samples: must be >= 0, got -1"),
        c(["eval", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
        c(["eval", "--temperature", "-1"], "argument --temperature: must be >= 0, got -1"),
        c(["eval", "--temperature", "nan"], "argument --temperature: must be a finite number, got nan"),
        # ----- the environment ------------------------------------------------------------------------
        c(["join", "--model", "tiny", "--home", "{tmp}/faults-home"], "HIVESPEC_FAULTS entry 'x@y'", env={"HIVESPEC_FAULTS": "x@y"}),
    ]
    if not HAS_VLLM:  # with vLLM installed the engine is refused only without CUDA, which a GPU machine has
        cases.append(c(["join", "--set", "model.engine=vllm"], "model.engine is 'vllm' but vLLM is not installed"))
    return cases


CASES = _cases()
assert len({case.id for case in CASES}) == len(CASES), "two cases with the same argv"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess | None, float, Path]]:
    """Every case run once, in parallel threads: id -> (result or None after a hang, seconds, its folder).

    The embedded model is converted first (in the cache the suite uses): the few cases that build
    a node would otherwise print the one-time conversion's progress before their line.
    """
    from hivespec.node.model.loader import ensure_embedded_cache

    ensure_embedded_cache()
    root = tmp_path_factory.mktemp("user-errors")

    def run(index: int, case: Case):
        tmp = root / f"case-{index}"
        _files(tmp)
        argv, extra, _ = case.text(tmp)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HIVESPEC_") or k == "HIVESPEC_CACHE_DIR"}
        env |= {"HIVESPEC_HOME": str(tmp / "home"), "HF_HUB_OFFLINE": "1", **extra}
        started = time.monotonic()
        try:
            result = subprocess.run([*CLI, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=CASE_TIMEOUT_S,
                                    check=False)
        except subprocess.TimeoutExpired:
            result = None
        return case.id, (result, time.monotonic() - started, tmp)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(lambda item: run(*item), enumerate(CASES)))


def _files(tmp: Path) -> None:
    """What the cases point at: a file where a folder belongs, broken configs, bad key files, peers files."""
    tmp.mkdir(parents=True)
    (tmp / "afile").write_text("not a folder\n")
    (tmp / "adir").mkdir()
    (tmp / "bad.yaml").write_text("rounds: [1,\n")
    (tmp / "list.yaml").write_text("- 1\n- 2\n")
    (tmp / "peers.txt").write_text(f"{PEER}\nnot-a-peer\n")
    (tmp / "bad-policy").mkdir()
    (tmp / "bad-policy" / "policy.json").write_text("{not json")
    (tmp / "run" / "node-0").mkdir(parents=True)  # a run with one round: `hivespec report` gets as far as writing
    (tmp / "run" / "node-0" / "events.jsonl").write_text('{"event": "round", "node": "node-0", "round": 0, "reward_mean": 0.5}\n')
    for name, mode in (("garbage-key", 0o600), ("open-key", 0o644)):
        (tmp / name).mkdir()
        key = tmp / name / "identity.key"
        key.write_bytes(b"garbage" if name == "garbage-key" else b"hivespec-key-v1\n" + bytes(32))
        key.chmod(mode)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_user_error_is_one_line_with_exit_2(case: Case, outcomes) -> None:
    result, _, tmp = outcomes[case.id]
    assert result is not None, f"no answer within {CASE_TIMEOUT_S} s: {case.argv}"
    lines = result.stderr.strip().splitlines()
    command = case.command or f"hivespec {case.argv[0]}:"
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(command), lines[0]
    assert case.text(tmp)[2] in lines[0], lines[0]


def test_the_first_command_a_new_user_got_wrong_is_told_exactly(outcomes) -> None:
    result, _, _ = outcomes[Case(["join", "--initial-peer", "garbage"], "").id]
    assert result is not None and result.stderr.strip() == (
        "hivespec join: --initial-peer (swarm.initial_peers) 'garbage' is not a peer's multiaddr; use the form "
        "/ip4/<address>/tcp/<port>/p2p/<peer id>, as `hivespec join` and `hivespec bootstrap` print it"
    )


def test_every_command_has_cases() -> None:
    from hivespec.node.cli import build_parser

    commands = set(build_parser()._subparsers._group_actions[0].choices)  # argparse keeps them here
    missing = commands - {case.argv[0] for case in CASES if case.argv}
    assert not missing, f"add bad inputs for {sorted(missing)} to this file's cases"


def test_unreachable_bootstrap_peers_are_named_in_one_line(tmp_path, monkeypatch):
    """Solo by default (the node retries in the background, and says so); an error with swarm.require_peers."""
    monkeypatch.setenv("HIVESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HIVESPEC_INITIAL_PEERS", raising=False)
    unreachable = "/ip4/127.0.0.1/tcp/1/p2p/QmXdb6jVUaaTsWwhRxDBnMxtoWW6G5YwYuTuWEmdbSEDF8"
    result = subprocess.run(
        [*CLI, "bootstrap", "--duration", "0", "--initial-peer", unreachable, "--set", "swarm.bootstrap_timeout=2",
         "--home", str(tmp_path / "boot")],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    notice = [line for line in result.stderr.splitlines() if line.startswith("hivespec bootstrap: ")]
    assert len(notice) == 1 and f"no bootstrap peer answered ({unreachable}); running solo" in notice[0], result.stderr
    result = subprocess.run(
        [*CLI, "join", "--model", "tiny", "--initial-peer", unreachable, "--set", "swarm.bootstrap_timeout=2",
         "--set", "swarm.require_peers=true", "--set", "status.enabled=false", "--home", str(tmp_path / "join")],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "none of the 1 initial peers answered within 2 s" in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [["join", "--model", "tiny"], ["follow", LEADER, "--model", "tiny"], ["bootstrap", "--duration", "0"]],
                         ids=["join", "follow", "bootstrap"])
def test_a_home_another_node_holds_is_one_line_with_exit_3(command, tmp_path, monkeypatch):
    """A second node on one home (one identity): the one line naming the holder's pid, and its own exit status, 3."""
    import fcntl

    home = tmp_path / "held"
    home.mkdir()
    with (home / "node.lock").open("w") as lock:  # what a running node holds (`bootstrap.HomeLock`)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("4242")
        lock.flush()
        env = {k: v for k, v in os.environ.items() if not k.startswith("HIVESPEC_")} | {"HF_HUB_OFFLINE": "1"}
        result = subprocess.run([*CLI, *command, "--home", str(home), "--set", "status.enabled=false"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=CASE_TIMEOUT_S, check=False)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.returncode == 3, (result.returncode, result.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith(f"hivespec {command[0]}: another hivespec node (pid 4242) is already running"), lines
    assert "give this one its own --home" in lines[0]
