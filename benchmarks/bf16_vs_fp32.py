"""bf16 weight panels (quantization="bf16") against the fp32 weight panels (the default).

    .venv/bin/python -m benchmarks.bf16_vs_fp32 --rounds 5 --w-rounds 2 \
        --out benchmarks/results/bf16-vs-fp32.json

Interleaved in one process (the order alternates from pass to pass, so that the host's
minute hits every kernel alike; report medians of per-pass ratios):
(1) the model's matmuls (all decoder linears + the LM head; the LM head not at the 512-row
    prefill chunk) at 1, 4, 16, 64 and 512 rows, for (--variants): "fp32" panels, "bf16"
    (what quantization="bf16" runs: bf16 panels widened below 8 rows, AMX from 8 where
    usable), "bf16 widen" (fp32 activations at every size), "bf16 dot" (bf16 activations,
    vdpbf16ps), "onednn bf16" (torch's bf16 linear; output rounded to bf16, for scale);
(2) batch-1 decode, one request of 128 tokens (TPOT), fp32 against bf16 engines;
(3) workload W at 64 slots (output tok/s), if --w-rounds > 0.
Quality (greedy agreement with fp32) is benchmarks/int8_quality.py's.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

from benchmarks.perf import PREFILL_CHUNK, workload_w
from slotserve.lab.bench import BenchSampling, EngineTarget, run_bench, write_report
from slotserve.lab.workload import generate_workload
from slotserve.model.cpu_ops import load_cpu_ops
from slotserve.model.kernels import resolve_kernels
from slotserve.model.linear_kernels import Bf16PanelLinear
from slotserve.model.registry import build_model

MATMUL_ROWS = (1, 4, 16, 64, PREFILL_CHUNK)
ENGINES = {"fp32": {"quantization": "none"}, "bf16": {"quantization": "bf16"}}


class OneDnnBf16Linear:
    """torch's bf16 linear (oneDNN, AMX where present): x and W in bf16, output rounded to
    bf16 then widened. For scale only: not batch invariant, and rounds outputs too."""

    def __init__(self, weight: torch.Tensor, bias) -> None:
        self.weight = weight.detach().t().contiguous().bfloat16()  # (out, in)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.bfloat16(), self.weight).float()


def model_linears(target: EngineTarget, variant: str) -> tuple[list, object]:
    """The decoder's linears (in order) and the LM head, with `variant`'s kernels."""
    from slotserve.model.layers import Linear

    if variant in ENGINES:  # the engine's own KernelSet for these weights
        model = build_model(target.model_config, resolve_kernels(**ENGINES[variant]))
        model.load_hf_weights(target.weights)
    else:
        model = build_model(target.model_config)
        model.load_hf_weights(target.weights)
        factory = {"bf16 dot": functools.partial(Bf16PanelLinear, ops=load_cpu_ops(),
                                                 bf16_activations=True),
                   "bf16 widen": functools.partial(Bf16PanelLinear, ops=load_cpu_ops()),
                   "onednn bf16": OneDnnBf16Linear}[variant]
        for module in model.modules():
            if isinstance(module, Linear):
                module.use_kernel(factory(module.weight, module.bias))
    linears = [linear for layer in model.layers for linear in
               (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj)]
    return linears, model.lm_head


def time_step_ms(linears, lm_head, xs, hidden) -> float:
    """One forward's matmuls, ms: every linear once, then the LM head (if hidden)."""
    start = time.perf_counter()
    for linear, x in zip(linears, xs):
        linear(x)
    if hidden is not None:
        lm_head(hidden)
    return (time.perf_counter() - start) * 1e3


