"""A/B/C: the fused CPU kernels, with and without the C++ decode stack, against torch ops.

    .venv/bin/python -m benchmarks.fused_ops --batch 1 16 64 --out benchmarks/results/fused-ops.json

For each batch size (and fp32 / int8 weights), three engines on the embedded SmolLM2-135M
with the same linear kernels: "stack" (the default: the fused kernels of
slotserve/csrc, all-decode iterations run by its DecodeStack in one C++ call),
"python layers" (the same kernels called layer by layer from Python) and "torch ops" (the
fused kernels taken out again: torch's RMSNorm, SiLU, RoPE, K/V write, decode attention by
gather + SDPA). All decode `batch` requests from a ~100-token context; their step times
are measured in interleaved rounds (this host's noise moves whole minutes, so only the
ratio within a round means much). Reported: the median step per engine and the median of
the per-round ratios against "stack".
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from benchmarks.profile_step import fill, time_steps
from slotserve.config import engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.lab.bench import write_report
from slotserve.loader import load_model
from slotserve.model.kernels import kernels_for

VARIANTS = ("stack", "python layers", "torch ops")


def make_engine(loaded, batch: int, quantization: str, variant: str = "stack"
                ) -> LLMEngine:
    config = engine_config(max_num_seqs=batch, num_blocks=batch * 24 + 16,
                           max_num_batched_tokens=2048, quantization=quantization)
    kernels = kernels_for(config)
    assert kernels.fused_layers, "the fused kernels did not build"
    if variant == "python layers":
        kernels = replace(kernels, decode_stack=False)
    elif variant == "torch ops":  # the torch ops back (and decode groups as torch's)
        kernels = replace(kernels, decode_stack=False, fused_layers=False)
    return LLMEngine(config, loaded.config, loaded.weights, loaded.tokenizer,
                     kernel_set=kernels)


def compare(loaded, batch: int, quantization: str | None, rounds: int, steps: int) -> dict:
    engines = {variant: make_engine(loaded, batch, quantization, variant)
               for variant in VARIANTS}
    for engine in engines.values():
        fill(engine, batch, 100)
    rounds_ms = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            rounds_ms[name].append(time_steps(engine, steps) * 1e3)  # median step
    speedups = {name: [t / s for s, t in zip(rounds_ms["stack"], rounds_ms[name])]
                for name in VARIANTS[1:]}  # per round: its step / the stack's step
    return {"batch": batch, "quantization": quantization, "rounds_ms": rounds_ms,
            "median_ms": {name: statistics.median(v) for name, v in rounds_ms.items()},
            "speedup_median": {name: statistics.median(v) for name, v in speedups.items()},
            "speedups": speedups}


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
            row = compare(loaded, batch, quantization, args.rounds, args.steps)
            med, speedup = row["median_ms"], row["speedup_median"]
            print(f"{quantization:5s} batch {batch:3d}: "
                  + ", ".join(f"{name} {med[name]:6.1f} ms" for name in VARIANTS)
                  + "; the stack's speedup over "
                  + ", ".join(f"{name} x{speedup[name]:.2f}" for name in VARIANTS[1:]),
                  flush=True)
            rows.append(row)
    if args.out:
        write_report(args.out, rows=rows)


if __name__ == "__main__":
    main()
