"""A/B: the fused CPU kernels against the plain torch ops they replace, per decode step.

    .venv/bin/python benchmarks/fused_ops.py --batch 1 16 64 --out benchmarks/results/fused-ops.json

For each batch size (and fp32 / int8 weights), two engines on the embedded SmolLM2-135M
with the same linear kernels: one with the fused kernels of slotserve/csrc/cpu_ops.cpp, one
with them taken out again (the torch reference ops: RMSNorm, SiLU, RoPE, K/V write, decode
attention by gather + SDPA). Both decode `batch` requests from a ~100-token context; their
step times are measured in interleaved rounds (this host's noise moves whole minutes, so
only the ratio within a round means much). Reported: the median step per engine and the
median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from profile_step import fill, time_steps

from slotserve.engine.llm import engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.lab.bench import machine_info
from slotserve.loader import load_model
from slotserve.model.cpu_ops import set_cpu_ops


def make_engine(loaded, batch: int, quantization: str | None, fused: bool) -> LLMEngine:
    engine = LLMEngine(engine_config(max_num_seqs=batch, num_blocks=batch * 24 + 16,
                                     max_num_batched_tokens=2048, quantization=quantization),
                       loaded.config, loaded.weights, loaded.tokenizer)
    if not fused:  # the same engine with the torch ops back (and decode groups as torch's)
        set_cpu_ops(engine.runner.model, None)
        engine.runner.fused_cpu_ops = False
    return engine


def compare(loaded, batch: int, quantization: str | None, rounds: int, steps: int) -> dict:
    engines = {"fused": make_engine(loaded, batch, quantization, True),
               "torch ops": make_engine(loaded, batch, quantization, False)}
    assert engines["fused"].runner.fused_cpu_ops, "the fused kernels did not build"
    for engine in engines.values():
        fill(engine, batch, 100)
    rounds_ms = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            rounds_ms[name].append(time_steps(engine, steps) * 1e3)  # median step
    ratios = [t / f for f, t in zip(rounds_ms["fused"], rounds_ms["torch ops"])]
    return {"batch": batch, "quantization": quantization, "rounds_ms": rounds_ms,
            "median_ms": {name: statistics.median(v) for name, v in rounds_ms.items()},
            "speedup_median": statistics.median(ratios), "speedups": ratios}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--quantization", nargs="+", default=["none", "int8"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps timed per round")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    loaded = load_model()
    rows = []
    for quantization in args.quantization:
        for batch in args.batch:
            row = compare(loaded, batch, None if quantization == "none" else quantization,
                          args.rounds, args.steps)
            med = row["median_ms"]
            print(f"{quantization:5s} batch {batch:3d}: fused {med['fused']:6.1f} ms, torch ops "
                  f"{med['torch ops']:6.1f} ms, speedup x{row['speedup_median']:.2f} "
                  f"(rounds {[round(s, 2) for s in row['speedups']]})", flush=True)
            rows.append(row)
    if args.out:
        report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
                  "command": " ".join(sys.argv), "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
