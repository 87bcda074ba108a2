"""Scheduling policies on the real engine and on the simulator (issue 18, "Show"), three
comparisons in one run:

1. flooding tenant, fcfs vs fair: tenant A sends 4x tenant B's rate, together 5x capacity
   (B alone 1x, above its fair half, so both stay backlogged); B's TTFT p50, B's share of
   the service in the iterations that begin with both tenants waiting, throughput.
   NOTE on B's TTFT ratio: with B at x times capacity, in the fluid limit FCFS makes a
   request arriving at t wait (5x - 1) t and fair share (B served at half the capacity)
   (2x - 1) t, a ratio of (5x - 1) / (2x - 1): 4 at x = 1, 3 at x = 2, 2.5 for a burst
   (x large); below x = 0.5 B is not backlogged under fair share. The 3x target needs
   0.5 < x < 2, and a run long enough that the start (A holding every slot when B comes)
   and Poisson noise do not dominate (simulated at x = 1, 3 seeds: 10 B requests gave
   x1.5-2.8, 16 gave x2.8-4.6, 20 gave x2.6-4.7).
2. goodput, fcfs vs deadline: short interactive requests with tight SLOs among long batch jobs,
   Poisson arrivals swept over rate; SLO attainment and goodput (requests meeting both SLOs
   per second), plotted; goodput at 90% attainment (DistServe's definition, interpolated).
3. priority, fcfs vs priority: high-priority requests' TTFT under load.

    python -m benchmarks.policies --out benchmarks/results/policies.json \\
        --plot benchmarks/results/policies-goodput.png     # SmolLM2, ~12 min (simulated)
    python -m benchmarks.policies --simulate-only          # the simulated half, seconds
    python -m benchmarks.policies --tiny       # a tiny random model: checks the script, fast

The engine runs in-process with a real-time arrival loop: a request is added (with its
tenant, priority and SLOs) when its arrival time comes, between `engine.step()` calls, and its
TTFT/TPOT come from the outputs' RequestMetrics. Every run drains (all requests finish).

Simulated: the same comparisons, settings, schedules and driver on `SimEngine`, the real
scheduler and policy objects on a virtual clock moved by the calibrated cost profile
(`--profile`, the replay simulator's; SmolLM2 on this machine by default). The simulation
calibrates itself the same way, so its rates and SLOs are the same multiples of its own
capacity and step. The report then lists, per figure, which policy is better measured and
simulated, and whether they agree; its `predicted_engine_seconds` is how long the real
run's engine time should be.

Sizing is relative to a calibration just before each comparison, because this CPU's speed
moves with other load: `capacity` (requests/s one engine serves when saturated, FCFS, requests
all at t=0) of each request shape, and `step` (median iteration time with the slots full of
decodes). Arrival rates are multiples of the capacity, SLOs multiples of the step (the
settings are the `Settings` fields, one flag each, recorded in the JSON). Policies of one
comparison run back to back on identically configured fresh engines over the same arrival
schedule; the goodput sweep alternates which policy goes first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from slotserve.config import EngineConfig, engine_config
from slotserve.engine.llm_engine import LLMEngine, set_torch_threads
from slotserve.engine.outputs import RequestMetrics
from slotserve.lab.replay import VirtualEngineCore, load_profile
from slotserve.lab.workload import poisson_arrivals, random_token_prompts
from slotserve.percentile import percentile
from slotserve.request import Request
from slotserve.sampling import SamplingParams

FINISHED_OK = ("stop", "length")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = "benchmarks/results/replay-profile.json"  # SmolLM2 on this machine
SMOLLM2_VOCAB = 49152  # NOTE: --simulate-only draws the same prompts as the SmolLM2 run


# ---------------------------------------------------------------------- clocks and engines
class RealClock:
    """Wall-clock time for the real engine's runs."""

    @staticmethod
    def now() -> float:
        return time.monotonic()

    @staticmethod
    def sleep_until(t: float) -> None:
        time.sleep(max(0.0, t - time.monotonic()))


@dataclass
class SimOutput:
    """What `drive` reads of a RequestOutput, for a simulated request."""

    request_id: str
    finished: bool
    finish_reason: str | None
    token_ids: list[int]
    metrics: RequestMetrics


