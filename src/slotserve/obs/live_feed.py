"""The live view's data: iteration records fanned out to connected pages, and the state.

Data flow: the engine calls `LiveFeed.on_iteration` after every iteration (its one
subscriber hook); each connected page has a bounded queue that drops its oldest records
when the page lags, so a slow or stalled client costs the engine nothing and memory stays
bounded. The state (config, counts, block map) comes from the engine's `snapshot()`.

A replica set's ingress (scaleout.front.ReplicaFront) is followed the same way; it also has
`replica_views()` and `recent_iterations(n)`, and its records say which replica ran them
(`"replica"`). Then the state has `replicas` (name, up, slots, iteration of each: the page
draws one strip per replica) and a page's backfill is each replica's recent iterations.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from slotserve.engine.events import EngineSnapshot, IterationEvent
from slotserve.obs.subscriber import EngineSubscriber
from slotserve.obs.windows import LatencyWindow
from slotserve.percentile import percentile


class LiveClient:
    """One page's bounded queue of iteration records.

    NOTE: `push` runs in the engine thread, everything else in the event loop. The deque is
    thread-safe for append / popleft and its maxlen drops the oldest record when the page
    lags; at most one wake-up is in flight on the loop, so a stalled loop piles up nothing.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, maxlen: int) -> None:
        self.loop = loop
        self.records: deque[dict] = deque(maxlen=maxlen)
        self.wake = asyncio.Event()
        self.dropped = 0
        self._wake_pending = False

    def push(self, record: dict) -> None:
        if len(self.records) == self.records.maxlen:
            self.dropped += 1
        self.records.append(record)
        if not self._wake_pending:
            self._wake_pending = True
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._wake_pending = False
        self.wake.set()

    def drain(self) -> list[dict]:
        out = []
        while self.records:
            out.append(self.records.popleft())
        return out


class LiveFeed(EngineSubscriber):
    """Follows one engine (its `subscribe` / `snapshot` / `export_trace`): fans iteration
    records out to pages, keeps recent latencies.

    window_s: TTFT / TPOT percentiles cover the completions finished in this window.
    """

    def __init__(self, engine, client_queue: int = 2048, window_s: float = 60.0,
                 max_latencies: int = 4096) -> None:
        super().__init__(engine)
        self.client_queue = client_queue
        self.window_s = window_s
        self._clients: list[LiveClient] = []
        self._lock = threading.Lock()  # guards _clients and _tokens across the threads
        self.latencies = LatencyWindow(window_s, max_latencies)
        self._tokens: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens generated)
        self.replica_set = hasattr(engine, "replica_views")  # a ReplicaFront (module doc)

    # ------------------------------------------------------------------ engine side
    def on_iteration(self, event: IterationEvent) -> None:
        """Subscriber (engine thread): hand the record to every page, keep the latencies."""
        self.latencies.on_event(event)
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            try:
                client.push(event.record)
            except RuntimeError:  # its event loop is closed: the page is gone
                self.disconnect(client)

    # ------------------------------------------------------------------ pages
    def connect(self, loop: asyncio.AbstractEventLoop) -> LiveClient:
        client = LiveClient(loop, self.client_queue)
        with self._lock:
            self._clients.append(client)
        return client

    def disconnect(self, client: LiveClient) -> None:
        with self._lock:
            if client in self._clients:
                self._clients.remove(client)

    @property
    def num_clients(self) -> int:
        with self._lock:
            return len(self._clients)

    def hello(self, backfill: int) -> dict:
        """The first event of a stream: the state and the last `backfill` iterations."""
        if self.replica_set:
            return {**self.state(), "iterations": self.engine.recent_iterations(backfill)}
        iterations = self.engine.export_trace()["iterations"]
        return {**self.state(), "iterations": iterations[-backfill:] if backfill else []}

    # ------------------------------------------------------------------ snapshots
    def config(self, snap: EngineSnapshot | None = None) -> dict:
        snap = snap or self.engine.snapshot()
        return {"model": snap.model, "policy": snap.policy, "num_slots": snap.num_slots,
                "scheduling_policy": snap.scheduling_policy,
                "kv_blocks_total": snap.kv_blocks_total, "block_size": snap.block_size,
                "max_num_batched_tokens": snap.max_num_batched_tokens,
                "max_model_len": snap.max_model_len,
                "enable_prefix_caching": snap.enable_prefix_caching,
                "window_s": self.window_s}

    def state(self) -> dict:
        """Config, stats and the block map: GET /debug/state."""
        snap = self.engine.snapshot(include_blocks=True)
        return {**self.config(snap), **self.stats(snap=snap)}

    def stats(self, dropped: int = 0, now: float | None = None,
              snap: EngineSnapshot | None = None) -> dict:
        """Counters, recent latencies and the block map, from one engine snapshot."""
        now = time.monotonic() if now is None else now
        snap = snap or self.engine.snapshot(include_blocks=True)
        ttft, tpot = self.latencies.latencies(now)
        replicas = {"replicas": self.engine.replica_views()} if self.replica_set else {}
        return {
            "time": time.time(), "iteration": snap.iteration,
            "running": snap.num_running, "waiting": snap.num_waiting,
            "kv_blocks_used": snap.kv_blocks_used, "kv_blocks_free": snap.kv_blocks_free,
            "kv_blocks_cached_free": snap.kv_blocks_cached_free,
            "kv_blocks_shared": snap.kv_blocks_shared, "preemptions": snap.num_preemptions,
            "prefix_cache_queries": snap.prefix_cache_queries,
            "prefix_cache_hits": snap.prefix_cache_hits,
            "prefix_cache_hit_rate": snap.prefix_cache_hit_rate,
            "generation_tokens": snap.generation_tokens,
            "tokens_per_s": self._tokens_per_s(now, snap.generation_tokens),
            "finished_in_window": len(ttft),
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
            "blocks": snap.block_map.to_json() if snap.block_map is not None else None,
            "dropped": dropped, "clients": self.num_clients,
            "tenants": live_tenants(snap), **replicas,
        }

    def _tokens_per_s(self, now: float, total: int, span_s: float = 5.0) -> float:
        """Output tokens per second over the last ~span_s seconds of stats snapshots."""
        with self._lock:  # NOTE: pages ask from worker threads
            samples = self._tokens
            if not samples or now - samples[-1][0] >= 0.2:
                samples.append((now, total))
            while len(samples) > 2 and now - samples[1][0] >= span_s:
                samples.popleft()
            t0, n0 = samples[0]
        return (total - n0) / (now - t0) if now - t0 >= 0.5 else 0.0


MAX_LIVE_TENANTS = 16  # the live view lists the tenants served most (the rest: "more")


def live_tenants(snap: EngineSnapshot) -> list[dict]:
    """The tenants served most (tokens), at most MAX_LIVE_TENANTS, for the live view's
    tenant legend: name, weight, tokens served, active requests."""
    ranked = sorted(snap.tenants, key=lambda t: (-(t.prompt_tokens + t.output_tokens), t.name))
    return [{"name": t.name, "weight": t.weight, "active": t.active,
             "tokens_served": t.prompt_tokens + t.output_tokens}
            for t in ranked[:MAX_LIVE_TENANTS]]
