"""`hivespec doctor`: every line OK/WARN/SKIP/FAIL with what to do; non-zero exit on a failure."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hivespec.node.config import InputError, SwarmConfig, load_config
from hivespec.node.doctor import check_checkpoints, check_disk, check_identity, check_ports, check_private_swarm, run_checks
from hivespec.node.identity_file import load_or_create_identity
from hivespec.node.inputs import check_home
from hivespec.node.swarm.gossip import Gossip
from hivespec.node.training.checkpoint import MODEL_FILE
from hivespec.protocol.identity import Identity


def _config(tmp_path: Path, **overrides: str):
    return load_config("tiny", overrides={"home": str(tmp_path), "status.enabled": "false", **overrides})


def test_identity_line_says_chmod_when_the_key_is_readable_by_others(tmp_path):
    assert check_identity(tmp_path).status == "ok"  # none yet: join creates it
    key = tmp_path / "identity.key"
    load_or_create_identity(key)
    assert check_identity(tmp_path).status == "ok"
    os.chmod(key, 0o644)
    check = check_identity(tmp_path)
    assert check.status == "fail" and f"chmod 600 {key}" in check.detail


def test_the_private_swarm_line_reads_the_files_as_join_does_and_finds_this_node_on_the_allowlist(tmp_path):
    """A lab admin checking a member's setup: the doctor had no word on the private swarm's files, so a world-readable
    secret, a key missing from the allowlist or a member listed alone showed only when `join` refused, or never."""
    home, secret, allow = tmp_path / "home", tmp_path / "secret.txt", tmp_path / "allowlist.txt"
    public = _config(home)
    assert check_private_swarm(public, home).status == "skip"
    secret.write_text("ab" * 32 + "\n")
    os.chmod(secret, 0o600)
    other = Identity.generate()
    allow.write_text(other.public_key.hex() + "\n")
    private = _config(home, **{"swarm.swarm": "lab", "swarm.private.allowlist_file": str(allow),
                               "swarm.private.secret_file": str(secret)})
    check = check_private_swarm(private, home)
    assert check.status == "warn" and "no key yet" in check.detail  # join makes the key: it must be listed first
    me = load_or_create_identity(home / "identity.key")
    check = check_private_swarm(private, home)
    assert check.status == "fail" and me.public_key.hex() in check.detail and "not on swarm.private.allowlist_file" in check.detail
    allow.write_text(me.public_key.hex() + "\n")
    assert check_private_swarm(private, home).status == "warn"  # listed alone: shares with nobody
    allow.write_text(f"{me.public_key.hex()}\n{other.public_key.hex()}\n")
    check = check_private_swarm(private, home)
    assert check.status == "ok" and "2 public key(s)" in check.detail
    os.chmod(secret, 0o644)
    check = check_private_swarm(private, home)
    assert check.status == "fail" and "chmod 600" in check.detail
    assert check in run_checks(private, network=False)


def test_identity_line_fails_where_join_could_not_make_the_home(tmp_path):
    """The line said join creates the key where join's home check then refused the folder (a file on its path)."""
    (tmp_path / "notes").write_text("not a folder")
    home = tmp_path / "notes" / "hivespec"
    with pytest.raises(InputError, match="cannot create it"):
        check_home(_config(home))
    check = check_identity(home)
    assert check.status == "fail" and f"{tmp_path / 'notes'} is a file" in check.detail
    assert check_identity(tmp_path / "new" / "home").status == "ok"  # a folder join can make


