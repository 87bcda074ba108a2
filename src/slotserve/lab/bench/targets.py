"""Benchmark targets: the in-process engine (`EngineTarget`) and any OpenAI-compatible
server over HTTP (`OpenAITarget`, whose streaming client is `slotserve.lab.bench.client`).

A target's `run(workload, sampling, bar, trace_path)` returns `RunStats`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import replace

from slotserve.config import FinishReason, engine_config
from slotserve.engine.llm_engine import LLMEngine, set_torch_threads
from slotserve.lab.bench.client import first_model, open_session, run_client, stream_request
from slotserve.lab.bench.report import model_name
from slotserve.lab.bench.stats import BenchSampling, RequestRecord, RunStats
from slotserve.lab.workload import BenchRequest, Workload
from slotserve.sampling import SamplingParams


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
        """The same weights with some engine settings changed (e.g. batching="static")."""
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
        """Drive a fresh engine through the workload's arrival schedule (and its
        conversations' follow-up turns, each added when the previous answer finished)."""
        prompts = [self._prompt(r) for r in workload.requests]  # chat templates: not timed
        engine = self.build()
        records, duration = _drive_engine(engine, workload, prompts, sampling, bar, self._prompt)
        if trace_path is not None:
            engine.trace.save(trace_path)
        stats, slots = engine.stats, engine.scheduler_config.max_num_seqs
        util = stats.slot_iterations_busy / (slots * stats.iterations) if stats.iterations else None
        return RunStats(records, duration, self._config(engine), util,
                        engine.scheduler.num_preemptions, stats.iterations,
                        _prefix_cache_counts(engine))

    def _prompt(self, request: BenchRequest):
        if request.messages is None:
            return request.prompt
        if not self.has_chat_template:
            raise ValueError("workload has chat messages, but this model has no tokenizer "
                             "with a chat template: use token-id prompts (--prompts random)")
        return self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True)

    def _config(self, engine) -> dict:
        sched, cfg = engine.scheduler_config, engine.config
        return {"target": "engine", "model": model_name(self.source), "policy": sched.policy,
                "max_num_seqs": sched.max_num_seqs,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_model_len": sched.max_model_len, "block_size": cfg.cache.block_size,
                "num_blocks": engine.kv.num_blocks, "device": cfg.device, "dtype": cfg.dtype,
                "linear_kernel": engine.runner.linear_kernel,
                "enable_prefix_caching": cfg.cache.enable_prefix_caching}


def timed_greedy_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int
                     ) -> list[tuple[float, int]]:
    """Add every prompt at once (greedy, exactly max_tokens tokens each) and step the engine
    until it is idle: per step (wall seconds, completions that got output). The benchmarks'
    timing loop; request ids are unique across calls on one engine."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"timed-{time.perf_counter_ns()}-{i}", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        steps.append((time.perf_counter() - start, len(outputs)))
    return steps


def _prefix_cache_counts(engine) -> dict:
    """The engine's prompt-token and prefix-cache counters for the run.

    prompt_tokens counts every completion's prompt (n of them for n > 1, every turn of a
    conversation); prefill_tokens_computed = prompt_tokens - hits (tokens found cached).
    NOTE: hits also count cached tokens found when a preempted request is admitted again, so
    with preemptions this undercounts the prompt tokens computed (runs report preemptions).
    """
    stats = engine.stats
    queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    return {"prompt_tokens": stats.prompt_tokens, "queries": queries, "hits": hits,
            "hit_rate": hits / queries if queries else 0.0,
            "prefill_tokens_computed": stats.prompt_tokens - hits}


def _drive_engine(engine, workload: Workload, prompts: list, sampling: BenchSampling,
                  bar, prompt_of) -> tuple[list[RequestRecord], float]:
    """Add each request when its arrival comes, step until all finish; (records, duration).

    A request with follow-up turns: when it finishes, its next turn (`next_turn`, prompt by
    `prompt_of`) is added at once, arriving then (closed loop).
    """
    pending = deque(zip(workload.requests, prompts))
    live = {r.id: r for r in workload.requests}
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
                # NOTE: n > 1 finishes one output per completion, all with the request's id
                # (only n=1 requests have turns): the first one retires the request.
                request = live.pop(out.request_id, None)
                follow = request and request.next_turn(out.text, list(out.token_ids))
                if follow and records[-1].ok:
                    follow = replace(follow, arrival=time.monotonic() - t0)
                    live[follow.id] = follow
                    pending.appendleft((follow, prompt_of(follow)))
    return records, time.monotonic() - t0


def _add_due(engine, pending: deque, t0: float, sampling: BenchSampling) -> list[RequestRecord]:
    """Add every request whose arrival time has come; a rejected one is a failed record."""
    rejected = []
    while pending and t0 + pending[0][0].arrival <= time.monotonic():
        request, prompt = pending.popleft()
        params = SamplingParams(max_tokens=request.max_tokens, temperature=sampling.temperature,
                                ignore_eos=sampling.ignore_eos, n=request.n)
        try:
            # NOTE: arrival is the scheduled time, so a late add (the loop was inside a step)
            # still counts its wait in TTFT, as a server's queue would.
            engine.add_request(request.id, prompt, params, arrival=t0 + request.arrival,
                               **request.policy_fields())
        except ValueError as exc:
            rejected.append(RequestRecord(request.id, ok=False, error=str(exc)))
    return rejected


def _engine_record(out) -> RequestRecord:
    """One request's record: TTFT of its first completion, output tokens of all n."""
    m = out.metrics
    finished = (FinishReason.STOP, FinishReason.LENGTH)
    ok = out.error is None and all(o.finish_reason in finished for o in out.outputs)
    error = out.error or (None if ok else f"finish_reason={out.finish_reason}")
    outputs = sum(len(o.token_ids) for o in out.outputs)
    return RequestRecord(out.request_id, ok, len(out.prompt_token_ids), outputs,
                         m.ttft, m.tpot, m.e2e, list(m.itls), error)


