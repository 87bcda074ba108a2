"""`slotserve bench`: a load generator and report for the engine or any OpenAI-compatible server.

    result = run_bench(workload, EngineTarget.load(max_num_seqs=16))      # in-process
    result = run_bench(workload, OpenAITarget("http://127.0.0.1:8000"))   # over HTTP
    print(format_table([result])); json.dumps(result.to_dict())

Targets:
- `EngineTarget`: an LLMEngine in this process, driven `step()` by `step()`; each request is
  added when its arrival time comes, and its latencies come from the engine's RequestMetrics.
  Weights are loaded once; every run builds a fresh engine on them (fresh KV pool and stats).
- `OpenAITarget`: streaming /v1/completions or /v1/chat/completions; TTFT and ITL are measured
  client-side from chunk arrival times (so the same tool measures llama-server or vLLM).

Metrics (as in the design's words; vLLM's benchmark_serving computes the same ones):
- TTFT: first token - arrival (over HTTP: first text chunk - request sent).
- TPOT: (last token - first token) / (output tokens - 1); requests with one token have none.
- ITL: every gap between two consecutive tokens (HTTP: chunks) of one request, pooled.
- e2e: finish - arrival. Percentiles are numpy's (linear interpolation), in ms.
- utilisation (engine only): busy slot-iterations / (max_num_seqs x iterations), where a
  slot is busy if its request processed tokens in that iteration (the seed's definition).
- duration: from the start of the run (t=0 of the arrival schedule) to the last finish.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import inspect
import json
import os
import platform
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from slotserve.cli import add_engine_args, engine_kwargs
from slotserve.engine.llm import engine_config
from slotserve.engine.llm_engine import LLMEngine, set_torch_threads
from slotserve.lab.workload import (
    BenchRequest,
    Workload,
    generate_workload,
    load_workload,
    save_workload,
    with_poisson_arrivals,
)
from slotserve.sampling import SamplingParams

# ====================================================================== results


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
        ms = np.asarray(seconds, dtype=float) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(float(ms.mean()), float(p50), float(p90), float(p99))


@dataclass
class RunStats:
    """What a target returns from one run, before it is summarised."""

    records: list[RequestRecord]
    duration: float
    config: dict
    utilisation: float | None = None
    preemptions: int | None = None
    iterations: int | None = None


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
        errors=[f"{r.id}: {r.error}" for r in bad[:5]])


def _present(values) -> list[float]:
    return [v for v in values if v is not None]


def machine_info() -> dict:
    """Where the numbers were measured."""
    import torch

    info = {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_report(path: str | Path, **fields) -> None:
    """A benchmark script's JSON report: when, where and by which command, then `fields`."""
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
              "command": " ".join(sys.argv), **fields}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1))


# ====================================================================== sampling


@dataclass(frozen=True)
class BenchSampling:
    """How every request samples: greedy and ignoring EOS by default (exact lengths)."""

    temperature: float = 0.0
    ignore_eos: bool = True


# ====================================================================== in-process engine


