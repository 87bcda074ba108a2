"""Where does one decode iteration's time go? Median step time and a per-op breakdown.

    .venv/bin/python -m benchmarks.profile_step --batch 1 16 64 --threads 1

Builds the engine on the embedded SmolLM2-135M (fp32), fills the batch with `batch`
requests of ~40-token prompts, lets them reach steady decode, then times `steps` iterations
and profiles a few with torch.profiler, grouping ops into linear / attention / other
(`--wall`: no profiler, each part of the step timed by wall clock instead).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from types import SimpleNamespace

import torch

from slotserve import SamplingParams
from slotserve.config import KERNELS, QUANTIZATIONS, engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.loader import load_model
from slotserve.model.kernels import kernels_for
from slotserve.runner import model_runner

GROUPS = {
    "linear (mm/addmm)": ("aten::mm", "aten::addmm"),
    "linear (int8 weight-only)": ("aten::_weight_int8pack_mm",),
    "linear (MKL packed)": ("mkl::_mkl_linear",),
    "attention gather (index/index_select)": ("aten::index", "aten::index_select"),
    "attention (sdpa)": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::_scaled_dot_product_attention_math"),
    "kv write (index_copy_)": ("aten::index_copy_",),
    "linear (int8, fused kernel)": ("cpu_ops::int8_linear",),
    "decode attention (fused kernel)": ("cpu_ops::paged_decode_attention",),
    "norm/silu/rope/kv write (fused kernels)": ("cpu_ops::rms_norm", "cpu_ops::silu_mul",
                                                "cpu_ops::rotary_", "cpu_ops::write_kv_"),
    # the stack's own time: its kernels (attention, norms, SiLU, RoPE, K/V write, the int8
    # matmul) and glue; the MKL matmuls it calls go through torch's dispatcher and count above
    "decode stack, all but MKL/torch ops (C++)": ("DecodeStack::forward",),
}


class LabelledOps:
    """The fused kernels' module (or the DecodeStack), each call labelled for torch.profiler
    (it cannot see them: they are plain pybind functions, not torch ops)."""

    def __init__(self, ops, prefix: str = "cpu_ops") -> None:
        self.ops, self.prefix = ops, prefix

    def __getattr__(self, name: str):
        from torch.profiler import record_function

        kernel = getattr(self.ops, name)

        def labelled(*args):
            with record_function(f"{self.prefix}::{name}"):
                return kernel(*args)
        return labelled


def label_fused_ops(engine: LLMEngine) -> None:
    model = engine.runner.model
    for module in model.modules():
        if getattr(module, "ops", None) is not None:
            module.ops = LabelledOps(module.ops)
        kernel = getattr(module, "kernel", None)
        if getattr(kernel, "ops", None) is not None:
            kernel.ops = LabelledOps(kernel.ops)
    if getattr(model, "decode_stack", None) is not None:
        model.decode_stack = LabelledOps(model.decode_stack, "DecodeStack")


def fill(engine: LLMEngine, batch: int, context: int) -> None:
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 40000 + 100 for j in range(40)], params)
    while engine.scheduler.num_waiting or any(
            r.num_computed_tokens < context for r in engine.scheduler.running):
        engine.step()


def time_steps(engine: LLMEngine, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class PartTimers:
    """Wall time of each part of an engine step, without the profiler: the engine's and the
    runner's methods wrapped in timers (a few us each), summed per step (some parts run
    once per request)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.per_step: dict[str, list[float]] = {}
        self.this_step: dict[str, float] = {}
        runner, model = engine.runner, engine.runner.model
        parts = {"schedule": (engine.scheduler, "schedule"),
                 "inputs": (runner, "_prepare_inputs"),
                 "metadata": (model_runner, "build_metadata"),
                 "embedding": (model.embed_tokens, "forward"),
                 "rope tables": (model.rotary, "tables"),
                 "LM head": (model, "compute_logits"),
                 "sampling": (runner, "sampler"),
                 "scheduler update": (engine.scheduler, "update"),
                 "outputs (detokenize)": (engine, "_process"),
                 "trace": (engine.trace, "record"),
                 "stats": (engine.stats, "on_step")}
        if model.decode_stack is not None:
            parts["decode stack (all layers)"] = (model, "decode_stack")
        for label, (owner, name) in parts.items():
            setattr(owner, name, self._timed(label, getattr(owner, name)))
        engine.step = self._per_step(engine.step)

    def _timed(self, label: str, fn):
        if not callable(fn):  # the DecodeStack: time its forward
            return SimpleNamespace(forward=self._timed(label, fn.forward))

        def timed(*args, **kwargs):
            t = time.perf_counter()
            result = fn(*args, **kwargs)
            self.this_step[label] = self.this_step.get(label, 0.0) + time.perf_counter() - t
            return result
        return timed

    def _per_step(self, step):
        def timed_step():
            self.this_step = {}
            result = step()
            for label, seconds in self.this_step.items():
                self.per_step.setdefault(label, []).append(seconds)
            return result
        return timed_step

    def medians_ms(self) -> dict[str, float]:
        return {k: statistics.median(v) * 1e3 for k, v in self.per_step.items()}


def breakdown(engine: LLMEngine, steps: int) -> dict[str, float]:
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(steps):
            engine.step()
    totals = {name: 0.0 for name in GROUPS}
    total = 0.0
    for evt in prof.key_averages():
        if evt.key == "ProfilerStep*":
            continue
        for name, keys in GROUPS.items():
            if evt.key in keys:
                totals[name] += evt.self_cpu_time_total
        total += evt.self_cpu_time_total
    totals["everything else"] = total - sum(totals.values())
    return {k: v / steps / 1e3 for k, v in totals.items() if v}  # ms per step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--context", type=int, default=100, help="decode from this context length")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kernels", default="auto", choices=list(KERNELS))
    p.add_argument("--quantization", default="none", choices=list(QUANTIZATIONS))
    p.add_argument("--wall", action="store_true",
                   help="instead of the profiler: each part's median wall time (engine, "
                        "inputs, decode stack, LM head, sampling, ...) over the timed steps")
    p.add_argument("--python-layers", action="store_true",
                   help="no C++ decode stack: the fused kernels called layer by layer (the "
                        "profile then shows each kernel)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"kernels {args.kernels}, quantization {args.quantization}, "
          f"{'Python layers' if args.python_layers else 'decode stack'}")
    for batch in args.batch:
        config = engine_config(max_num_seqs=batch, num_blocks=batch * 16 + 16,
                               max_num_batched_tokens=2048, kernels=args.kernels,
                               quantization=args.quantization)
        kernels = kernels_for(config)
        if args.python_layers:
            kernels = replace(kernels, decode_stack=False)
        engine = LLMEngine(config, loaded.config, loaded.weights, loaded.tokenizer,
                           kernel_set=kernels)
        fill(engine, batch, args.context)
        if args.wall:
            timers = PartTimers(engine)
            step = time_steps(engine, args.steps)
            parts = timers.medians_ms()
            rest = step * 1e3 - sum(parts.values())
            detail = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
            print(f"batch {batch:3d}: step {step * 1e3:7.2f} ms | wall ms (medians): {detail}; "
                  f"not in these parts {rest:.2f}", flush=True)
            continue
        step = time_steps(engine, args.steps)
        label_fused_ops(engine)  # after the timing: labels cost a little per call
        parts = breakdown(engine, 5)
        detail = ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
        print(f"batch {batch:3d}: step {step * 1e3:7.1f} ms ({batch / step:6.1f} tok/s) | "
              f"wall+profiler ms/step: {detail}", flush=True)


if __name__ == "__main__":
    main()
