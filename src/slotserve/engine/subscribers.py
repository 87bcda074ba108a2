"""The engine's subscribers: callbacks that get every IterationEvent, each fault contained."""

from __future__ import annotations

import logging

from slotserve.engine.events import IterationEvent
from slotserve.engine.isolation import is_fault

logger = logging.getLogger("slotserve.engine")


class Subscribers:
    """callback(IterationEvent) for each subscribed callback, in subscription order."""

    def __init__(self) -> None:
        self._callbacks: list = []
        self._faults: dict = {}  # callback -> faults so far (logged in full once)

    def add(self, callback) -> None:
        self._callbacks.append(callback)

    def remove(self, callback) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def publish(self, event: IterationEvent | None) -> None:
        """Hand the event to every subscriber (NOTE: one's fault harms nothing else)."""
        if event is None:
            return
        for callback in list(self._callbacks):
            try:
                callback(event)
            except BaseException as exc:  # a native library's panic too (is_fault)
                if not is_fault(exc):
                    raise
                faults = self._faults.get(callback, 0) + 1
                self._faults[callback] = faults
                log = logger.exception if faults == 1 else logger.debug
                log("subscriber %r failed (%d times)", callback, faults)
