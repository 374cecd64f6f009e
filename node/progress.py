"""What the round loop tells people and the watchdog: the phase it is in, progress within it, heartbeats.

`RoundProgress.phase` reports a new phase at once (``join --events`` writes it as a ``phase``
event; the demo prints it); `progress` reports within a phase at most every
`PROGRESS_EVERY_S`, and each call is a heartbeat of the loop's phase. The callbacks it makes for
decoding and training also check the stop switch, so a stop request ends the round at the next
decode step or micro-batch. Owns no state of the round itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hivespec.node.status.board import RunControl
    from hivespec.node.supervise import Watchdog

PROGRESS_EVERY_S = 5.0  # at most one progress report per phase this often (the demo prints every 10 s)

# What a node is doing, for people: (phase, detail), e.g. ("generating", "round 3: 812 tokens, 16 completions").
PhaseListener = Callable[[str, str], None]


class RoundProgress:
    """Phases and progress to `on_phase` (None: nobody listens), heartbeats to `watchdog` (None: unwatched)."""

    def __init__(self, control: RunControl, *, on_phase: PhaseListener | None = None, watchdog: Watchdog | None = None) -> None:
        self.control = control
        self.on_phase = on_phase
        self.watchdog = watchdog
        self._reported_at = 0.0
        self._beat_phase = ""  # the round loop's phase as last beaten (progress within it beats it again)

    def phase(self, phase: str, detail: str = "") -> None:
        """Tell `on_phase` what the node is doing now (loading, calibrating, generating, training, ...)."""
        self._reported_at = time.monotonic()
        if self.on_phase is not None:
            self.on_phase(phase, detail)

    def progress(self, phase: str, detail: str) -> None:
        """A progress report within a phase, at most every PROGRESS_EVERY_S; a heartbeat each time.

        Progress is what the watchdog waits for: a training step of many micro batches (a larger model on
        a slow CPU) may outlast supervise.stall_after, and was reported as a stall, stacks and all.
        """
        if self.watchdog is not None and self._beat_phase:
            self.watchdog.beat("round", self._beat_phase)
        if time.monotonic() - self._reported_at >= PROGRESS_EVERY_S:
            self.phase(phase, detail)

    def beat(self, phase: str) -> None:
        """The round loop is alive and in `phase` (a loop silent for too long is reported as stalled)."""
        self._beat_phase = phase
        if self.watchdog is not None:
            self.watchdog.beat("round", phase)

    def generating(self, round_index: int, total: int) -> Callable[[int], None]:
        """An engine's `on_tokens(added)` for round `round_index` of `total` completions: progress, and a stop check per step."""
        made = 0

        def on_tokens(added: int) -> None:
            nonlocal made
            made += added
            self.control.check(f"generating round {round_index}")
            self.progress("generating", f"round {round_index}: {made} tokens, {total} completions")

        return on_tokens

    def training(self, round_index: int) -> Callable[[int, int], None]:
        """A trainer's `between_micro_batches(done, total)`: progress, and a stop check before each micro-batch."""

        def between(done: int, total: int) -> None:
            self.control.check(f"training round {round_index}")
            self.progress("training", f"round {round_index}: micro-batch {done + 1}/{total}")

        return between
