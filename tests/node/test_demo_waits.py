"""The demo's waits on its nodes end: a node that dies or goes silent ends the demo in one line naming it and its log.

Stand-in node processes (a sleeping or failing Python), no model: the wait logic alone, in seconds.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hivespec.node import demo
from hivespec.protocol.errors import UserError


def _child(tmp_path: Path, name: str, code: str, log: str = "") -> demo._Child:
    home = tmp_path / name
    home.mkdir()
    (home / "node.log").write_text(log)
    process = subprocess.Popen([sys.executable, "-c", code])
    return demo._Child(name=name, home=home, process=process, events_path=home / "events.jsonl")


def _event(child: demo._Child, line: str) -> None:
    with child.events_path.open("a") as f:
        f.write(line + "\n")


@pytest.fixture
def children(tmp_path):
    made: list[demo._Child] = []
    yield made
    for child in made:
        child.process.kill()
        child.process.wait()


def test_a_node_that_writes_no_event_ends_the_tail_naming_it_and_its_log(tmp_path, children):
    children += [_child(tmp_path, "node-0", "import time; time.sleep(60)", log="INFO training micro-batch 1/4\n"),
                 _child(tmp_path, "node-1", "import time; time.sleep(60)")]
    _event(children[0], '{"event": "phase", "phase": "training", "detail": "round 3"}')
    started = time.monotonic()
    keep_talking = children[1]
    keep_talking.heard_at = float("inf")  # node-1 is heard from all the time; node-0 is the one that stops
    with pytest.raises(demo._DemoFailure) as failure:
        demo._tail(children, 5, started, demo._Stop(), silent_limit=1.0)
    assert time.monotonic() - started < 10
    text = str(failure.value)
    assert "\n" not in text
    assert text.startswith("node-0 wrote no event for") and "(last: training round 3)" in text, text
    assert "'INFO training micro-batch 1/4'" in text and text.endswith(f"its log: {children[0].home / 'node.log'}"), text


def test_a_node_that_dies_before_it_is_ready_ends_the_wait_in_one_line(tmp_path, children):
    children.append(_child(tmp_path, "node-0", "import sys; sys.exit(1)", log="Traceback (most recent call last):\n  ...\nRuntimeError: boom\n"))
    children[0].process.wait()
    with pytest.raises(demo._DemoFailure) as failure:
        demo._wait_ready(children, children, time.monotonic(), demo._Stop())
    text = str(failure.value)
    assert "\n" not in text
    assert text == f"node-0 exited with code 1 before it was ready (last log line: 'RuntimeError: boom'); its log: {children[0].log}"


def test_a_node_that_ends_on_a_held_home_is_the_users_error(tmp_path, children):
    line = "hivespec join: another hivespec node (pid 7) is already running with the identity in x; ..."
    children.append(_child(tmp_path, "node-1", "import sys; sys.exit(3)", log=line + "\n"))
    children[0].process.wait()
    with pytest.raises(UserError, match=r"^node-1: another hivespec node \(pid 7\)"):
        demo._tail(children, 5, time.monotonic(), demo._Stop(), silent_limit=60.0)


def test_not_ready_in_time_names_each_slow_node_and_its_log(tmp_path, children, monkeypatch):
    monkeypatch.setattr(demo, "READY_TIMEOUT_S", 0.5)
    children += [_child(tmp_path, "node-0", "import time; time.sleep(60)"), _child(tmp_path, "node-1", "import time; time.sleep(60)")]
    _event(children[0], '{"event": "ready", "maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/x"]}')
    with pytest.raises(demo._DemoFailure) as failure:
        demo._wait_ready(children, children, time.monotonic(), demo._Stop())
    text = str(failure.value)
    assert "\n" not in text and "node-0" not in text
    assert text.startswith("not ready after 0s: node-1: starting importing torch") and text.endswith(f"its log: {children[1].log}"), text


def test_the_closing_lines_say_what_the_runs_hold_on_disk(tmp_path):
    def run(name: str, megabytes: int) -> Path:
        node = tmp_path / name / "node-0"
        node.mkdir(parents=True)
        (node / "policy.safetensors").write_bytes(b"w" * megabytes * 1_000_000)
        return tmp_path / name

    alone = run("demo-20261129-010000", 3)
    assert demo.disk_line(alone) == "disk: this run holds 3 MB"
    run("demo-20261128-090000", 1000)
    (tmp_path / "demo-notes").mkdir()  # not a demo run: no node-0 in it
    latest = run("demo-20261129-020000", 600)
    assert demo.disk_line(latest) == (
        f"disk: this run holds 600 MB; {tmp_path}/ holds 1.6 GB in 3 demo runs: remove those you no longer need "
        f"(the oldest: rm -r {tmp_path / 'demo-20261128-090000'})")


def test_a_node_started_after_the_stop_is_asked_to_stop_too_and_each_node_once(tmp_path, children, monkeypatch):
    """A Ctrl-C while the demo sizes or spawns its nodes came before a node it then started: that node must hear it."""
    monkeypatch.setattr(demo, "STOP_GRACE_S", 30.0)  # what the old wait waited out for a node never asked

    def counting_node(name: str) -> demo._Child:
        # Records each SIGTERM it gets, and exits a second after the first (room for a second one to arrive).
        code = (
            "import signal, sys, time, pathlib\n"
            f"heard = pathlib.Path({str(tmp_path / name)!r} + '.terms')\n"
            "first = []\n"
            "def on_term(*_):\n"
            "    heard.open('a').write('term\\n'); first.append(first[0] if first else time.monotonic())\n"
            "signal.signal(signal.SIGTERM, on_term)\n"
            f"pathlib.Path({str(tmp_path / name)!r} + '.up').touch()\n"
            "while not first or time.monotonic() - first[0] < 1.0:\n"
            "    time.sleep(0.05)\n"
        )
        child = _child(tmp_path, name, code)
        while not (tmp_path / f"{name}.up").exists():
            assert child.process.poll() is None, f"{name} exited before it was up"
            time.sleep(0.05)
        return child

    stop = demo._Stop()
    children.append(counting_node("node-0"))
    stop.children.extend(children)
    stop(signal.SIGINT, None)  # the Ctrl-C: node-0 is asked
    children.append(counting_node("node-1"))  # spawned after it
    stop.children.append(children[1])
    with pytest.raises(demo._Stopped):
        demo._wait_ready(stop.children, stop.children, time.monotonic(), stop)
    assert [child.process.poll() for child in children] == [0, 0]
    assert [(tmp_path / f"{c.name}.terms").read_text() for c in children] == ["term\n", "term\n"]


def test_a_dir_run_in_before_does_not_lend_its_events_to_the_next_run(tmp_path):
    """A second `demo --dir D` read the first run's ready event: its node-0 'ready' at once, at last run's address."""
    events = tmp_path / "node-0" / "events.jsonl"
    events.parent.mkdir()
    events.write_text('{"event": "ready", "maddrs": ["/ip4/127.0.0.1/tcp/41234/p2p/QmLastRun"]}\n{"event": "done"}\n')
    # A real node process that ends on the user's error before it writes an event.
    child = demo._spawn(0, tmp_path, "demo", {"rollout.prompts_per_round": "0"}, 1, initial_peers=[])
    try:
        with pytest.raises(UserError, match=r"^node-0: rollout.prompts_per_round must be >= 1, got 0$"):
            demo._wait_ready([child], [child], time.monotonic(), demo._Stop())
    finally:
        child.process.kill()
        child.process.wait()