@torch.inference_mode()
def matmul_passes(target: EngineTarget, variants: tuple, passes: int) -> dict:
    """{rows: {variant: [ms per pass]}}, the variants interleaved pass by pass."""
    built = {v: model_linears(target, v) for v in variants}
    first = built[variants[0]][0]
    out: dict = {}
    for rows in MATMUL_ROWS:
        xs = [torch.randn(rows, linear.in_features) for linear in first]
        hidden = None if rows == PREFILL_CHUNK else torch.randn(rows, first[0].in_features)
        out[rows] = {v: [] for v in variants}
        for v in variants:  # warm-up
            time_step_ms(*built[v], xs, hidden)
        for p in range(passes):
            for v in variants if p % 2 == 0 else variants[::-1]:
                out[rows][v].append(time_step_ms(*built[v], xs, hidden))
        print(f"matmuls {rows} rows: " + ", ".join(
            f"{v} {statistics.median(ms):.2f} ms" for v, ms in out[rows].items()),
            file=sys.stderr, flush=True)
    return out


def engine_round(target: EngineTarget, workload, max_num_seqs: int, metric: str,
                 order: tuple) -> dict:
    row = {}
    for name in order:
        result = run_bench(workload, target.configured(max_num_seqs=max_num_seqs,
                                                       **ENGINES[name]),
                           sampling=BenchSampling(), label=f"{name} {max_num_seqs} slots")
        d = result.to_dict()
        row[name] = d["tpot_ms"]["mean"] if metric == "tpot" else d["output_throughput"]
    return row


def ratio_summary(values: dict, base: str, other: str, higher_is_better: bool) -> str:
    """Medians, and the median of per-pass speedups of `other` over `base`."""
    pairs = list(zip(values[base], values[other]))
    speedups = [(o / b) if higher_is_better else (b / o) for b, o in pairs]
    best = max if higher_is_better else min
    best_ratio = (best(values[other]) / best(values[base]) if higher_is_better
                  else best(values[base]) / best(values[other]))
    return (f"{base} {statistics.median(values[base]):.2f}, {other} "
            f"{statistics.median(values[other]):.2f} (medians); {other} speedup per pass: "
            f"median x{statistics.median(speedups):.2f}, range "
            f"x{min(speedups):.2f}-x{max(speedups):.2f}; best against best x{best_ratio:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=21, help="matmul passes per row count")
    p.add_argument("--rounds", type=int, default=5, help="batch-1 rounds per engine")
    p.add_argument("--w-rounds", type=int, default=0, help="W (64 slots) rounds per engine")
    p.add_argument("--variants", default="fp32,bf16,bf16 widen,bf16 dot,onednn bf16",
                   help="matmul variants, comma-separated, fp32 first")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the engine's); 1 keeps a shared host's "
                        "scheduling out of each kernel's barrier")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target = EngineTarget.load(max_num_batched_tokens=512, max_model_len=1024)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = tuple(args.variants.split(","))
    matmuls = matmul_passes(target, variants, args.passes)
    for rows, per in matmuls.items():
        for other in variants[1:]:
            print(f"matmuls, {rows:3d} rows, ms: {ratio_summary(per, 'fp32', other, False)}")
    one = generate_workload(1, prompts="chat", output_len=128, seed=0)
    batch1 = {name: [] for name in ENGINES}
    w64 = {name: [] for name in ENGINES}
    for round_ in range(max(args.rounds, args.w_rounds)):
        order = tuple(ENGINES) if round_ % 2 == 0 else tuple(ENGINES)[::-1]
        print(f"round {round_ + 1}: {order}", file=sys.stderr, flush=True)
        if round_ < args.rounds:
            for name, v in engine_round(target, one, 1, "tpot", order).items():
                batch1[name].append(v)
        if round_ < args.w_rounds:
            for name, v in engine_round(target, workload_w(), 64, "throughput", order).items():
                w64[name].append(v)
    print(f"batch-1 TPOT, ms: {ratio_summary(batch1, 'fp32', 'bf16', False)}")
    if args.w_rounds:
        print(f"W, 64 slots, output tok/s: {ratio_summary(w64, 'fp32', 'bf16', True)}")
    if args.out:
        write_report(args.out, matmul_ms_per_pass=matmuls, batch1_tpot_ms=batch1,
                     w_64_slots_tok_s=w64 if args.w_rounds else None,
                     threads=torch.get_num_threads(),
                     note="2-core host shared with other jobs: compare per-pass ratios")


if __name__ == "__main__":
    main()
