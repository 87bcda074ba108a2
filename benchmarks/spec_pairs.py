"""Speculation on against off at batch 1, as interleaved pairs: one request, off then auto
(the order alternating pair by pair), the workload's prompts in turn.

    PYTHONPATH=src python -m benchmarks.spec_pairs --pairs 12 --out

A check of `benchmarks.speculative`'s batch-1 cells on a host whose speed drifts: each pair
runs within a second, so a drift falls on both sides of its ratio, and the median over many
pairs is what speculation changes. Both engines answer one warm-up request first (a first
call pays one-time costs). `--out [PATH]` writes the JSON report (default:
benchmarks/results/spec-pairs.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.speculative import WORKLOADS, chat_prompts, run_once
from slotserve.engine.llm import LLM
from slotserve.lab.bench.report import write_report

DEFAULT_OUT = "benchmarks/results/spec-pairs.json"
AUTO = '{"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}'


def run_pairs(engines: dict[str, LLM], prompts: list[list[int]], pairs: int,
              max_tokens: int, log) -> dict:
    """`pairs` pairs (off, auto), order alternating, prompts in turn: each pair's tok/s and
    ratio, and the median ratio."""
    rows = []
    for number in range(pairs):
        prompt = prompts[number % len(prompts)]
        order = ["off", "auto"] if number % 2 == 0 else ["auto", "off"]
        speed = {name: run_once(engines[name], [prompt], max_tokens)["output_tok_s"]
                 for name in order}
        rows.append({"prompt": number % len(prompts), "first": order[0], **speed,
                     "ratio": speed["auto"] / speed["off"]})
        log(f"  pair {number + 1}: off {speed['off']:.1f} tok/s, auto {speed['auto']:.1f}, "
            f"x{rows[-1]['ratio']:.3f}")
    ratios = [row["ratio"] for row in rows]
    return {"pairs": rows, "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios), "max_ratio": max(ratios)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS),
                   default=list(WORKLOADS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", metavar="JSON", nargs="?", const=DEFAULT_OUT, default=None)
    args = p.parse_args(argv)
    if args.pairs < 1 or args.max_tokens < 1:
        p.error("--pairs and --max-tokens must be >= 1")
    log = lambda line: print(line, file=sys.stderr, flush=True)
    engines = {"off": LLM(), "auto": LLM(speculative_config=AUTO)}
    report = {"speculative_config": AUTO, "max_tokens": args.max_tokens, "results": {}}
    for workload in args.workloads:
        prompts = chat_prompts(engines["off"], WORKLOADS[workload], len(WORKLOADS[workload]))
        for llm in engines.values():
            run_once(llm, prompts[:1], 8)  # warm-up
        log(f"{workload}, batch 1:")
        report["results"][workload] = run_pairs(engines, prompts, args.pairs,
                                                args.max_tokens, log)
    for workload, result in report["results"].items():
        print(f"{workload}: auto / off median x{result['median_ratio']:.3f} "
              f"(x{result['min_ratio']:.2f}-{result['max_ratio']:.2f}, {args.pairs} pairs)")
    if args.out:
        write_report(args.out, **report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
