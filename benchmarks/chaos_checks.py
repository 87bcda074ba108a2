"""The chaos benchmark's checks after a run: the victim against its solo run, each attack's
statuses against ATTACKS, the server idle and whole, its log (benchmarks/chaos.py)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from benchmarks.chaos_adversary import ATTACKS
from benchmarks.chaos_attacks_clients import SLOW_LORIS
from benchmarks.chaos_kit import ADMIN_KEY, Outcome
from benchmarks.chaos_victim import VictimResult
from benchmarks.soak import server_outcomes
from slotserve.lab.bench.server import scrape_metrics
from slotserve.percentile import percentile


def percentiles_ms(values: list[float]) -> dict:
    if not values:
        return {}
    ms = [v * 1000 for v in values]
    return {"p50": round(percentile(ms, 50), 1), "p99": round(percentile(ms, 99), 1),
            "max": round(max(ms), 1), "n": len(values)}


def check_victim(solo: list[list[VictimResult]], attacked: list[list[VictimResult]],
                 failures: list[str]) -> tuple[int, int]:
    """(victim requests with errors, chaos outputs unlike the first solo run's)."""
    reference = {r.index: r.text for r in solo[0]}
    errors = differing = 0
    for run in solo + attacked:
        for r in run:
            if r.errors:
                errors += 1
                failures.append(f"{r.request_id}: {'; '.join(r.errors)}")
            elif r.text != reference[r.index]:
                differing += 1
                failures.append(f"{r.request_id}: {r.text!r} != solo {reference[r.index]!r}")
    return errors, differing


def tally_attacks(outcomes: list[tuple[str, Outcome]], failures: list[str]) -> dict:
    expected = {**{name: expect for name, (_, expect) in ATTACKS.items()},
                **{name: expect for name, (_, expect) in SLOW_LORIS.items()}}
    tally: dict = defaultdict(lambda: {"statuses": Counter(), "notes": []})
    for name, outcome in outcomes:
        entry = tally[name]
        entry["statuses"][str(outcome.status)] += 1
        if outcome.note and outcome.note not in entry["notes"] and len(entry["notes"]) < 2:
            entry["notes"].append(outcome.note)
        if outcome.status not in expected.get(name, ()) or not outcome.ok:
            failures.append(f"attack {name!r}: {outcome.status} ({outcome.note}), expected "
                            f"{sorted(map(str, expected.get(name, ())))}")
    missing = set(expected) - set(tally)
    failures += [f"attack {name!r} never ran" for name in sorted(missing)]
    return {name: {"expect": sorted(map(str, expected.get(name, ()))),
                   "statuses": dict(entry["statuses"]), "notes": entry["notes"]}
            for name, entry in tally.items()}


def admin_metrics(url: str) -> dict[str, float]:
    return scrape_metrics(url, timeout=30, headers={"Authorization": f"Bearer {ADMIN_KEY}"})


def check_after(url: str, failures: list[str], timeout_s: float = 30.0) -> tuple[int, dict]:
    """/health, then the metrics once idle (aborts land at the next iteration boundary)."""
    health = httpx.get(url + "/health", timeout=30).status_code
    if health != 200:
        failures.append(f"/health {health} after the run")
    deadline = time.monotonic() + timeout_s
    while True:
        m = admin_metrics(url)
        idle = (m["slotserve:num_requests_running"] == 0 == m["slotserve:num_requests_waiting"]
                and m["slotserve:kv_blocks_free"] == m["slotserve:kv_blocks_total"])
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    final = {k.removeprefix("slotserve:"): m[k] for k in (
        "slotserve:num_requests_running", "slotserve:num_requests_waiting",
        "slotserve:kv_blocks_free", "slotserve:kv_blocks_total", "slotserve:kv_cache_usage_perc")}
    if not idle:
        failures.append(f"not idle {timeout_s}s after the run: {final}")
    return health, final


def check_log(log_path: Path, outcomes: list[tuple[str, Outcome]],
              failures: list[str]) -> dict:
    """No traceback; every stream the adversary left mid-way was aborted by the server."""
    text = Path(log_path).read_text("utf-8", "replace")
    seen = server_outcomes(text)
    left = [o.note.rsplit(": ", 1)[1] for name, o in outcomes
            if name == "a stream left after 2 events" and o.status == 200]
    not_aborted = [rid for rid in left if not seen.get(rid, {}).get("aborted")]
    failures += [f"{rid}: left mid-stream, but the server logged no abort: {seen.get(rid)}"
                 for rid in not_aborted]
    tracebacks = text.count("Traceback")
    if tracebacks:
        failures.append(f"{tracebacks} tracebacks in the server log")
    return {"tracebacks": tracebacks, "streams_left": len(left),
            "streams_left_aborted": len(left) - len(not_aborted)}
