"""Request colours: a palette, one shade per kind, and cell images built from them.

A request keeps its colour across the two traces of a comparison (`color_numbers`).
"""

from __future__ import annotations

import math

import numpy as np

from slotserve.lab.timeline.grid import DECODE, IDLE, KIND_NAMES, PREFILL, STALLED, WAITING, Grid

# Strong colors, no greys: grey means an idle slot.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#bcbd22", "#17becf", "#393b79", "#e7ba52", "#637939",
)
IDLE_COLOR = "#e6e6e6"
EMPTY_COLOR = "#ffffff"  # Gantt: the request is not alive in this iteration


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


def cell_rgb(palette: np.ndarray, kinds: np.ndarray, empty: str, max_rows: int) -> np.ndarray:
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
