"""transformers' progress bars (tqdm) where a node's output goes: a terminal shows them live, a log gets one line each.

`bars_fit_for_a_log` wraps work that draws bars worth seeing (dequantising the embedded GGUF, writing a model folder);
`no_loading_bar` drops the one that is not (a local folder loads in a fraction of a second).
"""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from typing import TextIO

from transformers.utils import logging as hf_logging


@contextmanager
def bars_fit_for_a_log() -> Iterator[None]:
    """transformers' progress bars (dequantising the GGUF's 272 tensors, writing the shards) as one line each where
    stderr is a file or a pipe: a terminal shows them live, a captured log got hundreds of frames on one line."""
    if sys.stderr is None or sys.stderr.isatty():
        yield
        return
    frames = _LastFrames(sys.stderr)
    try:
        with redirect_stderr(frames):  # tqdm takes sys.stderr when a bar starts
            yield
    finally:
        frames.end_line()


class _LastFrames(io.TextIOBase):
    """A text stream that passes lines on, and of a line redrawn after carriage returns (a progress bar) its last frame."""

    def __init__(self, target: TextIO) -> None:
        self._target = target
        self._frame = ""  # what was written since the last carriage return or newline
        self._last = ""  # the line's last frame with text in it (a bar may clear itself before its newline)

    @property
    def encoding(self) -> str | None:  # tqdm draws its bar in Unicode where the target's encoding allows it
        return getattr(self._target, "encoding", None)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        for piece in re.split(r"([\r\n])", text):
            if piece == "\n":
                self._target.write(self._line() + "\n")
                self._frame = self._last = ""
            elif piece == "\r":
                self._last = self._line()
                self._frame = ""
            else:
                self._frame += piece
        return len(text)

    def end_line(self) -> None:
        """End a line left open (a bar's last frame, text without its newline) and flush."""
        if pending := self._line():
            self._target.write(pending + "\n")
        self._frame = self._last = ""
        self._target.flush()

    def _line(self) -> str:
        return self._frame if self._frame.strip() else self._last

    def flush(self) -> None:
        self._target.flush()


@contextmanager
def no_loading_bar() -> Iterator[None]:
    """Without transformers' per-tensor "Loading weights" bar: a local folder loads in a fraction of a second, and the bar
    only wrote a line of carriage returns into every node's log ahead of the node's own "loaded model" line."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
