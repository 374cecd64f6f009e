"""Pilot tests of the dashboard: every key, every panel, a lost node, several local nodes, 80 x 24."""

import asyncio
import os
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import FakeSource, crowded, make_snapshot, screen_text
from textual.widgets import DataTable

from hivespec.dashboard.app import PANELS, DashboardApp
from hivespec.dashboard.help import HelpScreen
from hivespec.dashboard.log import LogPanel
from hivespec.dashboard.view import PEER_ROWS

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("HIVESPEC_UPDATE_SNAPSHOTS") == "1"


async def _until(pilot, condition, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await pilot.pause(0.02)


def _app(*sources, **kwargs) -> DashboardApp:
    return DashboardApp(list(sources), poll_interval=0.2, **kwargs)


def _run(coro):
    asyncio.run(coro)


def test_every_key_does_what_the_footer_says():
    source = FakeSource(make_snapshot())

    async def scenario():
        app = _app(source)
        async with app.run_test(size=(80, 24)) as pilot:
            await _until(pilot, lambda: app.feed.snapshot is not None)
            tabs = app.query_one("#panels")
            assert tabs.active == "swarm"
            for key, panel in (("2", "throughput"), ("3", "training"), ("4", "sync"), ("1", "swarm")):
                await pilot.press(key)
                assert tabs.active == panel
            for panel in (*PANELS[1:], PANELS[0]):  # tab cycles and wraps
                await pilot.press("tab")
                assert tabs.active == panel

            log = app.query_one(LogPanel)
            assert not log.display
            await pilot.press("l")
            assert log.display and "reward_mismatch" in screen_text(app)
            await pilot.press("l")
            assert not log.display

            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen) and "tab, 1-4" in screen_text(app)
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)

            await pilot.press("p")
            await _until(pilot, lambda: source.pause_requests == [True])
            await _until(pilot, lambda: "PAUSED after round 6/10 (p resumes)" in screen_text(app))
            await pilot.press("p")
            await _until(pilot, lambda: source.pause_requests == [True, False])
            await _until(pilot, lambda: "training round 7/10" in screen_text(app))

            await pilot.press("q")
            await pilot.pause()
            assert not app.is_running

    _run(scenario())


def test_footer_lists_every_key_at_80x24():
    async def scenario():
        app = _app(FakeSource(make_snapshot()))
        async with app.run_test(size=(80, 24)) as pilot:
            await _until(pilot, lambda: "quit" in screen_text(app).splitlines()[-1])
            footer = screen_text(app).splitlines()[-1]
            for key in ("tab/1-4 panels", "q quit", "p pause/resume", "l log", "? help"):
                assert key in footer
            assert "next node" not in footer  # one node: nothing to switch to

    _run(scenario())


def test_a_lost_node_is_shown_as_lost_keeps_its_last_view_and_recovers():
    source = FakeSource(make_snapshot())
    now = [1000.0]

    async def scenario():
        app = _app(source, clock=lambda: now[0])
        async with app.run_test(size=(80, 24)) as pilot:
            await _until(pilot, lambda: app.feed.snapshot is not None)
            source.fail = "no answer from http://127.0.0.1:4483 (Connection refused); is the node running?"
            await _until(pilot, lambda: app.feed.error is not None)
            now[0] += 12
            await _until(pilot, lambda: "LOST  for 12s: no answer from http://127.0.0.1:4483" in screen_text(app))
            assert "swift-otter-3fa2" in screen_text(app)  # the last snapshot stays on screen
            fetches = source.fetches
            await pilot.press("p")
            assert source.pause_requests == []  # nothing to pause while lost
            source.fail = None
            await _until(pilot, lambda: app.feed.error is None and source.fetches > fetches)
            await _until(pilot, lambda: "LOST" not in screen_text(app))

    _run(scenario())


def test_a_source_that_raises_something_else_shows_the_node_lost_and_polling_goes_on():
    """Any exception out of a fetch had ended its worker with the node still marked as being fetched: never polled again,
    its last view shown as if live."""
    source = FakeSource(make_snapshot())

    async def scenario():
        app = _app(source)
        async with app.run_test(size=(80, 24)) as pilot:
            await _until(pilot, lambda: app.feed.snapshot is not None)
            source.broken = ValueError("a bug in the source")
            await _until(pilot, lambda: "LOST" in screen_text(app))
            assert "ValueError: a bug in the source" in screen_text(app)
            fetches, source.broken = source.fetches, None
            await _until(pilot, lambda: app.feed.error is None and source.fetches > fetches)

    _run(scenario())


