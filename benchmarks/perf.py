"""The CPU performance yardstick (issue "Performance on CPU"): floors, slotserve, peers.

    .venv/bin/python -m benchmarks.perf --out benchmarks/results/perf.json
    make bench-peers        # builds llama.cpp first, then runs this with every peer

Workload W: 64 chat requests (prompts of about 20-60 tokens with the template), output
lengths lognormal (median 64, sigma 0.8, clipped to [8, 384]), ignore_eos, greedy, all at
t=0; and its online form at 4 requests/s (Poisson). The floors are measured in the same
run: memory bandwidth (a large copy) and fp32 GEMM peak (a large square matmul).
Everything runs side by side in one process tree, one system at a time.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.perf_hf import hf_continuous_run, hf_static_run
from slotserve.lab.bench import (
    BenchResult,
    BenchSampling,
    EngineTarget,
    OpenAITarget,
    format_table,
    run_bench,
    write_report,
)
from slotserve.lab.bench.server import free_port, wait_healthy
from slotserve.lab.workload import Workload, generate_workload

REPO = Path(__file__).resolve().parent.parent


def workload_w(request_rate: float = math.inf) -> Workload:
    return generate_workload(64, prompts="chat", output_len_median=64, output_len_sigma=0.8,
                             output_len_min=8, output_len_max=384, seed=0,
                             request_rate=request_rate)


# --------------------------------------------------------------------------- floors
def measure_floors(repeats: int = 5) -> dict:
    """Memory bandwidth (GB/s, read + write of a 512 MiB copy) and fp32 GEMM GFLOP/s."""
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    gemm_s = _median_seconds(lambda: a @ b, repeats)
    return {"bandwidth_gbs": measure_bandwidth_gbs(repeats),
            "gemm_gflops": 2 * n ** 3 / gemm_s / 1e9}


def measure_bandwidth_gbs(repeats: int = 5) -> float:
    """Copy bandwidth, GB/s: read + write of a 512 MiB tensor."""
    src = torch.randn(128 * 1024 * 1024)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = _median_seconds(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / copy_s / 1e9


def _median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def floor_figures(floors: dict, target: EngineTarget, workload: Workload) -> dict:
    """W's compute floor and batch-1 decode floor from the measured machine figures."""
    prompt_tokens = count_prompt_tokens(target, workload)
    output_tokens = workload.total_max_tokens
    params = target.model_config.num_parameters
    token_s = 2 * params / (floors["gemm_gflops"] * 1e9)  # one token's matmuls at GEMM peak
    w_floor = (prompt_tokens + output_tokens) * token_s
    step_floor_s = batch1_floor_ms(params, floors["bandwidth_gbs"]) / 1e3
    schedule_floor = prompt_tokens * token_s + sum(
        max(step_floor_s, running * token_s)
        for running in running_per_step([r.max_tokens for r in workload.requests]))
    return {**floors, "parameters": params, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "w_floor_s": w_floor,
            "w_floor_tok_s": output_tokens / w_floor,
            "w_schedule_floor_s": schedule_floor,
            "w_schedule_floor_tok_s": output_tokens / schedule_floor,
            "batch1_floor_ms": step_floor_s * 1e3}


# NOTE: the batch sizes W's decode steps are timed at (interpolated between), and the rows
# of one prefill chunk (perf.py's engines run max_num_batched_tokens=512).
MATMUL_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PREFILL_CHUNK = 512


def measure_matmul_ms(target: EngineTarget, repeats: int = 5, kernels: str = "auto") -> dict:
    """The matmuls of one forward of `rows` tokens as slotserve runs them (`kernels` as
    EngineConfig's; "auto": the weight panels where the fused kernels run with AVX-512), in
    ms: the decoder layers' linears, and the LM head apart (it runs only for the tokens
    sampled). {"layers": {rows: ms}, "lm_head": {rows: ms}}.
    """
    from slotserve.model.kernels import resolve_kernels
    from slotserve.model.registry import build_model

    model = build_model(target.model_config, resolve_kernels(kernels, quantization="none"))
    model.load_hf_weights(target.weights)
    linears = [linear for layer in model.layers for linear in
               (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj)]

    def all_layers(xs: list[torch.Tensor]) -> None:
        for linear, x in zip(linears, xs):
            linear(x)

    timings = {"layers": {}, "lm_head": {}}
    with torch.inference_mode():
        for rows in (*MATMUL_BATCHES, PREFILL_CHUNK):
            xs = [torch.randn(rows, linear.in_features) for linear in linears]
            hidden = torch.randn(rows, model.lm_head.in_features)
            timings["layers"][rows] = _median_seconds(
                functools.partial(all_layers, xs), repeats) * 1e3
            timings["lm_head"][rows] = _median_seconds(
                functools.partial(model.lm_head, hidden), repeats) * 1e3
    return timings


