"""EngineSubscriber: follow an engine's iterations through its one `subscribe` hook."""

from __future__ import annotations

from slotserve.engine.events import IterationEvent


class EngineSubscriber:
    """Base of the obs/ readers: `attach()` subscribes `on_iteration`, `close()` stops.

    NOTE: both are idempotent, so a reader attached twice is called once per iteration.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self._attached = False

    def attach(self) -> None:
        """Follow the engine's iterations."""
        if not self._attached:
            self.engine.subscribe(self.on_iteration)
            self._attached = True

    def close(self) -> None:
        """Stop following the engine."""
        if self._attached:
            self.engine.unsubscribe(self.on_iteration)
            self._attached = False

    def on_iteration(self, event: IterationEvent) -> None:  # pragma: no cover - abstract
        raise NotImplementedError
