"""The command line as a user runs it (a real subprocess each)."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from hivespec.node.config import load_config

HIVESPEC = str(Path(sys.executable).with_name("hivespec"))


def _run(*args: str, home: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if home is not None:
        env["HIVESPEC_HOME"] = str(home)
    return subprocess.run([HIVESPEC, *args], check=False, capture_output=True, text=True, timeout=120, env=env)


def test_identity_show_creates_then_reuses_the_key(tmp_path):
    first = _run("identity", "show", "--json", home=tmp_path)
    assert first.returncode == 0, first.stderr
    info = json.loads(first.stdout)
    assert info["created_now"] is True and info["peer_id"].startswith("hs")
    key = Path(info["key_file"])
    assert key.parent == tmp_path and stat.S_IMODE(key.stat().st_mode) == 0o600
    second = json.loads(_run("identity", "show", "--json", home=tmp_path).stdout)
    assert second["created_now"] is False
    assert (second["peer_id"], second["name"], second["public_key"]) == (info["peer_id"], info["name"], info["public_key"])
    human = _run("identity", "show", home=tmp_path).stdout
    assert info["name"] in human and info["peer_id"] in human


def test_identity_show_refuses_a_world_readable_key(tmp_path):
    _run("identity", "show", home=tmp_path)
    (tmp_path / "identity.key").chmod(0o644)
    result = _run("identity", "show", home=tmp_path)
    assert result.returncode != 0
    assert "chmod 600" in result.stderr


def test_config_prints_resolved_values_and_documents_every_key():
    resolved = _run("config", "--config", "demo", "--set", "rollout.num_generations=6")
    assert resolved.returncode == 0, resolved.stderr
    assert json.loads(resolved.stdout)["rollout"]["num_generations"] == 6
    keys = _run("config", "--keys").stdout
    assert "train.tis_clip" in keys and "truncated importance sampling" in keys


def test_the_flags_that_set_a_key_take_their_value_as_text(tmp_path):
    """They went through --set's YAML: --home 'run #2' was the folder 'run' (' #' starts a YAML comment), another node's
    home maybe; --name 'gpu box #2' was 'gpu box', and --name yes a boolean, refused as 'name must be a string'."""
    from hivespec.node.cli import _config, build_parser

    home = tmp_path / "run #2"
    args = build_parser().parse_args(["join", "--home", str(home), "--name", "gpu box #2", "--model", "./models/mine #3"])
    config = _config(args)
    assert (config.home, config.name, config.model.name) == (str(home), "gpu box #2", "./models/mine #3")
    for name in ("yes", "null", "bob: the builder", "[lab] 2"):
        assert _config(build_parser().parse_args(["join", "--name", name])).name == name


def test_the_swarm_line_says_whether_a_node_joined_waits_for_its_peers_or_starts_the_swarm():
    from hivespec.node.cli import _swarm_line

    config = load_config("public")
    joined = {"solo": False, "joined_via": "config /ip4/10.0.0.1/tcp/31337/p2p/QmX", "known_peers": 3}
    assert _swarm_line(config, joined, True) == "swarm 'public': joined via config /ip4/10.0.0.1/tcp/31337/p2p/QmX; 3 peer(s) known"
    alone = {"solo": True, "joined_via": "", "known_peers": 0}
    assert "no peer answered yet; training alone and retrying" in _swarm_line(config, alone, True)
    assert "no initial peers" in _swarm_line(config, alone, False) and "--initial-peer" in _swarm_line(config, alone, False)

    # Peers the user named that did not answer: the stderr warning names them, and the swarm line does not say it twice.
    named = load_config("public", overrides={"swarm.initial_peers": '["/ip4/10.0.0.1/tcp/31337/p2p/QmX"]'})
    assert named.swarm.initial_peers and _swarm_line(named, alone, True) is None


def test_status_takes_the_url_join_prints_and_a_home_s_recorded_url(tmp_path, capsys):
    """`join` prints http://HOST:PORT/status: passed to --node it had been asked for /status/status (HTTP 404)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from hivespec.node.cli import main

    asked = []

    class NotANode(BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's name
            asked.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"not a snapshot")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotANode)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    (tmp_path / "status.json").write_text(json.dumps({"url": url}))
    try:
        assert main(["status", "--node", f"{url}/status"]) == 2
        assert main(["status", "--home", str(tmp_path)]) == 2
    finally:
        server.shutdown()
    assert asked == ["/status", "/status"]
    assert capsys.readouterr().err.count(f"{url}/status sent a bad snapshot") == 2


def test_a_reader_that_stops_early_ends_the_output_quietly():
    """`hivespec config --keys | head`: a BrokenPipeError traceback before; now nothing on stderr, the status of SIGPIPE."""
    process = subprocess.Popen([HIVESPEC, "config", "--keys"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # the reader is gone before the first line is written
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141 and stderr == "", stderr
