"""What a benchmark run measures, and its summary (metrics defined in `slotserve.lab.bench`)."""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import asdict, dataclass, field

import numpy as np

from slotserve.percentile import percentile


@dataclass
class RequestRecord:
    """What one request measured (seconds). ok=False: it failed; error says why."""

    id: str
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""  # the answer (HTTP: what the stream carried), for a conversation's next turn


@dataclass
class LatencyStats:
    """mean, p50, p90, p99 in milliseconds (None when nothing was measured)."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        if not seconds:
            return cls()
        ms = [s * 1000.0 for s in seconds]
        p50, p90, p99 = (percentile(ms, q) for q in (50, 90, 99))
        return cls(float(np.mean(ms)), p50, p90, p99)


@dataclass
class RunStats:
    """What a target returns from one run, before it is summarised."""

    records: list[RequestRecord]
    duration: float
    config: dict
    utilisation: float | None = None
    preemptions: int | None = None
    iterations: int | None = None
    prefix_cache: dict | None = None  # engine only: prompt tokens, cache queries and hits


@dataclass
class BenchResult:
    """One run's report: the row of a table, one object of the JSON file."""

    label: str
    target: str  # "engine" or the server's URL
    duration_s: float
    completed: int
    failed: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens) / s
    total_input_tokens: int
    total_output_tokens: int
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    utilisation: float | None  # engine only
    preemptions: int | None  # engine only
    iterations: int | None  # engine only
    config: dict
    machine: dict
    date: str
    errors: list[str] = field(default_factory=list)  # the first few failures' messages
    # engine only: prompt_tokens, queries, hits (tokens), hit_rate, prefill_tokens_computed
    prefix_cache: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(run: RunStats, label: str, target: str) -> BenchResult:
    """Aggregate per-request records into a BenchResult."""
    ok = [r for r in run.records if r.ok]
    bad = [r for r in run.records if not r.ok]
    inputs = sum(r.prompt_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    duration = max(run.duration, 1e-9)
    return BenchResult(
        label=label, target=target, duration_s=run.duration, completed=len(ok),
        failed=len(bad), request_throughput=len(ok) / duration,
        output_throughput=outputs / duration,
        total_token_throughput=(inputs + outputs) / duration,
        total_input_tokens=inputs, total_output_tokens=outputs,
        ttft_ms=LatencyStats.of(_present(r.ttft for r in ok)),
        tpot_ms=LatencyStats.of(_present(r.tpot for r in ok)),
        itl_ms=LatencyStats.of([gap for r in ok for gap in r.itls]),
        e2e_ms=LatencyStats.of(_present(r.e2e for r in ok)),
        utilisation=run.utilisation, preemptions=run.preemptions, iterations=run.iterations,
        config=run.config, machine=machine_info(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        errors=[f"{r.id}: {r.error}" for r in bad[:5]], prefix_cache=run.prefix_cache)


def _present(values) -> list[float]:
    return [v for v in values if v is not None]


def machine_info() -> dict:
    """Where the numbers were measured."""
    import torch

    info = {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__}
    info.update(cpu_identity())
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# The /proc/cpuinfo flags that choose slotserve's CPU kernels (model/kernels.py's classes).
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_identity(path: str = "/proc/cpuinfo") -> dict:
    """The CPU's model name and which of KERNEL_FLAGS it has ({} where `path` cannot be
    read): a result holds for the class it was measured on."""
    from slotserve.model.kernels import cpuinfo_fields

    fields = cpuinfo_fields(path)
    if not fields:
        return {}
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name", ""),
            "cpu_flags": [flag for flag in KERNEL_FLAGS if flag in flags]}


@dataclass(frozen=True)
class BenchSampling:
    """How every request samples: greedy and ignoring EOS by default (exact lengths)."""

    temperature: float = 0.0
    ignore_eos: bool = True


def compare_ratios(baseline: BenchResult, other: BenchResult) -> dict:
    """other / baseline for throughput and latency (e.g. continuous vs static)."""
    def ratio(a, b):
        return None if a is None or b is None or a == 0 else b / a

    return {
        "baseline": baseline.label, "other": other.label,
        "request_rate": other.config.get("workload", {}).get("request_rate"),
        "output_throughput": ratio(baseline.output_throughput, other.output_throughput),
        "request_throughput": ratio(baseline.request_throughput, other.request_throughput),
        "ttft_mean": ratio(baseline.ttft_ms.mean, other.ttft_ms.mean),
        "ttft_p50": ratio(baseline.ttft_ms.p50, other.ttft_ms.p50),
        "tpot_mean": ratio(baseline.tpot_ms.mean, other.tpot_ms.mean),
        "tpot_p50": ratio(baseline.tpot_ms.p50, other.tpot_ms.p50),
        "e2e_mean": ratio(baseline.e2e_ms.mean, other.e2e_ms.mean),
        "utilisation": ratio(baseline.utilisation, other.utilisation),
    }
