"""Slot-strip charts of a trace, simulated or real: terminal text, HTML (inline SVG), PNG.

Two views of one trace (format in `slotserve.lab.simulate`):

- the seed's **slot strip**: a row per slot, a column per iteration, each cell colored by
  the request in it (decode solid, prefill lighter and hatched, stalled dark and crossed,
  idle grey), with the per-iteration utilisation line under it;
- a per-request **Gantt**: a row per request: waiting (arrived but holding no slot),
  prefill, decode and stalled spans.

Every renderer first turns the trace, or a window [start, end) of its iteration indices,
into a `Grid` of numpy arrays (one pass over the cells), so long engine traces draw fast.
A request keeps its color across the two traces of a comparison.
"""

from __future__ import annotations

import bisect
import html
import math
from dataclasses import dataclass

import numpy as np

from slotserve.lab.simulate import TRACE_VERSION

IDLE, PREFILL, DECODE, STALLED, WAITING = range(5)
KIND_NAMES = ("idle", "prefill", "decode", "stalled", "waiting")
_KIND_CODES = {"prefill": PREFILL, "decode": DECODE, "stalled": STALLED}

# Strong colors, no greys: grey means an idle slot.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#bcbd22", "#17becf", "#393b79", "#e7ba52", "#637939",
)
IDLE_COLOR = "#e6e6e6"
EMPTY_COLOR = "#ffffff"  # Gantt: the request is not alive in this iteration


# ---------------------------------------------------------------------------------------
# The trace as arrays
# ---------------------------------------------------------------------------------------


@dataclass
class Grid:
    """A window of a trace as arrays: cell (slot, column) -> request number and kind.

    Request numbers index `ids` (the trace's requests in order, then any id seen only in
    cells). Column j is iteration `index[j]`.
    """

    trace: dict
    ids: list[str]
    index: np.ndarray  # (n,) iteration index of each column
    request: np.ndarray  # (S, n) int32, request number or -1 when idle
    kind: np.ndarray  # (S, n) int8, IDLE | PREFILL | DECODE | STALLED
    total_iterations: int  # in the whole trace, not just the window

    @property
    def num_slots(self) -> int:
        return self.request.shape[0]

    @property
    def num_columns(self) -> int:
        return self.request.shape[1]

    def busy(self) -> np.ndarray:
        """(n,) slots doing work (prefill or decode) in each column."""
        return ((self.kind == PREFILL) | (self.kind == DECODE)).sum(axis=0)

    def utilisation(self) -> float:
        """Busy slot-iterations / (slots x iterations) over the window; 0.0 if empty."""
        capacity = self.num_slots * self.num_columns
        return float(self.busy().sum()) / capacity if capacity else 0.0

    def windowed(self) -> bool:
        return self.num_columns != self.total_iterations


def check_trace(trace: dict) -> None:
    """Raise ValueError unless `trace` looks like a version-1 trace with S cells a row."""
    if not isinstance(trace, dict):
        raise ValueError("trace must be a JSON object")
    if trace.get("version") != TRACE_VERSION:
        raise ValueError(f"version must be {TRACE_VERSION}, got {trace.get('version')!r}")
    slots = trace.get("num_slots")
    if not isinstance(slots, int) or slots < 1:
        raise ValueError(f"num_slots must be an integer >= 1, got {slots!r}")
    for key in ("requests", "iterations"):
        if not isinstance(trace.get(key), list):
            raise ValueError(f"{key} must be a list")
    bad = next((it for it in trace["iterations"] if len(it["slots"]) != slots), None)
    if bad is not None:
        raise ValueError(f"iteration {bad.get('index')} has {len(bad['slots'])} slots, "
                         f"expected num_slots={slots}")


def build_grid(trace: dict, start: int | None = None, end: int | None = None) -> Grid:
    """Arrays for the iterations whose index is in [start, end) (None: unbounded)."""
    check_trace(trace)
    iterations = _window(trace["iterations"], start, end)
    numbers = {record["id"]: i for i, record in enumerate(trace["requests"])}
    cells = [cell for it in iterations for cell in it["slots"]]
    request = np.array(
        [-1 if c is None else numbers.setdefault(c["request"], len(numbers)) for c in cells],
        dtype=np.int32,
    )
    try:
        kind = np.array([IDLE if c is None else _KIND_CODES[c["kind"]] for c in cells],
                        dtype=np.int8)
    except KeyError as err:
        raise ValueError(f"cell kind must be one of {tuple(_KIND_CODES)}, "
                         f"got {err.args[0]!r}") from None
    shape = (len(iterations), trace["num_slots"])  # cells are iteration-major
    return Grid(
        trace=trace,
        ids=list(numbers),
        index=np.array([it["index"] for it in iterations], dtype=np.int64),
        request=request.reshape(shape).T.copy(),
        kind=kind.reshape(shape).T.copy(),
        total_iterations=len(trace["iterations"]),
    )


