"""Every bad input a user can type on the user-facing commands ends in one line naming it, exit 2, no traceback.

Walks the real CLI (`main(argv)`, and a subprocess for the case a new user hit first) through
malformed multiaddrs, bad ports and hosts, unreadable or malformed files, wrong types in --set,
bad --node URLs and usage errors. Each is rejected before a model loads or a socket opens.
"""

import subprocess
import sys

import pytest

from hivespec.node.cli import main

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmXdb6jVUaaTsWwhRxDBnMxtoWW6G5YwYuTuWEmdbSEDF8"


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.setenv("HIVESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HIVESPEC_INITIAL_PEERS", raising=False)
    (tmp_path / "bad.yaml").write_text("rounds: [1,\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "peers.txt").write_text(f"{PEER}\nnot-a-peer\n")
    return tmp_path


def _cases(tmp):
    """(argv, text the one line must name)."""
    return [
        (["join", "--initial-peer", "garbage"], "'garbage' is not a peer's multiaddr"),
        (["join", "--initial-peer", "/ip4/1.2.3.4/tcp/99999/p2p/QmXdb6jVUaaTsWwhRxDBnMxtoWW6G5YwYuTuWEmdbSEDF8"], "port 99999"),
        (["join", "--set", "swarm.port=99999"], "swarm.port must be in 0..65535"),
        (["join", "--set", "swarm.port=abc"], "swarm.port must be an integer, got 'abc'"),
        (["join", "--set", "swarm.host=my-laptop"], "swarm.host must be an IPv4 address"),
        (["join", "--set", "rollout.max_batch_size=["], "--set rollout.max_batch_size='[' is not a valid value"),
        (["join", "--set", "train.learning_rate=fast"], "train.learning_rate must be a number, got 'fast'"),
        (["join", "--set", "checkpoint.resume=maybe"], "checkpoint.resume must be true or false"),
        (["join", "--set", "rounds"], "--set expects section.field=value, got 'rounds'"),
        (["join", "--set", "no.such.key=1"], "unknown config key(s) ['no']"),
        (["join", "--config", str(tmp / "bad.yaml")], "bad.yaml is not valid YAML"),
        (["join", "--config", str(tmp / "list.yaml")], "the top level must be a mapping"),
        (["join", "--config", str(tmp / "missing.yaml")], "missing.yaml not found"),
        (["join", "--set", f"swarm.peers_file={tmp / 'nope.txt'}"], "nope.txt': cannot read it (No such file or directory)"),
        (["join", "--set", f"swarm.peers_file={tmp / 'peers.txt'}"], "line 2: 'not-a-peer' is not a multiaddr"),
        (["join", "--set", f"swarm.private.allowlist_file={tmp / 'allow.txt'}", "--set",
          f"swarm.private.secret_file={tmp / 'secret.txt'}"], "secret.txt' (No such file or directory)"),
        (["join", "--rounds", "five"], "argument --rounds: invalid int value: 'five'"),
        (["demo", "--nodes", "0"], "--nodes must be >= 1, got 0"),
        (["demo", "--set", "rollout.temperature=-1"], "rollout.temperature"),
        (["demo", "--set", "status.port=70000"], "status.port must be in 0..65535"),
        (["follow", "notapeer"], "leader 'notapeer' is not a hivespec peer id"),
        (["follow", "hs0123456789abcdef", "--initial-peer", "/ip4/1.2.3.4/tcp/x"], "'/ip4/1.2.3.4/tcp/x' is not a peer's multiaddr"),
        (["bootstrap", "--initial-peer", "garbage"], "'garbage' is not a peer's multiaddr"),
        (["bootstrap", "--set", "swarm.port=-1"], "swarm.port must be in 0..65535"),
        (["doctor", "--offline", "--initial-peer", "garbage"], "'garbage' is not a peer's multiaddr"),
        (["doctor", "--offline", "--timeout", "soon"], "argument --timeout: invalid float value: 'soon'"),
        (["status", "--node", "garbage"], "node URL must start with http://"),
        (["status", "--node", "http://127.0.0.1:abc"], "node URL 'http://127.0.0.1:abc' is malformed"),
        (["status", "--node", "http://127.0.0.1"], "needs a host and a port"),
        (["status", "--node", "http://127.0.0.1:9"], "no answer from http://127.0.0.1:9"),
        (["dash", "--node", "http://[::1", "--screenshot", str(tmp / "x.svg")], "'http://[::1' is malformed (Invalid IPv6 URL)"),
        (["dash", "--panel", "everything"], "--panel must be one of"),
        (["dash", "--node", "http://127.0.0.1:9", "--size", "huge", "--screenshot", str(tmp / "x.svg")], "--size must be WIDTHxHEIGHT"),
    ]


def test_every_bad_input_ends_in_one_line_that_names_it_with_exit_2(files, capsys):
    for argv, named in _cases(files):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert code == 2, (argv, captured.err)
        assert len(lines) == 1 and named in lines[0], (argv, captured.err)
        assert lines[0].startswith("hivespec"), (argv, lines)
        assert "Traceback" not in captured.err + captured.out, argv


def test_the_first_command_a_new_user_got_wrong_through_the_real_executable(files):
    result = subprocess.run(
        [sys.executable, "-P", "-m", "hivespec.node.cli", "join", "--initial-peer", "garbage"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "hivespec join: --initial-peer (swarm.initial_peers) 'garbage' is not a peer's multiaddr; use the form "
        "/ip4/<address>/tcp/<port>/p2p/<peer id>, as `hivespec join` and `hivespec bootstrap` print it"
    )


def test_unreachable_bootstrap_peers_are_named_in_one_line(files):
    """Solo by default (the node retries in the background, and says so); an error with swarm.require_peers."""
    unreachable = "/ip4/127.0.0.1/tcp/1/p2p/QmXdb6jVUaaTsWwhRxDBnMxtoWW6G5YwYuTuWEmdbSEDF8"
    cli = [sys.executable, "-P", "-m", "hivespec.node.cli"]
    result = subprocess.run(
        [*cli, "bootstrap", "--duration", "0", "--initial-peer", unreachable, "--set", "swarm.bootstrap_timeout=2",
         "--home", str(files / "boot")],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    notice = [line for line in result.stderr.splitlines() if line.startswith("hivespec bootstrap: ")]
    assert len(notice) == 1 and f"no bootstrap peer answered ({unreachable}); running solo" in notice[0], result.stderr
    result = subprocess.run(
        [*cli, "join", "--model", "tiny", "--initial-peer", unreachable, "--set", "swarm.bootstrap_timeout=2",
         "--set", "swarm.require_peers=true", "--set", "status.enabled=false", "--home", str(files / "join")],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "none of the 1 initial peers answered within 2 s" in lines[0] and "Traceback" not in result.stderr
