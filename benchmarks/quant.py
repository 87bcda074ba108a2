"""slotserve serving GGUF files in their own blocks against llama.cpp's server on the same
files (issue 31, "Show"). One command:

    .venv/bin/python -m benchmarks.quant --out benchmarks/results/quant.json
    .venv/bin/python -m benchmarks.quant --files smollm2-q4_k_m --rounds 1 --smoke   # minutes

Files (benchmarks.peers.quant_files, prepared under --workdir and reused): the embedded
SmolLM2-135M as an F32 GGUF quantized by llama.cpp's `llama-quantize` to Q8_0, Q4_0,
Q4_K_M, Q5_K_M and Q6_K; the real Gemma 3 270M Q4_K_M (`make models`; a copy with Gemma 3's
chat template added, the base model's file has none); a random-weight
Llama-3.2-1B-shaped model quantized to Q4_K_M (`--sizes 1b,3b` adds the 3B one).

Systems, one after the other on each file, the order rotated every round: slotserve
(`serve --quantization gguf`, 64 slots) and llama.cpp's server (`-np 64 -t 2`, continuous
batching); both with the same context per slot (512 tokens: slotserve `--max-model-len 512
--num-blocks 2048` of 16 positions, llama.cpp `-c 32768`). Each is started fresh per file and
round (start-up: to a healthy /health), measured by the same streaming client
(`slotserve.lab.bench.OpenAITarget`, chat endpoint, greedy, ignore_eos) on benchmarks.vs_vllm's
workloads, then stopped; peak RSS is the server's VmHWM after its workloads.

Workloads (SCALES): "W" (64 chat requests at t=0, output lengths lognormal, median 64),
"W 2/s" and "W 4/s" (the same requests, Poisson arrivals), "batch-1" (one request alone, 128
tokens). On the 1B model (3B: more) the requests, their lengths and the rates are scaled down
so a round stays a few minutes; the report names each workload's actual figures.

Quality (trained weights only: SmolLM2 and Gemma; on random weights the logits are so flat
that agreement says nothing): teacher-forced greedy agreement with the fp32-dequantized
reference, slotserve `quantization="none"` on the same file in this process (its greedy
continuations of 32 chat prompts, `--quality-prompts`, 64 tokens each). Through each
server's API, in round 1 after the workloads: slotserve's by `prompt_logprobs` (the rank-1
token after each teacher-forced prefix, as benchmarks.vs_vllm measures vLLM); llama.cpp's
server returns no prompt logprobs (`echo` is refused), so one greedy token per prefix
(`/completion`, token-id prompt, top_k 1, the sampled token's id; its prompt cache reuses
the prefix). Both are the argmax after the same prefixes. slotserve's engine in process
gives the same figure as a check of the API path. The report keeps each system's hit at
every position and compares them paired (`paired_agreement`: the difference and its
standard error by prompt).
`--workloads ""` measures quality alone (one round, the files with trained weights).

Targets (issue 31), per file: batch-1 tok/s >= llama.cpp's; W output tok/s >= 1.5x
llama.cpp's; peak RSS <= llama.cpp's + 20%; agreement >= llama.cpp's.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.peers.quant_files import (
    LLAMA_SHAPES,
    ModelFile,
    all_keys,
    find_gemma,
    planned_files,
    prepare,
    tensor_types,
)
from benchmarks.perf import llama_server, measure_bandwidth_gbs
from benchmarks.vs_vllm import QUALITY_PROMPTS, QUALITY_TOKENS, Server, prompt_logprob_hits
from slotserve.lab.bench import (
    BenchSampling,
    OpenAITarget,
    format_table,
    run_bench,
    write_report,
)
from slotserve.lab.bench.server import ServerProcess, cli_flags
from slotserve.lab.workload import Workload, generate_workload

SLOTS = 64
CTX_PER_SLOT = 512
BLOCK_SIZE = 16
LLAMA_THREADS = 2
LLAMA_BIN = Path(os.environ.get("LLAMA_BIN", "/tmp/llama-build/bin"))
SYSTEMS = ("slotserve", "llama.cpp")
WORKLOADS = ("W", "W online low", "W online high", "batch-1")
# NOTE: the issue's targets: slotserve's figure over llama.cpp's must be at least (">=") or
# at most ("<=") the bar.
TARGETS = {"batch-1 tok/s": (">=", 1.0), "W tok/s": (">=", 1.5), "peak RSS": ("<=", 1.2),
           "agreement": (">=", 1.0)}


@dataclass(frozen=True)
class Scale:
    """A size class's workloads: W's requests and output lengths (lognormal, sigma 0.8,
    clipped), the online rates (W's requests at these req/s), batch-1's output tokens."""

    requests: int
    output_median: int
    output_min: int
    output_max: int
    rates: tuple[float, float]
    batch1_tokens: int


# NOTE: "small" is benchmarks.vs_vllm's W exactly (benchmarks.perf.workload_w). The 1B model
# decodes ~10x slower than SmolLM2: half the requests, half the lengths, a quarter of the
# rates (the low rate about llama.cpp's capacity there, the high one past it; a round of both
# systems ~7 min); the 3B (~2.5x the 1B's bytes) halves them again; the 0.5B (~0.4x the 1B's
# bytes) doubles the 1B's rates.
SCALES = {
    "small": Scale(64, 64, 8, 384, (2.0, 4.0), 128),
    "0.5b": Scale(32, 32, 8, 128, (1.0, 2.0), 64),
    "1b": Scale(32, 32, 8, 128, (0.5, 1.0), 64),
    "3b": Scale(16, 16, 4, 64, (0.25, 0.5), 32),
    "smoke": Scale(8, 16, 4, 32, (2.0, 4.0), 16),
}


def workload(name: str, scale: Scale) -> Workload:
    """One of WORKLOADS at `scale` (seed 0: every system gets the same requests)."""
    if name == "batch-1":
        return generate_workload(1, prompts="chat", output_len=scale.batch1_tokens, seed=0)
    rate = {"W": math.inf, "W online low": scale.rates[0],
            "W online high": scale.rates[1]}[name]
    return generate_workload(scale.requests, prompts="chat", output_len_median=scale.output_median,
                             output_len_sigma=0.8, output_len_min=scale.output_min,
                             output_len_max=scale.output_max, seed=0, request_rate=rate)


def workload_label(name: str, scale: Scale) -> str:
    """The workload as the table names it: its requests, lengths and rate."""
    if name == "batch-1":
        return f"batch-1 ({scale.batch1_tokens} tokens)"
    rate = {"W": "t=0", "W online low": f"{scale.rates[0]:g}/s",
            "W online high": f"{scale.rates[1]:g}/s"}[name]
    return f"{scale.requests} req, median {scale.output_median} tok, {rate}"


# --------------------------------------------------------------------------- servers
def slotserve_flags(path: Path, quantization: str = "gguf") -> list[str]:
    """`serve` flags: the file's own blocks (or `quantization`), 64 slots, llama.cpp's
    context per slot (the KV pool holds SLOTS x CTX_PER_SLOT positions, as llama.cpp's
    `-c`)."""
    return cli_flags(model=path, quantization=quantization, max_num_seqs=SLOTS,
                     max_model_len=CTX_PER_SLOT, num_blocks=SLOTS * CTX_PER_SLOT // BLOCK_SIZE,
                     block_size=BLOCK_SIZE)


def start_slotserve(model: ModelFile) -> Server:
    t0 = time.perf_counter()
    log = Path(f"/tmp/quant-slotserve-{model.key}.log")
    proc = ServerProcess.launch(log, *slotserve_flags(model.path))
    try:
        proc.wait_ready(600)
    except Exception:
        proc.stop()
        raise
    return Server("slotserve", proc.url, proc.proc.pid, time.perf_counter() - t0, proc.stop)


def start_llamacpp(model: ModelFile) -> Server:
    t0 = time.perf_counter()
    server = llama_server(str(LLAMA_BIN / "llama-server"), str(model.path), SLOTS,
                          LLAMA_THREADS, ctx_per_slot=CTX_PER_SLOT)
    url = server.__enter__()  # NOTE: a server never healthy is killed there
    return Server("llama.cpp", url, server.proc.pid, time.perf_counter() - t0,
                  lambda: server.__exit__(None, None, None))


def start(system: str, model: ModelFile) -> Server:
    print(f"starting {system} on {model.label} ...", file=sys.stderr, flush=True)
    server = (start_slotserve if system == "slotserve" else start_llamacpp)(model)
    print(f"{system}: healthy after {server.start_s:.1f} s", file=sys.stderr, flush=True)
    return server


def rotated(items: tuple | list, round_: int) -> list:
    """`items` rotated by `round_` (the order systems run in that round)."""
    k = round_ % len(items)
    return [*items[k:], *items[:k]]


# --------------------------------------------------------------------------- one run
def measure(server: Server, model: ModelFile, scale: Scale, workloads: list[str],
            round_: int) -> dict:
    """Every workload on a started server; the run's record (results, peak RSS, start-up)."""
    runs: dict[str, dict] = {}
    for wname in workloads:
        label = f"{server.name}, {model.key}, {wname} (round {round_ + 1})"
        print(f"running {label} ...", file=sys.stderr, flush=True)
        result = run_bench(workload(wname, scale), OpenAITarget(server.url, endpoint="chat"),
                           sampling=BenchSampling(), label=label)
        print(format_table([result]), file=sys.stderr, flush=True)
        runs[wname] = result.to_dict()
    return {"start_s": server.start_s, "peak_rss_mib": server.peak_rss_mib(), "results": runs}


# --------------------------------------------------------------------------- quality
def reference(model: ModelFile, prompts_count: int, tokens: int) -> dict:
    """The fp32-dequantized reference on `model` (slotserve quantization="none" in process):
    chat prompts' ids, their greedy continuations, and slotserve gguf's teacher-forced
    agreement with them in process (the check of the API path)."""
    from benchmarks.int8_quality import chat_prompts, quality_engine
    from slotserve.lab.quality import greedy_continuations, teacher_forced_agreement
    from slotserve.loader import load_model

    loaded = load_model(str(model.path), use_cache=False)
    prompts = chat_prompts(loaded.tokenizer, prompts_count)
    engine = quality_engine(loaded, quantization="none")
    continuations = greedy_continuations(engine, prompts, tokens)
    del engine, loaded
    gc.collect()
    blocks = load_model(str(model.path), keep_quantized=True)
    in_process = teacher_forced_agreement(quality_engine(blocks, quantization="gguf"), prompts,
                                          continuations)
    del blocks
    gc.collect()
    return {"prompts": prompts, "continuations": continuations,
            "slotserve_in_process": in_process}


def agreement(hits: list[list[bool]]) -> float:
    """The share of positions, over every prompt, where the server's argmax was the
    reference's token."""
    flat = [h for prompt in hits for h in prompt]
    if not flat:
        raise ValueError("no positions to score")
    return sum(flat) / len(flat)


def slotserve_hits(url: str, prompts, continuations) -> list[list[bool]]:
    """Through slotserve's API (vs_vllm.prompt_logprob_hits: the rank-1 token of
    `prompt_logprobs` at each continuation position is its argmax after the forced prefix)."""
    with httpx.Client(base_url=url, timeout=300) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
    return prompt_logprob_hits(url, prompts, continuations, model, timeout=300)


def llamacpp_top_token(client: httpx.Client, ids: list[int]) -> int:
    """llama.cpp's greedy token after the token ids `ids` (top_k 1: its argmax).

    NOTE: the sampled token's id (`return_tokens`), not `n_probs`' top token: llama.cpp
    leaves the probabilities out when the token ends in an incomplete UTF-8 character.
    """
    body = {"prompt": ids, "n_predict": 1, "temperature": 0.0, "top_k": 1,
            "cache_prompt": True, "return_tokens": True}
    response = client.post("/completion", json=body)
    response.raise_for_status()
    answer = response.json()
    if len(answer.get("tokens") or []) != 1:
        answer.pop("generation_settings", None)
        raise RuntimeError(f"llama.cpp answered no single token: {answer}")
    return int(answer["tokens"][0])


def llamacpp_hits(url: str, prompts, continuations) -> list[list[bool]]:
    """Through llama.cpp's server: one greedy token per teacher-forced prefix, the prompts
    in parallel (each prompt's prefixes in order, so its slot's cache holds the prefix)."""
    def one(prompt_cont) -> list[bool]:
        prompt, cont = prompt_cont
        with httpx.Client(base_url=url, timeout=300) as client:
            return [llamacpp_top_token(client, prompt + cont[:i]) == expected
                    for i, expected in enumerate(cont)]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, zip(prompts, continuations)))


