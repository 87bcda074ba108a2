"""A PNG of exact pixel size (matplotlib, Agg): strip, utilisation and Gantt per trace."""

from __future__ import annotations

import math

import numpy as np

from slotserve.lab.timeline.colours import (
    EMPTY_COLOR,
    IDLE_COLOR,
    PALETTE,
    SHADES_HEX,
    cell_rgb,
    color_numbers,
)
from slotserve.lab.timeline.grid import PREFILL, STALLED, WAITING, Grid, build_grid, gantt
from slotserve.lab.timeline.text import describe, title

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
    image = cell_rgb(palette, grid.kind, IDLE_COLOR, _pixel_rows(ax))
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
    image = cell_rgb(colors[numbers][:, None], codes, EMPTY_COLOR, _pixel_rows(ax))
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
