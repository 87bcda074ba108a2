"""Stall-free batching on W (issue 16): `max_prefill_tokens_while_decoding` against no cap.

W is 64 chat requests, all at t=0, on 64 slots with a 512-token budget (benchmarks/perf.py):
without a cap the first iterations carry ~500 prefill tokens each, and the requests admitted
first decode through them, so their inter-token times (TPOT) include those long iterations.

    python -m benchmarks.stall_free --simulate [--profile P.json]   # replay sweep, seconds
    python -m benchmarks.stall_free --engine --caps none,128 --rounds 2

--simulate replays W through the real scheduler on a cost model for each cap (the calibrated
profile, or the default estimate below); --engine runs W on the engine, the caps interleaved
round by round (A, B, A, B) so that a busy machine slows every configuration alike. Each row:
TPOT p50 / p99 and their ratio, output tok/s, TTFT p50 / p99, iterations.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.perf import workload_w
from slotserve.lab.bench.stats import BenchResult, BenchSampling

# A linear step-time estimate of this CPU when quiet (fp32, SmolLM2-135M): batch-1 decode
# ~25 ms, a 64-sequence decode step ~140 ms, a 512-token prefill step ~0.85 s (issue 16's
# figures). The calibrated profile was fitted on a loaded machine (its base is 160 ms).
QUIET_ESTIMATE = {"base": 0.022, "coefficients": {
    "prefill_tokens": 0.0016, "decode_seqs": 0.0, "attention_pairs": 1e-7,
    "sampled_rows": 0.0018}}


def parse_caps(text: str) -> list[int | None]:
    return [None if c.strip().lower() == "none" else int(c) for c in text.split(",")]


def row(label: str, r: BenchResult) -> dict:
    return {"label": label, "tpot_p50_ms": r.tpot_ms.p50, "tpot_p99_ms": r.tpot_ms.p99,
            "tpot_p99_over_p50": r.tpot_ms.p99 / r.tpot_ms.p50,
            "output_tok_s": r.output_throughput, "ttft_p50_ms": r.ttft_ms.p50,
            "ttft_p99_ms": r.ttft_ms.p99, "itl_p99_ms": r.itl_ms.p99, "duration_s": r.duration_s,
            "iterations": r.iterations}


def print_row(d: dict) -> None:
    print(f"{d['label']:<28} TPOT p50 {d['tpot_p50_ms']:7.1f}  p99 {d['tpot_p99_ms']:7.1f}  "
          f"p99/p50 {d['tpot_p99_over_p50']:5.2f}  out tok/s {d['output_tok_s']:7.1f}  "
          f"TTFT p50 {d['ttft_p50_ms']:7.1f}  p99 {d['ttft_p99_ms']:7.1f}  "
          f"ITL p99 {d['itl_p99_ms']:7.1f}  "
          f"iters {d['iterations']}", flush=True)


def simulate(caps: list[int | None], profile: str | None) -> list[dict]:
    from slotserve.lab.replay.cost_model import LinearCost, load_profile
    from slotserve.lab.replay.inputs import requests_from_workload
    from slotserve.lab.replay.simulator import ReplaySettings, replay
    from slotserve.loader import load_model

    cost = load_profile(profile) if profile else LinearCost(**QUIET_ESTIMATE)
    requests = requests_from_workload(workload_w(), load_model(None).tokenizer)
    rows = []
    for cap in caps:
        settings = ReplaySettings(max_num_seqs=64, max_num_batched_tokens=512,
                                  max_prefill_tokens_while_decoding=cap, max_model_len=1024)
        result = replay(requests, settings, cost, check=True)
        rows.append(row(f"sim cap={cap}", result.bench_result()))
        print_row(rows[-1])
    return rows


def engine(caps: list[int | None], rounds: int, out: str | None = None) -> list[dict]:
    from slotserve.lab.bench import EngineTarget, run_bench

    target = EngineTarget.load(max_num_batched_tokens=512, max_model_len=1024, max_num_seqs=64)
    w = workload_w()
    rows = []
    for round_index in range(rounds):
        for cap in caps:
            label = f"engine cap={cap} r{round_index + 1}"
            result = run_bench(w, target.configured(max_prefill_tokens_while_decoding=cap),
                               sampling=BenchSampling(), label=label)
            rows.append(row(label, result))
            print_row(rows[-1])
            if out:  # NOTE: after every run, so an interrupted comparison keeps its rows
                write_rows(out, rows)
    return rows


def write_rows(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--simulate", action="store_true")
    mode.add_argument("--engine", action="store_true")
    p.add_argument("--caps", default="none,256,192,128,96,64,48,32",
                   help="max_prefill_tokens_while_decoding values (none: no cap)")
    p.add_argument("--rounds", type=int, default=2, help="--engine: rounds of every cap")
    p.add_argument("--profile", default=None, help="--simulate: a `slotserve calibrate` "
                   "profile (default: the quiet-CPU estimate in this file)")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    args = p.parse_args()
    caps = parse_caps(args.caps)
    rows = simulate(caps, args.profile) if args.simulate else engine(caps, args.rounds, args.out)
    if args.out:
        write_rows(args.out, rows)
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
