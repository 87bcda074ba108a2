"""The live view of a replica set: each replica's iterations, carried to the ingress.

Replica side: `IterationTap` follows the replica's engine (one deque append per iteration,
in the engine thread: nothing else on the hot path) and keeps its last `capacity` events,
each numbered. `EngineReplica.snapshot(cursor, instance)` returns the events after the
ingress's cursor with the snapshot the ingress polls anyway (every ~0.5 s).

Ingress side: `ReplicaFront` hands each new event to its subscribers (the live view's
LiveFeed) with the record tagged `"replica": name`, so the page draws one slot strip per
replica and the latency windows get the replicas' finished completions.

NOTE: a replica that Serve restarts is a new `instance` with its own numbering: the tap
answers an unknown instance from its oldest event, and the ingress marks the first record
after a restart `"restarted": true` (the page then clears that replica's strip).
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections import deque

from slotserve.engine.events import FinishedCompletion, IterationEvent
from slotserve.obs.subscriber import EngineSubscriber

TAP_CAPACITY = 2048  # events a replica keeps for the ingress (~4 s of a fast tiny engine)


class IterationTap(EngineSubscriber):
    """A replica engine's recent IterationEvents, numbered from 1, for the ingress's polls."""

    def __init__(self, engine, capacity: int = TAP_CAPACITY) -> None:
        super().__init__(engine)
        self.instance = uuid.uuid4().hex
        self._events: deque[tuple[int, IterationEvent]] = deque(maxlen=capacity)
        self._count = 0
        self._lock = threading.Lock()  # NOTE: the engine thread appends, the replica reads

    def on_iteration(self, event: IterationEvent) -> None:
        """Subscriber (engine thread): keep the event; the oldest goes when full."""
        with self._lock:
            self._count += 1
            self._events.append((self._count, event))

    def since(self, cursor: int, instance: str | None) -> dict:
        """The events after `cursor` (all kept ones if `instance` is not this tap's):
        {"instance", "cursor" (the newest number), "events", "missed" (dropped unread)}.

        The events' completions lose their inter-token latencies (the live view reads
        TTFT and TPOT only; a long completion's list is large to send).
        """
        if instance != self.instance:
            cursor = 0
        with self._lock:
            newest = self._count
            events = [e for n, e in self._events if n > cursor]
        missed = max(0, newest - cursor - len(events))
        return {"instance": self.instance, "cursor": newest, "missed": missed,
                "events": [_light(e) for e in events]}


def _light(event: IterationEvent) -> IterationEvent:
    if not event.finished:
        return event
    return IterationEvent(event.record, tuple(_without_itls(f) for f in event.finished))


def _without_itls(done: FinishedCompletion) -> FinishedCompletion:
    if done.metrics is None or not done.metrics.itls:
        return done
    return dataclasses.replace(done, metrics=dataclasses.replace(done.metrics, itls=[]))


def tag_events(feed: dict, name: str, restarted: bool) -> list[IterationEvent]:
    """A tap's answer as events whose records say `"replica": name` (the first one also
    `"restarted": true` when `restarted`). NOTE: new dicts: the replica's own records are
    never changed."""
    tagged = []
    for event in feed["events"]:
        record = {**event.record, "replica": name}
        if restarted and not tagged:
            record["restarted"] = True
        tagged.append(IterationEvent(record, event.finished))
    return tagged
