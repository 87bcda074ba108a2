"""fp32 linears over weight panels (the default) against MKL's packed GEMM, side by side.

    .venv/bin/python -m benchmarks.panel_vs_mkl --rounds 3 \
        --out benchmarks/results/panel-vs-mkl.json

Three comparisons, each interleaved round by round in one process so that the host's
minute hits both alike (the order alternates from round to round): (1) all of the model's
matmuls at 1-64 rows and a 512-row prefill chunk (perf.py's measure_matmul_ms) and W's
matmul bound from them; (2) batch-1 decode, one request of 128 tokens (TPOT); (3) workload
W with 64 slots (output tok/s). The engines differ only in `kernels` ("auto": panels;
"mkl": MKL's packed GEMM); the fused kernels and the decode stack run in both.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.perf import count_prompt_tokens, matmul_bound, measure_matmul_ms, workload_w
from slotserve.lab.bench import BenchSampling, EngineTarget, run_bench, write_report
from slotserve.lab.workload import generate_workload

KERNELS = ("auto", "mkl")


def matmul_round(target: EngineTarget, prompt_tokens: int, lengths: list[int],
                 order: tuple) -> dict:
    row = {}
    for kernels in order:
        ms = measure_matmul_ms(target, kernels=kernels)
        row[kernels] = {"matmul_ms": ms, "w_matmul_bound_s": matmul_bound(ms, prompt_tokens,
                                                                          lengths)}
    return row


def engine_round(target: EngineTarget, workload, max_num_seqs: int, metric: str,
                 order: tuple) -> dict:
    row = {}
    for kernels in order:
        result = run_bench(workload, target.configured(kernels=kernels,
                                                       max_num_seqs=max_num_seqs),
                           sampling=BenchSampling(), label=f"{kernels} {max_num_seqs} slots")
        d = result.to_dict()
        row[kernels] = d["tpot_ms"]["mean"] if metric == "tpot" else d["output_throughput"]
    return row


def summary(rounds: list[dict], key) -> str:
    auto, mkl = [key(r["auto"]) for r in rounds], [key(r["mkl"]) for r in rounds]
    ratios = [m / a for a, m in zip(auto, mkl)]
    return (f"panels {statistics.median(auto):.1f}, MKL {statistics.median(mkl):.1f} "
            f"(medians); MKL/panels per round {[round(r, 2) for r in ratios]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target = EngineTarget.load(max_num_batched_tokens=512, max_model_len=1024)
    w = workload_w()
    prompt_tokens = count_prompt_tokens(target, w)
    lengths = [r.max_tokens for r in w.requests]
    one = generate_workload(1, prompts="chat", output_len=128, seed=0)
    matmuls, batch1, w64 = [], [], []
    for round_ in range(args.rounds):
        order = KERNELS if round_ % 2 == 0 else KERNELS[::-1]
        print(f"round {round_ + 1}: {order}", file=sys.stderr, flush=True)
        matmuls.append(matmul_round(target, prompt_tokens, lengths, order))
        batch1.append(engine_round(target, one, 1, "tpot", order))
        w64.append(engine_round(target, w, 64, "throughput", order))
    for rows in sorted(matmuls[0]["auto"]["matmul_ms"]["layers"]):
        both = lambda r, rows=rows: (r["matmul_ms"]["layers"][rows]  # noqa: E731
                                     + r["matmul_ms"]["lm_head"][rows])
        print(f"matmuls, {rows:3d} rows, ms: {summary(matmuls, both)}")
    print(f"W's matmul bound, s: {summary(matmuls, lambda r: r['w_matmul_bound_s'])}")
    print(f"batch-1 TPOT, ms: {summary(batch1, lambda v: v)}")
    print(f"W, 64 slots, output tok/s: {summary(w64, lambda v: v)}")
    if args.out:
        write_report(args.out, matmuls=matmuls, batch1_tpot_ms=batch1,
                     w_64_slots_tok_s=w64)


if __name__ == "__main__":
    main()
