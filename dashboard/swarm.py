"""Panel 1, swarm: the four health answers and one row per peer."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Static

from hivespec.protocol.status import StatusSnapshot

from .header import LEVEL_STYLE
from .plot import LinePlot, Series
from .view import DASH, fmt, fmt_ago, fmt_int, health, is_active, peer_label

PEER_COLUMNS = ("peer", "last seen", "rtt", "batches", "accepted", "rej/ign", "score")


class SwarmPanel(Vertical):
    """How many peers, rollouts in and out, speculation, reward trend; then the peer table
    (green dot: sent rollouts recently; rej/ign: batches rejected as wrong / ignored as stale or duplicate)."""

    DEFAULT_CSS = """
    SwarmPanel #health { height: auto; margin-bottom: 1; }
    SwarmPanel DataTable { height: auto; max-height: 50%; }
    SwarmPanel > Horizontal { height: 1fr; min-height: 5; margin-top: 1; }
    SwarmPanel LinePlot { width: 1fr; margin-right: 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="health")
        table: DataTable = DataTable(id="peers", cursor_type="row", zebra_stripes=True)
        table.add_columns(*PEER_COLUMNS)
        yield table
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
        table = self.query_one("#peers", DataTable)
        table.clear()
        for peer in sorted(snapshot.peers, key=lambda p: peer_label(p, names)):
            active = is_active(snapshot, peer)
            seen = snapshot.time - peer.last_seen if peer.last_seen is not None else None
            table.add_row(
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
                key=peer.peer_id,
            )
