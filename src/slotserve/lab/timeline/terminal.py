"""The slot strip (and optionally the Gantt) as terminal text, with ANSI colours."""

from __future__ import annotations

import numpy as np

from slotserve.lab.timeline.colours import SHADES, color_numbers
from slotserve.lab.timeline.grid import (
    DECODE,
    IDLE,
    PREFILL,
    STALLED,
    WAITING,
    Grid,
    build_grid,
    gantt,
)
from slotserve.lab.timeline.text import describe, tick_step, title

_RESET = "\x1b[0m"
_BLANK = -1  # terminal Gantt: the request is not alive in this column
_BARS = " ▁▂▃▄▅▆▇█"
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def render_terminal(trace: dict, color: bool = True, start: int | None = None,
                    end: int | None = None, gantt_rows: bool = False) -> str:
    """The slot strip as text: one character per slot-iteration, a row per slot.

    Request k of the window is the letter L (A, B, ... repeating after Z): `L` decode,
    `l` prefill, `!` stalled, `·` idle; the legend maps letters to ids. Under the strip,
    the utilisation of each iteration as a bar character and the overall figure. With
    `gantt_rows`, a row per request too (`-` waiting). ANSI colors unless `color=False`.
    """
    grid = build_grid(trace, start, end)
    head = f"{title(trace)} · {describe(grid)}"
    if grid.num_columns == 0:
        return f"{head}\n(no iterations in this window)\n"
    numbers, codes = gantt(grid)
    letters = {int(n): _LETTERS[i % len(_LETTERS)] for i, n in enumerate(numbers)}
    paint = _TerminalPaint(color, color_numbers(grid)[0], letters)
    names = [f"slot {s}" for s in range(grid.num_slots)]
    gantt_names = [grid.ids[n][:12] for n in numbers] if gantt_rows else []
    width = max(len(x) for x in ["iteration", "util", *names, *gantt_names])
    lines = [head, f"{'iteration':<{width}} │{_tick_line(grid.index)}│"]
    for s, name in enumerate(names):
        row = paint.row(grid.request[s], grid.kind[s])
        lines.append(f"{name:<{width}} │{row}│")
    lines.append(f"{'util':<{width}} │{_util_bars(grid)}│ {grid.utilisation():.0%}")
    for name, number, row_codes in zip(gantt_names, numbers, codes):
        shown = np.where(row_codes == IDLE, _BLANK, row_codes)  # not alive: blank
        row = paint.row(np.full(row_codes.shape, number), shown)
        lines.append(f"{name:<{width}} │{row}│")
    lines.extend(paint.legend(grid.ids))
    return "\n".join(lines) + "\n"


def _tick_line(index: np.ndarray) -> str:
    """Iteration numbers placed over their columns, as many as fit."""
    chars = [" "] * len(index)
    step = tick_step(len(index), max(1, len(index) // 3))
    free_from = 0
    for col, value in enumerate(index.tolist()):
        label = str(value)
        wanted = col == 0 or value % step == 0  # the window's first column, then multiples
        if wanted and col >= free_from and col + len(label) <= len(chars):
            chars[col:col + len(label)] = label
            free_from = col + len(label) + 1
    return "".join(chars)


def _util_bars(grid: Grid) -> str:
    levels = np.rint(grid.busy() / grid.num_slots * 8).astype(int)
    return "".join(_BARS[level] for level in levels.tolist())


class _TerminalPaint:
    """Characters and ANSI styles for (request, kind) cells."""

    def __init__(self, color: bool, colors: np.ndarray, letters: dict[int, str]):
        self.color, self.colors, self.letters = color, colors, letters
        self._styles: dict[tuple[int, int], tuple[str, str]] = {}

    def cell(self, number: int, kind: int) -> tuple[str, str]:
        """(style, character) of one cell, memoised."""
        key = (number, kind)
        if key not in self._styles:
            self._styles[key] = (self._style(number, kind), self._char(number, kind))
        return self._styles[key]

    def _char(self, number: int, kind: int) -> str:
        letter = self.letters.get(number, "?")
        return {_BLANK: " ", IDLE: "·", PREFILL: letter.lower(), DECODE: letter,
                STALLED: "!", WAITING: "-"}[kind]

    def _style(self, number: int, kind: int) -> str:
        if not self.color or kind == _BLANK:
            return ""
        if kind == IDLE or number < 0:
            return "\x1b[38;5;250m"
        shade = SHADES[self.colors[number], kind]
        if kind == WAITING:
            return f"\x1b[38;5;{_xterm256(SHADES[self.colors[number], DECODE])}m"
        text = 97 if kind == STALLED else 30
        return f"\x1b[{text};48;5;{_xterm256(shade)}m"

    def row(self, requests: np.ndarray, kinds: np.ndarray) -> str:
        out, current = [], ""
        for number, kind in zip(requests.tolist(), kinds.tolist()):
            style, char = self.cell(number if kind != IDLE else -1, kind)
            if style != current:
                out.append(_RESET + style if current else style)
                current = style
            out.append(char)
        if current:
            out.append(_RESET)
        return "".join(out)

    def legend(self, ids: list[str]) -> list[str]:
        pairs = [f"{self._paint(n, DECODE)}={ids[n]}" for n in self.letters]
        lines = ["  ".join(pairs[i:i + 10]) for i in range(0, len(pairs), 10)]
        example = next(iter(self.letters), None)
        if example is None:
            return ["· idle"]
        kinds = [(DECODE, "decode"), (PREFILL, "prefill"), (STALLED, "stalled"),
                 (IDLE, "idle"), (WAITING, "waiting")]
        lines.append("  ".join(f"{self._paint(example, k)} {name}" for k, name in kinds))
        return lines

    def _paint(self, number: int, kind: int) -> str:
        style, char = self.cell(number if kind != IDLE else -1, kind)
        return f"{style}{char}{_RESET}" if style else char


def _xterm256(rgb: np.ndarray) -> int:
    """Nearest color of the xterm 6x6x6 cube."""
    levels = np.array([0, 95, 135, 175, 215, 255]) / 255
    r, g, b = (int(np.abs(levels - v).argmin()) for v in rgb)
    return 16 + 36 * r + 6 * g + b
