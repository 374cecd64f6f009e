"""A line plot over rounds drawn with braille dots (2 x 4 per cell), one or more series.

`braille_canvas` is the pure part (values -> rows of braille characters and the series that
owns each cell); `LinePlot` is the widget: a title, y-axis labels at the top and bottom, the
canvas, and the first and last round under it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text
from textual.widget import Widget

from .view import DASH

_BRAILLE = 0x2800
# Dot bits by (column, row) inside one cell.
_DOT = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
_LABEL_WIDTH = 7


@dataclass(frozen=True)
class Series:
    name: str
    values: Sequence[float | None]
    style: str


def value_range(series: Sequence[Series]) -> tuple[float, float] | None:
    """(low, high) over every finite value, widened when flat; None when there is nothing to plot."""
    values = [v for s in series for v in s.values if v is not None and math.isfinite(v)]
    if not values:
        return None
    low, high = min(values), max(values)
    if high - low < 1e-9:
        pad = abs(high) * 0.1 or 0.5
        low, high = low - pad, high + pad
    return low, high


def braille_canvas(
    series: Sequence[Series], width: int, height: int, low: float, high: float
) -> list[list[tuple[str, int | None]]]:
    """Rows x cells of (character, index of the series drawn in that cell or None).

    Points are spread evenly over the width (the first at the left edge, the last at the right)
    and joined by straight segments; ``None`` values leave a gap.
    """
    dots_x, dots_y = width * 2, height * 4
    bits = [[0] * width for _ in range(height)]
    owner: list[list[int | None]] = [[None] * width for _ in range(height)]

    def plot(x: int, y: int, index: int) -> None:
        if 0 <= x < dots_x and 0 <= y < dots_y:
            row, col = y // 4, x // 2
            bits[row][col] |= _DOT[x % 2][y % 4]
            if owner[row][col] is None:
                owner[row][col] = index

    for index, s in enumerate(series):
        n = len(s.values)
        previous: tuple[int, int] | None = None
        for i, value in enumerate(s.values):
            if value is None or not math.isfinite(value):
                previous = None
                continue
            x = round(i * (dots_x - 1) / (n - 1)) if n > 1 else dots_x // 2
            y = dots_y - 1 - round((value - low) / (high - low) * (dots_y - 1))
            if previous is None:
                plot(x, y, index)
            else:
                for px, py in _segment(previous, (x, y)):
                    plot(px, py, index)
            previous = (x, y)
    return [[(chr(_BRAILLE + bits[r][c]), owner[r][c]) for c in range(width)] for r in range(height)]


def _segment(a: tuple[int, int], b: tuple[int, int]) -> list[tuple[int, int]]:
    """Integer points from a to b (Bresenham)."""
    (x0, y0), (x1, y1) = a, b
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
    err = dx + dy
    points = []
    while True:
        points.append((x0, y0))
        if (x0, y0) == (x1, y1):
            return points
        e2 = 2 * err
        if e2 >= dy:
            err += dy
            x0 += sx
        if e2 <= dx:
            err += dx
            y0 += sy


def _label(value: float) -> str:
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:.2e}"
    return text[: _LABEL_WIDTH - 1].rjust(_LABEL_WIDTH - 1)


class LinePlot(Widget):
    """A titled braille line plot of per-round series (call `set_series`)."""

    DEFAULT_CSS = "LinePlot { height: 1fr; min-height: 5; }"

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.title = title
        self._series: list[Series] = []
        self._rounds: tuple[int, int] | None = None

    def set_series(self, series: Sequence[Series], rounds: tuple[int, int] | None) -> None:
        """Replace the data; ``rounds`` is (first, last) round number under the x axis."""
        self._series = list(series)
        self._rounds = rounds
        self.refresh()

    def render(self) -> Text:
        width, height = self.size.width, self.size.height
        text = Text(no_wrap=True, overflow="crop")
        text.append(self.title, style="bold")
        for s in self._series:
            last = next((v for v in reversed(s.values) if v is not None), None)
            text.append("  ")
            text.append(f"{s.name} {DASH if last is None else f'{last:.3g}'}", style=s.style)
        plot_w, plot_h = max(1, width - _LABEL_WIDTH), max(1, height - 2)
        bounds = value_range(self._series)
        if bounds is None:
            text.append("\n" + "no rounds yet".center(width), style="dim")
            return text
        low, high = bounds
        canvas = braille_canvas(self._series, plot_w, plot_h, low, high)
        for r, row in enumerate(canvas):
            text.append("\n")
            label = _label(high) if r == 0 else _label(low) if r == plot_h - 1 else " " * (_LABEL_WIDTH - 1)
            text.append(label + ("┤" if r in (0, plot_h - 1) else "│"), style="dim")
            for char, owner in row:
                text.append(char, style=self._series[owner].style if owner is not None else "")
        if self._rounds is not None:
            first, last = self._rounds
            left, right = f"round {first}", f"{last}"
            gap = max(1, plot_w - len(left) - len(right))
            text.append("\n" + " " * _LABEL_WIDTH + left + " " * gap + right, style="dim")
        return text
