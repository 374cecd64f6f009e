"""Live: the dashboard, `hivespec status` and the status server against a real two-node swarm.

Two node processes (tiny model, real hivemind on loopback, real signatures and SQLite), started
by `hivespec demo`; each serves /status, /metrics and /control on a free loopback port.
"""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fakes import screen_text

from hivespec.dashboard.app import DashboardApp
from hivespec.dashboard.source import HttpSource

ROOT = Path(__file__).resolve().parents[2]
METRIC_LINE = re.compile(r'^hivespec_[a-z_]+(\{([a-z_]+="[^"]*",?)*\})? -?[0-9.e+-]+$')


def _events(home: Path) -> list[dict]:
    path = home / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("live-swarm")
    log = (root / "demo.log").open("wb")
    demo = subprocess.Popen(
        [sys.executable, "-P", "-m", "hivespec.node.cli", "demo", "--config", "tiny", "--nodes", "2", "--rounds", "0",
         "--dir", str(root)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    homes = [root / "node-0", root / "node-1"]
    try:
        deadline = time.monotonic() + 300
        while True:  # both up and through a round: each fetched the other's batch, so rollouts flowed both ways
            events = [_events(home) for home in homes]
            if all(sum(e["event"] == "round" for e in ev) >= 1 for ev in events):
                break
            assert demo.poll() is None, (root / "demo.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (root / "demo.log").read_text()[-3000:]
            time.sleep(0.5)
        urls = [next(e["status_url"] for e in ev if e["event"] == "ready") for ev in events]
        yield homes, urls
    finally:
        # The whole group: each node gets SIGTERM from us and again from the demo parent, and a
        # second one stops a node at once instead of after its round (node/cli.py).
        os.killpg(demo.pid, signal.SIGTERM)
        try:
            demo.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(timeout=10)
        log.close()


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_status_reports_real_peers_and_flow_both_ways(swarm):
    homes, urls = swarm
    for index, url in enumerate(urls):
        snapshot = HttpSource(url).fetch()
        other = HttpSource(urls[1 - index]).fetch()
        assert snapshot.node.name == f"node-{index}" and snapshot.node.swarm == "test"
        assert snapshot.node.round >= 0 and len(snapshot.rounds) >= 1
        assert [p.peer_id for p in snapshot.peers] == [other.node.peer_id]
        peer = snapshot.peers[0]
        assert peer.accepted > 0 and peer.rejected == 0 and peer.name  # readable name from its key
        assert snapshot.intake.accepted_rollouts > 0 and snapshot.gossip.bodies_served > 0
        assert snapshot.store.own >= sum(r.made for r in snapshot.rounds) > 0 and snapshot.store.foreign > 0
        last = snapshot.rounds[-1]
        assert last.tokens_generated > 0 and last.tokens_per_second > 0 and 0 <= last.delta_density <= 1
        assert last.delta_bytes == 0  # no followers: the engine is written directly, nothing coded
        assert snapshot.sync.engine_mismatch == 0
        assert snapshot.trainer.sources[0].source == "own"
        assert json.loads((homes[index] / "status.json").read_text())["url"] == url


def test_metrics_are_prometheus_text(swarm):
    _, urls = swarm
    status, body = _get(f"{urls[0]}/metrics")
    assert status == 200
    lines = body.decode().splitlines()
    samples = [line for line in lines if not line.startswith("#")]
    assert samples and all(METRIC_LINE.match(line) for line in samples), [s for s in samples if not METRIC_LINE.match(s)]
    names = {line.split("{")[0].split(" ")[0] for line in samples}
    for name in ("hivespec_round", "hivespec_gossip_bytes_total", "hivespec_intake_batches_total", "hivespec_reward_mean"):
        assert name in names
    assert sum(line.startswith("# TYPE hivespec_round ") for line in lines) == 1


def test_the_server_refuses_what_a_web_page_could_send(swarm):
    _, urls = swarm
    assert _get(f"{urls[0]}/nothing")[0] == 404
    assert _get(f"{urls[0]}/status", {"Host": "evil.example"})[0] == 403  # DNS rebinding
    request = urllib.request.Request(f"{urls[0]}/control", data=b'{"paused": true}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 403  # no X-Hivespec-Control header
    assert HttpSource(urls[0]).fetch().node.paused is False


def test_dashboard_attaches_pauses_and_resumes_a_real_node(swarm):
    _, urls = swarm

    async def scenario():
        app = DashboardApp([HttpSource(url) for url in urls], poll_interval=0.3)
        async with app.run_test(size=(100, 30)) as pilot:
            deadline = time.monotonic() + 30

            def attached(text: str) -> bool:  # the peer named after its node once the app has read node-1 too
                peers = text.split("last seen", 1)[1] if "last seen" in text else ""
                return "both ways" in text and "[node-0]" in text and "1 connected" in text and "node-1" in peers

            while not attached(screen_text(app)):
                assert time.monotonic() < deadline, screen_text(app)
                await pilot.pause(0.1)
            await pilot.press("p")
            while not HttpSource(urls[0]).fetch().node.paused:
                assert time.monotonic() < deadline + 30
                await pilot.pause(0.1)
            while not (app.feed.snapshot.node.paused and "PAUS" in screen_text(app)):  # the app saw it too
                assert time.monotonic() < deadline + 30
                await pilot.pause(0.1)
            await pilot.press("p")
            while HttpSource(urls[0]).fetch().node.paused:
                assert time.monotonic() < deadline + 60
                await pilot.pause(0.1)
            await pilot.press("q")

    asyncio.run(scenario())


def test_hivespec_status_finds_the_local_node_and_never_imports_torch(swarm):
    homes, urls = swarm
    code = (
        "import sys; from hivespec.node.cli import main; "
        f"rc = main(['status', '--home', {str(homes[1])!r}]); "
        "assert 'torch' not in sys.modules, 'hivespec status imported torch'; sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("node-1 (") and "rollouts  both ways" in result.stdout
    result = subprocess.run([sys.executable, "-P", "-m", "hivespec.node.cli", "status", "--json", "--node", urls[0]],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and json.loads(result.stdout)["node"]["name"] == "node-0"
    result = subprocess.run([sys.executable, "-P", "-m", "hivespec.node.cli", "status", "--node", "http://127.0.0.1:9"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "is the node running?" in result.stderr
