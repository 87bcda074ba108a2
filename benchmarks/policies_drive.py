"""benchmarks.policies' driver: one engine (real or simulated) through an arrival schedule, in
real time or on its virtual clock, with the same loop and accounting (`drive`); and the
closed-loop calibration that sizes every comparison (`calibrate`)."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from benchmarks.policies_engines import Engine, clock_of
from benchmarks.policies_workloads import Arrival, Shape, schedule_of
from slotserve.sampling import SamplingParams

FINISHED_OK = ("stop", "length")


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
