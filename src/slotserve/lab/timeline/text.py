"""Text every renderer shares: the title, the one-line description, tick spacing."""

from __future__ import annotations

from slotserve.lab.timeline.grid import Grid


def describe(grid: Grid) -> str:
    """One line: source, slots, iterations (window), utilisation and busy/capacity."""
    trace = grid.trace
    busy, capacity = int(grid.busy().sum()), grid.num_slots * grid.num_columns
    parts = [str(trace.get("source", "trace")), f"{grid.num_slots} slots"]
    if grid.windowed() and grid.num_columns:
        parts.append(f"iterations {grid.index[0]}–{grid.index[-1]} "
                     f"of {grid.total_iterations}")
    else:
        parts.append(f"{grid.num_columns} iterations")
    parts.append(f"utilisation {grid.utilisation():.0%} ({busy}/{capacity} busy "
                 "slot-iterations)")
    if trace.get("source") == "engine" and trace["iterations"]:
        seconds = trace["iterations"][-1]["end"] - trace["iterations"][0]["start"]
        parts.append(f"{seconds:.2f} s")
    requests, cached, prompt = cached_prefill(trace)
    if cached:
        parts.append(f"prefill skipped: {cached}/{prompt} prompt tokens from the prefix cache "
                     f"({requests} requests)")
    return " · ".join(parts)


def cached_prefill(trace: dict) -> tuple[int, int, int]:
    """(requests whose prefill was partly skipped, tokens skipped, prompt tokens) over the
    trace's requests (`cached_tokens`: engine traces with prefix caching; 0 otherwise)."""
    records = trace.get("requests", [])
    cached = [r.get("cached_tokens") or 0 for r in records]
    prompt = sum(r.get("prompt_tokens") or 0 for r in records)
    return sum(1 for c in cached if c), sum(cached), prompt


def title(trace: dict) -> str:
    policy = trace.get("policy")
    return f"{policy} batching" if policy else "trace"


def tick_step(n: int, max_ticks: int) -> int:
    """A 1-2-5 step giving at most `max_ticks` ticks over n columns."""
    step = 1
    while n / step > max_ticks:
        for factor in (2, 2.5, 2):
            step = int(step * factor)
            if n / step <= max_ticks:
                break
    return step