class EngineTarget:
    """The in-process engine: weights loaded once, a fresh LLMEngine for every run."""

    name = "engine"

    def __init__(self, model_config, weights: dict, tokenizer=None,
                 engine_kwargs: dict | None = None, source: str | None = None) -> None:
        self.model_config = model_config
        self.weights = weights
        self.tokenizer = tokenizer
        self.engine_kwargs = dict(engine_kwargs or {})
        self.source = source or model_config.name

    @classmethod
    def load(cls, model: str | None = None, **engine_kwargs) -> EngineTarget:
        """Load a model (None: the embedded default); engine_kwargs as engine_config's."""
        from slotserve.loader import load_model  # NOTE: lazy: only the CLI path loads files

        set_torch_threads()
        loaded = load_model(model)
        return cls(loaded.config, loaded.weights, loaded.tokenizer, engine_kwargs, loaded.source)

    def configured(self, **overrides) -> EngineTarget:
        """The same weights with some engine settings changed (e.g. policy="static")."""
        return EngineTarget(self.model_config, self.weights, self.tokenizer,
                            {**self.engine_kwargs, **overrides}, self.source)

    def build(self):
        """A fresh LLMEngine on the shared weights."""
        config = engine_config(**self.engine_kwargs)
        return LLMEngine(config, self.model_config, self.weights, self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def run(self, workload: Workload, sampling: BenchSampling, bar=None,
            trace_path: str | None = None) -> RunStats:
        """Drive a fresh engine through the workload's arrival schedule."""
        prompts = [self._prompt(r) for r in workload.requests]  # chat templates: not timed
        engine = self.build()
        records, duration = _drive_engine(engine, workload, prompts, sampling, bar)
        if trace_path is not None:
            engine.trace.save(trace_path)
        stats, slots = engine.stats, engine.scheduler_config.max_num_seqs
        util = stats.slot_iterations_busy / (slots * stats.iterations) if stats.iterations else None
        return RunStats(records, duration, self._config(engine), util,
                        engine.scheduler.num_preemptions, stats.iterations)

    def _prompt(self, request: BenchRequest):
        if request.messages is None:
            return request.prompt
        if not self.has_chat_template:
            raise ValueError("workload has chat messages, but this model has no tokenizer "
                             "with a chat template: use token-id prompts (--prompts random)")
        return self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True)

    def _config(self, engine) -> dict:
        sched, cfg = engine.scheduler_config, engine.config
        return {"target": "engine", "model": self.source, "policy": sched.policy,
                "max_num_seqs": sched.max_num_seqs,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_model_len": sched.max_model_len, "block_size": cfg.cache.block_size,
                "num_blocks": engine.kv.num_blocks, "device": cfg.device, "dtype": cfg.dtype,
                "linear_kernel": engine.runner.linear_kernel}


def _drive_engine(engine, workload: Workload, prompts: list, sampling: BenchSampling,
                  bar) -> tuple[list[RequestRecord], float]:
    """Add each request when its arrival comes, step until all finish; (records, duration)."""
    pending = deque(zip(workload.requests, prompts))
    records: list[RequestRecord] = []
    t0 = time.monotonic()
    while pending or engine.has_unfinished_requests():
        records += _add_due(engine, pending, t0, sampling)
        if not engine.has_unfinished_requests():
            if pending:
                time.sleep(max(0.0, t0 + pending[0][0].arrival - time.monotonic()))
            continue
        for out in engine.step():
            if out.finished:
                records.append(_engine_record(out))
                _tick(bar)
    return records, time.monotonic() - t0


def _add_due(engine, pending: deque, t0: float, sampling: BenchSampling) -> list[RequestRecord]:
    """Add every request whose arrival time has come; a rejected one is a failed record."""
    rejected = []
    while pending and t0 + pending[0][0].arrival <= time.monotonic():
        request, prompt = pending.popleft()
        params = SamplingParams(max_tokens=request.max_tokens, temperature=sampling.temperature,
                                ignore_eos=sampling.ignore_eos)
        try:
            # NOTE: arrival is the scheduled time, so a late add (the loop was inside a step)
            # still counts its wait in TTFT, as a server's queue would.
            engine.add_request(request.id, prompt, params, arrival=t0 + request.arrival)
        except ValueError as exc:
            rejected.append(RequestRecord(request.id, ok=False, error=str(exc)))
    return rejected


def _engine_record(out) -> RequestRecord:
    m = out.metrics
    ok = out.error is None and out.finish_reason in ("stop", "length")
    error = out.error or (None if ok else f"finish_reason={out.finish_reason}")
    return RequestRecord(out.request_id, ok, len(out.prompt_token_ids), len(out.token_ids),
                         m.ttft, m.tpot, m.e2e, list(m.itls), error)


def _tick(bar) -> None:
    if bar is not None:
        bar.update(1)


# ====================================================================== OpenAI-compatible server