def _tick(bar) -> None:
    if bar is not None:
        bar.update(1)


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
        return run_client(self._run(workload, sampling, bar))

    def _check(self, request: BenchRequest) -> None:
        if self.endpoint == "chat" and isinstance(request.prompt, list):
            raise ValueError("token-id prompts need --endpoint completions")
        if request.turns and (self.endpoint != "chat" or request.messages is None):
            raise ValueError("multi-turn conversations over HTTP need chat messages and "
                             "--endpoint chat (the server applies the chat template)")

    async def _run(self, workload: Workload, sampling: BenchSampling, bar) -> RunStats:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with open_session(self.base, headers, self.timeout) as client:
            model = self.model or await first_model(client)
            t0 = time.perf_counter()
            tasks = [self._send_at(client, t0, model, r, sampling, bar) for r in workload.requests]
            records = [r for group in await asyncio.gather(*tasks) for r in group]
            duration = time.perf_counter() - t0
        config = {"target": "url", "url": self.base, "endpoint": self.endpoint, "model": model}
        return RunStats(records, duration, config)

    async def _send_at(self, client, t0: float, model: str, request: BenchRequest | None,
                       sampling: BenchSampling, bar) -> list[RequestRecord]:
        """Send the request at its arrival time, then its conversation's next turns, each
        when the previous answer has arrived (closed loop); one record per turn."""
        await asyncio.sleep(max(0.0, t0 + request.arrival - time.perf_counter()))
        records = []
        while request is not None:
            payload = self._payload(model, request, sampling)
            try:
                record = await stream_request(client, self.path, payload, request)
            except Exception as exc:  # NOTE: one failed request must not end the run
                record = RequestRecord(request.id, ok=False,
                                       error=f"{type(exc).__name__}: {exc}")
            records.append(record)
            _tick(bar)
            request = request.next_turn(record.text, []) if record.ok else None
        return records

    def _payload(self, model: str, request: BenchRequest, sampling: BenchSampling) -> dict:
        body = {"model": model, "max_tokens": request.max_tokens,
                "temperature": sampling.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if sampling.ignore_eos:
            body["ignore_eos"] = True  # vLLM, llama-server and slotserve accept it
        if request.n != 1:
            body["n"] = request.n
        # Scheduling-policy fields only where the workload sets them (other servers may not
        # take them); the tenant is OpenAI's `user`.
        fields = request.policy_fields(only_set=True)
        if "tenant" in fields:
            fields["user"] = fields.pop("tenant")
        body.update(fields)
        if self.endpoint == "chat":
            body["messages"] = request.messages or [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt if request.prompt is not None else _joined(request)
        return body


def _joined(request: BenchRequest) -> str:
    """A completions prompt from chat messages (no template on the client: the contents)."""
    return "\n".join(str(m.get("content", "")) for m in request.messages)
