"""Prometheus metrics of one engine, named like vLLM's (`slotserve:` for `vllm:`).

- Gauges and engine-wide counters are read from the live engine at scrape time (a custom
  collector), so they are never stale and cost nothing per iteration.
- Latency histograms are observed when a completion finishes, from its RequestMetrics,
  in the engine thread (`AsyncEngine.add_step_listener`); prometheus_client metrics are thread-safe.
- Slot utilisation (busy slot-iterations / (slots x iterations), as in the seed) covers the
  iterations of the last `window_s` seconds, fed by the trace's per-iteration listener.

Each ServerMetrics has its own CollectorRegistry, so a process can hold several apps.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from slotserve.engine.outputs import CompletionOutput, RequestOutput
from slotserve.obs.trace import is_busy

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "slotserve:"

# Buckets as vLLM's (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Finish reasons whose latencies are observed (aborted / failed ones would skew them).
OBSERVED_REASONS = ("stop", "length")


class ServerMetrics:
    """The metrics of one served engine. `attach(async_engine)` starts feeding them."""

    def __init__(self, engine, window_s: float = 10.0) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self.slots = SlotWindow(engine.scheduler.config.max_num_seqs, window_s)
        self._histograms(self.registry)
        self.registry.register(EngineCollector(engine, self.slots))

    def _histograms(self, registry: CollectorRegistry) -> None:
        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Mean time per output token after the first.", TPOT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Gap between two consecutive tokens of one request.", TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Arrival to first scheduled iteration.", REQUEST_BUCKETS)

    def attach(self, async_engine) -> None:
        """Observe finished completions after every step and follow the trace for slot
        utilisation."""
        async_engine.add_step_listener(self.observe_outputs)
        self.engine.trace.add_listener(self.slots.on_iteration)

    def observe_outputs(self, outputs: list[RequestOutput]) -> None:
        """Observe the latencies of the completions that finished (any thread)."""
        for out in outputs:
            for completion in out.outputs:
                if completion.finish_reason in OBSERVED_REASONS:
                    self.observe_finished(completion)

    def observe_finished(self, completion: CompletionOutput) -> None:
        m = completion.metrics
        if m is None:
            return
        for histogram, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e),
                                 (self.queue_time, m.queue_time)):
            if value is not None:
                histogram.observe(value)
        for gap in m.itls:
            self.itl.observe(gap)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class SlotWindow:
    """Busy slots of the iterations of the last `window_s` seconds.

    NOTE: `on_iteration` runs in the engine thread and `utilisation` in the server's; the
    lock guards the deque between them.
    """

    def __init__(self, num_slots: int, window_s: float, maxlen: int = 100_000) -> None:
        self.num_slots = num_slots
        self.window_s = window_s
        self._busy: deque[tuple[float, int]] = deque(maxlen=maxlen)  # (time, busy slots)
        self._lock = threading.Lock()

    def on_iteration(self, record: dict) -> None:
        """Trace listener: one iteration record (see slotserve.obs.trace).

        NOTE: busy as in the seed and the simulator: the slot processed tokens (prefill or
        decode); a stalled slot is held but idle.
        """
        self.add(sum(is_busy(slot) for slot in record["slots"]))

    def add(self, busy: int, now: float | None = None) -> None:
        with self._lock:
            self._busy.append((time.monotonic() if now is None else now, busy))

    def utilisation(self, now: float | None = None) -> float:
        """Busy slot-iterations / (slots x iterations) in the window; 0 when idle."""
        horizon = (time.monotonic() if now is None else now) - self.window_s
        with self._lock:
            while self._busy and self._busy[0][0] < horizon:
                self._busy.popleft()
            busy = [b for _, b in self._busy]
        if not busy:
            return 0.0
        return sum(busy) / (self.num_slots * len(busy))


class EngineCollector(Collector):
    """Gauges and counters read from the live engine at each scrape.

    NOTE: read from the server thread while the engine thread runs: each value is one
    attribute or len() read, so a scrape may mix two iterations but never sees a torn value.
    """

    def __init__(self, engine, slots: SlotWindow) -> None:
        self.engine = engine
        self.slots = slots

    def collect(self):
        yield from self._gauges()
        yield from self._counters()

    def _gauges(self):
        sched, kv = self.engine.scheduler, self.engine.kv
        values = (
            ("num_requests_running", "Requests in the running batch.", sched.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", sched.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", kv.usage),
            ("kv_blocks_free", "Free KV blocks.", kv.num_free_blocks),
            ("kv_blocks_total", "KV blocks in the pool.", kv.num_blocks),
            ("slot_utilisation", "Busy slots / max_num_seqs over the recent iterations.",
             self.slots.utilisation()),
        )
        for name, doc, value in values:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)

    def _counters(self):
        stats = self.engine.stats
        yield CounterMetricFamily(PREFIX + "num_preemptions", "Preemptions so far.",
                                  value=self.engine.scheduler.num_preemptions)
        yield CounterMetricFamily(PREFIX + "prompt_tokens", "Prompt tokens admitted.",
                                  value=stats.prompt_tokens)
        yield CounterMetricFamily(PREFIX + "generation_tokens", "Tokens generated.",
                                  value=stats.generation_tokens)
        success = CounterMetricFamily(PREFIX + "request_success",
                                      "Finished completions, by finish reason.",
                                      labels=["finished_reason"])
        for reason, count in sorted(dict(stats.finished_by_reason).items()):
            success.add_metric([reason], count)
        yield success
