"""The embedded SmolLM2 GGUF served in its own blocks (quantization=auto) vs bf16 and int8.

    .venv/bin/python -m benchmarks.gguf_quant --out benchmarks/results/gguf-quant.json

Each round starts one process per mode, the modes' order rotated round to round (the
machine is shared: medians over rounds). A process loads the model as `LLMEngine.from_config`
does (load time: kernels already built), then measures its resident memory (after the load,
freed heap returned), its peak, batch-1 ms per output token (median step of one request) and
the output tok/s of 64 sequences decoding together. Then, in this process, the teacher-forced
greedy agreement of each mode with the fp32-dequantized reference (quantization=none), and
batch-1 ms per token again with the three engines side by side, one step of each in turn
(on a busy machine the per-process batch-1 numbers are mostly its stalls).

    .venv/bin/python -m benchmarks.gguf_quant --speed --batches 1 8 --speed-steps 150 \
        --out benchmarks/results/gguf-stack-zen4.json

    .venv/bin/python -m benchmarks.gguf_quant --files A.gguf B.gguf --rounds 2 --seqs 32 \
        --out benchmarks/results/gguf-sizes.json

`--files` measures the same per process (load, memory, batch-1, `--seqs` decoding) for other
GGUF files, each served in its own blocks (quantization=auto), the files in turn.

`--speed` measures only decode speed, in this one process: GGUF blocks through the decode
stack, GGUF blocks layer by layer in Python (the stack off: what quantization=gguf ran
before the stack had a block kind) and bf16 (through the stack), each with `batch`
sequences decoding; one decode step of each engine in turn, the order rotated every step,
after warm-up steps (a shared machine's stalls then hit all alike). Output tok/s =
batch / the median step.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

MODES = {"gguf blocks": "gguf", "bf16": "bf16", "int8": "int8"}
# --speed: name -> (quantization, decode stack on)
SPEED_MODES = {"gguf blocks, decode stack": ("gguf", True),
               "gguf blocks, python layers": ("gguf", False),
               "bf16, decode stack": ("bf16", True)}
WARMUP_STEPS = 5


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def worker(quantization: str, batch_tokens: int, seqs: int, model: str | None = None) -> dict:
    """One mode's numbers, measured in this (fresh) process (`model`: a file; None: the
    embedded one)."""
    from benchmarks.int8_quality import batch1_ms_per_token, chat_prompts
    from slotserve.config import engine_config
    from slotserve.engine.llm_engine import LLMEngine
    from slotserve.engine.sizing import set_torch_threads
    from slotserve.model.cpu_ops import load_cpu_ops
    from slotserve.sampling import SamplingParams

    set_torch_threads()
    load_cpu_ops()
    start = time.perf_counter()
    engine = LLMEngine.from_config(engine_config(model=model, max_num_seqs=seqs,
                                                 num_blocks=2048, quantization=quantization))
    load_s = time.perf_counter() - start
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss = _rss_mib()
    prompts = chat_prompts(engine.tokenizer, seqs)
    b1 = batch1_ms_per_token(engine, prompts[0], batch_tokens)
    params = SamplingParams(max_tokens=batch_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"w{i}", prompt, params)
    tokens, decode_s = 0, 0.0
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - step_start
        if engine.scheduler.num_waiting == 0 and len(outputs) == seqs:  # all decoding
            decode_s += elapsed
            tokens += len(outputs)
    return {"kernels": engine.runner.kernels.describe(), "load_s": load_s,
            "rss_after_load_mib": rss,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "batch1_ms_per_token": b1, f"decode_tok_s_{seqs}_seqs": tokens / decode_s}


def agreement(prompts: int, max_tokens: int) -> dict:
    from benchmarks.int8_quality import chat_prompts
    from slotserve.config import engine_config
    from slotserve.engine.llm_engine import LLMEngine
    from slotserve.lab.quality import greedy_continuations, teacher_forced_agreement
    from slotserve.loader import load_model

    fp32 = load_model()
    settings = dict(max_num_seqs=32, num_blocks=1024)
    reference = LLMEngine(engine_config(quantization="none", **settings), fp32.config,
                          fp32.weights, fp32.tokenizer)
    ids = chat_prompts(fp32.tokenizer, prompts)
    continuations = greedy_continuations(reference, ids, max_tokens)
    del reference
    result = {}
    for name, quantization in MODES.items():
        loaded = load_model(keep_quantized=quantization == "gguf")
        engine = LLMEngine(engine_config(quantization=quantization, **settings),
                           loaded.config, loaded.weights, loaded.tokenizer)
        result[name] = teacher_forced_agreement(engine, ids, continuations)
        del engine, loaded
    return {"prompts": prompts, "tokens_each": max_tokens, "teacher_forced": result}


def interleaved_batch1(steps: int) -> dict:
    """Batch-1 ms per output token with the three modes in this one process, one decode
    step of each in turn (a busy machine's stalls then hit all alike): median and quartiles."""
    from benchmarks.int8_quality import chat_prompts
    from slotserve.config import engine_config
    from slotserve.engine.llm_engine import LLMEngine
    from slotserve.engine.sizing import set_torch_threads
    from slotserve.loader import load_model
    from slotserve.sampling import SamplingParams

    set_torch_threads()
    engines = {}
    for name, quantization in MODES.items():
        loaded = load_model(keep_quantized=quantization == "gguf")
        engines[name] = LLMEngine(engine_config(max_num_seqs=4, num_blocks=256,
                                                quantization=quantization),
                                  loaded.config, loaded.weights, loaded.tokenizer)
    prompt = chat_prompts(engines["bf16"].tokenizer, 1)[0]
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for engine in engines.values():
        engine.add_request("b1", prompt, params)
        engine.step()  # the prefill
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"median": statistics.median(t),
                   "quartiles": statistics.quantiles(t, n=4)[::2]} for name, t in times.items()}