def api_hits(server: Server, ref: dict) -> list[list[bool]]:
    """Per prompt and continuation position, whether the server's argmax was the reference's."""
    return (slotserve_hits if server.name == "slotserve" else llamacpp_hits)(
        server.url, ref["prompts"], ref["continuations"])


def paired_agreement(ours: list[list[bool]], theirs: list[list[bool]]) -> dict:
    """The two systems' hits position by position (a paired comparison, as McNemar's): the
    positions only one of them got (b ours, c theirs, of n), the difference of agreements
    d = (b - c) / n, and two standard errors of d: `standard_error` with the positions
    independent, sqrt(b + c - (b - c)^2 / n) / n, and `prompt_standard_error` clustered by
    prompt (the one to read), sqrt(J / (J - 1) * sum_j (D_j - d n_j)^2) / n over the J
    prompts, D_j = b_j - c_j and n_j positions in prompt j.

    NOTE: at ~98% agreement each system's own standard error is as large as the gap it is
    compared with; pairing removes the positions both get (or both miss). A prompt's
    positions are not independent (one early miss shifts what follows), so the clustered
    error is the honest one; it needs two prompts or more (else None)."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} prompts against {len(theirs)}")
    per_prompt = [_only_counts(row_a, row_b) for row_a, row_b in zip(ours, theirs)]
    n = sum(size for size, _, _ in per_prompt)
    if not n:
        raise ValueError("no positions to compare")
    only_ours = sum(b for _, b, _ in per_prompt)
    only_theirs = sum(c for _, _, c in per_prompt)
    difference = (only_ours - only_theirs) / n
    spread = max(only_ours + only_theirs - (only_ours - only_theirs) ** 2 / n, 0.0)
    prompts = len(per_prompt)
    clustered = None
    if prompts >= 2:
        squares = sum((b - c - difference * size) ** 2 for size, b, c in per_prompt)
        clustered = math.sqrt(prompts / (prompts - 1) * squares) / n
    return {"positions": n, "prompts": prompts, "only_slotserve": only_ours,
            "only_llama.cpp": only_theirs, "difference": difference,
            "standard_error": math.sqrt(spread) / n, "prompt_standard_error": clustered}


def _only_counts(ours: list[bool], theirs: list[bool]) -> tuple[int, int, int]:
    """(positions, only ours hit, only theirs hit) of one prompt; ValueError if the prompt's
    positions differ in number."""
    if len(ours) != len(theirs):
        raise ValueError(f"a prompt of {len(ours)} positions against {len(theirs)}")
    return (len(ours), sum(a and not b for a, b in zip(ours, theirs)),
            sum(b and not a for a, b in zip(ours, theirs)))


def quality_paired(hits: dict[str, list[list[bool]]]) -> dict | None:
    """The paired comparison where both systems were scored (None where one failed)."""
    if not set(SYSTEMS) <= set(hits):
        return None
    return paired_agreement(hits["slotserve"], hits["llama.cpp"])


def hits_text(hits: list[list[bool]]) -> list[str]:
    """Hits as one string of 0/1 per prompt (the report keeps them for paired figures)."""
    return ["".join("1" if h else "0" for h in row) for row in hits]


# --------------------------------------------------------------------------- summary
def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict]) -> dict:
    """Medians over a system's runs on one file: start-up, peak RSS, and per workload
    output tok/s, TTFT and TPOT p50/p99 (ms)."""
    row = {"rounds": len(runs), "start_s": _median([r["start_s"] for r in runs]),
           "peak_rss_mib": _median([r["peak_rss_mib"] for r in runs])}
    for wname in WORKLOADS:
        results = [r["results"][wname] for r in runs if wname in r["results"]]
        if not results:
            continue
        row[wname] = {
            "output_tok_s": _median([x["output_throughput"] for x in results]),
            "ttft_p50_ms": _median([x["ttft_ms"]["p50"] for x in results]),
            "tpot_p50_ms": _median([x["tpot_ms"]["p50"] for x in results]),
            "tpot_p99_ms": _median([x["tpot_ms"]["p99"] for x in results]),
            "failed": sum(x["failed"] for x in results)}
    return row


def target_figures(ours: dict, theirs: dict, quality: dict) -> dict:
    """The issue's targets on one file: {target: {slotserve, llama.cpp, ratio, bar, met}},
    ratio = slotserve's figure over llama.cpp's (batch-1 as tok/s: 1000 / TPOT p50); met
    None where a figure is missing."""
    def b1(row):
        tpot = row.get("batch-1", {}).get("tpot_p50_ms")
        return 1e3 / tpot if tpot else None

    # NOTE: a quality-only run's peak RSS is idle servers': no target
    measured = any(w in ours for w in WORKLOADS)
    pairs = {"batch-1 tok/s": (b1(ours), b1(theirs)),
             "W tok/s": (ours.get("W", {}).get("output_tok_s"),
                         theirs.get("W", {}).get("output_tok_s")),
             "peak RSS": ((ours.get("peak_rss_mib"), theirs.get("peak_rss_mib")) if measured
                          else (None, None)),
             "agreement": (quality.get("slotserve"), quality.get("llama.cpp"))}
    out = {}
    for name, (a, b) in pairs.items():
        sense, bar = TARGETS[name]
        ratio = a / b if a and b else None
        met = None
        if ratio is not None:  # NOTE: 1e-9: a figure exactly at the bar meets it
            met = ratio >= bar - 1e-9 if sense == ">=" else ratio <= bar + 1e-9
        out[name] = {"slotserve": a, "llama.cpp": b, "ratio": ratio, "bar": f"{sense} x{bar}",
                     "met": met}
    return out


def _f(x, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def speed_table(report: dict) -> str:
    lines = ["| file | MiB | system | peak RSS MiB | start s | W tok/s | W TPOT p50/p99 ms "
             "| online low: TTFT p50, TPOT p50/p99 | online high: TTFT p50, TPOT p50/p99 "
             "| batch-1 ms/token | agreement |", "|" + " --- |" * 11]
    for f in report["files"]:
        for system in SYSTEMS:
            row = f["summary"].get(system)
            if row is None:
                lines.append(f"| {f['label']} | {f['size_mib']:.0f} | {system} | failed: "
                             f"{f['errors'].get(system, '?')[:80]} |" + " |" * 7)
                continue
            w, lo, hi, b1 = (row.get(k, {}) for k in WORKLOADS)
            q = f["quality"].get(system)
            lines.append(
                f"| {f['label']} | {f['size_mib']:.0f} | {system} | {_f(row['peak_rss_mib'])} "
                f"| {_f(row['start_s'], '.1f')} | {_f(w.get('output_tok_s'))} "
                f"| {_f(w.get('tpot_p50_ms'))} / {_f(w.get('tpot_p99_ms'))} "
                f"| {_f(lo.get('ttft_p50_ms'))}, {_f(lo.get('tpot_p50_ms'))} / "
                f"{_f(lo.get('tpot_p99_ms'))} "
                f"| {_f(hi.get('ttft_p50_ms'))}, {_f(hi.get('tpot_p50_ms'))} / "
                f"{_f(hi.get('tpot_p99_ms'))} "
                f"| {_f(b1.get('tpot_p50_ms'), '.1f')} | {_f(q, '.1%')} |")
    return "\n".join(lines)


def targets_table(report: dict) -> str:
    lines = ["| file | " + " | ".join(f"{t}: slotserve / llama.cpp {sense} x{bar:g}"
                                      for t, (sense, bar) in TARGETS.items()) + " |",
             "|" + " --- |" * (len(TARGETS) + 1)]

    def cell(fig: dict) -> str:
        if fig["met"] is None:
            return "-"
        return f"x{fig['ratio']:.2f} {'met' if fig['met'] else '**not met**'}"

    for f in report["files"]:
        lines.append(f"| {f['label']} | " + " | ".join(cell(f["targets"][t]) for t in TARGETS)
                     + " |")
    return "\n".join(lines)


def paired_lines(report: dict) -> list[str]:
    """One line per file with both systems' hits: the paired difference of agreements."""
    lines = []
    for f in report["files"]:
        paired = f.get("quality_paired")
        if paired:
            clustered = paired.get("prompt_standard_error")
            lines.append(
                f"{f['label']}: agreement slotserve - llama.cpp {paired['difference']:+.2%} "
                f"(standard error {_f(clustered, '.2%')} by prompt, "
                f"{paired['standard_error']:.2%} by position; positions only slotserve "
                f"got {paired['only_slotserve']}, only llama.cpp {paired['only_llama.cpp']}, "
                f"of {paired['positions']})")
    return lines


