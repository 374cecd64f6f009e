"""bench/first_run.py's silence: a demo that prints nothing before it exits, or nothing at all, is measured too."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from first_run import longest_silence


def test_the_longest_silence_counts_the_quiet_before_the_demo_exits():
    # Lines at 5, 10 and 12 s, then 40 s of nothing before the exit at 52 s: the old figure was 5 s (between lines only).
    assert longest_silence([5.0, 10.0, 12.0], 52.0) == 40.0
    assert longest_silence([20.0, 22.0], 23.0) == 20.0  # the wait for the first line


def test_a_demo_that_printed_nothing_was_silent_all_along():
    assert longest_silence([], 31.5) == 31.5  # was max() of nothing: a ValueError instead of the RESULT line