def test_a_node_that_never_answered_says_so():
    source = FakeSource(make_snapshot(), label="127.0.0.1:9")
    source.fail = "no answer from http://127.0.0.1:9 (Connection refused); is the node running?"

    async def scenario():
        app = _app(source)
        async with app.run_test(size=(80, 24)) as pilot:
            await _until(pilot, lambda: "LOST" in screen_text(app))
            assert "127.0.0.1:9" in screen_text(app)

    _run(scenario())


def test_the_peer_table_of_a_large_swarm_keeps_its_cursor_on_its_peer_and_shows_the_peers_heard_from_last():
    """The table is redrawn three times a second: a user scrolling a public swarm's peers must stay where they are,
    on the same peer when one joins above it; it lists the PEER_ROWS peers heard from most recently, and says how
    many more there are."""
    base = make_snapshot()
    source = FakeSource(crowded(base, 300))

    async def scenario():
        app = _app(source)
        async with app.run_test(size=(100, 40)) as pilot:
            await _until(pilot, lambda: app.feed.snapshot is not None)
            table = app.query_one("#peers", DataTable)
            await _until(pilot, lambda: table.row_count == PEER_ROWS)
            assert "and 200 more peers, heard from less recently" in screen_text(app)
            assert str(table.get_row_at(0)[0]) == "● peer-000" and str(table.get_row_at(PEER_ROWS - 1)[0]) == "○ peer-099"
            table.focus()
            for _ in range(40):
                await pilot.press("down")
            assert table.cursor_row == 40 and table.scroll_y > 0
            scrolled = table.scroll_y
            source.snapshots = [replace(crowded(base, 300), time=base.time + 5)]  # every "last seen" changes
            fetches = source.fetches
            await _until(pilot, lambda: source.fetches > fetches + 2)
            assert str(table.get_row_at(40)[1]) == "1m25s ago"  # refreshed in place
            assert (table.cursor_row, table.scroll_y) == (40, scrolled)

            source.snapshots = [crowded(base, 300, newcomer=True)]  # sorts first: every row moves down one
            await _until(pilot, lambda: str(table.get_row_at(0)[0]) == "● aaa-newcomer")
            assert table.cursor_row == 41 and str(table.get_row_at(41)[0]) == "● peer-040"
            assert table.row_count == PEER_ROWS and "and 201 more peers" in screen_text(app)

    _run(scenario())


def test_n_switches_between_local_nodes_and_names_peers_by_their_node_names():
    first = make_snapshot()
    second = make_snapshot(name="node-1", peer_id="hs0123456789abcdef")  # is PEER_A of the first node
    sources = [FakeSource(first, label="a"), FakeSource(second, label="b")]

    async def scenario():
        app = _app(*sources)
        async with app.run_test(size=(100, 30)) as pilot:
            await _until(pilot, lambda: "[node-0]" in screen_text(app) and "n next node" in screen_text(app))
            text = screen_text(app)
            assert "[node-0]" in text and " node-1 " in text and "n next node" in text
            assert "node-1" in text.split("peer")[1]  # PEER_A shown by its local node name
            await pilot.press("n")
            assert app.current == 1
            await _until(pilot, lambda: "[node-1]" in screen_text(app))
            await pilot.press("n")
            assert app.current == 0

    _run(scenario())


def test_a_local_node_named_like_markup_is_shown_by_its_name_in_the_training_table():
    """Another node's name labels its row of the sources table (a DataTable, which reads a plain string as markup):
    a name with '[/' in it had ended the dashboard with a MarkupError."""
    first = make_snapshot()
    second = make_snapshot(name="rig[/1]", peer_id="hs0123456789abcdef")  # PEER_A: a source of the first node's step
    sources = [FakeSource(first, label="a"), FakeSource(second, label="b")]

    async def scenario():
        app = _app(*sources, initial_panel="training")
        async with app.run_test(size=(100, 30)) as pilot:
            await _until(pilot, lambda: all(feed.snapshot is not None for feed in app.feeds))
            await _until(pilot, lambda: "rig[/1]" in screen_text(app).split("source", 1)[-1])

    _run(scenario())


