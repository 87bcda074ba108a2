"""A trace (or a window of its iterations) as numpy arrays: the `Grid` every renderer draws.

A trace is one pass over its cells away from the arrays, so long engine traces draw fast.
Kinds: IDLE, PREFILL, DECODE, STALLED in the strip; WAITING only in the per-request Gantt.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from slotserve.engine.trace import TRACE_VERSION

IDLE, PREFILL, DECODE, STALLED, WAITING = range(5)
KIND_NAMES = ("idle", "prefill", "decode", "stalled", "waiting")
KIND_CODES = {"prefill": PREFILL, "decode": DECODE, "stalled": STALLED}


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
        kind = np.array([IDLE if c is None else KIND_CODES[c["kind"]] for c in cells],
                        dtype=np.int8)
    except KeyError as err:
        raise ValueError(f"cell kind must be one of {tuple(KIND_CODES)}, "
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


def kind_runs(codes: np.ndarray) -> tuple[np.ndarray, ...]:
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
