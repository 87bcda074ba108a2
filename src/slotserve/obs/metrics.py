"""Prometheus metrics of one engine, named like vLLM's (`slotserve:` for `vllm:`).

- Names: `slotserve:*`, and the same families under vLLM's names (`vllm:*`, with vLLM's
  `model_name` label) for what dashboards, autoscalers and endpoint pickers read
  (VLLM_FAMILIES). `names="both"` (the default) exposes both, so the live view's and
  existing scrapes' names keep working beside vLLM's; "vllm" or "slotserve" one set.

- Gauges and engine-wide counters come from the engine's `snapshot()` at scrape time (a
  custom collector), so they are never stale and cost nothing per iteration; among them
  the prefix cache's `prefix_cache_queries_total` / `prefix_cache_hits_total` (tokens, as
  vLLM counts them) and `prefix_cache_hit_rate`.
- Latency histograms are observed from each `IterationEvent`'s finished completions, in
  the engine thread (`subscribe`); prometheus_client metrics are thread-safe.
- Speculative decoding (--speculative-config), as vLLM names them: `spec_decode_num_drafts`
  (verifications: a sequence with draft tokens in an iteration), `..._num_draft_tokens`,
  `..._num_accepted_tokens` and `..._num_accepted_tokens_per_pos{position}` (drafts accepted
  at each position 0, 1, ... of a verification), from each iteration's trace record.
- Slot utilisation (busy slot-iterations / (slots x iterations), as in the seed) covers the
  iterations of the last `window_s` seconds (a `SlotWindow` fed by the same events).
- Scheduling (--scheduling-policy): `scheduling_policy_info{scheduling_policy}`; per tenant
  (label `tenant`) the tokens served and the virtual counter (from the snapshot), queue time
  and TTFT sums and counts (from the events), and goodput: `request_slo_met_total` /
  `request_slo_missed_total` (finished stop / length within both SLOs, or not; "rejected"
  ones missed) and the gauge `slo_attainment` (met / judged since start, 0 before any).
  Every tenant known at start ("default", the keys file's, SchedulerConfig.tenant_weights')
  has its series from the start, at zero. NOTE: tenant labels are bounded by the server
  (keys-file tenants, or --max-user-tenants names of the `user` field).

Each ServerMetrics has its own CollectorRegistry, so a process can hold several apps.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from slotserve.engine.events import (
    FINISH_REASONS,
    OBSERVED_REASONS,
    FinishedCompletion,
    IterationEvent,
)
from slotserve.obs.subscriber import EngineSubscriber
from slotserve.obs.windows import SlotWindow

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "slotserve:"
VLLM_PREFIX = "vllm:"
METRIC_NAMES = ("both", "vllm", "slotserve")  # which names /metrics exposes
# Families also exposed under vLLM's name (the part after the prefix is the same), with the
# label model_name: vLLM v1's engine and request metrics that slotserve measures alike.
VLLM_FAMILIES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
    "generation_tokens", "request_success", "time_to_first_token_seconds",
    "time_per_output_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
    "request_generation_tokens", "iteration_tokens_total",
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
})
DEFAULT_TENANT = "default"
# Finish reasons judged against the SLOs (goodput): normal ends, and the deadline policy's
# rejections (missed by definition). Aborted and failed requests are not judged.
SLO_JUDGED_REASONS = (*OBSERVED_REASONS, "rejected")

# Buckets as vLLM's (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets), at least (1,)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(buckets) or (1,)
            buckets.append(step * scale)
        scale *= 10


class ServerMetrics(EngineSubscriber):
    """The metrics of one served engine. `attach()` starts feeding them.

    engine: what publishes the engine's read side, `snapshot()` and `subscribe()` (an
    AsyncEngine or an LLMEngine).
    """

    def __init__(self, engine, window_s: float = 10.0, tenants=(),
                 model_name: str | None = None, names: str = "both") -> None:
        """tenants: tenant names whose series exist from the start (with "default" and the
        engine's configured tenants). model_name: the `model_name` label of the vLLM names
        (default: the model's own name). names: one of METRIC_NAMES."""
        super().__init__(engine)
        if names not in METRIC_NAMES:
            raise ValueError(f"names must be one of {METRIC_NAMES}, got {names!r}")
        self.names = names
        self.registry = CollectorRegistry()
        snap = engine.snapshot()
        self.model_name = model_name or snap.model
        self.slots = SlotWindow(snap.num_slots, window_s)
        self._histograms(self.registry)
        self._token_histograms(self.registry, snap)
        self.known_tenants = tuple(sorted({DEFAULT_TENANT, *tenants,
                                           *getattr(snap, "configured_tenants", ())}))
        self._tenant_metrics(self.registry)
        self._spec_metrics(self.registry)
        self.registry.register(EngineCollector(engine, self.slots, self))

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

    def _token_histograms(self, registry: CollectorRegistry, snap) -> None:
        def hist(name: str, doc: str, limit: int) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=token_buckets(limit),
                             registry=registry)

        self.request_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens of a "
                                          "finished request.", snap.max_model_len)
        self.request_generation_tokens = hist("request_generation_tokens", "Tokens a "
                                              "finished request generated.", snap.max_model_len)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens one iteration "
                                     "processed (prefill chunks + decodes).",
                                     snap.max_num_batched_tokens)

    def _spec_metrics(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels=()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        self.spec_drafts = counter("spec_decode_num_drafts", "Verifications of draft tokens "
                                   "(a sequence with drafts in one iteration).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Draft tokens proposed and verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by their "
            "position in the verification (0: the first draft).", ["position"])

    def _observe_speculation(self, record: dict) -> None:
        """Count the drafts of one iteration's trace record (slots with `proposed`)."""
        for slot in record["slots"]:
            proposed = slot.get("proposed", 0) if slot else 0
            if not proposed:
                continue
            accepted = slot.get("accepted", 0)
            self.spec_drafts.inc()
            self.spec_draft_tokens.inc(proposed)
            self.spec_accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.spec_accepted_per_pos.labels(str(position)).inc()

    def _tenant_metrics(self, registry: CollectorRegistry) -> None:
        # NOTE: histograms, not summaries: clients such as aiperf collect only histograms;
        # the tenants are bounded (API keys, or ServerLimits.max_user_tenants `user` names).
        self.tenant_ttft = Histogram(PREFIX + "tenant_time_to_first_token_seconds",
                                     "Time to first token, by tenant.", ["tenant"],
                                     buckets=TTFT_BUCKETS, registry=registry)
        self.tenant_queue_time = Histogram(PREFIX + "tenant_request_queue_time_seconds",
                                           "Arrival to first scheduled iteration, by tenant.",
                                           ["tenant"], buckets=REQUEST_BUCKETS,
                                           registry=registry)
        self.slo_met = Counter(PREFIX + "request_slo_met",
                               "Finished requests within both SLOs (goodput), by tenant.",
                               ["tenant"], registry=registry)
        self.slo_missed = Counter(PREFIX + "request_slo_missed",
                                  "Finished (or rejected) requests that missed an SLO, by "
                                  "tenant.", ["tenant"], registry=registry)
        self._slo_lock = threading.Lock()  # guards the two totals below (read at scrapes)
        self.slo_met_total = 0
        self.slo_judged_total = 0
        for tenant in self.known_tenants:
            self._label_tenant(tenant)

    def _label_tenant(self, tenant: str) -> None:
        """Give a tenant its series (at zero until observed); idempotent."""
        for metric in (self.tenant_ttft, self.tenant_queue_time, self.slo_met, self.slo_missed):
            metric.labels(tenant)

    @property
    def slo_attainment(self) -> float:
        """Requests within both SLOs / requests judged, since start (0.0 before any)."""
        with self._slo_lock:
            return self.slo_met_total / self.slo_judged_total if self.slo_judged_total else 0.0

    def on_iteration(self, event: IterationEvent) -> None:
        """Subscriber (engine thread): the slots' work and the finished latencies."""
        self.slots.on_iteration(event.record)
        self.iteration_tokens.observe(sum(s["tokens"] for s in event.record["slots"] if s))
        self._observe_speculation(event.record)
        for finished in event.observed():
            self.observe_finished(finished)
        for finished in event.finished:
            self._label_tenant(finished.tenant)
            if finished.finish_reason in SLO_JUDGED_REASONS:
                self.observe_goodput(finished)

    def observe_goodput(self, finished: FinishedCompletion) -> None:
        """Count a judged completion (SLO_JUDGED_REASONS) as within its SLOs or not."""
        (self.slo_met if finished.met_slo else self.slo_missed).labels(finished.tenant).inc()
        with self._slo_lock:
            self.slo_judged_total += 1
            self.slo_met_total += int(finished.met_slo)

    def observe_finished(self, finished: FinishedCompletion) -> None:
        self.request_prompt_tokens.observe(finished.num_prompt_tokens)
        self.request_generation_tokens.observe(finished.num_output_tokens)
        m = finished.metrics
        if m is None:
            return
        for histogram, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e),
                                 (self.queue_time, m.queue_time)):
            if value is not None:
                histogram.observe(value)
        for gap in m.itls:
            self.itl.observe(gap)
        for summary, value in ((self.tenant_ttft, m.ttft), (self.tenant_queue_time,
                                                            m.queue_time)):
            if value is not None:
                summary.labels(finished.tenant).observe(value)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric, under the names asked for."""
        families = list(self.registry.collect())
        shown = families if self.names != "vllm" else []
        if self.names != "slotserve":
            shown += [vllm_family(f, self.model_name) for f in families
                      if f.name.removeprefix(PREFIX) in VLLM_FAMILIES]
        return generate_latest(FixedRegistry(shown))


def vllm_family(family: Metric, model_name: str) -> Metric:
    """A copy of a `slotserve:` family under its `vllm:` name, every sample labelled with
    model_name."""
    name = VLLM_PREFIX + family.name.removeprefix(PREFIX)
    copy = Metric(name, family.documentation, family.type, family.unit)
    for s in family.samples:
        copy.add_sample(name + s.name.removeprefix(family.name),
                        {"model_name": model_name, **s.labels}, s.value, s.timestamp,
                        s.exemplar)
    return copy


class FixedRegistry(CollectorRegistry):
    """A registry that exposes the given families as they are."""

    def __init__(self, families: list[Metric]) -> None:
        super().__init__(auto_describe=False)
        self.families = families

    def collect(self):
        return iter(self.families)


class EngineCollector(Collector):
    """Gauges and counters from one engine snapshot per scrape (so they agree)."""

    def __init__(self, engine, slots: SlotWindow, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.slots = slots
        self.metrics = metrics

    def collect(self):
        snap = self.engine.snapshot()
        yield from self._gauges(snap)
        yield from self._counters(snap)
        yield from self._scheduling(snap)

    def _scheduling(self, snap):
        """The policy (an info gauge), per-tenant service and SLO attainment."""
        info = GaugeMetricFamily(PREFIX + "scheduling_policy_info",
                                 "The scheduling policy (--scheduling-policy), as a label.",
                                 labels=["scheduling_policy"])
        info.add_metric([snap.scheduling_policy], 1)
        yield info
        known = self.metrics.known_tenants if self.metrics is not None else ()
        tenants = {name: None for name in known}
        tenants.update({t.name: t for t in snap.tenants})
        families = (
            (CounterMetricFamily, "tenant_prompt_tokens", "Prompt tokens processed, by "
             "tenant (prefix-cache hits are not).", "prompt_tokens"),
            (CounterMetricFamily, "tenant_generation_tokens", "Tokens generated, by tenant.",
             "output_tokens"),
            (GaugeMetricFamily, "tenant_virtual_counter", "The fair-share virtual token "
             "counter (weighted service), by tenant.", "virtual_counter"),
            (GaugeMetricFamily, "tenant_requests_active", "Requests waiting or running, by "
             "tenant.", "active"),
        )
        for kind, name, doc, attr in families:
            family = kind(PREFIX + name, doc, labels=["tenant"])
            for tenant, view in sorted(tenants.items()):
                family.add_metric([tenant], getattr(view, attr) if view is not None else 0)
            yield family
        if self.metrics is not None:
            yield GaugeMetricFamily(PREFIX + "slo_attainment", "Finished requests within "
                                    "both SLOs / finished or rejected ones, since start.",
                                    value=self.metrics.slo_attainment)

    def _gauges(self, snap):
        values = (
            ("num_requests_running", "Requests in the running batch.", snap.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", snap.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", snap.kv_usage),
            ("kv_blocks_free", "Free KV blocks.", snap.kv_blocks_free),
            ("kv_blocks_total", "KV blocks in the pool.", snap.kv_blocks_total),
            ("kv_blocks_cached_free", "Free KV blocks that still hold cached prefixes.",
             snap.kv_blocks_cached_free),
            ("kv_blocks_shared", "KV blocks held by more than one request.",
             snap.kv_blocks_shared),
            ("prefix_cache_hit_rate", "Prefix-cache hits / queries in tokens, since start.",
             snap.prefix_cache_hit_rate),
            ("slot_utilisation", "Busy slots / max_num_seqs over the recent iterations.",
             self.slots.utilisation()),
        )
        for name, doc, value in values:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)

    def _counters(self, snap):
        counters = (
            ("num_preemptions", "Preemptions so far.", snap.num_preemptions),
            ("prompt_tokens", "Prompt tokens admitted.", snap.prompt_tokens),
            ("generation_tokens", "Tokens generated.", snap.generation_tokens),
            ("prefix_cache_queries", "Prefix-cache queries, in tokens (a request's length "
             "at each admission).", snap.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix-cache hits, in tokens (found cached, not computed).",
             snap.prefix_cache_hits),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        success = CounterMetricFamily(PREFIX + "request_success",
                                      "Finished completions, by finish reason.",
                                      labels=["finished_reason"])
        # NOTE: every reason from the start (at 0), so rate() and alerts see the series
        for reason, count in {**dict.fromkeys(FINISH_REASONS, 0),
                              **dict(snap.finished_by_reason)}.items():
            success.add_metric([reason], count)
        yield success