def test_a_busy_port_fails_with_how_to_find_its_owner(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        checks = check_ports(_config(tmp_path, **{"swarm.port": str(port)}))
    assert checks[0].status == "fail" and f"ss -ltnp | grep :{port}" in checks[0].detail
    assert check_ports(_config(tmp_path))[0].status == "ok"


def test_a_busy_status_port_is_a_warning_as_the_status_server_takes_a_free_one(tmp_path):
    """It failed the doctor (another node on this machine has the default 4483) where the node serves on a free port."""
    from hivespec.node.status.board import BoardSources, NodeFacts, RunControl, StatusBoard
    from hivespec.node.status.server import StatusServer

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        check = check_ports(_config(tmp_path, **{"status.enabled": "true", "status.port": str(port)}))[1]
        assert check.name == "status port" and check.status == "warn" and "a free port instead" in check.detail
        control = RunControl()
        server = StatusServer(StatusBoard(NodeFacts(name="n", peer_id="hs0", swarm="s", model="m", device="cpu",
                                                    rounds_target=1), BoardSources(lambda: 0), control), control, port=port)
        try:
            assert server.port not in (0, port)  # as the doctor said
        finally:
            server.close()


def test_disk_line_compares_free_space_with_what_checkpoints_need(tmp_path):
    check = check_disk(_config(tmp_path), tmp_path, params=3_000_000)
    assert check.status == "ok" and "checkpoints need" in check.detail
    huge = check_disk(_config(tmp_path), tmp_path, params=10**15)
    assert huge.status == "fail" and "checkpoint.dir" in huge.detail


def test_checkpoint_line_reports_a_torn_newest_checkpoint(tmp_path):
    import torch

    from hivespec.node.training.checkpoint import CheckpointManager, training_snapshot

    model = torch.nn.Linear(4, 4)
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(training_snapshot(model, torch.optim.AdamW(model.parameters()), {"next_round": 3, "policy_version": 3}))
    newest = manager.save(training_snapshot(model, torch.optim.AdamW(model.parameters()), {"next_round": 4}))
    config = _config(tmp_path)
    assert check_checkpoints(config, tmp_path).status == "ok"
    (newest / MODEL_FILE).write_bytes(b"torn")
    check = check_checkpoints(config, tmp_path)
    assert check.status == "warn" and "ckpt-000001 verifies (resumes at round 3" in check.detail and "ckpt-000002" in check.detail


@pytest.mark.timeout(180)
def test_network_checks_find_a_live_peer_and_its_clock_and_fail_on_a_dead_one(tmp_path):
    peer = Gossip(Identity.generate(), SwarmConfig(swarm="doctor-test"))
    peer.start()
    try:
        config = _config(tmp_path, **{"swarm.initial_peers": f"[{peer.visible_maddrs[0]!r}]"})
        checks = {c.name: c for c in run_checks(config, timeout=5.0)}
    finally:
        peer.shutdown()
    assert checks["p2pd"].status == "ok"
    assert checks["peers"].status == "ok", checks["peers"].detail
    assert checks["clock"].status == "ok" and "within" in checks["clock"].detail
    # On loopback the peer can open a fresh connection back to us (tests/net/ covers NAT).
    assert checks["reachability"].status == "ok" and checks["reachability"].detail.startswith("reachable: "), checks["reachability"]

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
    dead = f"/ip4/127.0.0.1/tcp/{dead_port}/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    config = _config(tmp_path, **{"swarm.initial_peers": f"[{dead!r}]"})
    checks = {c.name: c for c in run_checks(config, timeout=3.0)}
    assert checks["peers"].status == "fail" and "check the multiaddrs" in checks["peers"].detail
    assert checks["clock"].status == "skip"


@pytest.mark.timeout(180)
def test_cli_prints_one_line_per_check_and_exits_non_zero_on_a_failure(tmp_path):
    command = [sys.executable, "-P", "-m", "hivespec.node.cli", "doctor", "--config", "tiny", "--home", str(tmp_path),
               "--set", "status.enabled=false"]
    ok = subprocess.run(command, check=False, capture_output=True, text=True, timeout=150)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    names = [line.split()[1] for line in ok.stdout.splitlines() if line.split()[0] in ("OK", "WARN", "SKIP", "FAIL")]
    for name in ("python", "torch", "model", "ram", "vram", "vllm", "p2pd", "peers", "clock", "reachability", "identity", "disk",
                 "checkpoint"):
        assert name in names, ok.stdout
    assert "all checks passed" in ok.stdout
    key = tmp_path / "identity.key"
    load_or_create_identity(key)
    os.chmod(key, 0o640)
    bad = subprocess.run([*command, "--offline"], check=False, capture_output=True, text=True, timeout=150)
    assert bad.returncode == 1
    assert "FAIL  identity" in bad.stdout and "chmod 600" in bad.stdout and "1 check(s) failed" in bad.stdout


def test_the_ram_line_sizes_a_node_by_the_precision_measured_here():
    """A CPU can carry bf16 flags and still train faster in float32 (a 2-core Xeon model 207 without AMX: autocast 1.8x
    slower, 2026-11-29): the ram line then sizes the node by float32's activations, as the node will train, and says so."""
    from dataclasses import replace

    import torch

    from hivespec.node.doctor import check_memory
    from hivespec.node.model.footprint import ModelShape, config_peak_bytes
    from hivespec.node.model.precision import PrecisionChoice, PrecisionPlan

    def plan(autocast: bool) -> PrecisionPlan:
        return PrecisionPlan(PrecisionChoice("engine", torch.bfloat16, "measured", "as measured"),
                             PrecisionChoice("trainer", torch.bfloat16 if autocast else None, "measured", "as measured"))

    config = load_config("demo")
    shape = ModelShape(params=135 * 10**6, layers=30, hidden=576, intermediate=1536, heads=9)
    plenty = 1 << 40
    for autocast, label in ((False, "float32"), (True, "bfloat16 autocast")):
        (check,) = check_memory(config, shape, available=plenty, precision=plan(autocast))
        need = config_peak_bytes(replace(config, model=replace(config.model, autocast=autocast, engine_dtype="bfloat16")), shape)
        assert check.status == "ok" and f"needs up to ~{need / (1 << 30):.1f} GiB while it trains (in {label} here)" in check.detail
    float32, bf16 = (config_peak_bytes(plan(a).applied_to(config), shape) for a in (False, True))
    assert float32 > bf16  # float32 keeps its activations in more bytes


def test_the_ram_line_says_where_a_node_will_train_in_smaller_micro_batches_and_where_it_cannot_fit():
    """Models shaped against this machine's free memory: one whose step of 8 samples does not fit but of fewer does
    (a node trains so: WARN), and one whose step does not fit even one sample at a time (FAIL)."""
    from dataclasses import replace

    from hivespec.node.doctor import check_memory
    from hivespec.node.model.footprint import ACTIVATION_BYTES, PROMPT_TOKENS, ModelShape
    from hivespec.node.process_memory import available_bytes

    if available_bytes() < 4 << 30:
        pytest.skip("less than 4 GiB free: the runtime alone would leave no micro batch that fits")
    config = load_config("demo")
    config = replace(config, model=replace(config.model, autocast=True, engine_dtype="bfloat16"))
    per_layer = (PROMPT_TOKENS + config.rollout.max_completion_length) * ACTIVATION_BYTES[True] * (10 * 576 + 4 * 1536)
    layers = int(0.3 * available_bytes() / per_layer)  # a sample's activations: 0.3 of what is free
    (check,) = check_memory(config, ModelShape(params=10**6, layers=layers, hidden=576, intermediate=1536, heads=9))
    assert check.status == "warn" and "it will train in micro batches of " in check.detail and "not 8" in check.detail
    (check,) = check_memory(config, ModelShape(params=10**6, layers=10 * layers, hidden=576, intermediate=1536, heads=9))
    assert check.status == "fail" and "close other programs" in check.detail