@pytest.mark.parametrize(("panel", "size", "keys"), [
    ("swarm", (80, 24), ()),
    ("throughput", (80, 24), ()),
    ("training", (80, 24), ()),
    ("sync", (80, 24), ()),
    ("swarm", (80, 24), ("l",)),
    ("swarm", (120, 36), ()),
])
def test_screens_match_their_snapshots(panel, size, keys):
    """Whole-screen text against tests/dashboard/snapshots/ (HIVESPEC_UPDATE_SNAPSHOTS=1 rewrites them)."""
    snapshot = replace(make_snapshot(), logs=make_snapshot().logs)

    async def scenario() -> str:
        app = _app(FakeSource(snapshot), initial_panel=panel)
        async with app.run_test(size=size) as pilot:
            await _until(pilot, lambda: "quit" in screen_text(app).splitlines()[-1] and "node-0" in screen_text(app))
            for key in keys:
                await pilot.press(key)
            await pilot.pause(0.3)
            return screen_text(app)

    text = asyncio.run(scenario())
    name = f"{panel}-{size[0]}x{size[1]}{''.join('-' + k for k in keys)}.txt"
    path = SNAPSHOTS / name
    if UPDATE or not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; inspect and rerun with HIVESPEC_UPDATE_SNAPSHOTS=1"
    lines = text.splitlines()
    assert len(lines) == size[1] and all(len(line) <= size[0] for line in lines)


def test_the_training_panel_draws_the_held_out_curve_when_the_node_scores_itself():
    """A node with eval.every_rounds: a third plot and the last figure in the summary (snapshot: training-heldout-100x30.txt)."""
    from hivespec.protocol.status import HeldoutPoint

    snapshot = replace(make_snapshot(), heldout=[HeldoutPoint(round=r, accuracy=a) for r, a in ((1, 0.25), (3, 0.375), (5, 0.5))])

    async def scenario() -> str:
        app = _app(FakeSource(snapshot), initial_panel="training")
        async with app.run_test(size=(100, 30)) as pilot:
            await _until(pilot, lambda: "held-out 0.50 after round 5" in screen_text(app))
            await pilot.pause(0.3)
            return screen_text(app)

    text = asyncio.run(scenario())
    assert "held-out accuracy" in text
    path = SNAPSHOTS / "training-heldout-100x30.txt"
    if UPDATE or not path.exists():
        path.write_text(text)
    assert text == path.read_text(), f"{path.name} changed; inspect and rerun with HIVESPEC_UPDATE_SNAPSHOTS=1"


def test_the_sync_panel_says_when_peers_run_another_hivespec_version():
    """Their index records are refused (another swarm protocol): the node shares nothing with them, and says so."""
    base = make_snapshot()
    counters = {**base.gossip.counters, "peers_older_protocol": 3, "peers_newer_protocol": 1}
    snapshot = replace(base, gossip=replace(base.gossip, counters=counters))

    async def scenario() -> tuple[str, str]:
        app = _app(FakeSource(snapshot), initial_panel="sync")
        async with app.run_test(size=(80, 24)) as pilot:
            await _until(pilot, lambda: "other hivespec versions" in screen_text(app))
            shown = screen_text(app)
        app = _app(FakeSource(base), initial_panel="sync")
        async with app.run_test(size=(80, 24)) as pilot:
            await _until(pilot, lambda: "checkpoint" in screen_text(app))
            return shown, screen_text(app)

    shown, plain = asyncio.run(scenario())
    assert "other hivespec versions: 3 older, 1 newer peers (no sharing)" in shown
    assert "other hivespec versions" not in plain


def test_the_sync_panel_says_when_the_node_trains_in_smaller_micro_batches_to_fit_the_memory():
    base = make_snapshot()
    snapshot = replace(base, supervision=replace(base.supervision, micro_batch_size=3, micro_batch_wanted=8))

    async def scenario() -> str:
        app = _app(FakeSource(snapshot), initial_panel="sync")
        async with app.run_test(size=(100, 30)) as pilot:
            await _until(pilot, lambda: "micro batches" in screen_text(app))
            return screen_text(app)

    assert "micro batches of 3 samples, not 8, to fit the memory" in asyncio.run(scenario())