def matmul_bound(matmul_ms: dict, prompt_tokens: int, output_lengths: list[int]) -> float:
    """W's wall time (s) if its schedule (all requests started together) ran nothing but
    its matmuls at the speeds measured by measure_matmul_ms: the prompts in chunks of
    PREFILL_CHUNK rows, then each decode step at its batch size (interpolated). No
    attention, no sampling, no Python: an engine that runs these matmuls cannot be faster.

    NOTE: a request with n output tokens runs n - 1 decode forwards (its first token comes
    from the prefill) but n LM-head rows.
    """
    def at(table: dict, rows: int) -> float:
        sizes = sorted(table)
        return float(np.interp(rows, sizes, [table[n] for n in sizes]))

    layers, head = matmul_ms["layers"], matmul_ms["lm_head"]
    running = running_per_step(output_lengths)
    prefill_ms = prompt_tokens / PREFILL_CHUNK * layers[PREFILL_CHUNK]
    decode_ms = sum(at(layers, n) for n in running[1:]) + sum(at(head, n) for n in running)
    return (prefill_ms + decode_ms) / 1e3


def matmul_figures(target: EngineTarget, workload: Workload, prompt_tokens: int) -> dict:
    """The measured matmul times and W's matmul bound (s, output tok/s)."""
    matmul_ms = measure_matmul_ms(target)
    bound_s = matmul_bound(matmul_ms, prompt_tokens, [r.max_tokens for r in workload.requests])
    return {"matmul_ms": matmul_ms, "w_matmul_bound_s": bound_s,
            "w_matmul_bound_tok_s": workload.total_max_tokens / bound_s}


def count_prompt_tokens(target: EngineTarget, workload: Workload) -> int:
    """Tokens of the workload's chat prompts with the model's template."""
    return sum(map(len, workload.chat_prompt_ids(target.tokenizer)))


def running_per_step(output_lengths: list[int]) -> list[int]:
    """Requests still decoding at each step when all start together (64 slots on W).

    W's schedule floor: the prompts at GEMM peak, then each of these decode steps at the
    larger of its tokens' matmuls at GEMM peak and one read of the weights. Unlike the
    compute floor, which counts only tokens, it charges the long tail, where a few requests
    still decode and every step reads all the weights for them. (Only a scheduler that knew
    every output length in advance could spread W's work evenly enough to approach the
    compute floor.)
    """
    return [sum(n > step for n in output_lengths) for step in range(max(output_lengths))]


def batch1_floor_ms(params: int, bandwidth_gbs: float) -> float:
    """One decode step's floor: every fp32 weight read once at the copy bandwidth."""
    return 4 * params / (bandwidth_gbs * 1e9) * 1e3


# --------------------------------------------------------------------------- slotserve
def slotserve_runs(target: EngineTarget, slots: list[int], online: bool) -> list[BenchResult]:
    results = []
    w = workload_w()
    for n in slots:
        for policy in ("continuous", "static"):
            label = f"slotserve {policy} {n} slots"
            results.append(_run(w, target.configured(batching=policy, max_num_seqs=n), label))
    label = f"slotserve continuous {max(slots)} slots, int8 weights"
    results.append(_run(w, target.configured(max_num_seqs=max(slots), quantization="int8"),
                        label))
    if online:
        for n in slots:
            label = f"slotserve continuous {n} slots, online 4 req/s"
            results.append(_run(workload_w(4.0), target.configured(max_num_seqs=n), label))
    return results


def _run(workload: Workload, target, label: str) -> BenchResult:
    print(f"running {label} ...", file=sys.stderr, flush=True)
    result = run_bench(workload, target, sampling=BenchSampling(), label=label)
    print(format_table([result]), file=sys.stderr, flush=True)
    return result


def batch1_runs(target: EngineTarget, server_bin: str | None, models: dict[str, str],
                rounds: int = 3) -> tuple[list[BenchResult], list[float]]:
    """One request alone, 128 output tokens: the batch-1 decode speed (TPOT), each system
    `rounds` times, interleaved so the host's noise hits all alike.

    Also returns the batch-1 floor (ms) measured again just before each round: the host's
    bandwidth moves between minutes, and a floor from the start of the run would not say
    how close a later round came to its own.
    """
    w = generate_workload(1, prompts="chat", output_len=128, seed=0)
    systems = {"slotserve fp32": target.configured(max_num_seqs=1, quantization="none"),
               "slotserve int8": target.configured(max_num_seqs=1, quantization="int8")}
    for name, path in (models.items() if server_bin else ()):
        systems[f"llama.cpp server {name}"] = path
    results, round_floors_ms = [], []
    params = target.model_config.num_parameters
    for round_ in range(rounds):
        round_floors_ms.append(batch1_floor_ms(params, measure_bandwidth_gbs()))
        for name, system in systems.items():
            label = f"batch-1 decode, {name} (round {round_ + 1})"
            if isinstance(system, str):
                results.append(_run_llamacpp(server_bin, system, w, label))
            else:
                results.append(_run(w, system, label))
    return results, round_floors_ms


