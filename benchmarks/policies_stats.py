"""benchmarks.policies' statistics: latency percentiles, shares of service, SLO attainment and
goodput, the targets' arithmetic, and the measured-vs-simulated ranking of the policies."""

from __future__ import annotations

from benchmarks.policies_drive import Record
from slotserve.percentile import percentile


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


def _within(value: float | None, target: float, tolerance: float) -> dict:
    met = None if value is None else abs(value - target) <= tolerance * target
    return {"value": value, "target": target, "relative_tolerance": tolerance, "met": met}


def _ratio(numerator: float | None, denominator: float | None) -> dict:
    ratio = None if not numerator or not denominator else numerator / denominator
    return {"ratio": ratio}


def _at_least(entry: dict, bound: float) -> bool | None:
    return None if entry["ratio"] is None else entry["ratio"] >= bound


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
