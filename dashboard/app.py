"""The hivespec dashboard: a Textual app that polls status snapshots from one or more nodes.

Polling never blocks the UI: every fetch runs in a thread worker (at most one in flight per
node) and hands its result back with ``call_from_thread``. A node that stops answering is shown
as LOST with the reason, its last snapshot stays on screen, and polling goes on, so the view
recovers by itself when the node is back. With several sources (the demo's local nodes) ``n``
switches between them; the others are polled slowly so the header can show them all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, TabbedContent, TabPane

from hivespec.protocol.status import StatusSnapshot

from .header import StatusHeader
from .help import HelpScreen
from .log import LogPanel
from .source import SnapshotSource, SourceError
from .swarm import SwarmPanel
from .sync import SyncPanel
from .throughput import ThroughputPanel
from .training import TrainingPanel
from .view import fmt_duration

PANELS = ("swarm", "throughput", "training", "sync")
DEFAULT_POLL_S = 0.33  # ~3 Hz
SCREENSHOT_TIMEOUT_S = 15.0  # --screenshot: how long a headless run waits for every node's first snapshot
BACKGROUND_EVERY = 6  # other nodes of a demo: every 6th tick (~0.5 Hz)


@dataclass
class NodeFeed:
    """What the app knows about one source."""

    source: SnapshotSource
    snapshot: StatusSnapshot | None = None
    error: str | None = None
    failing_since: float | None = None
    fetching: bool = False
    fetches: int = 0


class DashboardApp(App[None]):
    """Header, four panels (tabs), a log drawer and the footer; see `HelpScreen` for the keys."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "hivespec"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("q", "quit", "quit"),
        Binding("p", "toggle_pause", "pause/resume"),
        Binding("tab", "next_panel", "panels", key_display="tab/1-4", priority=True),
        Binding("1", "panel(0)", "swarm", show=False),
        Binding("2", "panel(1)", "throughput", show=False),
        Binding("3", "panel(2)", "training", show=False),
        Binding("4", "panel(3)", "sync", show=False),
        Binding("l", "toggle_log", "log"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("n", "next_node", "next node"),
    ]

    def __init__(
        self,
        sources: Sequence[SnapshotSource],
        *,
        poll_interval: float = DEFAULT_POLL_S,
        clock: Callable[[], float] = time.monotonic,
        screenshot: Path | None = None,
        screenshot_after: float = 1.0,
        screenshot_timeout: float = SCREENSHOT_TIMEOUT_S,
        initial_panel: str = "swarm",
    ) -> None:
        super().__init__()
        if not sources:
            raise ValueError("DashboardApp needs at least one snapshot source")
        if initial_panel not in PANELS:
            raise ValueError(f"initial_panel must be one of {PANELS}, got {initial_panel!r}")
        self.feeds = [NodeFeed(source) for source in sources]
        self.current = 0
        self.poll_interval = poll_interval
        self.clock = clock
        self.screenshot = screenshot
        self.screenshot_after = screenshot_after
        self.screenshot_timeout = screenshot_timeout
        self.initial_panel = initial_panel
        self.names: dict[str, str] = {}  # peer id -> a local node's configured name (demo)
        self._ticks = 0
        self._screenshot_due: float | None = None

    # ----- layout ------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield StatusHeader(id="header")
        with TabbedContent(initial=self.initial_panel, id="panels"):
            with TabPane("1 swarm", id="swarm"):
                yield SwarmPanel()
            with TabPane("2 throughput", id="throughput"):
                yield ThroughputPanel()
            with TabPane("3 training", id="training"):
                yield TrainingPanel()
            with TabPane("4 sync", id="sync"):
                yield SyncPanel()
        yield LogPanel(id="log")
        yield Footer()

    def on_mount(self) -> None:
        self._redraw()
        self._tick()
        self.set_interval(self.poll_interval, self._tick)
        if self.screenshot is not None:  # a node that never answers must not keep a headless run alive
            self.set_timer(self.screenshot_timeout + self.screenshot_after, self._give_up_screenshot)

    def _give_up_screenshot(self) -> None:
        """No snapshot from every node in time: exit without a screenshot (the caller says so)."""
        if self._screenshot_due is None:
            self.exit()

    @property
    def feed(self) -> NodeFeed:
        return self.feeds[self.current]

    # ----- polling -----------------------------------------------------------------------

    def _tick(self) -> None:
        self._ticks += 1
        for index, feed in enumerate(self.feeds):
            due = index == self.current or self._ticks % BACKGROUND_EVERY == 0 or feed.fetches == 0
            if due and not feed.fetching:
                feed.fetching = True
                self.run_worker(lambda i=index: self._fetch(i), thread=True, group=f"fetch-{index}", exit_on_error=False)
        if self._screenshot_due is not None and self.clock() >= self._screenshot_due:
            self._screenshot_due = None
            self._save_screenshot_and_exit()

    def _fetch(self, index: int) -> None:
        """Thread worker: one blocking fetch, handed back to the event loop."""
        feed = self.feeds[index]
        result: StatusSnapshot | SourceError
        try:
            result = feed.source.fetch()
        except SourceError as exc:
            result = exc
        except Exception as exc:  # noqa: BLE001 - a fetch that raised anything else had left this node unpolled for good
            result = SourceError(f"{feed.source.label}: {type(exc).__name__}: {exc}")
        try:
            self.call_from_thread(self._apply, index, result)
        except RuntimeError:  # the app is shutting down
            feed.fetching = False

    def _apply(self, index: int, result: StatusSnapshot | SourceError) -> None:
        feed = self.feeds[index]
        feed.fetching = False
        feed.fetches += 1
        if isinstance(result, SourceError):
            feed.error = str(result)
            if feed.failing_since is None:
                feed.failing_since = self.clock()
        else:
            feed.snapshot, feed.error, feed.failing_since = result, None, None
            self.names[result.node.peer_id] = result.node.name
            if self.screenshot is not None and self._screenshot_due is None and all(f.snapshot for f in self.feeds):
                self._screenshot_due = self.clock() + self.screenshot_after
        if index == self.current or len(self.feeds) > 1:
            self._redraw()

    # ----- drawing -----------------------------------------------------------------------

    def lost_reason(self) -> str | None:
        """Why the current node is shown as lost, or None while it answers."""
        feed = self.feed
        if feed.error is None:
            return None
        since = fmt_duration(self.clock() - feed.failing_since) if feed.failing_since is not None else "?"
        return f"for {since}: {feed.error}"

    def _redraw(self) -> None:
        feed = self.feed
        snapshot = feed.snapshot
        local_names = {f.snapshot.node.peer_id: f.snapshot.node.name for f in self.feeds if f.snapshot is not None}
        nodes = [(f.snapshot.node.name if f.snapshot else f.source.label, i == self.current) for i, f in enumerate(self.feeds)]
        self.query_one(StatusHeader).show(snapshot, label=feed.source.label, lost=self.lost_reason(), nodes=nodes)
        if snapshot is None:
            return
        names = {**self.names, **local_names}
        self.query_one(SwarmPanel).show(snapshot, names)
        self.query_one(ThroughputPanel).show(snapshot)
        self.query_one(TrainingPanel).show(snapshot, names)
        self.query_one(SyncPanel).show(snapshot)
        self.query_one(LogPanel).show(snapshot.logs, snapshot.time)

    # ----- actions -----------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "next_node":
            return len(self.feeds) > 1
        return True

    def action_panel(self, index: int) -> None:
        self.query_one(TabbedContent).active = PANELS[index]

    def action_next_panel(self) -> None:
        tabs = self.query_one(TabbedContent)
        tabs.active = PANELS[(PANELS.index(tabs.active) + 1) % len(PANELS)] if tabs.active in PANELS else PANELS[0]

    def action_toggle_log(self) -> None:
        self.query_one(LogPanel).toggle_class("-open")

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_next_node(self) -> None:
        self.current = (self.current + 1) % len(self.feeds)
        self._redraw()
        self._tick()

    def action_toggle_pause(self) -> None:
        feed = self.feed
        if feed.snapshot is None or feed.error is not None:
            self.notify("no node to pause: it does not answer", severity="warning")
            return
        paused = not feed.snapshot.node.paused
        name = feed.snapshot.node.name
        self.run_worker(lambda: self._send_pause(feed, name, paused), thread=True, group="control", exit_on_error=False)

    def _send_pause(self, feed: NodeFeed, name: str, paused: bool) -> None:
        try:
            feed.source.set_paused(paused)
        except SourceError as exc:
            self.call_from_thread(self.notify, str(exc), severity="error", markup=False)
            return
        message = f"{name}: training pauses after the current round" if paused else f"{name}: training resumed"
        self.call_from_thread(self.notify, message, markup=False)  # names and errors are not ours to write: no markup

    def _save_screenshot_and_exit(self) -> None:
        assert self.screenshot is not None
        self.screenshot.parent.mkdir(parents=True, exist_ok=True)
        self.save_screenshot(filename=self.screenshot.name, path=str(self.screenshot.parent))
        self.exit()