def _window(iterations: list[dict], start: int | None, end: int | None) -> list[dict]:
    """The iterations with start <= index < end (indices are increasing)."""
    indices = [it["index"] for it in iterations]
    lo = 0 if start is None else bisect.bisect_left(indices, start)
    hi = len(indices) if end is None else bisect.bisect_left(indices, end)
    return iterations[lo:hi]


def gantt(grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """Per-request rows for the window: (request numbers (R,), codes (R, n)).

    A code is the request's kind in that column, WAITING when it has arrived and not
    finished but holds no slot (queued, or preempted), IDLE when it is not alive.
    Only requests alive somewhere in the window get a row, in trace order.
    """
    candidates = _alive_requests(grid)
    rows = np.full(len(grid.ids), -1, dtype=np.int64)
    rows[candidates] = np.arange(len(candidates))
    codes = np.zeros((len(candidates), grid.num_columns), dtype=np.int8)
    slot, col = np.nonzero(grid.request >= 0)
    codes[rows[grid.request[slot, col]], col] = grid.kind[slot, col]
    for row, number in enumerate(candidates):
        _mark_waiting(codes[row], grid, number)
    keep = codes.any(axis=1)
    return candidates[keep], codes[keep]


def _alive_requests(grid: Grid) -> np.ndarray:
    """Request numbers that run in the window or, by their record, wait in it."""
    running = set(np.unique(grid.request[grid.request >= 0]).tolist())
    if grid.num_columns:
        lo, hi = int(grid.index[0]), int(grid.index[-1])
        for number, record in enumerate(grid.trace["requests"]):
            span = _alive_span(record)
            if span is not None and span[0] <= hi and span[1] >= lo:
                running.add(number)
    return np.array(sorted(running), dtype=np.int64)


def _alive_span(record: dict) -> tuple[float, float] | None:
    """[arrival, finish] iterations of a request record (finish inf while unfinished)."""
    arrival = record.get("arrival_iteration")
    if arrival is None:
        arrival = record.get("first_iteration")
    if arrival is None:
        return None
    finish = record.get("finish_iteration")
    return arrival, math.inf if finish is None else finish


def _mark_waiting(row: np.ndarray, grid: Grid, number: int) -> None:
    """Set WAITING where the request is alive but holds no slot (in place)."""
    if number >= len(grid.trace["requests"]):
        return  # seen only in cells: no arrival known
    span = _alive_span(grid.trace["requests"][number])
    if span is None:
        return
    lo = np.searchsorted(grid.index, span[0], side="left")
    hi = np.searchsorted(grid.index, span[1], side="right")
    segment = row[lo:hi]
    segment[segment == IDLE] = WAITING


def _runs(codes: np.ndarray) -> tuple[np.ndarray, ...]:
    """Runs of equal non-IDLE codes in each row: (row, first column, length, code)."""
    rows, n = codes.shape
    padded = np.full((rows, n + 1), -1, dtype=np.int16)  # -1 column splits the rows
    padded[:, :n] = codes
    flat = padded.ravel()
    if flat.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    starts = np.concatenate(([0], np.flatnonzero(flat[1:] != flat[:-1]) + 1))
    lengths = np.diff(np.concatenate((starts, [flat.size])))
    values = flat[starts]
    keep = values > IDLE
    starts, lengths, values = starts[keep], lengths[keep], values[keep]
    return starts // (n + 1), starts % (n + 1), lengths, values


# ---------------------------------------------------------------------------------------
# Colors
# ---------------------------------------------------------------------------------------


def _hex_to_rgb(color: str) -> np.ndarray:
    return np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.float64) / 255


def _rgb_to_hex(rgb: np.ndarray) -> str:
    r, g, b = (int(round(v * 255)) for v in rgb)
    return f"#{r:02x}{g:02x}{b:02x}"


