"""What benchmarks.policies runs: its settings, the request shapes and the arrival schedules
of its three comparisons (flooding tenant, goodput, priority), and the SLOs derived from a
calibration."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slotserve.lab.workload import poisson_arrivals, random_token_prompts


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


def slos_from(step_s: float, s: Settings) -> Slos:
    step_ms = step_s * 1000.0
    return Slos(interactive_ttft_ms=s.interactive_ttft_steps * step_ms,
                interactive_tpot_ms=s.interactive_tpot_steps * step_ms,
                batch_ttft_ms=s.batch_ttft_steps * step_ms,
                batch_tpot_ms=s.batch_tpot_steps * step_ms)


def mixed_shapes(batch_fraction: float) -> list[Shape]:
    """A cycle of shapes with about batch_fraction BATCH jobs (for calibration)."""
    every = max(1, round(1 / batch_fraction)) if batch_fraction > 0 else 0
    if not every:
        return [INTERACTIVE]
    return [BATCH] + [INTERACTIVE] * (every - 1)