class SimEngine:
    """The engine's scheduling on a virtual clock (the replay simulator's pieces): the real
    `Scheduler`, KV manager and policy object of the same config, and a `FakeRunner` that
    moves the clock by the calibrated profile's time for each planned iteration.

    It offers what `drive` and `calibrate` use of an `LLMEngine` (add_request, step,
    has_unfinished_requests, scheduler, scheduler_config) and its clock (now, sleep_until),
    so a simulated run goes through the same driver and statistics as a measured one.
    """

    def __init__(self, config: EngineConfig, cost_model) -> None:
        # NOTE: the replay simulator's core: the scheduler reads the virtual clock, so SLO
        # deadlines, slack and the deadline policy's learnt iteration time are all in
        # simulated seconds; a KV pool not given is the engine's default when memory is
        # plentiful (every slot can hold a max_model_len sequence), as the benchmark's
        # engines are sized.
        self.core = VirtualEngineCore(config.scheduler, config.cache, cost_model)
        self.clock, self.kv = self.core.clock, self.core.kv
        self.scheduler, self.runner = self.core.scheduler, self.core.runner

    @property
    def scheduler_config(self):
        return self.scheduler.config

    def now(self) -> float:
        return self.clock.now

    def sleep_until(self, t: float) -> None:
        self.clock.advance_to(t)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    arrival: float, priority: int = 0, tenant: str = "default",
                    slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> None:
        request = Request(request_id, list(prompt), params, priority=priority, tenant=tenant,
                          slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
        request.times.arrival = arrival
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[SimOutput]:
        plan, updated = self.core.step()
        if plan.is_empty:
            raise RuntimeError(f"the scheduler planned nothing with "
                               f"{len(self.scheduler.requests)} requests unfinished")
        return [SimOutput(r.request_id, r.is_finished, r.finish_reason,
                          list(r.output_token_ids), RequestMetrics.of(r)) for r in updated]

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


Engine = LLMEngine | SimEngine
EngineFactory = Callable[[str], Engine]  # scheduling policy -> a fresh engine


def clock_of(engine: Engine):
    """The clock a run of this engine is timed by (virtual for a SimEngine)."""
    return engine if isinstance(engine, SimEngine) else RealClock


# ---------------------------------------------------------------------- requests and records
@dataclass(frozen=True)
class Arrival:
    """One request of a schedule: when it comes (s after the run's start) and what it asks."""

    id: str
    at: float
    prompt: list[int]
    max_tokens: int
    kind: str = "chat"  # which class of the workload (for per-class statistics)
    tenant: str = "default"
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


@dataclass
class Record:
    """What became of one request (latencies in seconds, from the engine's RequestMetrics)."""

    id: str
    kind: str
    tenant: str
    priority: int
    finish_reason: str | None
    output_tokens: int
    ttft: float | None
    tpot: float | None
    preemptions: int
    met_slo: bool


def met_slo(finish_reason: str | None, ttft: float | None, tpot: float | None,
            slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Goodput's test, as `Request.met_slo`: finished normally, first token within the TTFT
    SLO, mean time per output token after the first within the TPOT SLO (no SLO: met; fewer
    than two tokens: TPOT met)."""
    if finish_reason not in FINISHED_OK or ttft is None:
        return False
    if slo_ttft_ms is not None and ttft * 1000.0 > slo_ttft_ms:
        return False
    return slo_tpot_ms is None or tpot is None or tpot * 1000.0 <= slo_tpot_ms


@dataclass
class RunResult:
    """One drive of an engine through a schedule."""

    records: list[Record]
    duration: float  # first arrival to last finish (s)
    step_seconds: list[float]
    prompt_tokens: dict[str, int]  # per tenant, processed during the run
    output_tokens: dict[str, int]
    # Per tenant, service (prompt and output tokens) in the iterations that began with every
    # tenant of `backlog_tenants` waiting, and how long those iterations took.
    backlogged_prompt: dict[str, int] = field(default_factory=dict)
    backlogged_output: dict[str, int] = field(default_factory=dict)
    backlogged_seconds: float = 0.0
    preemptions: int = 0

    @property
    def tokens_served(self) -> int:
        return sum(self.prompt_tokens.values()) + sum(self.output_tokens.values())


def _tenant_tokens(engine: Engine) -> dict[str, tuple[int, int]]:
    tenants = engine.scheduler.policy_state()["tenants"]
    return {name: (t["prompt_tokens"], t["output_tokens"]) for name, t in tenants.items()}


def _add(engine: Engine, arrival: Arrival, t0: float) -> None:
    params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0.0, ignore_eos=True)
    # NOTE: arrival is the scheduled time, so a request added late (the loop was inside a
    # step) still counts its wait in its TTFT, as a server's queue would.
    engine.add_request(arrival.id, arrival.prompt, params, arrival=t0 + arrival.at,
                       priority=arrival.priority, tenant=arrival.tenant,
                       slo_ttft_ms=arrival.slo_ttft_ms, slo_tpot_ms=arrival.slo_tpot_ms)


def drive(engine: Engine, schedule: Iterable[Arrival],
          backlog_tenants: tuple[str, ...] = ()) -> RunResult:
    """Run the schedule on an idle engine until every request has finished: in real time,
    or for a SimEngine on its virtual clock (the same loop and accounting)."""
    clock = clock_of(engine)
    pending = deque(sorted(schedule, key=lambda a: a.at))
    by_id = {a.id: a for a in pending}
    if len(by_id) != len(pending):
        raise ValueError("schedule: request ids must be unique")
    records: list[Record] = []
    steps: list[float] = []
    start_tokens = _tenant_tokens(engine)
    start_preemptions = engine.scheduler.num_preemptions
    back_prompt = dict.fromkeys(backlog_tenants, 0)
    back_output = dict.fromkeys(backlog_tenants, 0)
    back_seconds = 0.0
    t0 = clock.now()
    last_finish = t0
    while pending or engine.has_unfinished_requests():
        while pending and t0 + pending[0].at <= clock.now():
            _add(engine, pending.popleft(), t0)
        if not engine.has_unfinished_requests():
            clock.sleep_until(t0 + pending[0].at)
            continue
        waiting = {r.tenant for r in engine.scheduler.waiting}
        backlogged = bool(backlog_tenants) and waiting >= set(backlog_tenants)
        before = _tenant_tokens(engine) if backlogged else {}
        began = clock.now()
        outputs = engine.step()
        steps.append(clock.now() - began)
        if backlogged:
            back_seconds += steps[-1]
            after = _tenant_tokens(engine)
            for tenant in backlog_tenants:
                was = before.get(tenant, (0, 0))
                now = after.get(tenant, (0, 0))
                back_prompt[tenant] += now[0] - was[0]
                back_output[tenant] += now[1] - was[1]
        for out in outputs:
            if out.finished:
                records.append(_record(by_id[out.request_id], out))
                last_finish = clock.now()
    end_tokens = _tenant_tokens(engine)
    prompt = {t: end_tokens[t][0] - start_tokens.get(t, (0, 0))[0] for t in end_tokens}
    output = {t: end_tokens[t][1] - start_tokens.get(t, (0, 0))[1] for t in end_tokens}
    return RunResult(records, last_finish - t0, steps, prompt, output, back_prompt, back_output,
                     back_seconds, engine.scheduler.num_preemptions - start_preemptions)


def _record(arrival: Arrival, out) -> Record:
    m = out.metrics
    return Record(arrival.id, arrival.kind, arrival.tenant, arrival.priority, out.finish_reason,
                  len(out.token_ids), m.ttft, m.tpot, m.num_preemptions,
                  met_slo(out.finish_reason, m.ttft, m.tpot, arrival.slo_ttft_ms,
                          arrival.slo_tpot_ms))


# ---------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Shape:
    """A class of requests: prompt length range and output length (exact: ignore_eos)."""

    prompt_min: int
    prompt_max: int
    max_tokens: int


CHAT = Shape(24, 64, 16)  # the flooding and priority comparisons
INTERACTIVE = Shape(16, 48, 16)  # goodput: tight SLOs
BATCH = Shape(160, 256, 32)  # goodput: long jobs, loose SLOs


def schedule_of(times: list[float], shapes: list[Shape], vocab: int, rng: np.random.Generator,
                prefix: str, **fields) -> list[Arrival]:
    """Arrivals at `times` with the given shapes (random token prompts); `fields` per request
    may be values or lists (one per request)."""
    out = []
    for i, (at, shape) in enumerate(zip(times, shapes)):
        (prompt,) = random_token_prompts(1, shape.prompt_min, shape.prompt_max, vocab, rng)
        extra = {k: v[i] if isinstance(v, list) else v for k, v in fields.items()}
        out.append(Arrival(f"{prefix}{i}", float(at), prompt, shape.max_tokens, **extra))
    return out


def flood_schedule(b_rate: float, count_b: int, vocab: int, seed: int,
                   a_factor: float = 4.0) -> list[Arrival]:
    """Tenant B: Poisson at b_rate, count_b requests; tenant A: Poisson at a_factor x b_rate
    over the same span (a_factor x count_b requests). Both CHAT-shaped."""
    rng = np.random.default_rng(seed)
    count_a = round(a_factor * count_b)
    a = schedule_of(poisson_arrivals(count_a, a_factor * b_rate, rng), [CHAT] * count_a, vocab,
                    rng, "A", kind="A", tenant="A")
    b = schedule_of(poisson_arrivals(count_b, b_rate, rng), [CHAT] * count_b, vocab, rng, "B",
                    kind="B", tenant="B")
    return a + b


@dataclass(frozen=True)
class Slos:
    """SLOs (ms) of the goodput workload's two classes."""

    interactive_ttft_ms: float
    interactive_tpot_ms: float
    batch_ttft_ms: float
    batch_tpot_ms: float


def mixed_schedule(rate: float, count: int, batch_fraction: float, slos: Slos, vocab: int,
                   seed: int) -> list[Arrival]:
    """Poisson arrivals at `rate`; each request is a BATCH job with probability batch_fraction,
    else INTERACTIVE, with its class's SLOs. The same seed gives the same classes and prompts
    at every rate (only the times scale)."""
    rng = np.random.default_rng(seed)
    is_batch = (rng.random(count) < batch_fraction).tolist()
    gaps = poisson_arrivals(count, 1.0, rng)
    times = [t / rate for t in gaps]
    shapes = [BATCH if b else INTERACTIVE for b in is_batch]
    kinds = ["batch" if b else "interactive" for b in is_batch]
    ttft = [slos.batch_ttft_ms if b else slos.interactive_ttft_ms for b in is_batch]
    tpot = [slos.batch_tpot_ms if b else slos.interactive_tpot_ms for b in is_batch]
    return schedule_of(times, shapes, vocab, rng, "m", kind=kinds, slo_ttft_ms=ttft,
                       slo_tpot_ms=tpot)


def priority_schedule(rate: float, count: int, high_fraction: float, vocab: int,
                      seed: int) -> list[Arrival]:
    """Poisson arrivals at `rate`, CHAT-shaped; a request is high priority (0) with
    probability high_fraction, else low (1). Lower runs first, as vLLM."""
    rng = np.random.default_rng(seed)
    high = (rng.random(count) < high_fraction).tolist()
    times = poisson_arrivals(count, rate, rng)
    return schedule_of(times, [CHAT] * count, vocab, rng, "p",
                       kind=["high" if h else "low" for h in high],
                       priority=[0 if h else 1 for h in high])


# ---------------------------------------------------------------------- statistics
def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 1)


def latency_summary(records: list[Record]) -> dict:
    """TTFT / TPOT p50 and p90 (ms) of the finished requests among records."""
    ttft = [r.ttft for r in records if r.ttft is not None]
    tpot = [r.tpot for r in records if r.tpot is not None]
    return {"requests": len(records), "ttft_p50_ms": ms(percentile(ttft, 50)),
            "ttft_p90_ms": ms(percentile(ttft, 90)), "tpot_p50_ms": ms(percentile(tpot, 50)),
            "tpot_p90_ms": ms(percentile(tpot, 90))}


def share(part: dict[str, int], other: dict[str, int], tenant: str, w_in: float = 1.0,
          w_out: float = 2.0) -> dict:
    """The tenant's share of prompt+output tokens, and of VTC cost (w_in x prompt + w_out x
    output), given per-tenant prompt (`part`) and output (`other`) token counts."""
    tokens = {t: part.get(t, 0) + other.get(t, 0) for t in set(part) | set(other)}
    cost = {t: w_in * part.get(t, 0) + w_out * other.get(t, 0) for t in tokens}
    total_tokens, total_cost = sum(tokens.values()), sum(cost.values())
    return {"tokens": tokens.get(tenant, 0) / total_tokens if total_tokens else None,
            "cost": cost.get(tenant, 0) / total_cost if total_cost else None}


def attainment(records: list[Record]) -> float | None:
    return sum(r.met_slo for r in records) / len(records) if records else None


def goodput_at(rates: list[float], attainments: list[float], threshold: float = 0.9
               ) -> tuple[float, str]:
    """DistServe's goodput: the highest rate at which attainment >= threshold, by linear
    interpolation between swept rates (rates ascending). Returns (rate, note): note is
    "interpolated", "below the sweep" (0.0: missed even at the lowest rate) or "at least"
    (met at the highest rate: the true value may be higher)."""
    if not rates or len(rates) != len(attainments):
        raise ValueError("rates and attainments must be non-empty and of equal length")
    if attainments[0] < threshold:
        return 0.0, "below the sweep"
    for i in range(1, len(rates)):
        if attainments[i] < threshold:
            lo, hi = attainments[i - 1], attainments[i]
            frac = (lo - threshold) / (lo - hi)
            return rates[i - 1] + frac * (rates[i] - rates[i - 1]), "interpolated"
    return rates[-1], "at least"


# ---------------------------------------------------------------------- calibration
def calibrate(engine: Engine, shapes: list[Shape], count: int, vocab: int,
              seed: int) -> dict:
    """Closed loop: `count` requests (shapes cycled) all at t=0, FCFS. Saturated capacity in
    requests/s, and the median iteration time while every slot decodes (`step_s`)."""
    rng = np.random.default_rng(seed)
    sched = schedule_of([0.0] * count, [shapes[i % len(shapes)] for i in range(count)], vocab,
                        rng, "cal")
    slots = engine.scheduler_config.max_num_seqs
    full_steps: list[float] = []
    steps_all: list[float] = []
    pending = deque(sched)
    clock = clock_of(engine)
    t0 = clock.now()
    while pending:
        _add(engine, pending.popleft(), t0)
    while engine.has_unfinished_requests():
        full = engine.scheduler.num_running == slots and all(
            r.num_pending_tokens <= 1 for r in engine.scheduler.running)
        began = clock.now()
        engine.step()
        steps_all.append(clock.now() - began)
        if full:
            full_steps.append(steps_all[-1])
    duration = clock.now() - t0
    step_s = statistics.median(full_steps or steps_all)
    return {"requests": count, "duration_s": round(duration, 3),
            "capacity_rps": count / duration, "step_s": step_s,
            "full_decode_steps": len(full_steps)}


def warm_up(engine: Engine, vocab: int) -> None:
    """One short request, so first-call costs fall outside the timed runs."""
    drive(engine, [Arrival("warm", 0.0, list(range(3, min(vocab, 40))), 4)])


# ---------------------------------------------------------------------- the comparisons
@dataclass
class Settings:
    slots: int = 8
    budget: int = 256
    # NOTE: B alone at 1x capacity, above its fair half (both stay backlogged) and below 2x
    # (above 2x, B's own backlog makes even fair share's ratio to FCFS < 3: module doc).
    flood_load: float = 5.0  # A+B arrival rate x the CHAT capacity
    flood_b_requests: int = 16  # A sends 4x as many over the same span
    # NOTE: chosen on the simulator (SmolLM2 profile) so FCFS's attainment crosses 90%
    # (between 0.5x and 1x) inside the sweep; with fewer than ~36 requests per rate the
    # queue never grows past the interactive TTFT SLO, and every rate meets it.
    goodput_loads: tuple[float, ...] = (0.5, 1.0, 1.5, 2.5)  # x the mixed capacity
    goodput_requests: int = 40  # per rate
    batch_fraction: float = 0.25
    interactive_ttft_steps: float = 20.0  # SLOs in calibrated full-decode steps
    interactive_tpot_steps: float = 3.0
    batch_ttft_steps: float = 200.0
    batch_tpot_steps: float = 6.0
    priority_load: float = 2.5  # x the CHAT capacity
    priority_requests: int = 32
    high_fraction: float = 0.25
    calibration_requests: int = 16  # per shape class (x2 for the mixed workload)
    seed: int = 0


def run_flood(make: EngineFactory, s: Settings, capacity: float, vocab: int, log) -> dict:
    b_rate = s.flood_load * capacity / 5.0
    sched = flood_schedule(b_rate, s.flood_b_requests, vocab, s.seed)
    runs = {}
    for policy in ("fcfs", "fair"):
        log(f"flood: {policy}, {len(sched)} requests, B at {b_rate:.3f} req/s, A 4x")
        engine = make(policy)
        warm_up(engine, vocab)
        result = drive(engine, sched, backlog_tenants=("A", "B"))
        runs[policy] = flood_summary(result, engine)
        del engine
    fcfs, fair = runs["fcfs"], runs["fair"]
    targets = {
        "b_share_within_10pct_of_weight_share": _within(fair["backlogged_b_share"]["cost"],
                                                         0.5, 0.10),
        "b_ttft_p50_3x_better": _ratio(fcfs["B"]["ttft_p50_ms"], fair["B"]["ttft_p50_ms"]),
        "throughput_within_5pct": _ratio(fair["tokens_per_s"], fcfs["tokens_per_s"]),
    }
    targets["b_ttft_p50_3x_better"]["met"] = _at_least(targets["b_ttft_p50_3x_better"], 3.0)
    thr = targets["throughput_within_5pct"]
    thr["met"] = None if thr["ratio"] is None else thr["ratio"] >= 0.95
    return {"b_rate_rps": b_rate, "a_rate_rps": 4 * b_rate, "weights": {"A": 1.0, "B": 1.0},
            "runs": runs, "targets": targets}


def flood_summary(result: RunResult, engine: Engine) -> dict:
    cfg = engine.scheduler_config
    w_in, w_out = cfg.fair_input_weight, cfg.fair_output_weight
    out = {tenant: latency_summary([r for r in result.records if r.tenant == tenant])
           for tenant in ("A", "B")}
    out.update(
        duration_s=round(result.duration, 2),
        tokens_per_s=result.tokens_served / result.duration,
        output_tokens_per_s=sum(result.output_tokens.values()) / result.duration,
        backlogged_s=round(result.backlogged_seconds, 2),
        backlogged_b_share=share(result.backlogged_prompt, result.backlogged_output, "B",
                                 w_in, w_out),
        whole_run_b_share=share(result.prompt_tokens, result.output_tokens, "B", w_in, w_out),
        preemptions=result.preemptions,
        failed=sum(r.finish_reason not in FINISHED_OK for r in result.records))
    return out


def _within(value: float | None, target: float, tolerance: float) -> dict:
    met = None if value is None else abs(value - target) <= tolerance * target
    return {"value": value, "target": target, "relative_tolerance": tolerance, "met": met}


def _ratio(numerator: float | None, denominator: float | None) -> dict:
    ratio = None if not numerator or not denominator else numerator / denominator
    return {"ratio": ratio}


def _at_least(entry: dict, bound: float) -> bool | None:
    return None if entry["ratio"] is None else entry["ratio"] >= bound


def run_goodput(make: EngineFactory, s: Settings, capacity: float, slos: Slos, vocab: int,
                log) -> dict:
    engines = {policy: make(policy) for policy in ("fcfs", "deadline")}
    for engine in engines.values():
        warm_up(engine, vocab)
    points: dict[str, list[dict]] = {p: [] for p in engines}
    rates = [load * capacity for load in s.goodput_loads]
    for index, rate in enumerate(rates):
        sched = mixed_schedule(rate, s.goodput_requests, s.batch_fraction, slos, vocab, s.seed)
        order = list(engines) if index % 2 == 0 else list(reversed(engines))
        for policy in order:  # NOTE: alternating order spreads the host's drift over both
            log(f"goodput: {policy} at {rate:.3f} req/s ({s.goodput_loads[index]}x capacity)")
            result = drive(engines[policy], sched)
            points[policy].append(goodput_point(rate, s.goodput_loads[index], result))
    summary = {}
    for policy, pts in points.items():
        at90, note = goodput_at(rates, [p["attainment"] for p in pts])
        summary[policy] = {"goodput_at_90_rps": at90, "note": note}
    ratio = _ratio(summary["deadline"]["goodput_at_90_rps"], summary["fcfs"]["goodput_at_90_rps"])
    ratio["met"] = _at_least(ratio, 1.5)
    return {"rates_rps": rates, "loads": list(s.goodput_loads), "slos_ms": asdict(slos),
            "points": points, "goodput_at_90": summary,
            "targets": {"goodput_at_90_1p5x": ratio}}


def goodput_point(rate: float, load: float, result: RunResult) -> dict:
    recs = result.records
    classes = {kind: [r for r in recs if r.kind == kind] for kind in ("interactive", "batch")}
    return {"rate_rps": rate, "load": load, "requests": len(recs),
            "duration_s": round(result.duration, 2),
            "attainment": attainment(recs),
            "goodput_rps": sum(r.met_slo for r in recs) / result.duration,
            "output_tokens_per_s": sum(result.output_tokens.values()) / result.duration,
            "preemptions": result.preemptions,
            **{f"{kind}_attainment": attainment(rs) for kind, rs in classes.items()},
            **{kind: latency_summary(rs) for kind, rs in classes.items()}}


def run_priority(make: EngineFactory, s: Settings, capacity: float, vocab: int, log) -> dict:
    rate = s.priority_load * capacity
    sched = priority_schedule(rate, s.priority_requests, s.high_fraction, vocab, s.seed)
    runs = {}
    for policy in ("fcfs", "priority"):
        log(f"priority: {policy}, {len(sched)} requests at {rate:.3f} req/s")
        engine = make(policy)
        warm_up(engine, vocab)
        result = drive(engine, sched)
        runs[policy] = {kind: latency_summary([r for r in result.records if r.kind == kind])
                        for kind in ("high", "low")}
        runs[policy].update(duration_s=round(result.duration, 2), preemptions=result.preemptions,
                            output_tokens_per_s=sum(result.output_tokens.values())
                            / result.duration)
        del engine
    ratio = _ratio(runs["fcfs"]["high"]["ttft_p50_ms"], runs["priority"]["high"]["ttft_p50_ms"])
    return {"rate_rps": rate, "load": s.priority_load, "runs": runs,
            "high_ttft_p50_fcfs_over_priority": ratio["ratio"]}


# ---------------------------------------------------------------------- engines, report
def engine_factory(tiny: bool, s: Settings) -> tuple[EngineFactory, int, str]:
    """(policy -> fresh engine, vocabulary size, model description); weights loaded once."""
    if tiny:
        model_config, weights = tiny_random_model()
        tokenizer, source = None, "tiny random llama (hidden 64, 3 layers)"
    else:
        from slotserve.loader import load_model

        loaded = load_model()
        model_config, weights, tokenizer = loaded.config, loaded.weights, loaded.tokenizer
        source = f"{model_config.name} ({loaded.source})"

    def make(policy: str) -> LLMEngine:
        return LLMEngine(config_for(policy, s), model_config, weights, tokenizer)

    return make, model_config.vocab_size, source


def config_for(policy: str, s: Settings) -> EngineConfig:
    """The engine configuration of every run (measured or simulated) of a policy."""
    max_len = BATCH.prompt_max + BATCH.max_tokens + 16
    return engine_config(max_num_seqs=s.slots, max_num_batched_tokens=s.budget,
                         max_model_len=max_len, scheduling_policy=policy)


class SimFactory:
    """policy -> a fresh SimEngine on the profile; `seconds` sums the simulated time of
    every engine made (calibrations and warm-ups included): the real run's predicted time."""

    def __init__(self, s: Settings, cost_model) -> None:
        self.settings, self.cost_model = s, cost_model
        self.engines: list[SimEngine] = []

    def __call__(self, policy: str) -> SimEngine:
        engine = SimEngine(config_for(policy, self.settings), self.cost_model)
        self.engines.append(engine)
        return engine

    @property
    def seconds(self) -> float:
        return sum(engine.clock.now for engine in self.engines)


def tiny_random_model():
    """A small random-weight Llama (as tests/conftest.py's), for quick runs of this script."""
    import torch
    import transformers

    from slotserve.config import ModelConfig

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ModelConfig.from_hf_dict(cfg.to_dict(), name="tiny"), weights


def slos_from(step_s: float, s: Settings) -> Slos:
    step_ms = step_s * 1000.0
    return Slos(interactive_ttft_ms=s.interactive_ttft_steps * step_ms,
                interactive_tpot_ms=s.interactive_tpot_steps * step_ms,
                batch_ttft_ms=s.batch_ttft_steps * step_ms,
                batch_tpot_ms=s.batch_tpot_steps * step_ms)


def plot_goodput(goodput: dict | None, path: str, simulated: dict | None = None) -> None:
    """Attainment and goodput over rate, per policy: measured (solid) and simulated (dashed,
    over its own calibrated rates)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for section, style, suffix in ((goodput, "-", ""), (simulated, "--", " (simulated)")):
        for policy, pts in (section or {"points": {}})["points"].items():
            rates = [p["rate_rps"] for p in pts]
            label = policy + suffix
            left.plot(rates, [100 * p["attainment"] for p in pts], style, marker="o",
                      label=label)
            right.plot(rates, [p["goodput_rps"] for p in pts], style, marker="o", label=label)
    left.axhline(90, color="grey", linestyle="--", linewidth=1)
    left.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 102),
             title="requests meeting both SLOs")
    right.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)",
              title="goodput (requests meeting both SLOs per second)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_report(report: dict) -> str:
    """The comparisons that ran, as text tables: measured, simulated, then side by side."""
    lines = []
    if "model" in report:
        lines += [f"measured, model: {report['model']}", *_section_lines(report),
                  f"\ntargets (measured): {report['targets']}"]
    sim = report.get("simulated")
    if sim:
        lines += [f"\nsimulated on {sim['profile']} (predicted engine time of this run "
                  f"{sim['predicted_engine_seconds']:.0f} s)", *_section_lines(sim),
                  f"\ntargets (simulated): {sim['targets']}"]
    if report.get("agreement"):
        lines += ["\nranking, measured vs simulated (better policy; tie within 2%)",
                  f"{'figure':34} {'measured':>32} {'simulated':>32}  better m / s  agrees"]
        for row in report["agreement"]:
            lines.append(f"{row['figure']:34} {_pair(row['measured']):>32} "
                         f"{_pair(row['simulated']):>32}  {row['measured_better']} / "
                         f"{row['simulated_better']}  {row['agrees']}")
    return "\n".join(lines)


def _section_lines(sections: dict) -> list[str]:
    lines = []
    if "flood" in sections:
        lines += _flood_lines(sections["flood"])
    if "goodput" in sections:
        lines += _goodput_lines(sections["goodput"])
    if "priority" in sections:
        lines += _priority_lines(sections["priority"])
    return lines


def _pair(values: dict[str, float | None]) -> str:
    return " ".join(f"{p} {_g(v)}" for p, v in values.items())


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _flood_lines(flood: dict) -> list[str]:
    lines = [_calibration_line(flood), f"flooding tenant: B {flood['b_rate_rps']:.3f} req/s, A "
             f"{flood['a_rate_rps']:.3f} req/s (weights 1:1)",
             "policy  B TTFT p50 ms  A TTFT p50 ms  B share backlogged (cost/tokens)  "
             "backlogged s  tok/s  dur s"]
    for policy, run in flood["runs"].items():
        sh = run["backlogged_b_share"]
        lines.append(f"{policy:7} {_f(run['B']['ttft_p50_ms']):>13} "
                     f"{_f(run['A']['ttft_p50_ms']):>14} {_pct(sh['cost']):>18} / "
                     f"{_pct(sh['tokens']):<13} {run['backlogged_s']:>12} "
                     f"{run['tokens_per_s']:6.1f} {run['duration_s']:6}")
    return lines


def _goodput_lines(good: dict) -> list[str]:
    slos = ", ".join(f"{k} {v:.0f}" for k, v in good["slos_ms"].items())
    lines = [_calibration_line(good), f"goodput: SLOs (ms) {slos}",
             "policy    rate  attain  interactive  batch   goodput r/s  TTFT p50 int ms  "
             "TPOT p90 int ms"]
    for policy, pts in good["points"].items():
        for p in pts:
            lines.append(f"{policy:8} {p['rate_rps']:5.3f} {_pct(p['attainment']):>7} "
                         f"{_pct(p['interactive_attainment']):>12} "
                         f"{_pct(p['batch_attainment']):>6} {p['goodput_rps']:12.3f} "
                         f"{_f(p['interactive']['ttft_p50_ms']):>16} "
                         f"{_f(p['interactive']['tpot_p90_ms']):>16}")
    for policy, g in good["goodput_at_90"].items():
        lines.append(f"{policy}: goodput at 90% attainment {g['goodput_at_90_rps']:.3f} req/s "
                     f"({g['note']})")
    return lines


def _priority_lines(prio: dict) -> list[str]:
    lines = [_calibration_line(prio),
             f"priority: {prio['rate_rps']:.3f} req/s ({prio['load']}x capacity)",
             "policy    high TTFT p50/p90 ms   low TTFT p50/p90 ms   preemptions  tok/s"]
    for policy, run in prio["runs"].items():
        hi, lo = run["high"], run["low"]
        lines.append(f"{policy:9} {_f(hi['ttft_p50_ms']):>9} / {_f(hi['ttft_p90_ms']):<9} "
                     f"{_f(lo['ttft_p50_ms']):>9} / {_f(lo['ttft_p90_ms']):<9} "
                     f"{run['preemptions']:>11} {run['output_tokens_per_s']:6.1f}")
    return lines


def _calibration_line(section: dict) -> str:
    cal = section["calibration"]
    return (f"\ncalibration: capacity {cal['capacity_rps']:.3f} req/s, full decode step "
            f"{cal['step_s'] * 1000:.0f} ms")


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny random model (checks the script)")
    p.add_argument("--out", default=None, help="JSON report path")
    p.add_argument("--plot", default=None, help="goodput plot path (PNG)")
    p.add_argument("--only", default="flood,goodput,priority",
                   help="comma-separated comparisons to run (default all three)")
    p.add_argument("--simulate-only", action="store_true",
                   help="only the simulated half: the replay simulator on --profile, no "
                        "model (seconds)")
    p.add_argument("--no-simulate", action="store_true",
                   help="only the measured half (no simulated column)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"the simulator's calibrated cost profile (default {DEFAULT_PROFILE}, "
                        "SmolLM2 on this machine, also under --tiny: then only the "
                        "rankings compare; `slotserve calibrate` writes one)")
    defaults = Settings()
    for name, value in asdict(defaults).items():
        kind = type(value[0]) if isinstance(value, tuple) else type(value)
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value,
                       nargs="+" if isinstance(value, tuple) else None)
    args = p.parse_args(argv)
    settings = Settings(**{k: tuple(v) if isinstance(v, list) else v
                           for k, v in vars(args).items() if k in asdict(defaults)})
    only = set(args.only.split(","))
    if not only <= {"flood", "goodput", "priority"}:
        p.error(f"--only: unknown comparison in {args.only!r}")
    if args.simulate_only and args.no_simulate:
        p.error("--simulate-only and --no-simulate exclude each other")
    simulate = "only" if args.simulate_only else "none" if args.no_simulate else "both"
    report = run_all(settings, tiny=args.tiny, only=only, simulate=simulate,
                     profile=args.profile)
    print(format_report(report))
    sim_goodput = report.get("simulated", {}).get("goodput")
    if args.plot and ("goodput" in report or sim_goodput):
        plot_goodput(report.get("goodput"), args.plot, sim_goodput)
    if args.out:
        from slotserve.lab.bench import write_report

        write_report(args.out, **report)
    return report


def run_all(s: Settings, tiny: bool = False, only: set[str] | None = None,
            log=None, simulate: str = "both", profile: str = DEFAULT_PROFILE) -> dict:
    """Calibrate, then run the chosen comparisons; the report as a dict (JSON-ready).

    simulate: "both" (measured on the engine, then simulated on the profile, and the
    rankings compared), "only" (simulated: no model is loaded, seconds) or "none"."""
    if simulate not in ("both", "only", "none"):
        raise ValueError(f"simulate must be 'both', 'only' or 'none', got {simulate!r}")
    only = only or {"flood", "goodput", "priority"}
    log = log or (lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr,
                                    flush=True))
    started = time.monotonic()
    report: dict = {"settings": asdict(s),
                    "shapes": {"chat": asdict(CHAT), "interactive": asdict(INTERACTIVE),
                               "batch": asdict(BATCH)}}
    vocab = 512 if tiny else SMOLLM2_VOCAB
    if simulate != "only":
        set_torch_threads()
        make, vocab, report["model"] = engine_factory(tiny, s)
        report.update(run_comparisons(make, s, vocab, only, log))
        report["targets"] = _targets(report)
    if simulate != "none":
        path = Path(profile)
        # NOTE: a relative path is tried from the current directory, then the checkout's.
        cost_model = load_profile(path if path.is_absolute() or path.exists() else REPO / path)
        sims = SimFactory(s, cost_model)
        simulated = run_comparisons(sims, s, vocab, only,
                                    lambda msg: log(f"simulated {msg}"))
        report["simulated"] = {"profile": profile, "cost_model": cost_model.describe(),
                               **simulated, "targets": _targets(simulated),
                               "predicted_engine_seconds": round(sims.seconds, 1)}
        if simulate == "both":
            report["agreement"] = agreement(report, simulated)
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report


def _targets(sections: dict) -> dict:
    return {name: sections[name]["targets"] for name in ("flood", "goodput")
            if name in sections}


def run_comparisons(make: EngineFactory, s: Settings, vocab: int, only: set[str],
                    log) -> dict:
    """Each chosen comparison, after its own calibration, on engines from `make`."""
    out: dict = {}

    def calibrated(name: str, shapes: list[Shape], count: int, seed: int) -> dict:
        """NOTE: just before each comparison, as this host's speed drifts over minutes."""
        engine = make("fcfs")
        warm_up(engine, vocab)
        calibration = calibrate(engine, shapes, count, vocab, seed)
        log(f"{name}: calibration {calibration}")
        return calibration

    if "flood" in only:
        cal = calibrated("flood", [CHAT], s.calibration_requests, s.seed + 100)
        out["flood"] = {"calibration": cal,
                        **run_flood(make, s, cal["capacity_rps"], vocab, log)}
    if "goodput" in only:
        cal = calibrated("goodput", mixed_shapes(s.batch_fraction), 2 * s.calibration_requests,
                         s.seed + 200)
        out["goodput"] = {"calibration": cal,
                          **run_goodput(make, s, cal["capacity_rps"],
                                        slos_from(cal["step_s"], s), vocab, log)}
    if "priority" in only:
        cal = calibrated("priority", [CHAT], s.calibration_requests, s.seed + 100)
        out["priority"] = {"calibration": cal,
                           **run_priority(make, s, cal["capacity_rps"], vocab, log)}
    return out


# ---------------------------------------------------------------------- measured vs simulated
def ranking_figures(sections: dict) -> dict[str, tuple[dict[str, float | None], bool]]:
    """The figures whose policy ranking the simulator must reproduce: name -> ({policy:
    value}, whether higher is better)."""
    figures: dict[str, tuple[dict[str, float | None], bool]] = {}
    if "flood" in sections:
        runs = sections["flood"]["runs"]
        figures["flood: B TTFT p50 ms"] = ({p: r["B"]["ttft_p50_ms"] for p, r in runs.items()},
                                           False)
        figures["flood: B share while backlogged"] = (
            {p: r["backlogged_b_share"]["cost"] for p, r in runs.items()}, True)
    if "goodput" in sections:
        good = sections["goodput"]
        figures["goodput: goodput at 90% req/s"] = (
            {p: g["goodput_at_90_rps"] for p, g in good["goodput_at_90"].items()}, True)
        for i, load in enumerate(good["loads"]):
            figures[f"goodput: attainment at {load}x"] = (
                {p: pts[i]["attainment"] for p, pts in good["points"].items()}, True)
    if "priority" in sections:
        runs = sections["priority"]["runs"]
        figures["priority: high TTFT p50 ms"] = (
            {p: r["high"]["ttft_p50_ms"] for p, r in runs.items()}, False)
    return figures


def better_of(values: dict[str, float | None], higher_better: bool,
              tie: float = 0.02) -> str | None:
    """The better policy of two, "tie" within a relative `tie`, None if a value is
    missing."""
    (a, va), (b, vb) = values.items()
    if va is None or vb is None:
        return None
    if abs(va - vb) <= tie * max(abs(va), abs(vb)):
        return "tie"
    return a if (va > vb) == higher_better else b


def agreement(measured: dict, simulated: dict) -> list[dict]:
    """Per figure: measured and simulated values, the better policy of each, and whether
    they agree (a tie agrees only with a tie)."""
    sim_figures = ranking_figures(simulated)
    rows = []
    for name, (values, higher_better) in ranking_figures(measured).items():
        if name not in sim_figures:
            continue
        sim_values = sim_figures[name][0]
        want, got = better_of(values, higher_better), better_of(sim_values, higher_better)
        rows.append({"figure": name, "measured": values, "simulated": sim_values,
                     "measured_better": want, "simulated_better": got,
                     "agrees": None if got is None or want is None else got == want})
    return rows


def mixed_shapes(batch_fraction: float) -> list[Shape]:
    """A cycle of shapes with about batch_fraction BATCH jobs (for calibration)."""
    every = max(1, round(1 / batch_fraction)) if batch_fraction > 0 else 0
    if not every:
        return [INTERACTIVE]
    return [BATCH] + [INTERACTIVE] * (every - 1)


if __name__ == "__main__":
    main()
