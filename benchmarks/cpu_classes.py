"""Each CPU class's linear kernels on this machine, and which configuration `auto` should pick.

    .venv/bin/python -m benchmarks.cpu_classes --engine-rounds 5 \
        --quality "bf16 widen,bf16 dot,int8" --out benchmarks/results/cpu-classes-<cpu>.json

Check /proc/cpuinfo first (the vendor and the flags vary from machine to machine): the
report records the CPU's model name and its vector flags. Three parts, each interleaved
pass by pass in one process (the order alternating, so that a shared host's minute hits
every variant alike; medians of per-pass ratios):
(1) matmuls: one forward's decoder linears with distinct random weights (so they stream
    from memory, as a model's do) at 1, 4, 8, 16, 32 and 64 rows, for SmolLM2-135M's shapes
    (hidden 576, intermediate 1536, 30 layers), Qwen2.5-0.5B's (hidden 896, intermediate
    4864, 24 layers) and Llama-3.2-1B's (hidden 2048, intermediate 8192, 16 layers; --layers
    caps the layers: a 1B forward's fp32 panels alone are 3.9 GB): fp32 panels, bf16 panels
    widened ("bf16 widen"), bf16 panels with x rounded to bf16 and vdpbf16ps ("bf16 dot",
    where the CPU has AVX512_BF16), int8 weights x int16 activations ("int8") and MKL's
    packed fp32 GEMM ("mkl"); asked for, AMX tiles at every row count ("bf16 amx", on a CPU
    with AMX). Where dot overtakes widening is the avx512bf16 class's dot threshold
    (model/kernels.py, BF16_DOT_MIN_ROWS), where AMX does the amx class's
    (linear_kernels.BF16_AMX_MIN_ROWS). --cpu-isa CLASS: the kernels of that
    class's build (the avx2 class: its AVX2 tiles), MKL and torch held to its instructions
    (the process starts again with vs_vllm.LIBRARY_ISA_ENV: they read them at start-up).
(2) engines (--engine-rounds): the real model in process (LLMEngine with the fused kernels
    and the decode stack; the KV cache dtype `auto`), one sequence of 128 tokens (median
    time per step after the prefill) and 64 chat prompts at once, 128 tokens each (output
    tok/s over every step, prefills included), for the configurations of --engines (a
    quantization with a CPU class forced: ENGINES).
(3) quality (--quality ENGINES): greedy agreement with fp32 teacher-forced (lab/quality.py, 32 chat
    prompts of 64 tokens; the bar is 97%), for the same configurations.
(4) arithmetic (--arithmetic): each variant at 1 row on weights that stay in cache, in GB/s
    of weights, beside the copy bandwidth: whether a class's batch-1 arithmetic keeps up with
    the weight stream (a CPU whose vector units are narrower shows it here), e.g.
    `--arithmetic --shapes "" --variants "fp32,bf16 widen,bf16 dot,int8"`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from slotserve.config import engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.sizing import set_torch_threads
from slotserve.lab.bench import write_report
from slotserve.lab.bench.targets import timed_greedy_run
from slotserve.lab.quality import greedy_agreement
from slotserve.lab.workload import generate_workload
from slotserve.model.cpu_ops import load_cpu_ops
from slotserve.model.kernels import CPU_CLASSES, cpu_class, resolve_kernels
from slotserve.model.linear_kernels import (
    Bf16PanelLinear,
    Int8WeightOnlyLinear,
    MKLPackedLinear,
    PanelLinear,
)

# (hidden, intermediate, q heads, kv heads, head dim, layers)
SHAPES = {"smollm2-135m": (576, 1536, 9, 3, 64, 30), "qwen2.5-0.5b": (896, 4864, 14, 2, 64, 24),
          "llama3.2-1b": (2048, 8192, 32, 8, 64, 16)}
ROWS = (1, 4, 8, 16, 32, 64)
MATMUL_VARIANTS = {
    "fp32": lambda w, ops: PanelLinear(w, None, ops),
    "bf16 widen": lambda w, ops: Bf16PanelLinear(w, None, ops),
    "bf16 dot": lambda w, ops: Bf16PanelLinear(w, None, ops, dot_min_rows=1),
    "bf16 amx": lambda w, ops: Bf16PanelLinear(w, None, ops, amx_min_rows=1),
    "int8": lambda w, ops: Int8WeightOnlyLinear(w, None, ops),
    "mkl": lambda w, ops: MKLPackedLinear(w, None),
}
# The in-process engines: (quantization, CPU class forced[, kernels]) -> resolve_kernels.
# "bf16 widen" is what the avx512 class runs, "bf16 dot" the avx512bf16 class's kernel.
ENGINES = {
    "fp32": ("none", None),
    "bf16 widen": ("bf16", "avx512"),
    "bf16 dot": ("bf16", "avx512bf16"),
    "int8": ("int8", None),
    "q8_0": ("q8_0", None),  # weights quantized to Q8_0 blocks at load, 16-bit activations
    "avx2 fp32": ("none", "avx2"),  # the AVX2 panels, the fused ops built for AVX2
    "avx2 bf16": ("bf16", "avx2"),  # the bf16 panels widened in AVX2 tiles
    "avx2 mkl": ("none", "avx2", "mkl"),  # MKL's packed GEMM (the avx2 class's fp32 before)
    "avx2 int8": ("int8", "avx2"),  # the int8 kernel's fallback loops, built for AVX2
}
QUALITY_BAR = 0.97


def amx_usable(cpu_isa: str | None) -> bool:
    """Whether the kernels of CPU class cpu_isa's build (None: this CPU's) run AMX here."""
    ops = load_cpu_ops(cpu_class(cpu_isa).march)
    return ops is not None and ops.amx_bf16_usable()


def layer_shapes(shape: str, max_layers: int | None = None) -> list[tuple[int, int]]:
    """(in, out) of one forward's decoder linears, in order: qkv, o, gate_up, down per layer
    (at most max_layers layers)."""
    hidden, inter, heads, kv_heads, head_dim, layers = SHAPES[shape]
    one = [(hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden),
           (hidden, 2 * inter), (inter, hidden)]
    return one * min(layers, max_layers or layers)


def build_linears(shape: str, variant: str, ops, max_layers: int | None = None) -> list[tuple]:
    """(the variant's kernel, in_features) for each linear, over its own random weights."""
    gen = torch.Generator().manual_seed(0)
    make = MATMUL_VARIANTS[variant]
    return [(make(torch.randn(i, o, generator=gen) * 0.05, ops), i)
            for i, o in layer_shapes(shape, max_layers)]


def forward_ms(linears: list[tuple], xs: dict) -> float:
    """Every linear once, on the x of its input width (xs: in_features -> (rows, in))."""
    start = time.perf_counter()
    for linear, in_features in linears:
        linear(xs[in_features])
    return (time.perf_counter() - start) * 1e3


@torch.inference_mode()
def matmul_table(shape: str, variants: tuple, passes: int, cpu_isa: str | None = None,
                 max_layers: int | None = None, rows_list: tuple = ROWS) -> dict:
    """{rows: {variant: [ms per pass]}}: one forward's linears, variants interleaved; the
    kernels of CPU class cpu_isa's build (None: this CPU's)."""
    ops = load_cpu_ops(cpu_class(cpu_isa).march)
    built = {variant: build_linears(shape, variant, ops, max_layers) for variant in variants}
    out: dict = {}
    for rows in rows_list:
        gen = torch.Generator().manual_seed(rows)
        xs = {i: torch.randn(rows, i, generator=gen) for i, _ in set(layer_shapes(shape))}
        out[rows] = {v: [] for v in variants}
        for v in variants:  # warm-up
            forward_ms(built[v], xs)
        for p in range(passes):
            for v in variants if p % 2 == 0 else variants[::-1]:
                out[rows][v].append(forward_ms(built[v], xs))
        print(f"{shape} {rows} rows: " + ", ".join(
            f"{v} {statistics.median(ms):.2f} ms" for v, ms in out[rows].items()),
            file=sys.stderr, flush=True)
    return out


# Weight bytes per parameter of each matmul variant (int8's per-channel scales aside).
WEIGHT_BYTES = {"fp32": 4, "bf16 widen": 2, "bf16 dot": 2, "bf16 amx": 2, "int8": 1, "mkl": 4}
# A variant a CPU may lack: not in the default --variants (asked for, it must run here).
AMX_VARIANT = "bf16 amx"
DEFAULT_VARIANTS = tuple(v for v in MATMUL_VARIANTS if v != AMX_VARIANT)
# The arithmetic part: one linear of ARITHMETIC_IN inputs whose weights fill
# ARITHMETIC_BYTES_PER_THREAD per thread (so they stay in each core's L2), at one row.
ARITHMETIC_IN = 2048
ARITHMETIC_BYTES_PER_THREAD = 1 << 20
ARITHMETIC_CALLS = 200


def arithmetic_linear(variant: str, ops):
    """The variant's kernel on one in-cache-sized linear, and its weight bytes."""
    out = torch.get_num_threads() * ARITHMETIC_BYTES_PER_THREAD // (
        ARITHMETIC_IN * WEIGHT_BYTES[variant])
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(ARITHMETIC_IN, out, generator=gen) * 0.05
    return MATMUL_VARIANTS[variant](weights, ops), ARITHMETIC_IN * out * WEIGHT_BYTES[variant]


