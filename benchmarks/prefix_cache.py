"""Prefix caching on vs off (issue 17, "Show"): the same engine, the same workloads, one run.

    PYTHONPATH=src python -m benchmarks.prefix_cache \\
        --out benchmarks/results/prefix-cache.json --text benchmarks/results/prefix-cache.txt

Workloads (`slotserve.lab.workload`; greedy, ignore_eos, all at t=0). The issue's sizes
(64 requests behind the system prompt, 8 conversations, ...) are `--scale 4`; the default
(scale 1) is reduced so that the whole run stays under ~10 minutes on two busy CPU cores
with the embedded SmolLM2-135M:
- shared-system-prompt: 16 requests behind one 400-token system prompt (427 tokens with
  the chat template and a short question), 4 output tokens each.
- multi-turn: 2 conversations of 4-8 turns, each turn sent when the previous answer arrives
  (the conversation so far + the answer + a new user message, through the chat template),
  8 output tokens a turn.
- n=4: 4 distinct 128-token prompts, 4 completions each, 8 output tokens each.
- W: 8 chat requests of W's shape (benchmarks/perf.py: short chat prompts, lognormal output
  lengths, median 16 here instead of 64), no shared prefixes beyond the chat template's
  few tokens (SmolLM2's template writes a default system prompt: one 16-token block is
  shared). Run `--w-rounds` times.
- W-random: W's shape with random token ids of 20-60 tokens instead of chat prompts: no
  shared prefix at all, so caching must cost nothing there. Run `--w-rounds` times.

Each workload runs `--rounds` times with caching off and on, interleaved (off, on, on, off,
...) so that a drift of the host's speed falls on both sides; every run builds a fresh engine
(an empty cache). Timings are the median over rounds; token counts and hit rates come from
the engine's counters (EngineStats: prompt tokens, prefix-cache queries and hits) and are
exact. Prefill tokens computed = prompt tokens - prefix-cache hits.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from slotserve.lab.bench import BenchResult, EngineTarget, run_bench
from slotserve.lab.bench.report import write_report
from slotserve.lab.workload import (
    Workload,
    generate_workload,
    multi_turn_workload,
    parallel_sampling_workload,
    shared_prefix_workload,
)

# The targets: (workload, metric, at least this factor in caching's favour).
TARGETS = (("shared-system-prompt", "ttft_p50_x", 3.0),
           ("shared-system-prompt", "prefill_computed_x", 5.0),
           ("multi-turn", "output_throughput_x", 1.5))


def build_workloads(target: EngineTarget, scale: float = 1.0) -> dict[str, Workload]:
    """The four workloads (chat when the model has a chat template, token ids otherwise);
    scale multiplies request counts and output lengths (tests use a small one)."""
    vocab = None if target.has_chat_template else target.model_config.vocab_size

    def count(n: int) -> int:
        return max(2, round(n * scale))

    return {
        "shared-system-prompt": shared_prefix_workload(count(16), output_len=count(4),
                                                       vocab_size=vocab),
        "multi-turn": multi_turn_workload(count(2), turns_min=4, turns_max=8,
                                          output_len=count(8), vocab_size=vocab),
        "n=4": parallel_sampling_workload(count(4), n=4, output_len=count(8),
                                          vocab_size=target.model_config.vocab_size,
                                          prompt_len=min(count(128), 400)),
        "W": generate_workload(count(8), prompts="chat" if vocab is None else "random",
                               output_len_median=count(16), output_len_sigma=0.8,
                               output_len_min=2, output_len_max=count(64), vocab_size=vocab),
        "W-random": generate_workload(count(8), prompts="random", prompt_len_min=20,
                                      prompt_len_max=60, output_len_median=count(16),
                                      output_len_sigma=0.8, output_len_min=2,
                                      output_len_max=count(64),
                                      vocab_size=target.model_config.vocab_size),
    }


def interleaved(rounds: int) -> list[bool]:
    """caching off/on per run: off, on, on, off, off, on, ... (ABBA: drift hits both)."""
    order = []
    for i in range(rounds):
        order += [False, True] if i % 2 == 0 else [True, False]
    return order


def compare(target: EngineTarget, workload: Workload, rounds: int, name: str) -> dict:
    """Run the workload with caching off and on, interleaved; the two sides and ratios."""
    runs: dict[bool, list[BenchResult]] = {False: [], True: []}
    for on in interleaved(rounds):
        label = f"{name} {'on' if on else 'off'}"
        result = run_bench(workload, target.configured(enable_prefix_caching=on), label=label)
        if result.failed:
            raise RuntimeError(f"{label}: {result.failed} requests failed: {result.errors}")
        runs[on].append(result)
        print(f"  {label}: TTFT p50 {result.ttft_ms.p50:.0f} ms, "
              f"{result.output_throughput:.1f} out tok/s, {result.prefix_cache}", flush=True)
    off, on = side(runs[False]), side(runs[True])
    return {"workload": dict(workload.params), "off": off, "on": on, "ratios": ratios(off, on)}


def side(results: list[BenchResult]) -> dict:
    """One setting over its rounds: median timings, the (exact) token counts."""
    counts = results[0].prefix_cache
    # NOTE: greedy, exact lengths and no preemption make every round's counts identical.
    return {
        "ttft_p50_ms": statistics.median(r.ttft_ms.p50 for r in results),
        "ttft_p99_ms": statistics.median(r.ttft_ms.p99 for r in results),
        "output_throughput": statistics.median(r.output_throughput for r in results),
        "duration_s": statistics.median(r.duration_s for r in results),
        "prompt_tokens": counts["prompt_tokens"],
        "prefill_tokens_computed": counts["prefill_tokens_computed"],
        "hit_rate": counts["hit_rate"],
        "counts_equal_over_rounds": all(r.prefix_cache == counts for r in results),
        "preemptions": [r.preemptions for r in results],
        "requests": results[0].completed,
        "output_tokens": results[0].total_output_tokens,
        "rounds": [r.to_dict() for r in results],
    }


def ratios(off: dict, on: dict) -> dict:
    """Factors in caching's favour (> 1: caching better)."""
    def x(a: float, b: float) -> float | None:
        return a / b if b else None

    return {"ttft_p50_x": x(off["ttft_p50_ms"], on["ttft_p50_ms"]),
            "ttft_p99_x": x(off["ttft_p99_ms"], on["ttft_p99_ms"]),
            "prefill_computed_x": x(off["prefill_tokens_computed"],
                                    on["prefill_tokens_computed"]),
            "output_throughput_x": x(on["output_throughput"], off["output_throughput"])}


