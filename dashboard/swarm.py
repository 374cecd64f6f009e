"""Panel 1, swarm: the four health answers and one row per peer."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Static

from hivespec.protocol.status import PeerRow, StatusSnapshot

from .header import LEVEL_STYLE
from .plot import LinePlot, Series
from .view import DASH, fmt, fmt_ago, fmt_int, health, is_active, listed_peers, peer_label, unlisted_peers_line

PEER_COLUMNS = ("peer", "last seen", "rtt", "batches", "accepted", "rej/ign", "score")


class SwarmPanel(Vertical):
    """How many peers, rollouts in and out, speculation, reward trend; then the peer table
    (green dot: sent rollouts recently; rej/ign: batches rejected as wrong / ignored as stale or duplicate)."""

    DEFAULT_CSS = """
    SwarmPanel #health { height: auto; margin-bottom: 1; }
    SwarmPanel DataTable { height: auto; max-height: 50%; }
    SwarmPanel #peers-more { height: auto; color: $text-muted; }
    SwarmPanel > Horizontal { height: 1fr; min-height: 5; margin-top: 1; }
    SwarmPanel LinePlot { width: 1fr; margin-right: 1; }
    """

    def __init__(self) -> None:
        super().__init__()
        self._rows: dict[str, tuple[Text | str, ...]] = {}  # the peer table as shown: peer id -> its cells, in order

    def compose(self) -> ComposeResult:
        yield Static(id="health")
        table: DataTable = DataTable(id="peers", cursor_type="row", zebra_stripes=True)
        table.add_columns(*((column, column) for column in PEER_COLUMNS))  # each column keyed by its title
        yield table
        yield Static(id="peers-more")
        with Horizontal():
            yield LinePlot("reward", id="swarm-reward")
            yield LinePlot("rollouts/round", id="swarm-flow")

    def show(self, snapshot: StatusSnapshot, names: dict[str, str]) -> None:
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, answer in enumerate(health(snapshot)):
            if i:
                text.append("\n")
            text.append(f"{answer.label:>11} ", style="bold")
            text.append(answer.text, style=LEVEL_STYLE[answer.level] if answer.level != "good" else "green")
        self.query_one("#health", Static).update(text)
        rounds = snapshot.rounds
        span = (rounds[0].round, rounds[-1].round) if rounds else None
        self.query_one("#swarm-reward", LinePlot).set_series(
            [Series("own", [r.reward_mean for r in rounds], "green"),
             Series("peers'", [r.foreign_reward_mean for r in rounds], "cyan")],
            span,
        )
        self.query_one("#swarm-flow", LinePlot).set_series(
            [Series("made", [float(r.made) for r in rounds], "magenta"),
             Series("in", [float(r.accepted) for r in rounds], "cyan")],
            span,
        )
        self._show_peers(snapshot, names)

    def _show_peers(self, snapshot: StatusSnapshot, names: dict[str, str]) -> None:
        """The peer table (`listed_peers`: at most `PEER_ROWS`, the peers heard from last). Rows change in place, so the
        cursor and the scroll stay where the user put them (the panel is redrawn three times a second); where peers
        come, go or change places the table is rebuilt with the cursor on its peer. Rebuilt every time, 1024 rows kept
        the event loop 0.2 s a redraw, and the cursor went back to the top."""
        table = self.query_one("#peers", DataTable)
        peers = listed_peers(snapshot, names)
        rows = {peer.peer_id: _peer_cells(snapshot, peer, names) for peer in peers}
        more = self.query_one("#peers-more", Static)
        more.update(unlisted_peers_line(snapshot, peers))
        more.display = len(peers) < len(snapshot.peers)
        if list(rows) == list(self._rows):
            for peer_id, cells in rows.items():
                for column, cell, before in zip(PEER_COLUMNS, cells, self._rows[peer_id], strict=True):
                    if cell != before:
                        table.update_cell(peer_id, column, cell)
        else:
            order = list(self._rows)
            selected = order[table.cursor_row] if 0 <= table.cursor_row < len(order) else None
            scrolled = table.scroll_y
            table.clear()
            for peer_id, cells in rows.items():
                table.add_row(*cells, key=peer_id)
            if selected in rows:
                table.move_cursor(row=table.get_row_index(selected), scroll=False)
            table.scroll_to(y=scrolled, animate=False, immediate=True)
        self._rows = rows


def _peer_cells(snapshot: StatusSnapshot, peer: PeerRow, names: dict[str, str]) -> tuple[Text | str, ...]:
    active = is_active(snapshot, peer)
    seen = snapshot.time - peer.last_seen if peer.last_seen is not None else None
    return (
        Text.assemble(
            ("● " if active else "○ ", "green" if active else "yellow"),
            (peer_label(peer, names)[:18], "bold red strike" if peer.graylisted else "bold" if active else "dim"),
        ),
        fmt_ago(seen),
        DASH if peer.latency_ms is None else f"{peer.latency_ms:.0f}ms",
        fmt_int(peer.batches),
        fmt_int(peer.accepted),
        Text(f"{peer.rejected}/{peer.ignored}", style="bold red" if peer.rejected else ""),
        fmt(peer.score, ".2f"),
    )
