"""Panel 2, throughput: per-round sparklines with the latest value beside each."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline

from hivespec.protocol.status import RoundPoint, StatusSnapshot

from .view import DASH, fmt, fmt_bytes

# (id, label, value of a round, format of the latest value)
METRICS: tuple[tuple[str, str, Callable[[RoundPoint], float | None], Callable[[float | None], str]], ...] = (
    ("tokens", "tokens/s", lambda r: r.tokens_per_second, lambda v: fmt(v, ".1f")),
    ("rollouts", "rollouts/min", lambda r: r.rollouts_per_minute, lambda v: fmt(v, ".1f")),
    ("tpf", "tokens/target fwd", lambda r: r.tokens_per_target_forward, lambda v: fmt(v, ".2f")),
    ("gossip-in", "gossip in/round", lambda r: float(r.gossip_bytes_in), fmt_bytes),
    ("gossip-out", "gossip out/round", lambda r: float(r.gossip_bytes_out), fmt_bytes),
)


class ThroughputPanel(Vertical):
    """Tokens/s, rollouts/min, tokens per target forward, gossip bytes in and out, over rounds."""

    DEFAULT_CSS = """
    ThroughputPanel > Horizontal { height: 2; margin-bottom: 1; }
    ThroughputPanel .name { width: 18; padding: 1 1 0 0; text-style: bold; }
    ThroughputPanel Sparkline { width: 1fr; height: 2; }
    ThroughputPanel .value { width: 12; padding: 1 0 0 1; }
    ThroughputPanel #note { height: auto; color: $text-muted; }
    """

    def compose(self) -> ComposeResult:
        for key, name, _, _ in METRICS:
            with Horizontal(id=f"row-{key}"):
                yield Label(name, classes="name")
                yield Sparkline([], id=f"spark-{key}")
                yield Label(DASH, id=f"value-{key}", classes="value")
        yield Label("", id="note")

    def show(self, snapshot: StatusSnapshot) -> None:
        rounds: Sequence[RoundPoint] = snapshot.rounds
        for key, _, value_of, format_value in METRICS:
            values = [v for v in (value_of(r) for r in rounds) if v is not None]
            self.query_one(f"#spark-{key}", Sparkline).data = values
            latest = values[-1] if values else None
            shown = format_value(latest)
            if key == "tpf" and latest is None:
                shown = "not reported"
            self.query_one(f"#value-{key}", Label).update(shown)
        span = f"rounds {rounds[0].round}-{rounds[-1].round}" if rounds else "no rounds yet"
        self.query_one("#note", Label).update(
            f"one bar per round ({span}); tokens/target fwd > 1 means speculative decoding saves target passes"
        )