def _speed_engines(seqs: int) -> dict:
    """One engine per SPEED_MODES entry, the embedded model."""
    from dataclasses import replace

    from slotserve.config import engine_config
    from slotserve.engine.llm_engine import LLMEngine
    from slotserve.loader import load_model

    engines = {}
    for name, (quantization, stack) in SPEED_MODES.items():
        loaded = load_model(keep_quantized=quantization == "gguf")
        config = engine_config(max_num_seqs=seqs, num_blocks=512, quantization=quantization)
        engine = LLMEngine(config, loaded.config, loaded.weights, loaded.tokenizer)
        if not stack:
            engine = LLMEngine(config, loaded.config, loaded.weights, loaded.tokenizer,
                               kernel_set=replace(engine.runner.kernels, decode_stack=False))
        assert (engine.runner.model.decode_stack is not None) == stack, name
        engines[name] = engine
    return engines


def interleaved_decode(batch: int, steps: int) -> dict:
    """Decode speed of SPEED_MODES with `batch` sequences decoding: one step of each engine
    in turn (order rotated each step) after the prefills and WARMUP_STEPS; per mode the
    median step and its quartiles (ms) and batch / median as output tok/s."""
    from benchmarks.int8_quality import chat_prompts
    from slotserve.engine.sizing import set_torch_threads
    from slotserve.sampling import SamplingParams

    set_torch_threads()
    engines = _speed_engines(batch)
    prompts = chat_prompts(next(iter(engines.values())).tokenizer, batch)
    params = SamplingParams(max_tokens=steps + WARMUP_STEPS + 4, temperature=0.0,
                            ignore_eos=True)
    for engine in engines.values():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"s{i}", prompt, params)
        started: set[str] = set()
        while len(started) < batch:  # the prefills: every sequence has its first token
            started |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
        for _ in range(WARMUP_STEPS):
            engine.step()
    names = list(engines)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(steps):
        for name in names[step % len(names):] + names[:step % len(names)]:
            start = time.perf_counter()
            outputs = engines[name].step()
            times[name].append((time.perf_counter() - start) * 1e3)
            assert len(outputs) == batch, (name, len(outputs))  # all decoding
    result = {}
    for name, t in times.items():
        median = statistics.median(t)
        result[name] = {"kernels": engines[name].runner.kernels.describe(),
                        "step_ms_median": median,
                        "step_ms_quartiles": statistics.quantiles(t, n=4)[::2],
                        "tok_s": batch * 1e3 / median}
    return result


def speed_report(batches: list[int], steps: int, repeats: int) -> dict:
    """interleaved_decode at each batch size, `repeats` times (fresh engines each time,
    batch sizes alternating): every run, and per batch and mode the median tok/s of runs."""
    report = {"command": " ".join(["python -m benchmarks.gguf_quant", *sys.argv[1:]]),
              "cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
              "model": "the embedded SmolLM2-135M-Instruct GGUF (Q4_1 layers, Q8_0 embedding)",
              "model_file_mib": _model_file_mib(), "steps_each": steps,
              "warmup_steps": WARMUP_STEPS, "load_average_before": os.getloadavg(),
              "runs": {str(b): [] for b in batches}}
    for repeat in range(repeats):
        for batch in batches:
            run = interleaved_decode(batch, steps)
            report["runs"][str(batch)].append(run)
            print(repeat, batch, json.dumps({n: round(r["tok_s"], 1) for n, r in run.items()}),
                  flush=True)
    report["load_average_after"] = os.getloadavg()  # (1, 5, 15 min): the machine is shared
    report["median_tok_s"] = {
        batch: {name: statistics.median(run[name]["tok_s"] for run in runs)
                for name in SPEED_MODES}
        for batch, runs in report["runs"].items()}
    return report