# --------------------------------------------------------------------------- main
def run_file(model: ModelFile, scale: Scale, workloads: list[str], rounds: int,
             quality: dict | None) -> dict:
    """Both systems on one file, `rounds` times (order rotated); quality in round 1."""
    t0 = time.perf_counter()
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    errors: dict[str, str] = {}
    scores: dict[str, float] = {}
    hits: dict[str, list[list[bool]]] = {}
    for round_ in range(rounds):
        for system in rotated(SYSTEMS, round_):
            if system in errors:
                continue
            try:
                server = start(system, model)
            except Exception as exc:  # NOTE: one system failing on one file ends only its cell
                errors[system] = f"start: {exc}"[:2000]
                print(f"{system} on {model.key}: {errors[system]}", file=sys.stderr)
                continue
            try:
                runs[system].append(measure(server, model, scale, workloads, round_))
                if quality is not None and round_ == 0:
                    hits[system] = api_hits(server, quality)
                    scores[system] = agreement(hits[system])
                    print(f"{system} agreement on {model.key}: {scores[system]:.2%}",
                          file=sys.stderr, flush=True)
            except Exception as exc:
                errors[system] = f"run: {exc}"[:2000]
                print(f"{system} on {model.key}: {errors[system]}", file=sys.stderr)
            finally:
                server.stop()
    if quality is not None:
        scores["slotserve (in process)"] = quality["slotserve_in_process"]
    paired = quality_paired(hits)
    summary = {s: summarize(r) for s, r in runs.items() if r}
    return {"key": model.key, "label": model.label, "path": str(model.path),
            "size_mib": model.path.stat().st_size / 2**20, "types": tensor_types(model.path),
            "size_class": model.size_class, "scale": asdict(scale),
            "workloads": {w: workload_label(w, scale) for w in workloads},
            "runs": runs, "summary": summary, "quality": scores, "errors": errors,
            "quality_paired": paired,
            "quality_hits": {system: hits_text(h) for system, h in hits.items()},
            "seconds": round(time.perf_counter() - t0),
            "targets": target_figures(summary.get("slotserve", {}),
                                      summary.get("llama.cpp", {}), scores)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON report (default: print only)")
    p.add_argument("--sizes", default="1b",
                   help=f"random Llama sizes, comma-separated, of {', '.join(LLAMA_SHAPES)} "
                        "(default: 1b; '' for none)")
    p.add_argument("--files", default=None,
                   help="comma-separated file keys (default: every SmolLM2 type, Gemma, "
                        f"the --sizes Llamas); known: {', '.join(all_keys())}")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-quality", action="store_true")
    p.add_argument("--quality-prompts", type=int, default=QUALITY_PROMPTS,
                   help=f"chat prompts for the agreement (default {QUALITY_PROMPTS}; --smoke: "
                        f"4), {QUALITY_TOKENS} reference tokens each")
    p.add_argument("--smoke", action="store_true",
                   help="short workloads on every file (SCALES['smoke']), 4 quality prompts "
                        "of 8 tokens: checks the script, measures nothing")
    p.add_argument("--workdir", default="/tmp/quant-bench", help="where the files are written")
    args = p.parse_args(argv)
    args.sizes = [s for s in args.sizes.split(",") if s]
    if set(args.sizes) - set(LLAMA_SHAPES):
        p.error(f"--sizes: each of {', '.join(LLAMA_SHAPES)}")
    args.files = args.files.split(",") if args.files else all_keys(tuple(args.sizes))
    args.workloads = [w for w in args.workloads.split(",") if w]  # NOTE: '' = quality only
    if set(args.workloads) - set(WORKLOADS):
        p.error(f"--workloads: each of {', '.join(WORKLOADS)}")
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    if args.quality_prompts < 1:
        p.error("--quality-prompts: at least 1")
    if not args.workloads:  # NOTE: quality alone: one round is all it measures
        if args.no_quality:
            p.error('--workloads "" with --no-quality measures nothing')
        args.rounds = 1
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start_time = time.perf_counter()
    gemma = find_gemma()
    files = planned_files(Path(args.workdir), args.files, gemma)
    if not args.workloads:
        files = [f for f in files if f.quality]
        if not files:
            raise SystemExit('--workloads "": none of --files has trained weights to score')
    prepare(files, Path(args.workdir), LLAMA_BIN / "llama-quantize", gemma_path=gemma)
    prompts, tokens = (4, 8) if args.smoke else (args.quality_prompts, QUALITY_TOKENS)
    references, t0 = {}, time.perf_counter()
    if not args.no_quality:
        for f in files:
            if f.quality:
                print(f"reference (fp32) on {f.key} ...", file=sys.stderr, flush=True)
                references[f.key] = reference(f, prompts, tokens)
    references_s = round(time.perf_counter() - t0)
    bandwidth, load = [measure_bandwidth_gbs()], [os.getloadavg()]
    results = []
    for f in files:
        scale = SCALES["smoke" if args.smoke else f.size_class]
        results.append(run_file(f, scale, args.workloads, args.rounds, references.get(f.key)))
        # NOTE: the machine is shared: the copy bandwidth and load average after each file
        bandwidth.append(measure_bandwidth_gbs())
        load.append(os.getloadavg())
    report = {"files": results, "bandwidth_gbs": bandwidth, "load_average": load,
              "rounds": args.rounds,
              "quality_prompts": prompts, "quality_tokens": tokens,
              "seconds": round(time.perf_counter() - start_time),
              "references_seconds": references_s,
              "settings": {"slots": SLOTS, "ctx_per_slot": CTX_PER_SLOT,
                           "llama_threads": LLAMA_THREADS, "smoke": args.smoke}}
    print(speed_table(report))
    print()
    print(targets_table(report))
    for line in paired_lines(report):
        print(line)
    print(f"bandwidth GB/s: {[round(b, 1) for b in bandwidth]}; {report['seconds']} s in all")
    if args.out:
        write_report(args.out, **report)
        print(f"wrote {args.out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