class OpenAITarget:
    """Any OpenAI-compatible server, streaming; latencies measured from chunk arrival times.

    url: the server root (http://127.0.0.1:8000, with or without /v1).
    endpoint: "completions" or "chat". model: the name sent (None: the first of /v1/models).
    """

    def __init__(self, url: str, endpoint: str = "completions", model: str | None = None,
                 api_key: str | None = None, timeout: float = 600.0) -> None:
        if endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
        self.base = url.rstrip("/").removesuffix("/v1")
        self.endpoint = endpoint
        self.model = model
        self.api_key = api_key
        self.timeout = timeout

    @property
    def name(self) -> str:
        return self.base

    @property
    def path(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"

    def run(self, workload: Workload, sampling: BenchSampling, bar=None,
            trace_path: str | None = None) -> RunStats:
        if trace_path is not None:
            raise ValueError("--trace needs the in-process engine (no --url)")
        for request in workload.requests:
            self._check(request)
        return asyncio.run(self._run(workload, sampling, bar))

    def _check(self, request: BenchRequest) -> None:
        if self.endpoint == "chat" and isinstance(request.prompt, list):
            raise ValueError("token-id prompts need --endpoint completions")

    async def _run(self, workload: Workload, sampling: BenchSampling, bar) -> RunStats:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # NOTE: no connection limit: a pool cap would queue requests on our side and
        # inflate TTFT with the client's wait instead of the server's.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=self.base, headers=headers, limits=limits,
                                     timeout=self.timeout) as client:
            model = self.model or await _first_model(client)
            t0 = time.perf_counter()
            tasks = [self._send_at(client, t0, model, r, sampling, bar) for r in workload.requests]
            records = list(await asyncio.gather(*tasks))
            duration = time.perf_counter() - t0
        config = {"target": "url", "url": self.base, "endpoint": self.endpoint, "model": model}
        return RunStats(records, duration, config)

    async def _send_at(self, client, t0: float, model: str, request: BenchRequest,
                       sampling: BenchSampling, bar) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + request.arrival - time.perf_counter()))
        payload = self._payload(model, request, sampling)
        try:
            record = await _stream_request(client, self.path, payload, request)
        except Exception as exc:  # NOTE: one failed request must not end the run
            record = RequestRecord(request.id, ok=False, error=f"{type(exc).__name__}: {exc}")
        _tick(bar)
        return record

    def _payload(self, model: str, request: BenchRequest, sampling: BenchSampling) -> dict:
        body = {"model": model, "max_tokens": request.max_tokens,
                "temperature": sampling.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if sampling.ignore_eos:
            body["ignore_eos"] = True  # vLLM, llama-server and slotserve accept it
        if self.endpoint == "chat":
            body["messages"] = request.messages or [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt if request.prompt is not None else _joined(request)
        return body


def _joined(request: BenchRequest) -> str:
    """A completions prompt from chat messages (no template on the client: the contents)."""
    return "\n".join(str(m.get("content", "")) for m in request.messages)


async def _first_model(client) -> str:
    """The first model the server lists, or "default" if it lists none."""
    try:
        response = await client.get("/v1/models")
        data = response.json().get("data") or []
        return data[0]["id"] if data else "default"
    except Exception:
        return "default"


async def _stream_request(client, path: str, payload: dict,
                          request: BenchRequest) -> RequestRecord:
    """Send one streaming request; time each chunk that carries text.

    A server may stream no text at all (a model without a tokenizer): then every chunk with
    a choice counts, so TTFT is when the first one came.
    """
    text_times: list[float] = []
    choice_times: list[float] = []
    usage: dict = {}
    start = time.perf_counter()
    async with client.stream("POST", path, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")[:200]
            return RequestRecord(request.id, ok=False, error=f"HTTP {response.status_code}: {body}")
        async for line in response.aiter_lines():
            chunk = _sse_data(line)
            if chunk is None:
                continue
            if chunk.get("error"):
                return RequestRecord(request.id, ok=False, error=str(chunk["error"])[:200])
            now = time.perf_counter()
            if chunk.get("choices"):
                choice_times.append(now)
            if _chunk_text(chunk):
                text_times.append(now)
            usage = chunk.get("usage") or usage
    return _client_record(request, start, time.perf_counter(), text_times or choice_times, usage)


def _sse_data(line: str) -> dict | None:
    """The JSON of one server-sent-events `data:` line; None for others and [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return None if data in ("", "[DONE]") else json.loads(data)


def _chunk_text(chunk: dict) -> str:
    """The text a completions or chat chunk carries ("" for role-only or usage chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _client_record(request: BenchRequest, start: float, end: float, times: list[float],
                   usage: dict) -> RequestRecord:
    """Latencies from chunk times; token counts from usage when the server sent it.

    TPOT = (end of stream - first token) / (output tokens - 1), as vLLM's benchmark.
    """
    output_tokens = usage.get("completion_tokens") or len(times)
    prompt_tokens = usage.get("prompt_tokens") or (
        len(request.prompt) if isinstance(request.prompt, list) else 0)
    if not times:
        return RequestRecord(request.id, ok=False, prompt_tokens=prompt_tokens,
                             error="the stream carried no choices")
    ttft, e2e = times[0] - start, end - start
    tpot = (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    itls = [b - a for a, b in zip(times, times[1:])]
    return RequestRecord(request.id, True, prompt_tokens, output_tokens, ttft, tpot, e2e, itls)


# ====================================================================== running


def run_bench(workload: Workload, target, *, sampling: BenchSampling | None = None,
              label: str | None = None, progress: bool = False,
              trace_path: str | None = None) -> BenchResult:
    """Run the workload against the target (EngineTarget or OpenAITarget) once.

    trace_path: (engine) also write the run's iteration trace there (`slotserve timeline`).
    """
    sampling = sampling or BenchSampling()
    bar = _progress_bar(len(workload), label) if progress else None
    try:
        run = target.run(workload, sampling, bar, trace_path)
    finally:
        if bar is not None:
            bar.close()
    run.config = {**run.config, "workload": dict(workload.params), "sampling": asdict(sampling)}
    return summarize(run, label or run.config.get("policy", target.name), target.name)


def _progress_bar(total: int, label: str | None):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label or "requests", unit="req", dynamic_ncols=True,
                file=sys.stderr)


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


# ====================================================================== text output


_COLUMNS = (  # header, width, value of a BenchResult
    ("run", 22, lambda r: r.label),
    ("rate", 6, lambda r: str(r.config.get("workload", {}).get("request_rate", "-"))),
    ("ok/fail", 8, lambda r: f"{r.completed}/{r.failed}"),
    ("dur s", 7, lambda r: f"{r.duration_s:.2f}"),
    ("req/s", 7, lambda r: f"{r.request_throughput:.2f}"),
    ("out tok/s", 9, lambda r: f"{r.output_throughput:.1f}"),
    ("TTFT p50/p99 ms", 17, lambda r: _pair(r.ttft_ms)),
    ("TPOT p50/p99 ms", 17, lambda r: _pair(r.tpot_ms)),
    ("ITL p50 ms", 10, lambda r: _ms(r.itl_ms.p50)),
    ("e2e p50 ms", 10, lambda r: _ms(r.e2e_ms.p50)),
    ("util", 5, lambda r: "-" if r.utilisation is None else f"{r.utilisation:.2f}"),
    ("preempt", 7, lambda r: "-" if r.preemptions is None else str(r.preemptions)),
    ("iters", 6, lambda r: "-" if r.iterations is None else str(r.iterations)),
)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _pair(stats: LatencyStats) -> str:
    return f"{_ms(stats.p50)}/{_ms(stats.p99)}"


def format_table(results: list[BenchResult]) -> str:
    """One row per run, fixed-width columns."""
    header = "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w, _) in enumerate(_COLUMNS))
    rows = ["  ".join(get(r).rjust(w) if i else get(r).ljust(w)
                      for i, (_, w, get) in enumerate(_COLUMNS)) for r in results]
    return "\n".join([header, "-" * len(header), *rows])


def format_detail(result: BenchResult) -> str:
    """One run, every latency statistic (vLLM's report layout)."""
    lines = [f"{'requests completed / failed':<30}{result.completed} / {result.failed}",
             f"{'duration (s)':<30}{result.duration_s:.2f}",
             f"{'requests/s':<30}{result.request_throughput:.2f}",
             f"{'output tokens/s':<30}{result.output_throughput:.1f}",
             f"{'total tokens/s':<30}{result.total_token_throughput:.1f}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = getattr(result, f"{name}_ms")
        cells = "  ".join(f"{k} {_ms(getattr(stats, k))}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name.upper() + ' (ms)':<30}{cells}")
    if result.utilisation is not None:
        lines.append(f"{'utilisation':<30}{result.utilisation:.3f}")
        lines.append(f"{'preemptions / iterations':<30}{result.preemptions} / {result.iterations}")
    lines += [f"error: {e}" for e in result.errors]
    return "\n".join(lines)


def format_ratios(ratios: dict) -> str:
    def x(key):
        value = ratios[key]
        return "-" if value is None else f"x{value:.2f}"

    return (f"{ratios['other']} vs {ratios['baseline']} (rate {ratios['request_rate']}): "
            f"output tok/s {x('output_throughput')}, "
            f"TTFT mean {x('ttft_mean')} p50 {x('ttft_p50')}, "
            f"TPOT mean {x('tpot_mean')} p50 {x('tpot_p50')}, e2e mean {x('e2e_mean')}, "
            f"utilisation {x('utilisation')}")


# ====================================================================== knee plot


def plot_knee(results: list[BenchResult], field_name: str, path: str) -> None:
    """Output tokens/s against TPOT p50, one point per swept value (the seed's knee)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rate, group in _by_rate(results).items():
        points = [(r.tpot_ms.p50, r.output_throughput, r.config.get(field_name)) for r in group
                  if r.tpot_ms.p50 is not None]
        if not points:
            continue
        xs, ys, labels = zip(*points)
        ax.plot(xs, ys, marker="o", label=f"rate {rate}")
        for x, y, value in points:
            ax.annotate(str(value), (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    ax.set_xlabel("TPOT p50 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"throughput vs per-token latency, labelled by {field_name}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _by_rate(results: list[BenchResult]) -> dict:
    groups: dict = {}
    for r in results:
        groups.setdefault(r.config.get("workload", {}).get("request_rate", "-"), []).append(r)
    return groups


# ====================================================================== command line


# Engine settings --sweep may vary: engine_config's integer keywords.
SWEEPABLE = tuple(name for name, p in inspect.signature(engine_config).parameters.items()
                  if p.kind == p.KEYWORD_ONLY and "int" in str(p.annotation))


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """`slotserve bench`: measure throughput and latency of the engine or a server."""
    p = subparsers.add_parser(
        "bench", help="benchmark the engine (in-process) or an OpenAI-compatible server",
        description="Send a workload (generated or JSONL) to the in-process engine or, with "
                    "--url, to any OpenAI-compatible server; report throughput, TTFT, TPOT, "
                    "ITL, e2e and (engine) utilisation.")
    _add_workload_args(p)
    _add_target_args(p)
    _add_run_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_bench)
    return p


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", metavar="FILE.jsonl",
                   help='one request a line: {"prompt"|"messages", "max_tokens", "arrival"}')
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--prompts", choices=["auto", "chat", "random"], default="auto",
                   help="built-in chat prompts or random token ids (auto: chat if the model "
                        "has a chat template or with --url)")
    g.add_argument("--prompt-len-min", type=int, default=16, help="random prompts (tokens)")
    g.add_argument("--prompt-len-max", type=int, default=128, help="random prompts (tokens)")
    g.add_argument("--output-len", type=int, default=None,
                   help="every output this long (default: lognormal lengths)")
    g.add_argument("--output-len-median", type=float, default=64)
    g.add_argument("--output-len-sigma", type=float, default=0.8)
    g.add_argument("--output-len-min", type=int, default=8)
    g.add_argument("--output-len-max", type=int, default=384)
    g.add_argument("--request-rate", type=_rate_list, default=None, metavar="R[,R...]",
                   help="Poisson arrivals at R req/s, several to sweep; inf: all at once "
                        "(default: inf, or the file's arrival times)")
    g.add_argument("--save-workload", metavar="FILE.jsonl", help="write the workload used")
    g.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at EOS (default: ignore it, so output lengths are exact)")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server target (default: the in-process engine)")
    g.add_argument("--url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--served-model", help="model name sent (default: first of /v1/models)")
    g.add_argument("--api-key", default=None)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("runs and output")
    g.add_argument("--compare", type=_str_list, metavar="POLICY,POLICY",
                   help="run the same workload under each policy, e.g. static,continuous")
    g.add_argument("--sweep", type=_sweep_spec, metavar="FIELD=V,V,...",
                   help=f"run each value of an engine setting ({', '.join(SWEEPABLE)})")
    g.add_argument("--plot", metavar="KNEE.png",
                   help="with --sweep: output tokens/s against TPOT p50")
    g.add_argument("--out", metavar="RESULTS.json", help="write every result as JSON")
    g.add_argument("--trace", metavar="TRACE.json",
                   help="engine: write the iteration trace (several runs: TRACE.<run>.json)")
    g.add_argument("--no-progress", dest="progress", action="store_false")


def _rate_list(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of rates: {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf): {text!r}")
    return rates


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _sweep_spec(text: str) -> tuple[str, list[int]]:
    name, _, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if name not in SWEEPABLE:
        raise argparse.ArgumentTypeError(f"cannot sweep {name!r}; one of {', '.join(SWEEPABLE)}")
    try:
        return name, [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sweep values must be integers: {text!r}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    """Build the target and workload, run every (rate, variant), print and write results."""
    _check_args(args)
    target = _target(args)
    base = _workload(args, target)
    if args.save_workload:
        save_workload(base, args.save_workload)
    variants = _variants(args)
    results, ratios = [], []
    for rate in args.request_rate or [None]:
        workload = base if rate is None else with_poisson_arrivals(base, rate, args.seed)
        group = [_run_variant(args, target, workload, label, overrides, len(variants) > 1)
                 for label, overrides in variants]
        results += group
        if args.compare:
            ratios += [compare_ratios(group[0], other) for other in group[1:]]
    _print_results(results, ratios)
    _write_outputs(args, results, ratios)
    return 0


def _check_args(args: argparse.Namespace) -> None:
    if args.compare and args.sweep:
        raise ValueError("use --compare or --sweep, not both")
    if args.url and (args.compare or args.sweep):
        raise ValueError("--compare and --sweep change engine settings: not with --url")
    if args.plot and not args.sweep:
        raise ValueError("--plot draws a --sweep")
    for policy in args.compare or []:
        if policy not in ("static", "continuous"):
            raise ValueError(f"--compare: unknown policy {policy!r} (static, continuous)")


def _target(args: argparse.Namespace):
    if args.url:
        return OpenAITarget(args.url, args.endpoint, args.served_model, args.api_key)
    return EngineTarget.load(args.model, **engine_kwargs(args))


def _workload(args: argparse.Namespace, target) -> Workload:
    if args.workload:
        return load_workload(args.workload)
    kind = args.prompts
    if kind == "auto":
        kind = "chat" if isinstance(target, OpenAITarget) or target.has_chat_template else "random"
    if kind == "random" and isinstance(target, OpenAITarget):
        raise ValueError("random token prompts need the model's vocabulary: in-process only")
    vocab = None if isinstance(target, OpenAITarget) else target.model_config.vocab_size
    return generate_workload(
        args.num_requests, prompts=kind, output_len=args.output_len,
        output_len_median=args.output_len_median, output_len_sigma=args.output_len_sigma,
        output_len_min=args.output_len_min, output_len_max=args.output_len_max,
        prompt_len_min=args.prompt_len_min, prompt_len_max=args.prompt_len_max,
        vocab_size=vocab, seed=args.seed)


def _variants(args: argparse.Namespace) -> list[tuple[str | None, dict]]:
    if args.compare:
        return [(policy, {"policy": policy}) for policy in args.compare]
    if args.sweep:
        name, values = args.sweep
        return [(f"{name}={v}", {name: v}) for v in values]
    return [(None, {})]


def _run_variant(args, target, workload: Workload, label: str | None, overrides: dict,
                 several: bool) -> BenchResult:
    if overrides:
        target = target.configured(**overrides)
    trace = args.trace
    if trace and (several or len(args.request_rate or []) > 1):
        rate = workload.params.get("request_rate")
        path = Path(trace)
        trace = str(path.with_name(f"{path.stem}.{label or 'run'}.rate{rate}{path.suffix}"))
    sampling = BenchSampling(args.temperature, args.ignore_eos)
    return run_bench(workload, target, sampling=sampling, label=label, progress=args.progress,
                     trace_path=trace)


def _print_results(results: list[BenchResult], ratios: list[dict]) -> None:
    if len(results) == 1:
        print(format_detail(results[0]))
        print()
    print(format_table(results))
    for r in ratios:
        print(format_ratios(r))
    for r in results:
        if r.errors and len(results) > 1:
            print(f"{r.label}: {r.failed} failed, e.g. {r.errors[0]}")


def _write_outputs(args, results: list[BenchResult], ratios: list[dict]) -> None:
    if args.out:
        mode = "compare" if args.compare else "sweep" if args.sweep else "single"
        report = {"mode": mode, "results": [r.to_dict() for r in results], "ratios": ratios}
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot_knee(results, args.sweep[0], args.plot)
        print(f"wrote {args.plot}")


__all__ = ["BenchRequest", "BenchResult", "BenchSampling", "EngineTarget", "LatencyStats",
           "OpenAITarget", "RequestRecord", "Workload", "compare_ratios", "format_table",
           "generate_workload", "load_workload", "plot_knee", "run_bench", "summarize"]