def _run_worker(quantization: str, tokens: int, seqs: int, model: str | None = None) -> dict:
    """worker() in a fresh process: its numbers."""
    command = [sys.executable, "-m", "benchmarks.gguf_quant", "--worker", quantization,
               "--tokens", str(tokens), "--seqs", str(seqs)]
    out = subprocess.run(command + (["--model", model] if model else []), capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def files_report(files: list[str], rounds: int, tokens: int, seqs: int) -> dict:
    """Each GGUF file served in its own blocks: `rounds` fresh processes each, the files in
    turn; per file every run and the medians (what the README's sizes table shows)."""
    runs: dict[str, list[dict]] = {f: [] for f in files}
    for _ in range(rounds):
        for f in files:
            runs[f].append(_run_worker("auto", tokens, seqs, f))
            print(os.path.basename(f), runs[f][-1], flush=True)
    return {"command": " ".join(["python -m benchmarks.gguf_quant", *sys.argv[1:]]),
            "cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
            "bandwidth_gbs": _bandwidth_gbs(), "load_average_after": os.getloadavg(),
            "rounds": rounds, "tokens_each": tokens, "seqs": seqs,
            "files": {f: {"file_mib": os.path.getsize(f) / 2**20, "median": _medians(rs),
                          "runs": rs} for f, rs in runs.items()}}


def _medians(runs: list[dict]) -> dict:
    return {key: (statistics.median(run[key] for run in runs) if key != "kernels"
                  else runs[0][key]) for key in runs[0]}


def _bandwidth_gbs() -> float:
    from benchmarks.perf import measure_bandwidth_gbs

    return measure_bandwidth_gbs()


def _write(report: dict, out: str | None) -> None:
    print(json.dumps({k: v for k, v in report.items() if k != "files"}))
    for name, entry in report.get("files", {}).items():
        print(os.path.basename(name), json.dumps(entry["median"]))
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per request")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--prompts", type=int, default=32, help="agreement prompts")
    p.add_argument("--agreement-tokens", type=int, default=32)
    p.add_argument("--batch1-steps", type=int, default=96,
                   help="decode steps per mode of the interleaved batch-1 measure")
    p.add_argument("--speed", action="store_true",
                   help="only decode speed: gguf (stack, python layers) and bf16, interleaved")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8],
                   help="--speed: sequences decoding together")
    p.add_argument("--speed-steps", type=int, default=100, help="--speed: steps per mode")
    p.add_argument("--speed-repeats", type=int, default=3,
                   help="--speed: runs per batch size (fresh engines each)")
    p.add_argument("--files", nargs="+", default=None,
                   help="only these GGUF files, each served in its own blocks (auto): "
                        "load time, memory, batch-1 and --seqs decoding, --rounds processes "
                        "each (the files in turn)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens, args.seqs, args.model)))
        return
    if args.files:
        _write(files_report(args.files, args.rounds, args.tokens, args.seqs), args.out)
        return
    if args.speed:
        report = speed_report(args.batches, args.speed_steps, args.speed_repeats)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        return
    runs: dict[str, list[dict]] = {name: [] for name in MODES}
    names = list(MODES)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(_run_worker(MODES[name], args.tokens, args.seqs))
            print(name, runs[name][-1], flush=True)
    table = {name: _medians(rs) for name, rs in runs.items()}
    report = {"command": " ".join(["python -m benchmarks.gguf_quant", *sys.argv[1:]]),
              "cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
              "model_file_mib": _model_file_mib(), "rounds": args.rounds, "median": table,
              "runs": runs, "agreement_vs_fp32": agreement(args.prompts,
                                                           args.agreement_tokens),
              "batch1_interleaved_ms": interleaved_batch1(args.batch1_steps)}
    print(json.dumps(report["median"], indent=1), report["agreement_vs_fp32"],
          report["batch1_interleaved_ms"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((line.split(":", 1)[1].strip() for line in cpuinfo
                     if line.startswith("model name")), platform.processor())


def _model_file_mib() -> float:
    from slotserve.loader import default_model_path

    return os.path.getsize(default_model_path()) / 2**20


if __name__ == "__main__":
    main()