@torch.inference_mode()
def arithmetic_table(variants: tuple, passes: int, cpu_isa: str | None = None) -> dict:
    """{variant: [GB/s of weights per pass]}: one row through the variant's kernel with its
    weights in cache (arithmetic_linear, ARITHMETIC_CALLS calls a pass; the calls' own
    overhead counts against it), variants interleaved. Against the memory's copy bandwidth
    it says whether the kernel's arithmetic keeps up with the weight stream at batch 1 (its
    arithmetic takes 1 / this rate a weight byte)."""
    ops = load_cpu_ops(cpu_class(cpu_isa).march)
    built = {v: arithmetic_linear(v, ops) for v in variants}
    x = torch.randn(1, ARITHMETIC_IN, generator=torch.Generator().manual_seed(2))
    out: dict = {v: [] for v in variants}
    for p in range(passes + 1):  # the first pass warms the caches up
        for v in variants if p % 2 == 0 else variants[::-1]:
            linear, weight_bytes = built[v]
            start = time.perf_counter()
            for _ in range(ARITHMETIC_CALLS):
                linear(x)
            seconds = time.perf_counter() - start
            if p:
                out[v].append(weight_bytes * ARITHMETIC_CALLS / seconds / 1e9)
    return out


def build_engine(loaded, name: str, max_num_seqs: int) -> LLMEngine:
    """The real model with the kernels of ENGINES[name] (KV cache dtype: auto)."""
    quantization, isa, *kernel_kind = ENGINES[name]
    config = engine_config(max_num_seqs=max_num_seqs, num_blocks=max_num_seqs * 24,
                           quantization=quantization)
    kernels = resolve_kernels(*kernel_kind, quantization=quantization, cpu_isa=isa)
    return LLMEngine(config, loaded.config, loaded.weights, loaded.tokenizer,
                     kernel_set=kernels)


