"""Opt-in int8 and bf16 weights: greedy agreement with fp32, and batch-1 decode speed.

    .venv/bin/python -m benchmarks.int8_quality --out benchmarks/results/int8.json
    .venv/bin/python -m benchmarks.int8_quality --engines "fp32 auto,bf16" --rounds 0

Quality bars (performance issues): greedy agreement with fp32 teacher-forced on at least 95%
of tokens over 32 prompts for int8, 97% for bf16. Prompts: the built-in chat prompts with
SmolLM2's chat template; 64 greedy tokens each (ignore_eos). Speed: one request alone,
median time per output token over 128 tokens, for each linear kernel side by side
(reference fp32, the default fp32 kernels: the weight panels, MKL's packed GEMM, int8,
bf16 panels). --engines picks some of them
("fp32 auto", the reference of the agreement, always runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

from slotserve.config import engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.lab.bench import write_report
from slotserve.lab.quality import greedy_agreement
from slotserve.lab.workload import generate_workload
from slotserve.loader import load_model
from slotserve.sampling import SamplingParams

# NOTE: fp32 pinned (quantization="none"): the default "auto" is bf16 on AVX512_BF16 CPUs.
KERNELS = {"fp32 reference": dict(kernels="reference", quantization="none"),
           "fp32 auto": dict(quantization="none"),
           "fp32 mkl": dict(kernels="mkl", quantization="none"),
           "int8": dict(quantization="int8"),  # int16 activations, the fused CPU kernel
           "int8 reference": dict(kernels="reference", quantization="int8"),  # bf16, torch's
           "bf16": dict(quantization="bf16")}  # bf16 weight panels, fp32 activations
RATED_ENGINES = ("int8", "int8 reference", "bf16")


def quality_engine(loaded, **kwargs) -> LLMEngine:
    """An engine for greedy agreement."""
    config = engine_config(max_num_seqs=32, num_blocks=1024, **kwargs)
    return LLMEngine(config, loaded.config, loaded.weights, loaded.tokenizer)


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    return generate_workload(count, prompts="chat", seed=0).chat_prompt_ids(tokenizer)


def batch1_ms_per_token(engine: LLMEngine, prompt: list[int], tokens: int) -> float:
    """Median wall time of one decode step with a single running request."""
    engine.add_request("b1", prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                    ignore_eos=True))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="batch-1 timing rounds per kernel")
    p.add_argument("--engines", default=",".join(KERNELS),
                   help=f"comma-separated, of: {', '.join(KERNELS)}")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    chosen = {"fp32 auto", *args.engines.split(",")}
    if chosen - set(KERNELS):
        p.error(f"--engines: unknown {sorted(chosen - set(KERNELS))}")
    loaded = load_model()
    engines = {name: quality_engine(loaded, **kw) for name, kw in KERNELS.items()
               if name in chosen}
    prompts = chat_prompts(loaded.tokenizer, args.prompts)
    agreements = {name: greedy_agreement(engines["fp32 auto"], engines[name], prompts,
                                         args.max_tokens)
                  for name in RATED_ENGINES if name in engines}
    timings: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):  # interleaved: the host's noise hits every kernel alike
        for name, engine in engines.items():
            timings[name].append(batch1_ms_per_token(engine, prompts[0], args.decode_tokens))
    batch1 = {name: statistics.median(v) for name, v in timings.items() if v}
    for name, ms in batch1.items():
        print(f"batch-1 decode, {name}: {ms:.1f} ms/token ({1e3 / ms:.1f} tok/s) "
              f"rounds {[round(t, 1) for t in timings[name]]}")
    for name, agreement in agreements.items():
        print(f"{name} greedy agreement with fp32 over {agreement.prompts} prompts, "
              f"{agreement.tokens} tokens: teacher-forced {agreement.teacher_forced:.1%}, "
              f"free-running {agreement.free_running:.1%}, first divergence (median) after "
              f"{agreement.first_divergence_median:.0f} tokens")
    if args.out:
        write_report(args.out, agreement={n: a.to_dict() for n, a in agreements.items()},
                     batch1_ms_per_token=batch1, batch1_rounds=timings)


if __name__ == "__main__":
    main()