def _run_llamacpp(server_bin: str, model: str, workload: Workload, label: str) -> BenchResult:
    with llama_server(server_bin, model, 1, 2) as url:
        return _run(workload, OpenAITarget(url, endpoint="chat"), label)


# --------------------------------------------------------------------------- llama.cpp
def llamacpp_runs(server_bin: str, models: dict[str, str], parallels: list[int],
                  threads: int) -> tuple[list[BenchResult], list[str]]:
    """Results, and the errors of configurations that could not run (kept in the report)."""
    results, errors = [], []
    for name, path in models.items():
        for parallel in parallels:
            label = f"llama.cpp server {name} --parallel {parallel}"
            try:
                with llama_server(server_bin, path, parallel, threads) as url:
                    results.append(_run(workload_w(), OpenAITarget(url, endpoint="chat"),
                                        label))
            except RuntimeError as exc:
                errors.append(f"{label}: {exc}")
                print(errors[-1], file=sys.stderr)
    return results, errors


class llama_server:  # noqa: N801 (a context manager used like a function)
    """llama-server on 127.0.0.1 for the duration of a `with` block."""

    def __init__(self, binary: str, model: str, parallel: int, threads: int,
                 ctx_per_slot: int = 512, poll_s: float = 0.5) -> None:
        self.port = free_port()
        self.poll_s = poll_s  # how often /health is asked while it starts
        self.cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
                    "--parallel", str(parallel), "--threads", str(threads),
                    "-c", str(parallel * ctx_per_slot), "--no-warmup"]

    def __enter__(self) -> str:
        self.log = open(f"/tmp/llama-server-{self.port}.log", "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{self.port}"
        try:
            wait_healthy(url, 300, lambda: self.proc.poll() is not None,
                         lambda: f"see {self.log.name}", poll_s=self.poll_s)
        except Exception:  # NOTE: started but never healthy: no server left behind
            self.proc.kill()
            self.proc.wait(30)
            self.log.close()
            raise
        return url

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# --------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/perf.json"))
    p.add_argument("--slots", default="16,64", help="slotserve max_num_seqs values")
    p.add_argument("--no-online", action="store_true")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                   help="path of llama.cpp's llama-server (skipped when absent)")
    p.add_argument("--llama-f32", default=None, help="F32 GGUF for llama.cpp (see peers/)")
    p.add_argument("--parallel", default="16,64")
    p.add_argument("--hf", action="store_true",
                   help="also run HF transformers (static batches, and its continuous batching)")
    p.add_argument("--no-batch1", action="store_true", help="skip the batch-1 decode runs")
    p.add_argument("--floors-only", action="store_true",
                   help="only the floors and W's matmul bound (about a minute)")
    p.add_argument("--batch1-only", action="store_true",
                   help="only the batch-1 decode runs (no workload W)")
    args = p.parse_args()
    errors: list[str] = []

    target = EngineTarget.load(max_num_batched_tokens=512, max_model_len=1024)
    w = workload_w()
    floors = floor_figures(measure_floors(), target, w)
    floors.update(matmul_figures(target, w, floors["prompt_tokens"]))
    print(json.dumps(floors, indent=1), file=sys.stderr)
    if args.floors_only:
        return
    results = [] if args.batch1_only else slotserve_runs(
        target, [int(s) for s in args.slots.split(",")], not args.no_online)
    from slotserve.loader import default_model_path

    models = {"Q4_1": default_model_path()}
    if args.llama_f32:
        models["F32"] = args.llama_f32
    if not args.no_batch1:
        batch1_results, floors["batch1_round_floors_ms"] = batch1_runs(
            target, args.llama_server, models)
        results += batch1_results
        print(f"batch-1 floor before each round: {floors['batch1_round_floors_ms']}",
              file=sys.stderr)
    if args.llama_server and not args.batch1_only:
        peer_results, errors = llamacpp_runs(args.llama_server, models,
                                             [int(n) for n in args.parallel.split(",")], 2)
        results += peer_results
    import resource

    # NOTE: read before HF's runs: its continuous batching alone takes ~15 GB here.
    rss_before_hf_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    extra = [hf_static_run(target, w), hf_continuous_run(target, w)] if args.hf else []
    for row in extra:
        print(f"{row['label']}: {row['duration_s']:.1f} s, "
              f"{row['output_throughput']:.1f} output tok/s", file=sys.stderr)
    print(format_table(results))
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this process: {rss_before_hf_mib:.0f} MiB after the slotserve runs, "
          f"{peak_rss_mib:.0f} MiB in all (with HF)")
    write_report(args.out, peak_rss_mib=peak_rss_mib, peak_rss_mib_before_hf=rss_before_hf_mib,
                 floors=floors, results=[r.to_dict() for r in results], hf_static=extra,
                 errors=errors)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
