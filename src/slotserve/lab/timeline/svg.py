"""A self-contained HTML page of inline SVG: strip, utilisation line and Gantt per trace."""

from __future__ import annotations

import html
from dataclasses import dataclass

import numpy as np

from slotserve.lab.timeline.colours import IDLE_COLOR, SHADES_HEX, color_numbers
from slotserve.lab.timeline.grid import (
    IDLE,
    KIND_NAMES,
    PREFILL,
    STALLED,
    Grid,
    build_grid,
    gantt,
    kind_runs,
)
from slotserve.lab.timeline.page import PAGE, SVG_DEFS, html_legend
from slotserve.lab.timeline.text import describe, tick_step, title

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
    return PAGE.format(title=html.escape(page_title), defs=SVG_DEFS,
                        legend=html_legend(), panels="\n".join(panels))


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
    step = tick_step(grid.num_columns, max(2, geo.columns * geo.cell_width // 48))
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
    row, col, length, code = (a.tolist() for a in kind_runs(codes))
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
    skipped = _svg_skipped_prefill(grid, number_of_row, geo)
    return (f'<svg class="gantt" width="{geo.width}" height="{height}">'
            + "".join(labels) + "".join(spans) + "".join(skipped) + "</svg>")


def _svg_skipped_prefill(grid: Grid, number_of_row: list[int], geo: _Geometry) -> list[str]:
    """A dark bar at the start of each request whose prefill the prefix cache partly
    skipped (its first iteration, when in the window), titled with the tokens skipped."""
    records = grid.trace["requests"]
    marks = []
    for r, number in enumerate(number_of_row):
        record = records[number] if number < len(records) else {}
        cached, first = record.get("cached_tokens") or 0, record.get("first_iteration")
        col = int(np.searchsorted(grid.index, first)) if first is not None else -1
        if not cached or not 0 <= col < grid.num_columns or grid.index[col] != first:
            continue
        marks.append(
            f'<rect class="cached" x="{_LEFT + col * geo.cell_width}" y="{r * geo.row_height + 1}"'
            f' width="2" height="{geo.row_height - 1}" fill="#101828" data-cached-tokens='
            f'"{cached}"><title>{cached} of {record.get("prompt_tokens")} prompt tokens from '
            "the prefix cache: their prefill was skipped</title></rect>")
    return marks