def _mix(rgb: np.ndarray, other: str, amount: float) -> np.ndarray:
    return rgb * (1 - amount) + _hex_to_rgb(other) * amount


def _shades() -> np.ndarray:
    """(P, 5, 3) RGB for each palette color and kind (IDLE slot gets the idle grey)."""
    table = np.zeros((len(PALETTE), len(KIND_NAMES), 3))
    for p, color in enumerate(PALETTE):
        base = _hex_to_rgb(color)
        table[p, IDLE] = _hex_to_rgb(IDLE_COLOR)
        table[p, PREFILL] = _mix(base, "#ffffff", 0.5)
        table[p, DECODE] = base
        table[p, STALLED] = _mix(base, "#202020", 0.6)
        table[p, WAITING] = _mix(base, "#ffffff", 0.8)
    return table


SHADES = _shades()
SHADES_HEX = np.array([[_rgb_to_hex(c) for c in kinds] for kinds in SHADES])


def color_numbers(*grids: Grid) -> list[np.ndarray]:
    """Per grid, request number -> palette index, one color per id across all grids."""
    order: dict[str, int] = {}
    for grid in grids:
        for request_id in grid.ids:
            order.setdefault(request_id, len(order))
    return [np.array([order[i] % len(PALETTE) for i in g.ids] or [0], dtype=np.int64)
            for g in grids]


def _cell_rgb(palette: np.ndarray, kinds: np.ndarray, empty: str, max_rows: int) -> np.ndarray:
    """(rows, n, 3) float32 image of palette indices (broadcast against kinds) and kinds.

    IDLE cells get `empty`. Past `max_rows` rows (a Gantt of thousands of requests), rows
    are averaged in blocks so the image stays about as small as the pixels showing it.
    """
    lut = SHADES.reshape(-1, 3).astype(np.float32)  # row p * 5 + kind
    lut[IDLE::len(KIND_NAMES)] = _hex_to_rgb(empty)
    codes = (palette * len(KIND_NAMES) + kinds).astype(np.int16)
    block = math.ceil(codes.shape[0] / max_rows)
    if block <= 1:
        return lut[codes]
    return np.stack([lut[codes[i:i + block]].mean(axis=0)
                     for i in range(0, codes.shape[0], block)])


# ---------------------------------------------------------------------------------------
# Text shared by the renderers
# ---------------------------------------------------------------------------------------


def describe(grid: Grid) -> str:
    """One line: source, slots, iterations (window), utilisation and busy/capacity."""
    trace = grid.trace
    busy, capacity = int(grid.busy().sum()), grid.num_slots * grid.num_columns
    parts = [str(trace.get("source", "trace")), f"{grid.num_slots} slots"]
    if grid.windowed() and grid.num_columns:
        parts.append(f"iterations {grid.index[0]}–{grid.index[-1]} "
                     f"of {grid.total_iterations}")
    else:
        parts.append(f"{grid.num_columns} iterations")
    parts.append(f"utilisation {grid.utilisation():.0%} ({busy}/{capacity} busy "
                 "slot-iterations)")
    if trace.get("source") == "engine" and trace["iterations"]:
        seconds = trace["iterations"][-1]["end"] - trace["iterations"][0]["start"]
        parts.append(f"{seconds:.2f} s")
    return " · ".join(parts)


def title(trace: dict) -> str:
    policy = trace.get("policy")
    return f"{policy} batching" if policy else "trace"


def _tick_step(n: int, max_ticks: int) -> int:
    """A 1-2-5 step giving at most `max_ticks` ticks over n columns."""
    step = 1
    while n / step > max_ticks:
        for factor in (2, 2.5, 2):
            step = int(step * factor)
            if n / step <= max_ticks:
                break
    return step


