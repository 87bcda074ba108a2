"""Batch-1 decode in process against its bandwidth floor (issue 32's in-process target).

    PYTHONPATH=src:. python -m benchmarks.batch1_in_process --rounds 5 \\
        --out benchmarks/results/batch1-in-process.json

One sequence through `LLM` (no server), the embedded SmolLM2 unless `--model`: each round
times a 1-token request and a (1 + N)-token one on the same prompt, so (t(1+N) - t(1)) / N
is the time of a decode step without the prefill; the copy bandwidth is read before and
after the round, and the floor takes the higher reading (vs_vllm's stricter floor: a reading
caught in a host's stall would flatter the round). Floor: every parameter's weight bytes
(4 fp32, 2 bf16) read once a token at that bandwidth. Reported: each round's ms per token,
floor and floor / ms; the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.perf import batch1_floor_ms, measure_bandwidth_gbs
from slotserve import LLM, SamplingParams
from slotserve.lab.bench import write_report

WEIGHT_BYTES = {"none": 4, "bf16": 2}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def request_seconds(llm: LLM, tokens: int) -> float:
    """Wall time of one greedy request of `tokens` output tokens (EOS ignored)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([PROMPT], params, use_tqdm=False)
    return time.perf_counter() - start


def measure_round(llm: LLM, tokens: int, params: int, weight_bytes: int) -> dict:
    """One round: decode ms per token and its floor from the bandwidth around it."""
    before = measure_bandwidth_gbs()
    step_ms = (request_seconds(llm, 1 + tokens) - request_seconds(llm, 1)) / tokens * 1e3
    after = measure_bandwidth_gbs()
    floor_ms = batch1_floor_ms(params, max(before, after)) * weight_bytes / 4
    return {"ms_per_token": round(step_ms, 3), "floor_ms": round(floor_ms, 3),
            "bandwidth_gbs": [round(before, 1), round(after, 1)],
            "of_floor": round(floor_ms / step_ms, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model path (default: the embedded one)")
    p.add_argument("--quantization", default="bf16", choices=sorted(WEIGHT_BYTES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128, help="decode steps timed a round")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    llm = LLM(args.model, quantization=args.quantization, max_num_seqs=1)
    params = llm.engine.model_config.num_parameters
    request_seconds(llm, 1 + args.tokens)  # warm-up
    rounds = []
    for index in range(args.rounds):
        rounds.append(measure_round(llm, args.tokens, params, WEIGHT_BYTES[args.quantization]))
        print(f"round {index + 1}: {json.dumps(rounds[-1])}", flush=True)
    medians = {"median_ms_per_token": statistics.median(r["ms_per_token"] for r in rounds),
               "median_of_floor": statistics.median(r["of_floor"] for r in rounds)}
    print(f"median: {medians['median_ms_per_token']:.2f} ms per token, "
          f"{medians['median_of_floor']:.1%} of its floor")
    if args.out:  # with the date, the machine (CPU model and flags) and the command
        write_report(args.out, parameters=params, quantization=args.quantization,
                     rounds=rounds, **medians)


if __name__ == "__main__":
    main()
