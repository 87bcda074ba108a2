"""Rolling windows over the engine's events: values kept for the last `window_s` seconds.

`TimeWindow` is the one mechanism; `SlotWindow` (slot utilisation, for /metrics) and
`LatencyWindow` (TTFT / TPOT of recent completions, for the live view) are its two uses.

NOTE: `add` runs in the engine thread (a subscriber), reads in the server's; the lock
guards the deque between them.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from slotserve.engine.events import IterationEvent
from slotserve.obs.trace import is_busy


class TimeWindow:
    """(time, value) pairs of the last window_s seconds (at most maxlen of them)."""

    def __init__(self, window_s: float, maxlen: int = 100_000) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, object]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, value, now: float | None = None) -> None:
        with self._lock:
            self._items.append((time.monotonic() if now is None else now, value))

    def extend(self, values: list, now: float | None = None) -> None:
        stamp = time.monotonic() if now is None else now
        with self._lock:
            self._items.extend((stamp, v) for v in values)

    def values(self, now: float | None = None) -> list:
        """The values added in the last window_s seconds, oldest first."""
        horizon = (time.monotonic() if now is None else now) - self.window_s
        with self._lock:
            while self._items and self._items[0][0] < horizon:
                self._items.popleft()
            return [v for _, v in self._items]


class SlotWindow(TimeWindow):
    """Busy slots of the iterations of the last `window_s` seconds."""

    def __init__(self, num_slots: int, window_s: float, maxlen: int = 100_000) -> None:
        super().__init__(window_s, maxlen)
        self.num_slots = num_slots

    def on_iteration(self, record: dict) -> None:
        """One iteration record (trace format).

        NOTE: busy as in the seed and the simulator: the slot processed tokens (prefill or
        decode); a stalled slot is held but idle.
        """
        self.add(sum(is_busy(slot) for slot in record["slots"]))

    def utilisation(self, now: float | None = None) -> float:
        """Busy slot-iterations / (slots x iterations) in the window; 0 when idle."""
        busy = self.values(now)
        if not busy:
            return 0.0
        return sum(busy) / (self.num_slots * len(busy))


class LatencyWindow(TimeWindow):
    """(ttft, tpot) of the completions that finished (stop / length) in the window."""

    def __init__(self, window_s: float, maxlen: int = 4096) -> None:
        super().__init__(window_s, maxlen)

    def on_event(self, event: IterationEvent) -> None:
        finished = [(f.metrics.ttft, f.metrics.tpot) for f in event.observed()
                    if f.metrics is not None]
        if finished:
            self.extend(finished)

    def latencies(self, now: float | None = None) -> tuple[list[float], list[float]]:
        """(TTFTs, TPOTs) in the window (a completion of one token has no TPOT)."""
        recent = self.values(now)
        return ([a for a, _ in recent if a is not None], [b for _, b in recent if b is not None])
