"""Soak: many requests of a mixed workload against a real `slotserve serve`; nothing is lost.

    .venv/bin/python -m benchmarks.soak --requests 1000 --concurrency 16 --json soak.json

Starts `slotserve serve` on loopback (the embedded SmolLM2-135M; or --url for a running
server, without the log and RSS checks) and warms it up: a burst of long prompts (so the
allocator reaches its high-water mark), then `--warmup` requests of the mix. Then
`--concurrency` clients send `--requests` requests: completions and chat, short to
~250-token prompts, greedy / seeded / free sampling (temperature, top_p), streaming or not,
n of 1-3, stop strings, 1 to `--max-tokens` (24) output tokens. A tenth of the clients
(`--disconnect`) leave at a random moment after sending: after a random delay, or
(streams) after a random number of events.

Checked (each failure is listed; the exit status is 1 if any):
- every request that was not cancelled completed: HTTP 200, n choices, finish_reason stop
  or length, no stop string in the text, usage consistent (total = prompt + completion,
  n <= completion <= n x max_tokens, = n x max_tokens when every choice hit the length);
- greedy outputs equal across repeats and equal to the offline API's (unless
  `--no-reference`), or differ first at a token the reference ranks in its top 5
  (the near-tie rule of docs/ARCHITECTURE.md); seeded outputs equal across repeats;
- every response echoes the client's X-Request-Id (header) and has the server's own id
  (`cmpl-...` / `chatcmpl-...`);
- server side (its log, by the client's X-Request-Id, which the server logs next to its own
  id): each completed request logged n "finished" lines and no "aborted"; each cancelled one
  was aborted, or had finished before the disconnect reached it; none has neither (lost);
- at the end: no request running or waiting, every KV block free, and the server's RSS
  within `--rss-tolerance` of its RSS after the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.soak_checks import (
    RssSampler,
    check_completed,
    check_greedy_reference,
    check_repeats,
    check_server_side,
    greedy_reference,
    near_tie,
    reference_entry,
    rss_bytes,
    server_outcomes,
    success_counts,
    wait_idle,
)
from benchmarks.soak_clients import run_workload
from benchmarks.soak_workload import (
    ENGINE_FLAGS,
    MODEL,
    WORDS,
    case_pools,
    make_workload,
    peak_workload,
)
from slotserve.lab.bench.server import ServerProcess, ServerStartError, cli_flags, scrape_metrics

# NOTE: the pieces are benchmarks/soak_workload.py, soak_clients.py and soak_checks.py;
# the names tests and benchmarks/chaos.py use stay importable from here.
__all__ = ["ENGINE_FLAGS", "MODEL", "REPO", "WORDS", "main", "near_tie", "reference_entry",
           "server_outcomes", "soak"]

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- the soak
@dataclass
class SoakReport:
    requests: int
    concurrency: int
    seconds: float
    outcomes: dict
    server_side: dict
    repeated_cases: dict
    greedy_near_ties: int
    preemptions: float
    success_delta: dict
    final_metrics: dict
    rss_after_warmup_mib: float | None
    rss_peak_mib: float | None
    rss_after_mib: float | None
    failures: list[str]

    def summary(self) -> str:
        lines = [f"{self.requests} requests, {self.concurrency} clients, {self.seconds:.1f}s",
                 f"client outcomes: {self.outcomes}",
                 f"server side: {self.server_side}",
                 f"repeated cases checked: {self.repeated_cases}, greedy near-ties "
                 f"(top-5 rule): {self.greedy_near_ties}",
                 f"completions by finish reason (metrics delta): {self.success_delta}",
                 f"preemptions: {self.preemptions:.0f}",
                 f"at the end: {self.final_metrics}"]
        if self.rss_after_mib is not None:
            lines.append(f"RSS: {self.rss_after_warmup_mib:.1f} MiB after warm-up, "
                         f"{self.rss_after_mib:.1f} MiB after the run "
                         f"({self.rss_after_mib / self.rss_after_warmup_mib - 1:+.1%}), "
                         f"{self.rss_peak_mib:.1f} MiB at most during it")
        lines.append(f"failures: {len(self.failures)}")
        lines += [f"  - {f}" for f in self.failures[:40]]
        return "\n".join(lines)


def soak(url: str, *, requests: int, concurrency: int = 16, disconnect: float = 0.1,
         seed: int = 0, warmup: int = 32, max_tokens: int = 24, pid: int | None = None,
         log_path: Path | None = None, reference_llm=None, rss_tolerance: float = 0.10,
         progress: bool = False) -> SoakReport:
    """Warm up (a burst of long prompts, then `warmup` requests of the mix), run the
    workload, check everything; the report lists the failures."""
    peak = peak_workload(int(scrape_metrics(url, timeout=30)["slotserve:kv_blocks_total"]))
    asyncio.run(run_workload(url, peak, ENGINE_FLAGS["max_num_seqs"]))
    asyncio.run(run_workload(url, make_workload(warmup, seed + 1, disconnect, "warmup",
                                                max_tokens), concurrency))
    before = wait_idle(url)
    rss_warm = rss_bytes(pid) if pid else None
    specs = make_workload(requests, seed, disconnect, f"s{seed}", max_tokens)
    start = time.monotonic()
    with RssSampler(pid) as sampler:
        results = asyncio.run(run_workload(url, specs, concurrency, progress))
    seconds = time.monotonic() - start
    after = wait_idle(url)
    rss_end = rss_bytes(pid) if pid else None
    failures: list[str] = []
    for r in results:
        if r.outcome == "completed":
            failures += [f"{r.spec.request_id}: {p}" for p in check_completed(r)]
        elif r.outcome != "cancelled":
            failures.append(f"{r.spec.request_id}: {r.outcome}: {r.error}")
    repeated = {}
    for kind in ("greedy", "seeded"):
        repeated[kind], problems = check_repeats(results, kind)
        failures += problems
    near = 0
    if reference_llm is not None:
        cases = case_pools(random.Random(seed), max_tokens)["greedy"]
        near, problems = check_greedy_reference(results, greedy_reference(reference_llm, cases))
        failures += problems
    server_side: Counter = Counter()
    if log_path is not None:
        server_side, problems = check_server_side(results, Path(log_path).read_text("utf-8",
                                                                                     "replace"))
        failures += problems
    failures += check_final(after, rss_warm, rss_end, rss_tolerance)
    delta = {k: v - success_counts(before).get(k, 0) for k, v in success_counts(after).items()}
    return SoakReport(
        requests=requests, concurrency=concurrency, seconds=seconds,
        outcomes=dict(Counter(r.outcome for r in results)), server_side=dict(server_side),
        repeated_cases=repeated, greedy_near_ties=near,
        preemptions=after["slotserve:num_preemptions_total"]
        - before["slotserve:num_preemptions_total"],
        success_delta=delta, final_metrics={k.removeprefix("slotserve:"): after[k] for k in (
            "slotserve:num_requests_running", "slotserve:num_requests_waiting",
            "slotserve:kv_blocks_free", "slotserve:kv_blocks_total")},
        rss_after_warmup_mib=rss_warm / 2**20 if rss_warm else None,
        rss_peak_mib=sampler.peak / 2**20 if pid else None,
        rss_after_mib=rss_end / 2**20 if rss_end else None, failures=failures)


def check_final(m: dict[str, float], rss_warm: int | None, rss_end: int | None,
                tolerance: float) -> list[str]:
    problems = []
    if m["slotserve:kv_blocks_free"] != m["slotserve:kv_blocks_total"]:
        problems.append(f"{m['slotserve:kv_blocks_free']:.0f} of "
                        f"{m['slotserve:kv_blocks_total']:.0f} KV blocks free at the end")
    for name in ("slotserve:num_requests_waiting", "slotserve:num_requests_running"):
        if m[name]:
            problems.append(f"{name} = {m[name]:.0f} at the end")
    if rss_warm and rss_end and rss_end > rss_warm * (1 + tolerance):
        problems.append(f"RSS grew {rss_end / rss_warm - 1:.1%} (> {tolerance:.0%}): "
                        f"{rss_warm / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB")
    return problems


# --------------------------------------------------------------------------- the server
def start_server(log_path: Path, extra: list[str]) -> ServerProcess:
    """`slotserve serve` with ENGINE_FLAGS on a free loopback port; waits for /health."""
    server = ServerProcess.launch(log_path, *cli_flags(**ENGINE_FLAGS), *extra, cwd=REPO)
    try:
        server.wait_ready()
    except ServerStartError:
        server.stop()
        raise
    return server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of clients that leave")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=24, help="output tokens: 1 to this")
    ap.add_argument("--url", default=None, help="a running server (skips log and RSS checks)")
    ap.add_argument("--log", default="soak-server.log", help="the started server's log")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the offline API's greedy reference")
    ap.add_argument("--rss-tolerance", type=float, default=0.10)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="the server's KV pool (default 512); e.g. 24 puts it under memory "
                         "pressure (preemptions), while the reference keeps the big pool")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    server, url, log_path = None, args.url, None
    if url is None:
        log_path = Path(args.log)
        extra = [] if args.num_blocks is None else [f"--num-blocks={args.num_blocks}"]
        server = start_server(log_path, extra)
        url = server.url
    try:
        report = soak(url, requests=args.requests, concurrency=args.concurrency,
                      disconnect=args.disconnect, seed=args.seed, warmup=args.warmup,
                      max_tokens=args.max_tokens,
                      pid=server.proc.pid if server else None, log_path=log_path,
                      reference_llm=None if args.no_reference else offline_llm(),
                      rss_tolerance=args.rss_tolerance, progress=True)
    finally:
        code = server.stop() if server else 0
    print(report.summary())
    if server:
        print(f"server exit code after SIGTERM: {code}")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2, default=str))
    return 1 if report.failures or code != 0 else 0


def offline_llm():
    from slotserve import LLM

    return LLM(**ENGINE_FLAGS)


if __name__ == "__main__":
    sys.exit(main())
