"""The help screen (key ?): every key, and what each panel's numbers mean."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP_TEXT = """\
[b]Keys[/b]
  q        quit the dashboard (a node started with --dashboard stops after its round)
  p        pause / resume training (takes effect between rounds)
  tab, 1-4 switch panels: 1 swarm, 2 throughput, 3 training, 4 sync
  l        show / hide recent warnings and errors
  n        next local node (demo with several nodes)
  ?        this help (escape closes it)

[b]1 swarm[/b]  peers [i]connected[/i] sent us rollouts recently (a node fetches only what its
  pool has room for, so a quiet spell while steps train on pooled rollouts is fine). [i]rollouts in[/i] are peers'
  rollouts we accepted after checking signature, model and reward; [i]out[/i] are our batches
  peers fetched. [i]speculation pays[/i] when one forward of the target model yields more than
  one token. [i]reward rising[/i] is a least-squares fit over the last rounds.
  Per peer: batches received, rollouts accepted, batches rejected (provably wrong) or ignored
  (stale, duplicate, another model).
[b]2 throughput[/b]  one bar per round: tokens/s, rollouts/min, tokens per target forward,
  gossip bytes in and out.
[b]3 training[/b]  reward (own and peers') and loss per round; importance weights of the last
  step per source: kept / truncated / masked token shares, effective sample size (ESS),
  mean and max weight; foreign share = peers' samples in the step.
[b]4 sync[/b]  sparse weight delta size against a dense copy, share of weights changed, whether
  the engine matches the trainer bit for bit, versions behind (followers); intake, journal
  and gossip counters.
'-' means the node does not report that number.
"""


class HelpScreen(ModalScreen[None]):
    """Modal help; escape, q or ? closes it."""

    BINDINGS: ClassVar[list[tuple[str, str, str]]] = [("escape", "close", "close"), ("question_mark", "close", "close"), ("q", "close", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 92%; max-width: 100; height: 90%; border: round $accent; background: $surface; padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(HELP_TEXT, id="help-text")

    def action_close(self) -> None:
        self.dismiss(None)
