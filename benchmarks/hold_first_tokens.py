"""hold_first_tokens on W: a burst's first tokens held together, against each as it comes.

    python -m benchmarks.hold_first_tokens --simulate               # replay, seconds
    python -m benchmarks.hold_first_tokens --engine --rounds 2 \\
        --model /tmp/vllm-peer/llama1b-hf --output-scale 0.25 --out R.json

W as benchmarks.vs_vllm sends it (64 chat requests at t=0, 64 slots, budget 512; at ~1B
the outputs a quarter as long, `--output-scale 0.25`), and its 2 and 4 req/s arrivals.
--engine runs each on the engine in process, hold on and off interleaved round by round
(off, on, on, off, ...) so a busy machine slows both alike; --simulate replays them through
the real scheduler on a linear step-cost estimate (135M fp32 and ~1B bf16 on a 2-core
CPU). Each row: TPOT p50 / p99 and their ratio (the issue's W target: <= 1.5), output
tok/s, TTFT p50 / p99.
"""

from __future__ import annotations

import argparse
import math
import sys

from benchmarks.stall_free import QUIET_ESTIMATE, print_row, row, write_rows
from benchmarks.vs_vllm import scaled_w

RATES = {"W": math.inf, "W 2/s": 2.0, "W 4/s": 4.0}
# ~1B bf16 on the 2-core EPYC: batch-1 ~70 ms, ~6 ms a prompt token, ~8 ms a decode row.
ONE_B_ESTIMATE = {"base": 0.07, "coefficients": {
    "prefill_tokens": 0.006, "decode_seqs": 0.0, "attention_pairs": 4e-7,
    "sampled_rows": 0.008}}
ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024)


def simulate(workloads: list[str]) -> list[dict]:
    from slotserve.lab.replay.cost_model import LinearCost
    from slotserve.lab.replay.inputs import requests_from_workload
    from slotserve.lab.replay.simulator import ReplaySettings, replay
    from slotserve.loader import load_model

    tokenizer = load_model(None).tokenizer
    rows = []
    for size, estimate, scale in (("135M", QUIET_ESTIMATE, 1.0), ("1B", ONE_B_ESTIMATE, 0.25)):
        for name in workloads:
            requests = requests_from_workload(scaled_w(RATES[name], scale), tokenizer)
            for hold in (False, True):
                settings = ReplaySettings(**ENGINE, hold_first_tokens=hold)
                result = replay(requests, settings, LinearCost(**estimate), check=True)
                rows.append(row(f"sim {size} {name} hold={hold}", result.bench_result()))
                print_row(rows[-1])
    return rows


def engine(model: str | None, scale: float, workloads: list[str], rounds: int,
           out: str | None) -> list[dict]:
    from slotserve.lab.bench import EngineTarget, run_bench
    from slotserve.lab.bench.stats import BenchSampling

    target = EngineTarget.load(model, **ENGINE)
    rows = []
    for round_index in range(rounds):
        order = (False, True) if round_index % 2 == 0 else (True, False)
        for name in workloads:
            for hold in order:
                label = f"engine {name} hold={hold} r{round_index + 1}"
                result = run_bench(scaled_w(RATES[name], scale),
                                   target.configured(hold_first_tokens=hold),
                                   sampling=BenchSampling(), label=label)
                rows.append(row(label, result))
                print_row(rows[-1])
                if out:  # NOTE: after every run, so an interrupted comparison keeps its rows
                    write_rows(out, rows)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--simulate", action="store_true")
    mode.add_argument("--engine", action="store_true")
    p.add_argument("--model", default=None, help="--engine: a model path (default: the "
                   "embedded SmolLM2-135M)")
    p.add_argument("--output-scale", type=float, default=1.0,
                   help="--engine: W's output lengths times this (vs_vllm's 0.25 at ~1B)")
    p.add_argument("--workloads", default=",".join(RATES), help=f"of: {', '.join(RATES)}")
    p.add_argument("--rounds", type=int, default=2, help="--engine: rounds of each")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    args = p.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in RATES]
    if unknown:
        p.error(f"unknown workloads {unknown}: of {', '.join(RATES)}")
    rows = (simulate(workloads) if args.simulate else
            engine(args.model, args.output_scale, workloads, args.rounds, args.out))
    if args.out:
        write_rows(args.out, rows)
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
