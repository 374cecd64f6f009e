"""Panel 3, training: reward and loss over rounds, the held-out curve (eval.every_rounds), and the last step's importance-weight statistics."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Static

from hivespec.protocol.status import StatusSnapshot

from .plot import LinePlot, Series
from .view import fmt, fmt_int, fmt_percent, short_id

SOURCE_COLUMNS = ("source", "samples", "kept", "truncated", "masked", "ESS", "mean w", "max w")


class TrainingPanel(Vertical):
    """Reward (own and peers') and loss plots; per-source TIS stats; foreign share."""

    DEFAULT_CSS = """
    TrainingPanel > Horizontal { height: 1fr; min-height: 6; }
    TrainingPanel LinePlot { width: 1fr; margin-right: 1; }
    TrainingPanel #trainer-summary { height: 1; }
    TrainingPanel DataTable { height: auto; max-height: 7; }
    """

    def compose(self) -> ComposeResult:
        with Horizontal():
            yield LinePlot("reward", id="reward-plot")
            yield LinePlot("loss", id="loss-plot")
            yield LinePlot("held-out accuracy", id="heldout-plot")  # shown once the node has scored itself
        yield Static(id="trainer-summary")
        table: DataTable = DataTable(id="sources", cursor_type="none", show_cursor=False)
        table.add_columns(*SOURCE_COLUMNS)
        yield table

    def show(self, snapshot: StatusSnapshot, names: dict[str, str]) -> None:
        rounds = snapshot.rounds
        span = (rounds[0].round, rounds[-1].round) if rounds else None
        self.query_one("#reward-plot", LinePlot).set_series(
            [
                Series("own", [r.reward_mean for r in rounds], "green"),
                Series("peers'", [r.foreign_reward_mean for r in rounds], "cyan"),
            ],
            span,
        )
        self.query_one("#loss-plot", LinePlot).set_series([Series("loss", [r.loss for r in rounds], "yellow")], span)
        heldout = snapshot.heldout
        heldout_plot = self.query_one("#heldout-plot", LinePlot)
        heldout_plot.display = bool(heldout)
        if heldout:  # its own span: one point per scored round, every eval.every_rounds rounds
            heldout_plot.set_series([Series("greedy", [p.accuracy for p in heldout], "magenta")],
                                    (heldout[0].round, heldout[-1].round))
        trainer = snapshot.trainer
        summary = Text(no_wrap=True, overflow="ellipsis")
        summary.append("last step ", style="bold")
        summary.append(
            f"round {fmt_int(trainer.step_round)} | {trainer.trained_samples} samples, "
            f"foreign share {fmt_percent(trainer.foreign_share)} | loss {fmt(trainer.loss, '.4f')}"
        )
        if trainer.kl is not None:
            summary.append(f" | KL {trainer.kl:.4f}")
        if trainer.ppo_clip_fraction:
            summary.append(f" | PPO clipped {fmt_percent(trainer.ppo_clip_fraction, 1)}")
        if heldout:
            summary.append(f" | held-out {heldout[-1].accuracy:.2f} after round {heldout[-1].round}")
        self.query_one("#trainer-summary", Static).update(summary)
        table = self.query_one("#sources", DataTable)
        table.clear()
        for source in trainer.sources:
            name = names.get(source.source) or (short_id(source.source) if source.source.startswith("hs") else source.source)
            table.add_row(
                Text(name),  # a DataTable reads a plain string as markup, and names are the nodes' to choose
                fmt_int(source.samples),
                fmt_percent(source.kept_fraction, 1),
                fmt_percent(source.truncated_fraction, 1),
                fmt_percent(source.masked_fraction, 1),
                fmt_percent(source.ess_fraction, 0),
                fmt(source.mean_weight, ".3f"),
                fmt(source.max_weight, ".2f"),
            )
