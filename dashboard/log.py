"""The log drawer (key l): the node's recent warnings and errors, newest last."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from hivespec.protocol.status import LogLine

from .view import fmt_ago

_LEVEL_STYLE = {"WARNING": "yellow", "ERROR": "bold red", "CRITICAL": "bold white on red"}


class LogPanel(Static):
    """Docked at the bottom, hidden until toggled; shows as many recent lines as fit."""

    DEFAULT_CSS = """
    LogPanel { dock: bottom; height: 8; border-top: solid $warning; padding: 0 1; display: none; }
    LogPanel.-open { display: block; }
    """

    def show(self, lines: list[LogLine], now: float) -> None:
        """``now`` is the snapshot's time: ages are shown relative to the node's clock."""
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append("recent warnings and errors", style="bold")
        if not lines:
            text.append("\nnone: the node has logged no warnings or errors", style="green")
        for line in lines[-6:]:
            text.append(f"\n{fmt_ago(now - line.time):>12} ")
            text.append(f"{line.level:<8}", style=_LEVEL_STYLE.get(line.level, ""))
            text.append(f"{line.logger.rsplit('.', 1)[-1]}: ", style="dim")
            text.append(line.message)
        self.update(text)
