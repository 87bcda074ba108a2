"""Planning: search settings and request rates in simulation for the best goodput under SLOs.

goodput = requests that meet both SLOs (TTFT <= slo_ttft and TPOT <= slo_tpot; a one-token
request has no TPOT and meets that one) per second of the run. For every setting (batching x
max_num_seqs x max_num_batched_tokens) the workload is replayed at every rate (Poisson
arrivals, as `slotserve bench --request-rate` sends them); the best (setting, rate) wins.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from slotserve.lab.replay.inputs import with_poisson
from slotserve.lab.replay.simulator import ReplayRequest, ReplayResult, ReplaySettings, replay

DEFAULT_RATES = (0.5, 1, 2, 3, 4, 6, 8, 12, 16, math.inf)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"slo {name} must be a number > 0, got {value!r}")

    def met(self, outcome) -> bool:
        ttft, tpot = outcome.ttft, outcome.tpot
        return (outcome.error is None and ttft is not None and ttft * 1000 <= self.ttft_ms
                and (tpot is None or tpot * 1000 <= self.tpot_ms))


@dataclass
class Candidate:
    """One (settings, rate) replayed and scored."""

    settings: ReplaySettings
    rate: float
    goodput: float  # requests meeting both SLOs per second
    attainment: float  # share of requests meeting both SLOs
    result: ReplayResult


def score(result: ReplayResult, slo: SLO) -> tuple[float, float]:
    """(goodput req/s, attainment) of one replay."""
    met = sum(slo.met(o) for o in result.outcomes)
    n = len(result.outcomes)
    return met / max(result.duration, 1e-9), met / n if n else 0.0


def score_records(records, duration: float, slo: SLO) -> tuple[float, float]:
    """(goodput req/s, attainment) of a measured run (`slotserve bench`'s RequestRecords)."""
    met = sum(r.ok and r.ttft is not None and r.ttft * 1000 <= slo.ttft_ms
              and (r.tpot is None or r.tpot * 1000 <= slo.tpot_ms) for r in records)
    n = len(records)
    return met / max(duration, 1e-9), met / n if n else 0.0


def search(requests: list[ReplayRequest], slo: SLO, cost_model, *,
           base: ReplaySettings | None = None, batching: tuple[str, ...] = ("continuous",),
           max_num_seqs: tuple[int, ...] = (4, 8, 16, 32, 64),
           max_num_batched_tokens: tuple[int, ...] = (256, 512, 1024),
           rates: tuple[float, ...] = DEFAULT_RATES, seed: int = 0,
           cached_prefixes: Sequence[tuple[str, Sequence[int]]] = ()) -> list[Candidate]:
    """Every (setting, rate) scored; best goodput first (ties: fewer slots, smaller budget).
    cached_prefixes: in the prefix cache at each replay's start (`replay`'s)."""
    if not requests:
        raise ValueError("requests: nothing to plan for")
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates must be > 0 (or inf), got {rates!r}")
    base = base or ReplaySettings()
    timed = {rate: with_poisson(requests, rate, seed) for rate in rates}
    candidates = []
    for rule, seqs, tokens in itertools.product(batching, max_num_seqs, max_num_batched_tokens):
        settings = replace(base, batching=rule, max_num_seqs=seqs, max_num_batched_tokens=tokens)
        for rate, arrivals in timed.items():
            result = replay(arrivals, settings, cost_model, cached_prefixes=cached_prefixes)
            goodput, attainment = score(result, slo)
            candidates.append(Candidate(settings, rate, goodput, attainment, result))
    candidates.sort(key=lambda c: (-c.goodput, c.settings.max_num_seqs,
                                   c.settings.max_num_batched_tokens))
    return candidates


def best_per_setting(candidates: list[Candidate]) -> list[Candidate]:
    """Each setting's best rate, in the candidates' order (best first)."""
    seen, best = set(), []
    for c in candidates:
        key = (c.settings.batching, c.settings.max_num_seqs, c.settings.max_num_batched_tokens)
        if key not in seen:
            seen.add(key)
            best.append(c)
    return best


def format_plan(candidates: list[Candidate], slo: SLO, top: int = 8) -> str:
    """The winner, then the best rate of the next settings."""
    rows = best_per_setting(candidates)[:top]
    lines = [f"SLOs: TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms "
             f"(goodput: requests meeting both, per second)",
             f"{'batching':<11}{'seqs':>5}{'tokens':>7}{'rate':>7}{'goodput':>9}{'met':>6}"
             f"{'TTFT p50/p99 ms':>18}{'TPOT p50/p99 ms':>18}"]
    for c in rows:
        b = c.result.bench_result()
        lines.append(f"{c.settings.batching:<11}{c.settings.max_num_seqs:>5}"
                     f"{c.settings.max_num_batched_tokens:>7}{_rate(c.rate):>7}"
                     f"{c.goodput:>9.2f}{c.attainment:>6.0%}{_pair(b.ttft_ms):>18}"
                     f"{_pair(b.tpot_ms):>18}")
    win = rows[0]
    lines.append(f"best: --batching {win.settings.batching} --max-num-seqs "
                 f"{win.settings.max_num_seqs} --max-num-batched-tokens "
                 f"{win.settings.max_num_batched_tokens} at {_rate(win.rate)} req/s: "
                 f"predicted goodput {win.goodput:.2f} req/s ({win.attainment:.0%} meet the SLOs)")
    return "\n".join(lines)


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _pair(stats) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.0f}"
    return f"{ms(stats.p50)}/{ms(stats.p99)}"