# ---------------------------------------------------------------------------------------
# Terminal
# ---------------------------------------------------------------------------------------

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
    step = _tick_step(len(index), max(1, len(index) // 3))
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


# ---------------------------------------------------------------------------------------
# HTML (inline SVG)
# ---------------------------------------------------------------------------------------

_LEFT = 72  # px for row labels
_HATCHES = {PREFILL: "hatch-prefill", STALLED: "hatch-stalled"}  # SVG pattern ids
_AXIS = 18  # px for the iteration numbers over the strip
_UTIL_HEIGHT = 56


@dataclass(frozen=True)
class _Geometry:
    """Pixel sizes shared by the panels of one page, so their iterations line up."""

    cell_width: int
    cell_height: int
    row_height: int  # Gantt
    columns: int  # widest panel

    @staticmethod
    def fit(grids: list[Grid], gantt_rows: int) -> _Geometry:
        columns = max(g.num_columns for g in grids)
        slots = max(g.num_slots for g in grids)
        cell_width = max(1, min(32, 960 // max(columns, 1)))
        cell_height = 24 if slots <= 8 else max(3, min(16, 384 // slots))
        row_height = 16 if gantt_rows <= 40 else max(2, 640 // gantt_rows)
        return _Geometry(cell_width, cell_height, row_height, columns)

    @property
    def width(self) -> int:
        return _LEFT + self.columns * self.cell_width + 40  # room for the overall figure


def render_html(trace: dict, compare: dict | None = None, start: int | None = None,
                end: int | None = None) -> str:
    """A self-contained HTML page: slot strip, utilisation line and Gantt of `trace`
    (and of `compare`, side by side, same scale and request colors).

    Each slot-iteration is one `<rect class="cell">` with `data-slot`, `data-iteration`,
    `data-request` (empty when idle) and `data-kind` (idle|prefill|decode|stalled).
    """
    traces = [trace] if compare is None else [trace, compare]
    grids = [build_grid(t, start, end) for t in traces]
    ganttes = [gantt(g) for g in grids]
    geometry = _Geometry.fit(grids, max(len(numbers) for numbers, _ in ganttes))
    colors = color_numbers(*grids)
    panels = [_html_panel(g, c, gt, geometry) for g, c, gt in zip(grids, colors, ganttes)]
    page_title = " vs ".join(title(t) for t in traces)
    return _PAGE.format(title=html.escape(page_title), defs=_SVG_DEFS,
                        legend=_html_legend(), panels="\n".join(panels))


def _html_panel(grid: Grid, colors: np.ndarray, gantt_rows: tuple, geo: _Geometry) -> str:
    return (
        f'<section class="panel"><h2>{html.escape(title(grid.trace))}</h2>'
        f'<p class="meta">{html.escape(describe(grid))}</p>'
        f"{_svg_strip(grid, colors, geo)}{_svg_util(grid, geo)}"
        f'<h3>requests</h3><div class="gantt">{_svg_gantt(grid, colors, gantt_rows, geo)}'
        "</div></section>"
    )


def _svg_strip(grid: Grid, colors: np.ndarray, geo: _Geometry) -> str:
    """The slot strip: one rect per slot-iteration, hatch marks, labels, axis."""
    cw, ch = geo.cell_width, geo.cell_height
    slots, n = grid.num_slots, grid.num_columns
    height = _AXIS + slots * ch + 2
    x = (_LEFT + np.arange(n) * cw)[None, :].repeat(slots, axis=0)
    y = (_AXIS + np.arange(slots) * ch)[:, None].repeat(n, axis=1)
    fill = SHADES_HEX[colors[np.maximum(grid.request, 0)], grid.kind]
    fill[grid.kind == IDLE] = IDLE_COLOR
    ids = np.array([html.escape(i, quote=True) for i in grid.ids] + [""])[grid.request]
    kinds = np.array(KIND_NAMES)[grid.kind]
    slot = np.arange(slots)[:, None].repeat(n, axis=1)
    iteration = grid.index[None, :].repeat(slots, axis=0)
    columns = [a.ravel().tolist() for a in (x, y, fill, slot, iteration, ids, kinds)]
    cells = [
        f'<rect class="cell" x="{cx}" y="{cy}" width="{cw}" height="{ch}" fill="{f}" '
        f'data-slot="{s}" data-iteration="{i}" data-request="{r}" data-kind="{k}"/>'
        for cx, cy, f, s, i, r, k in zip(*columns)
    ]
    parts = [f'<svg class="strip" width="{geo.width}" height="{height}">',
             _svg_ticks(grid, geo, _AXIS - 5), *_svg_row_labels(slots, ch, _AXIS),
             *cells, *_svg_marks(grid, geo), *_svg_cell_labels(grid, geo), "</svg>"]
    return "".join(parts)


def _svg_ticks(grid: Grid, geo: _Geometry, y: int) -> str:
    step = _tick_step(grid.num_columns, max(2, geo.columns * geo.cell_width // 48))
    cols = np.flatnonzero(grid.index % step == 0).tolist()
    return "".join(
        f'<text class="tick" x="{_LEFT + (c + 0.5) * geo.cell_width}" y="{y}">'
        f"{grid.index[c]}</text>" for c in cols
    )


def _svg_row_labels(slots: int, ch: int, top: int) -> list[str]:
    if ch < 9:
        return [f'<text class="rowlabel" x="{_LEFT - 6}" y="{top + slots * ch / 2}">'
                f"{slots} slots</text>"]
    return [f'<text class="rowlabel" x="{_LEFT - 6}" y="{top + (s + 0.5) * ch}">slot {s}</text>'
            for s in range(slots)]


def _svg_marks(grid: Grid, geo: _Geometry) -> list[str]:
    """Hatch overlays on prefill and stalled cells (they ignore the mouse)."""
    out = []
    for kind, pattern in _HATCHES.items():
        slot, col = np.nonzero(grid.kind == kind)
        out.extend(
            f'<rect class="mark" x="{_LEFT + c * geo.cell_width}" '
            f'y="{_AXIS + s * geo.cell_height}" width="{geo.cell_width}" '
            f'height="{geo.cell_height}" fill="url(#{pattern})"/>'
            for s, c in zip(slot.tolist(), col.tolist())
        )
    return out


def _svg_cell_labels(grid: Grid, geo: _Geometry) -> list[str]:
    """Request ids written in the cells when they are big enough to read."""
    if geo.cell_width < 24 or geo.cell_height < 16:
        return []
    slot, col = np.nonzero(grid.request >= 0)
    return [
        f'<text class="celllabel {KIND_NAMES[grid.kind[s, c]]}" '
        f'x="{_LEFT + (c + 0.5) * geo.cell_width}" y="{_AXIS + (s + 0.5) * geo.cell_height}">'
        f"{html.escape(grid.ids[grid.request[s, c]][:4])}</text>"
        for s, c in zip(slot.tolist(), col.tolist())
    ]


def _svg_util(grid: Grid, geo: _Geometry) -> str:
    """Step line of the busy fraction per iteration, with the overall figure dashed."""
    cw, top, h = geo.cell_width, 6, _UTIL_HEIGHT - 14
    frac = grid.busy() / grid.num_slots if grid.num_columns else np.zeros(0)
    ys = (top + (1 - frac) * h).round(1).tolist()
    path = "".join(f"{'M' if j == 0 else 'V'}{y} H{_LEFT + (j + 1) * cw} "
                   for j, y in enumerate(ys))
    path = path.replace("M", f"M{_LEFT} ", 1)
    overall = grid.utilisation()
    y_all = round(top + (1 - overall) * h, 1)
    right = _LEFT + grid.num_columns * cw
    return (
        f'<svg class="util" width="{geo.width}" height="{_UTIL_HEIGHT}">'
        f'<rect x="{_LEFT}" y="{top}" width="{right - _LEFT}" height="{h}" class="utilbg"/>'
        f'<text class="rowlabel" x="{_LEFT - 6}" y="{top + 4}">100%</text>'
        f'<text class="rowlabel" x="{_LEFT - 6}" y="{top + h}">0%</text>'
        f'<path class="utilline" d="{path}"/>'
        f'<line class="utilmean" x1="{_LEFT}" x2="{right}" y1="{y_all}" y2="{y_all}"/>'
        f'<text class="utiltext" x="{right + 4}" y="{y_all + 4}">{overall:.0%}</text></svg>'
    )


def _svg_gantt(grid: Grid, colors: np.ndarray, gantt_rows: tuple, geo: _Geometry) -> str:
    """A row per request: one rect per run of waiting / prefill / decode / stalled."""
    numbers, codes = gantt_rows
    rh, cw = geo.row_height, geo.cell_width
    height = len(numbers) * rh + 2
    row, col, length, code = (a.tolist() for a in _runs(codes))
    number_of_row = numbers.tolist()
    spans = []
    for r, c, n, k in zip(row, col, length, code):
        number = number_of_row[r]
        request_id = html.escape(grid.ids[number], quote=True)
        box = f'x="{_LEFT + c * cw}" y="{r * rh + 1}" width="{n * cw}" height="{rh - 1}"'
        spans.append(
            f'<rect class="span" {box} fill="{SHADES_HEX[colors[number], k]}" '
            f'data-request="{request_id}" data-kind="{KIND_NAMES[k]}" '
            f'data-from="{grid.index[c]}" data-to="{grid.index[c + n - 1]}"/>'
        )
        if k in _HATCHES:
            spans.append(f'<rect class="mark" {box} fill="url(#{_HATCHES[k]})"/>')
    labels = [] if rh < 10 else [
        f'<text class="rowlabel" x="{_LEFT - 6}" y="{r * rh + rh / 2 + 1}">'
        f"{html.escape(grid.ids[n][:10])}</text>" for r, n in enumerate(number_of_row)
    ]
    return (f'<svg class="gantt" width="{geo.width}" height="{height}">'
            + "".join(labels) + "".join(spans) + "</svg>")


def _html_legend() -> str:
    p = PALETTE[0]
    items = [
        (f'fill="{p}"', "decode"),
        (f'fill="{SHADES_HEX[0, PREFILL]}"', "prefill"),
        (f'fill="{SHADES_HEX[0, STALLED]}"', "stalled"),
        (f'fill="{IDLE_COLOR}"', "idle slot"),
        (f'fill="{SHADES_HEX[0, WAITING]}"', "waiting (Gantt)"),
    ]
    marks = {"prefill": "hatch-prefill", "stalled": "hatch-stalled"}
    out = []
    for fill, name in items:
        mark = (f'<rect width="14" height="14" fill="url(#{marks[name]})"/>'
                if name in marks else "")
        out.append(f'<span><svg width="14" height="14"><rect width="14" height="14" {fill}/>'
                   f"{mark}</svg> {name}</span>")
    return " ".join(out) + " <span>(color = request)</span>"


_SVG_DEFS = (
    '<svg width="0" height="0" style="position:absolute"><defs>'
    '<pattern id="hatch-prefill" width="5" height="5" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="5" '
    'stroke="#ffffff" stroke-width="1.6" stroke-opacity="0.9"/></pattern>'
    '<pattern id="hatch-stalled" width="6" height="6" patternUnits="userSpaceOnUse">'
    '<path d="M0 0 L6 6 M6 0 L0 6" stroke="#ffffff" stroke-width="1" '
    'stroke-opacity="0.8"/></pattern></defs></svg>'
)

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 16px; color: #222; }}
.panels {{ display: flex; gap: 24px; align-items: flex-start; flex-wrap: wrap; }}
.panel {{ overflow-x: auto; max-width: 100%; }}
h2 {{ margin: 0 0 2px; font-size: 16px; }} h3 {{ margin: 8px 0 2px; font-size: 13px; }}
.meta {{ margin: 0 0 6px; color: #555; }}
.gantt {{ max-height: 640px; overflow-y: auto; }}
svg text {{ font-size: 10px; dominant-baseline: middle; }}
.rowlabel {{ text-anchor: end; fill: #555; }}
.tick {{ text-anchor: middle; fill: #555; }}
.celllabel {{ text-anchor: middle; fill: #fff; pointer-events: none; }}
.celllabel.prefill {{ fill: #222; }}
.mark {{ pointer-events: none; }}
.cell:hover, .span:hover {{ stroke: #000; stroke-width: 1; }}
.utilbg {{ fill: #f6f6f6; }}
.utilline {{ fill: none; stroke: #333; stroke-width: 1.5; }}
.utilmean {{ stroke: #d62728; stroke-dasharray: 4 3; }}
.utiltext {{ fill: #d62728; }}
.legend span {{ margin-right: 14px; white-space: nowrap; }}
.legend svg {{ vertical-align: middle; }}
#info {{ min-height: 1.4em; margin: 6px 0; font-family: ui-monospace, monospace; }}
</style></head><body>
{defs}
<h1 style="font-size:18px;margin:0 0 8px">{title}</h1>
<div class="legend">{legend}</div>
<div id="info">hover a cell</div>
<div class="panels">
{panels}
</div>
<script>
const info = document.getElementById("info");
document.addEventListener("mouseover", (e) => {{
  const d = e.target.dataset;
  if (!d || !d.kind) return;
  info.textContent = d.slot !== undefined
    ? `slot ${{d.slot}} · iteration ${{d.iteration}} · ${{d.request || "-"}} · ${{d.kind}}`
    : `${{d.request}} · ${{d.kind}} · iterations ${{d.from}}–${{d.to}}`;
}});
</script>
</body></html>
"""


# ---------------------------------------------------------------------------------------
# PNG (matplotlib, Agg)
# ---------------------------------------------------------------------------------------

# Hatches and labels cost a patch or text per cell: drawn only where cells are big enough
# to see them (the shades alone tell prefill and stalled apart).
_MAX_MARKED_COLUMNS = 200
_MAX_MARKED_ROWS = 100
_MAX_CELL_LABELS = 400


def render_png(trace: dict, path: str, width_px: int = 1200, height_px: int = 800,
               compare: dict | None = None, start: int | None = None,
               end: int | None = None, dpi: int = 100) -> None:
    """Write a PNG of exactly width_px x height_px: strip, utilisation and Gantt per trace
    (two columns with `compare`, same x scale and request colors)."""
    if width_px < 16 or height_px < 16:
        raise ValueError(f"width_px and height_px must be >= 16, got {width_px}x{height_px}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    traces = [trace] if compare is None else [trace, compare]
    grids = [build_grid(t, start, end) for t in traces]
    fig = Figure(figsize=(_inches(width_px, dpi), _inches(height_px, dpi)), dpi=dpi)
    FigureCanvasAgg(fig)
    _draw_figure(fig, grids)
    fig.savefig(path, dpi=dpi, format="png")


def _inches(pixels: int, dpi: int) -> float:
    """Figure inches whose product with dpi truncates to exactly `pixels` in Agg."""
    # NOTE: Agg sizes its canvas with int(inches * dpi); 0.29 * 100 would give 28.
    inches = pixels / dpi
    while inches * dpi < pixels:
        inches = math.nextafter(inches, math.inf)
    return inches


def _draw_figure(fig, grids: list[Grid]) -> None:
    columns = max(g.num_columns for g in grids)
    ganttes = [gantt(g) for g in grids]
    rows = max([len(numbers) for numbers, _ in ganttes] + [1])
    slots = max(g.num_slots for g in grids)
    width, height = fig.get_size_inches() * fig.dpi
    spec = fig.add_gridspec(
        3, len(grids), height_ratios=[min(slots, 24) + 2, 4, min(rows, 40) + 2],
        # margins in pixels (titles, tick labels, legend), capped for tiny images
        left=min(64 / width, 0.3), right=1 - min(16 / width, 0.1),
        top=1 - min(56 / height, 0.3), bottom=min(72 / height, 0.3),
        hspace=0.45, wspace=0.15,
    )
    colors = color_numbers(*grids)
    for k, (grid, color, gantt_rows) in enumerate(zip(grids, colors, ganttes)):
        axes = [fig.add_subplot(spec[r, k]) for r in range(3)]
        _draw_panel(axes, grid, color, gantt_rows, columns)
    fig.legend(handles=_legend_handles(), loc="lower center", ncol=5, frameon=False,
               fontsize="small")


def _draw_panel(axes, grid: Grid, colors: np.ndarray, gantt_rows: tuple, columns: int):
    strip, util, chart = axes
    strip.set_title(f"{title(grid.trace)}\n{describe(grid)}", fontsize="small")
    if grid.num_columns == 0:
        for ax in axes:
            ax.set_axis_off()
        strip.text(0.5, 0.5, "no iterations", ha="center", transform=strip.transAxes)
        return
    x0 = float(grid.index[0])
    extent = (x0 - 0.5, x0 + grid.num_columns - 0.5)
    _draw_strip(strip, grid, colors, extent)
    _draw_util(util, grid, extent)
    _draw_gantt(chart, grid, colors, gantt_rows, extent)
    for ax in axes:
        ax.set_xlim(extent[0], extent[0] + columns)
    chart.set_xlabel("iteration", fontsize="small")


def _draw_strip(ax, grid: Grid, colors: np.ndarray, extent: tuple) -> None:
    palette = colors[np.maximum(grid.request, 0)]  # idle cells: any, IDLE paints them
    image = _cell_rgb(palette, grid.kind, IDLE_COLOR, _pixel_rows(ax))
    _show(ax, image, extent, grid.num_slots)
    ax.set_yticks(range(grid.num_slots) if grid.num_slots <= 16 else [])
    ax.set_yticklabels([f"slot {s}" for s in range(grid.num_slots)]
                       if grid.num_slots <= 16 else [], fontsize="x-small")
    if grid.num_slots > 16:
        ax.set_ylabel(f"{grid.num_slots} slots", fontsize="small")
    _draw_marks(ax, grid.kind, float(grid.index[0]))
    _draw_cell_labels(ax, grid)


def _pixel_rows(ax) -> int:
    """Height of an axes in pixels (at least 1)."""
    return max(1, int(ax.get_position().height * ax.figure.bbox.height))


def _show(ax, image: np.ndarray, extent: tuple, rows: int) -> None:
    """imshow with cell edges drawn when cells are wide enough to see them."""
    columns = image.shape[1]
    interpolation = "nearest" if columns <= 400 else "antialiased"
    ax.imshow(image, aspect="auto", interpolation=interpolation,
              extent=(extent[0], extent[1], rows - 0.5, -0.5))
    ax.tick_params(labelsize="x-small")
    if columns <= 120 and rows <= 48:
        ax.set_xticks(np.arange(columns + 1) + extent[0], minor=True)
        ax.set_yticks(np.arange(rows + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="white", linewidth=1)
        ax.tick_params(which="minor", length=0)


def _draw_marks(ax, kinds: np.ndarray, first_index: float) -> None:
    """Hatch prefill (///) and stalled (xx) cells of a (rows, n) kind image, when there
    are not too many (past that, their shades alone tell them apart)."""
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    if kinds.shape[0] > _MAX_MARKED_ROWS or kinds.shape[1] > _MAX_MARKED_COLUMNS:
        return
    x0 = first_index - 0.5
    for kind, hatch in ((PREFILL, "///"), (STALLED, "xx")):
        row, col = np.nonzero(kinds == kind)
        if len(row):
            boxes = [Rectangle((x0 + c, r - 0.5), 1, 1) for r, c in zip(row, col)]
            ax.add_collection(PatchCollection(boxes, facecolor="none", edgecolor="white",
                                              linewidth=0, hatch=hatch))


def _draw_cell_labels(ax, grid: Grid) -> None:
    slot, col = np.nonzero(grid.request >= 0)
    if len(slot) > _MAX_CELL_LABELS or grid.num_columns > 60:
        return
    for s, c in zip(slot.tolist(), col.tolist()):
        ink = "#222222" if grid.kind[s, c] == PREFILL else "white"
        ax.text(grid.index[c], s, grid.ids[grid.request[s, c]][:4], ha="center",
                va="center", fontsize="xx-small", color=ink)


def _draw_util(ax, grid: Grid, extent: tuple) -> None:
    frac = grid.busy() / grid.num_slots
    xs = np.concatenate((grid.index - 0.5, [grid.index[-1] + 0.5]))
    ax.stairs(frac, xs, fill=True, color="#cfcfcf")
    ax.stairs(frac, xs, color="#333333", linewidth=1)
    overall = grid.utilisation()
    ax.axhline(overall, color="#d62728", linestyle="--", linewidth=1)
    ax.text(0.995, overall, f"overall {overall:.0%}", color="#d62728", fontsize="x-small",
            ha="right", va="bottom", transform=ax.get_yaxis_transform())
    ax.set_ylim(0, 1.05)
    ax.set_yticks([0, 1])
    ax.set_yticklabels(["0%", "100%"])
    ax.set_ylabel("util", fontsize="x-small")
    ax.tick_params(labelsize="x-small", labelbottom=False)


def _draw_gantt(ax, grid: Grid, colors: np.ndarray, gantt_rows: tuple,
                extent: tuple) -> None:
    numbers, codes = gantt_rows
    if len(numbers) == 0:
        ax.set_axis_off()
        return
    image = _cell_rgb(colors[numbers][:, None], codes, EMPTY_COLOR, _pixel_rows(ax))
    _show(ax, image, extent, len(numbers))
    _draw_marks(ax, codes, float(grid.index[0]))
    labelled = len(numbers) <= 40
    ax.set_yticks(range(len(numbers)) if labelled else [])
    ax.set_yticklabels([grid.ids[n][:10] for n in numbers] if labelled else [],
                       fontsize="x-small")
    if not labelled:
        ax.set_ylabel(f"{len(numbers)} requests", fontsize="small")


def _legend_handles() -> list:
    from matplotlib.patches import Patch

    return [
        Patch(facecolor=PALETTE[0], label="decode"),
        Patch(facecolor=SHADES_HEX[0, PREFILL], hatch="///", edgecolor="white",
              label="prefill"),
        Patch(facecolor=SHADES_HEX[0, STALLED], hatch="xx", edgecolor="white",
              label="stalled"),
        Patch(facecolor=IDLE_COLOR, label="idle slot"),
        Patch(facecolor=SHADES_HEX[0, WAITING], label="waiting"),
    ]