def decode_rate(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """All prompts at once, `tokens` greedy tokens each: (median ms of the steps after the
    first, output tokens per second over all steps, prefills included)."""
    steps = [seconds for seconds, _ in timed_greedy_run(engine, prompts, tokens)]
    return statistics.median(steps[1:]) * 1e3, len(prompts) * tokens / sum(steps)


@torch.inference_mode()
def engine_rounds(loaded, names: tuple, rounds: int, tokens: int) -> dict:
    """{"1 seq": {name: [ms per token]}, "64 seqs": {name: [output tok/s]}}, interleaved."""
    prompts = generate_workload(64, prompts="chat", seed=0).chat_prompt_ids(loaded.tokenizer)
    out: dict = {"1 seq ms/token": {n: [] for n in names}, "64 seqs tok/s": {n: [] for n in names}}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            engine = build_engine(loaded, name, 64)
            out["1 seq ms/token"][name].append(decode_rate(engine, prompts[:1], tokens)[0])
            out["64 seqs tok/s"][name].append(decode_rate(engine, prompts, tokens)[1])
            del engine
        print(f"engines round {r + 1}: " + "; ".join(
            f"{n} {out['1 seq ms/token'][n][-1]:.2f} ms, {out['64 seqs tok/s'][n][-1]:.0f} tok/s"
            for n in names), file=sys.stderr, flush=True)
    return out


@torch.inference_mode()
def quality(loaded, names: tuple, prompts: int, tokens: int) -> dict:
    """{name: greedy agreement with fp32 (lab/quality.py)}, for the names other than fp32."""
    chat = generate_workload(prompts, prompts="chat", seed=0).chat_prompt_ids(loaded.tokenizer)
    reference = build_engine(loaded, "fp32", 32)
    return {name: greedy_agreement(reference, build_engine(loaded, name, 32), chat,
                                   tokens).to_dict()
            for name in names if name != "fp32"}


def restart_with_library_isa(cpu_isa: str) -> None:
    """Start this process again with CPU class cpu_isa's limits on torch, oneDNN and MKL
    (vs_vllm.LIBRARY_ISA_ENV) unless they are set. NOTE: the libraries read them once, at
    start-up: MKL's GEMM would otherwise run its AVX-512 code beside the avx2 class's panels."""
    from benchmarks.vs_vllm import LIBRARY_ISA_ENV

    wanted = LIBRARY_ISA_ENV.get(cpu_isa, {})
    if all(os.environ.get(k) == v for k, v in wanted.items()):
        return
    print(f"restarting with {wanted}", file=sys.stderr, flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.cpu_classes", *sys.argv[1:]],
              {**os.environ, **wanted})


def cpu_description() -> dict:
    """The CPU's model name and its vector flags (/proc/cpuinfo), for the report."""
    info = {"model": "unknown", "flags": []}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and info["model"] == "unknown":
                    info["model"] = value.strip()
                if key.strip() == "flags":
                    info["flags"] = sorted(f for f in value.split() if f.startswith(
                        ("avx", "amx", "fma", "f16c", "sse4")))
                    break
    except OSError:
        pass
    return info


def arithmetic_report(variants: tuple, passes: int, cpu_isa: str | None) -> dict:
    """arithmetic_table's medians beside the copy bandwidth (read before and after), printed."""
    from benchmarks.perf import measure_bandwidth_gbs

    before = measure_bandwidth_gbs()
    table = arithmetic_table(variants, passes, cpu_isa)
    bandwidth = max(before, measure_bandwidth_gbs())
    report = {"copy_bandwidth_gbs": round(bandwidth, 1), "in_cache_weight_gbs": {}}
    for v, rates in table.items():
        rate = statistics.median(rates)
        report["in_cache_weight_gbs"][v] = round(rate, 1)
        print(f"1 row, weights in cache: {v} {rate:.1f} GB/s of weights "
              f"({rate / WEIGHT_BYTES[v]:.1f} G weights/s), x{rate / bandwidth:.2f} the copy "
              f"bandwidth {bandwidth:.1f} GB/s", flush=True)
    report["per_pass_gbs"] = table
    return report


def ratios(per: dict, base: str) -> dict:
    """{variant: median over passes of base_ms / variant_ms} (> 1: faster than base)."""
    return {v: round(statistics.median(b / o for b, o in zip(per[base], ms)), 3)
            for v, ms in per.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=15, help="matmul passes per row count")
    p.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b",
                   help=f"matmul shapes, comma-separated, of: {', '.join(SHAPES)}")
    p.add_argument("--layers", type=int, default=None, help="at most this many layers a shape")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="matmul row counts")
    p.add_argument("--cpu-isa", default=None, choices=CPU_CLASSES,
                   help="the matmuls of this CPU class's build (default: this CPU's class)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="matmul variants, comma-separated, the base of the ratios first")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"in-process engines, comma-separated, of: {', '.join(ENGINES)}")
    p.add_argument("--engine-rounds", type=int, default=0,
                   help="rounds of the engines (1 sequence, then 64), 0: none")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--quality", default="",
                   help="engines to rate by greedy agreement with fp32, comma-separated")
    p.add_argument("--arithmetic", action="store_true",
                   help="each variant at 1 row with its weights in cache, against the copy "
                        "bandwidth: whether its arithmetic keeps up with the weight stream")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.cpu_isa:
        restart_with_library_isa(args.cpu_isa)
    set_torch_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = tuple(v for v in args.variants.split(",") if v)
    engines = tuple(e for e in args.engines.split(",") if e)
    rated = tuple(e for e in args.quality.split(",") if e)
    if set(engines + rated) - set(ENGINES) or set(variants) - set(MATMUL_VARIANTS):
        p.error("unknown --engines or --variants")
    if AMX_VARIANT in variants and not amx_usable(args.cpu_isa):
        p.error(f"--variants {AMX_VARIANT!r}: AMX-BF16 is not usable here (CPU or class)")
    matmuls, engine_results, agreements, arithmetic = {}, None, None, None
    if args.arithmetic and variants:
        arithmetic = arithmetic_report(variants, args.passes, args.cpu_isa)
    for shape in [s for s in args.shapes.split(",") if s] if variants else ():
        matmuls[shape] = matmul_table(shape, variants, args.passes, args.cpu_isa, args.layers,
                                      tuple(int(r) for r in args.rows.split(",")))
        for rows, per in matmuls[shape].items():
            print(f"{shape} {rows:2d} rows, ms: " + ", ".join(
                f"{v} {statistics.median(ms):.2f}" for v, ms in per.items())
                + f"; speedup over {variants[0]}: {ratios(per, variants[0])}")
    if args.engine_rounds or rated:
        from slotserve.loader import load_model

        loaded = load_model()
    if args.engine_rounds:
        engine_results = engine_rounds(loaded, engines, args.engine_rounds, args.decode_tokens)
        for metric, per in engine_results.items():
            faster = ratios(per, engines[0]) if "ms" in metric else {
                n: round(1 / r, 3) for n, r in ratios(per, engines[0]).items()}
            print(f"{metric}: " + ", ".join(f"{n} {statistics.median(v):.2f}"
                                           for n, v in per.items())
                  + f"; speedup over {engines[0]} (median of per-round ratios): {faster}")
    if rated:
        agreements = quality(loaded, rated, 32, 64)
        for name, a in agreements.items():
            verdict = "passes" if a["teacher_forced"] >= QUALITY_BAR else "FAILS"
            print(f"{name}: teacher-forced agreement with fp32 {a['teacher_forced']:.2%} "
                  f"({verdict} the {QUALITY_BAR:.0%} bar)")
    if args.out:
        speedups = {shape: {rows: ratios(per, variants[0]) for rows, per in table.items()}
                    for shape, table in matmuls.items()}
        write_report(args.out, cpu=cpu_description(), threads=torch.get_num_threads(),
                     matmul_cpu_class=cpu_class(args.cpu_isa).name, layers=args.layers,
                     matmul_speedup_over_first=speedups, matmul_ms_per_pass=matmuls,
                     engines=engine_results, arithmetic=arithmetic,
                     agreement=agreements, quality_bar=QUALITY_BAR,
                     note="2-core host shared with other jobs: compare per-pass ratios")


if __name__ == "__main__":
    main()
