"""argparse types for the command line's number flags: a bad value is a usage error (one line, exit 2) at parse time.

A number no command can use (below its bound, not a number, or infinite) never reaches the
code that would fail on it later, minutes in or with a traceback.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

MAX_WAIT_S = 1e9  # about 31 years: past this, time.sleep overflows on some platforms; use -1 to wait until stopped


def number(kind: type, *, low: float, strict: bool = False, meaning: str = "") -> Callable[[str], float]:
    """An argparse type: a finite ``kind(text)`` that must be >= low (> low when ``strict``); the error names the bound."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}{meaning}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def seconds_or_forever(text: str) -> float:
    """An argparse type for a wait: -1 (until stopped) or a finite number of seconds >= 0 (``inf`` overflows sleep)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if value != -1 and not (math.isfinite(value) and 0 <= value <= MAX_WAIT_S):
        raise argparse.ArgumentTypeError(f"must be -1 (until stopped) or seconds from 0 to {MAX_WAIT_S:g}, got {text}")
    return value


seconds_or_forever.__name__ = "float"  # argparse names the type in its messages
