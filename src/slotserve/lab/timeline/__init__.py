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

Modules: `grid` (trace -> arrays), `colours`, `text` (titles, descriptions, ticks), and one
per output: `terminal`, `svg` (with its HTML `page`), `png`.
"""

from slotserve.lab.timeline.colours import (
    EMPTY_COLOR,
    IDLE_COLOR,
    PALETTE,
    SHADES,
    SHADES_HEX,
    color_numbers,
)
from slotserve.lab.timeline.grid import (
    DECODE,
    IDLE,
    KIND_NAMES,
    PREFILL,
    STALLED,
    WAITING,
    Grid,
    build_grid,
    check_trace,
    gantt,
)
from slotserve.lab.timeline.png import render_png
from slotserve.lab.timeline.svg import render_html
from slotserve.lab.timeline.terminal import render_terminal
from slotserve.lab.timeline.text import describe, title

__all__ = [
    "DECODE", "EMPTY_COLOR", "IDLE", "IDLE_COLOR", "KIND_NAMES", "PALETTE", "PREFILL", "SHADES",
    "SHADES_HEX", "STALLED", "WAITING", "Grid", "build_grid", "check_trace", "color_numbers",
    "describe", "gantt", "render_html", "render_png", "render_terminal", "title",
]