def check_targets(results: dict[str, dict]) -> list[dict]:
    """Each of the issue's targets: measured factor, met or not (W: reported, see text)."""
    rows = []
    for name, metric, at_least in TARGETS:
        if name in results:
            value = results[name]["ratios"][metric]
            rows.append({"workload": name, "metric": metric, "target": at_least,
                         "measured": value, "met": value is not None and value >= at_least})
    return rows


def format_text(results: dict[str, dict], targets: list[dict]) -> str:
    """The markdown table of RESULTS.md's section."""
    head = ("| workload | caching | requests | TTFT p50 / p99 ms | prompt tokens | prefill "
            "computed | hit rate | out tok/s |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        for setting in ("off", "on"):
            s = r[setting]
            lines.append(f"| {name} | {setting} | {s['requests']} | {s['ttft_p50_ms']:.0f} / "
                         f"{s['ttft_p99_ms']:.0f} | {s['prompt_tokens']} | "
                         f"{s['prefill_tokens_computed']} | {s['hit_rate']:.1%} | "
                         f"{s['output_throughput']:.1f} |")
    lines += ["", "| workload | TTFT p50 off/on | TTFT p99 off/on | prefill computed off/on | "
              "out tok/s on/off |", "| --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        q = r["ratios"]
        lines.append(f"| {name} | " + " | ".join(
            "-" if q[k] is None else f"x{q[k]:.2f}" for k in
            ("ttft_p50_x", "ttft_p99_x", "prefill_computed_x", "output_throughput_x")) + " |")
    lines += ["", *(f"target {t['workload']} {t['metric']} >= {t['target']}: measured "
                    f"{t['measured']:.2f} -> {'met' if t['met'] else 'NOT met'}"
                    for t in targets)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--rounds", type=int, default=1, help="off/on pairs per workload")
    p.add_argument("--w-rounds", type=int, default=2, help="off/on pairs for W and W-random")
    p.add_argument("--scale", type=float, default=1.0, help="x request counts and lengths")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--only", nargs="*", help="some of the workloads (default: all)")
    p.add_argument("--out", metavar="JSON")
    p.add_argument("--text", metavar="TXT")
    args = p.parse_args()
    target = EngineTarget.load(args.model, max_num_seqs=args.max_num_seqs, max_model_len=1024)
    workloads = build_workloads(target, args.scale)
    run_bench(generate_workload(2, prompts="random", output_len=4,
                                vocab_size=target.model_config.vocab_size), target)  # warm-up
    results = {}
    for name, workload in workloads.items():
        if not args.only or name in args.only:
            print(f"{name}: {workload.num_sends} requests", flush=True)
            rounds = args.w_rounds if name.startswith("W") else args.rounds
            results[name] = compare(target, workload, rounds, name)
    targets = check_targets(results)
    text = format_text(results, targets)
    print(text)
    if args.text:
        Path(args.text).write_text(text + "\n")
    if args.out:
        write_report(args.out, engine={"max_num_seqs": args.max_num_seqs, "max_model_len": 1024,
                                       "model": target.source},
                     rounds=args.rounds, w_rounds=args.w_rounds, scale=args.scale,
                     results=results, targets=targets)


if __name__ == "__main__":
    main()
