"""LLMEngine: the synchronous loop. One `step()` is one iteration of continuous batching:

    plan   = scheduler.schedule()         # which requests run now, how many tokens each
    result = runner.execute(plan)         # ONE forward over a ragged batch, then sampling
    done   = scheduler.update(plan, result)   # append tokens, check stops, free blocks

Fault isolation: a request must not be able to fail another. An iteration whose forward or
sampling raises is retried in smaller groups (engine/isolation.py) and only the request(s)
that still raise on their own fail; a fault building one request's output (engine/sequence.py)
fails that request only. A fault is any exception, a native library's panic (pyo3's
PanicException, a BaseException) included: `isolation.is_fault`. Faults outside those
(schedule(), update()) escape `step()`; the caller (AsyncEngine) then fails what is in
flight with `fail_all`.

The read side: other layers never reach into the scheduler, the KV manager or the runner.
`snapshot()` returns a frozen `EngineSnapshot` (any thread), `subscribe(callback)` delivers
an `IterationEvent` after every iteration (in the engine's thread), `export_trace()` the
trace (see engine/events.py).

NOTE (threads): one thread drives the engine (AsyncEngine's, or the caller's offline).
`_state_lock` is held by every mutation (requests in and out, the planning and the update
of an iteration, but not its forward pass), so `snapshot()` from another thread sees the
state between two mutations and waits at most for one bookkeeping phase.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
from typing import TYPE_CHECKING

from slotserve.config import EngineConfig, ModelConfig, SchedulerConfig
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.outputs import RunnerOutput, SchedulerOutput
from slotserve.core.scheduler import Scheduler
from slotserve.core.scheduling_fields import SchedulingFields, given_or_loose
from slotserve.engine import sequence as seqs
from slotserve.engine.events import EngineSnapshot, FinishedCompletion, IterationEvent
from slotserve.engine.isolation import Culprits, execute_isolated, is_fault
from slotserve.engine.outputs import ErrorKind, RequestOutput
from slotserve.engine.sequence import Prompt, SequenceState
from slotserve.engine.sizing import (
    available_memory,
    eos_ids,
    fit_scheduler_config,
    resolve_num_blocks,
    set_torch_threads,
)
from slotserve.engine.snapshot import build_snapshot
from slotserve.engine.stats import EngineStats, finished_completion
from slotserve.engine.subscribers import Subscribers
from slotserve.engine.trace import TraceRecorder, policy_fields_of, trace_settings
from slotserve.layer_windows import uniform_window
from slotserve.model.kernels import (
    KernelSet,
    kernels_for,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from slotserve.model.linear_kernels import return_freed_memory
from slotserve.request import Request
from slotserve.runner.logit_shaping import SequenceShaping, ShapingSpec
from slotserve.runner.lookups import RequestLookups
from slotserve.runner.model_runner import ModelRunner
from slotserve.runner.prompt_logprobs import PromptLogprobs
from slotserve.sampling import SamplingParams
from slotserve.spec.planner import Speculator
from slotserve.structured.grammar import GrammarCompiler, GrammarMatcher

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("slotserve.engine")

# NOTE: the sizing helpers stay importable from here (benchmarks and older code do).
__all__ = ["EngineStats", "LLMEngine", "Prompt", "available_memory", "resolve_num_blocks",
           "set_torch_threads"]


def _holding_state_lock(method):
    """Run an LLMEngine method under its state lock (see the module NOTE on threads)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._state_lock:
            return method(self, *args, **kwargs)

    return locked


class LLMEngine:
    """Continuous batching over a paged KV cache, driven one `step()` at a time."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights: dict,
                 tokenizer=None, *, kernel_set: KernelSet | None = None) -> None:
        """kernel_set: the kernels the model runs; default: resolved from `config` once
        (model/kernels.py). Benchmarks pass another to compare kernels."""
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        sched = fit_scheduler_config(config.scheduler, model_config)
        kernels = kernel_set or kernels_for(config, weights)
        kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, kernels,
                                          resolve_dtype(config.device, config.dtype))
        num_blocks = resolve_num_blocks(config.cache, model_config, sched, config.device,
                                        kv_dtype)
        self.eos_token_ids = eos_ids(model_config, tokenizer)
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size, self.eos_token_ids)
        self.runner = ModelRunner(model_config, weights, config.cache, num_blocks,
                                  config.device, config.dtype, config.seed,
                                  kernels=kernels, kv_cache_dtype=kv_dtype,
                                  lookups=self._runner_lookups())
        if not config.enforce_eager:
            self.runner.capture_decode_graphs(sched.max_num_seqs, sched.max_model_len)
        window = uniform_window(model_config.sliding_windows)
        self.kv = KVCacheManager(num_blocks, config.cache.block_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching,
                                 tenant_scoped=config.cache.tenant_scoped, sliding_window=window)
        speculative = config.speculative
        self.scheduler = Scheduler(sched, self.kv, speculator=None if speculative is None
                                   else Speculator(speculative))
        self.scheduler.filter_drafts = self._filter_drafts
        self.trace = TraceRecorder(sched.max_num_seqs, sched.policy, num_blocks,
                                   config.trace_capacity,
                                   settings=trace_settings(sched, config.cache, window),
                                   planner_state=self.scheduler.planner_state)
        self._sequences: dict[str, SequenceState] = {}
        self._parents: dict[str, list[str]] = {}
        self._pending: list[RequestOutput] = []
        self.stats = EngineStats(kv=self.kv)
        self._state_lock = threading.RLock()
        self._subscribers = Subscribers()
        self._finished: list[FinishedCompletion] = []  # since the last IterationEvent

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load the model named by config.model (None: the embedded SmolLM2)."""
        from slotserve.loader import load_model

        set_torch_threads()
        # NOTE: a GGUF's quantized linears are read in their own blocks, never through an
        # fp32 copy: quantization="gguf" (and "auto" for a named GGUF file:
        # keeps_gguf_blocks) serves them so; the others dequantize one weight at a time as
        # the model loads it (KernelSet.prepare_weight), the embedding looked up in blocks.
        loaded = load_model(config.model, keep_quantized=True)
        engine = cls(config, loaded.config, loaded.weights, loaded.tokenizer)
        del loaded  # NOTE: the loading's copies (a GGUF's converted blocks): freed, and
        gc.collect()  # their pages given back to the OS, not kept in the heap
        return_freed_memory()
        return engine

    # ------------------------------------------------------------------ requests
    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.scheduler.config

    @property
    def max_total_tokens(self) -> int:
        """Longest sequence (prompt + output) a request may reach (a constant)."""
        return self.scheduler.max_total_tokens

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a slot (one len() read: safe from any thread)."""
        return self.scheduler.num_waiting

    def num_waiting_of(self, tenant: str) -> int:
        """Sequences of one tenant waiting for a slot (one dict read: any thread)."""
        return self.scheduler.num_waiting_of(tenant)

    # ------------------------------------------------------------------ read side
    def snapshot(self, include_blocks: bool = False) -> EngineSnapshot:
        """The engine now, as frozen data; include_blocks: with the block map. Any thread."""
        with self._state_lock:
            return build_snapshot(self, include_blocks)

    def subscribe(self, callback) -> None:
        """callback(IterationEvent) after every iteration that ran, in the engine's thread
        (outside the state lock). A callback that raises is logged and harms nothing else;
        a slow one slows the engine, so hand the work to another thread."""
        self._subscribers.add(callback)

    def unsubscribe(self, callback) -> None:
        self._subscribers.remove(callback)

    def export_trace(self) -> dict:
        """The iteration trace (version 1, JSON-able). Any thread."""
        return self.trace.export()

    @_holding_state_lock
    def reset_prefix_cache(self) -> int:
        """Drop the cached free blocks (running requests keep theirs); returns how many."""
        return self.kv.reset_prefix_cache()

    @_holding_state_lock
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits (L, V) for every position of token_ids (one prefill).

        NOTE: borrows free KV blocks for the pass and returns them (never hashed, so the
        prefix cache never sees them); ValueError if the pool has no room now.
        """
        borrower = Request("__score__", list(token_ids), SamplingParams())
        table = self.kv.allocate_slots(borrower, len(token_ids))
        if table is None:
            raise ValueError(f"the KV pool has no room for {len(token_ids)} tokens now")
        try:
            return self.runner.score(token_ids, table)
        finally:
            self.kv.free(borrower.request_id)

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids); ValueError on an empty or unusable prompt."""
        return seqs.tokenize_prompt(prompt, self.tokenizer, self.model_config.vocab_size)

    @_holding_state_lock
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    arrival: float | None = None, prompt_text: str | None = None,
                    cache_salt: str | None = None, priority: int = 0,
                    tenant: str = "default", slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None,
                    grammar_matchers: list[GrammarMatcher | None] | None = None,
                    scheduling: SchedulingFields | None = None) -> None:
        """Queue a request (n completions of it). ValueError if it is malformed or can never fit.

        prompt_text: the text of a prompt passed as token ids (shown in outputs).
        scheduling: its priority, tenant, SLOs and cache salt (core/scheduling_fields.py),
        checked when built; every completion gets them (see core/queue_policy.py). A cache
        salt keeps a request's cached blocks from others' (so one tenant cannot time
        another's prompts through the prefix cache).
        cache_salt, priority, tenant, slo_ttft_ms, slo_tpot_ms: the same one by one (for
        offline callers), only without `scheduling`.
        grammar_matchers: one per completion, built beforehand (`sequence.build_matchers`,
        off this thread: AsyncEngine does); None: built here (compiling the spec, which can
        take a second; fine offline).
        """
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        scheduling = given_or_loose(scheduling, SchedulingFields(
            priority, tenant, slo_ttft_ms, slo_tpot_ms, cache_salt))
        text, ids = self.tokenize(prompt)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):  # NOTE: SamplingParams: ints >= 0
            raise ValueError(f"stop_token_ids must be integers in [0, {vocab})")
        shaping = ShapingSpec.build(params, self.tokenizer, vocab)  # ValueError naming it
        text = text if text is not None else prompt_text
        if grammar_matchers is None:
            grammar_matchers = seqs.build_matchers(self.grammars, params)
        seqs.check_matchers(grammar_matchers, params)
        children = [seqs.new_sequence(request_id, i, text, ids, params, arrival,
                                      tokenizer=self.tokenizer, grammar=grammar_matchers[i],
                                      eos_token_ids=self.eos_token_ids)
                    for i in range(params.n)]
        for seq in children:
            scheduling.apply_to(seq.request)
            # NOTE: its own salt (no cache hits)
            seqs.ask_prompt_logprobs(seq, scheduling.cache_salt)
            if shaping is not None:
                seq.shaping = SequenceShaping(shaping, ids, seq.request.output_token_ids)
        try:
            self._register(request_id, children)
        except BaseException:
            self._unregister(request_id, children)
            raise
        self.stats.prompt_tokens += len(ids) * params.n

    def _register(self, request_id: str, children: list[SequenceState]) -> None:
        for seq in children:
            self.scheduler.add_request(seq.request)
        for seq in children:
            req = seq.request
            self._sequences[req.request_id] = seq
            self.trace.request_arrived(req.request_id, req.times.arrival,
                                       self.scheduler.iteration, req.num_prompt_tokens,
                                       policy_fields_of(req))
        self._parents[request_id] = [s.request.request_id for s in children]

    def _unregister(self, request_id: str, children: list[SequenceState]) -> None:
        """Undo a partial `_register` (NOTE: add_request is all or nothing)."""
        for seq in children:
            child_id = seq.request.request_id
            if self.scheduler.requests.get(child_id) is seq.request:
                self.scheduler.abort_request(child_id)
            if self._sequences.get(child_id) is seq:
                del self._sequences[child_id]
        self._parents.pop(request_id, None)  # add_request checked it was not in use

    def _runner_lookups(self) -> RequestLookups:
        """What the runner may read of the running completions (runner/lookups.py), and the
        EOS ids min_tokens masks. NOTE: bound methods over `_sequences`, read at each step."""
        return RequestLookups(grammar_of=self._grammar_of, shaping_of=self._shaping_of,
                              prompt_logprobs_of=self._prompt_logprobs_of,
                              eos_token_ids=self.eos_token_ids)

    def _shaping_of(self, request_id: str) -> SequenceShaping | None:
        """The penalties and logit shaping of a running completion (None: none); the runner's."""
        seq = self._sequences.get(request_id)
        return None if seq is None else seq.shaping

    def _prompt_logprobs_of(self, request_id: str) -> PromptLogprobs | None:
        """A running completion's prompt-logprobs accumulator (None: none); the runner's."""
        seq = self._sequences.get(request_id)
        return None if seq is None else seq.prompt_logprobs

    def _filter_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The drafts a running completion may verify: for a constrained one, the longest
        prefix its grammar accepts (structured outputs: the runner then masks each of its
        rows). NOTE: the scheduler's, under the state lock; the matcher has consumed the
        whole output (the engine advances it after every step)."""
        seq = self._sequences.get(request.request_id)
        if seq is None:
            return []
        if seq.grammar is None or not drafts:
            return drafts
        return drafts[:seq.grammar.ll_matcher.validate_tokens(drafts)]

    def _grammar_of(self, request_id: str) -> GrammarMatcher | None:
        """The grammar matcher of a running completion (None: unconstrained); the runner's."""
        seq = self._sequences.get(request_id)
        return None if seq is None else seq.grammar

    @_holding_state_lock
    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its completions); its blocks are free when this returns."""
        for child_id in list(self._parents.get(request_id, [])):
            request = self.scheduler.abort_request(child_id)
            if request is not None:
                self._pending.append(self._emit(self._sequences[child_id]))

    @_holding_state_lock
    def fail_request(self, request_id: str, message: str) -> None:
        """End a request (all its completions) with an error result, which comes with the
        next step; its blocks are free when this returns."""
        for child_id in list(self._parents.get(request_id, [])):
            seq = self._sequences.get(child_id)
            if seq is not None:
                self._pending.append(self._fail_sequence(seq, message))

    @_holding_state_lock
    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an error result now (an iteration failed beyond isolation).

        Returns the outputs still pending (aborts) and the error results. Afterwards the
        engine holds no request and every KV block is free.
        """
        outputs, self._pending = self._pending, []
        for seq in list(self._sequences.values()):
            outputs.append(self._fail_sequence(seq, message))
        for request_id in list(self.scheduler.requests):  # NOTE: none without a SequenceState
            self.scheduler.fail_requests([request_id], message)
        self._parents.clear()
        return outputs

    def has_request(self, request_id: str) -> bool:
        """Some completion of this request is still in the engine."""
        return request_id in self._parents

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ------------------------------------------------------------------ one iteration
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every completion that changed.

        NOTE: a fault in the forward or sampling fails only the requests that raise on their
        own (see engine/isolation.py); a fault building one request's output fails that one.
        NOTE: the forward runs outside the state lock (the module NOTE on threads).
        """
        with self._state_lock:
            plan = self.scheduler.schedule()
            outputs, self._pending = self._pending, []  # NOTE: after schedule(): if it raises,
            if plan.is_empty:                            # fail_all still returns them
                return outputs
        start = time.monotonic()
        result, culprits = execute_isolated(self.runner, plan)
        with self._state_lock:
            outputs += self._fail_culprits(culprits)
            touched = self.scheduler.update(plan, result)
            outputs += [self._emit(self._sequences[r.request_id]) for r in touched]
            event = self._observe(plan, result, start, time.monotonic())
        self._subscribers.publish(event)
        return outputs

    def _fail_culprits(self, culprits: Culprits) -> list[RequestOutput]:
        """Fail each request that raised on its own; their error results."""
        outputs = []
        for seq, exc in culprits:
            logger.error("request %s failed the iteration on its own: %s: %s",
                         seq.request_id, type(exc).__name__, exc, exc_info=exc)
            self._sequences[seq.request_id].error_kind = seqs.fault_kind(exc)
            failed = self.scheduler.fail_requests([seq.request_id],
                                                  f"{type(exc).__name__}: {exc}")
            outputs += [self._emit(self._sequences[r.request_id]) for r in failed]
        return outputs

    def _observe(self, plan: SchedulerOutput, result: RunnerOutput, start: float,
                 end: float) -> IterationEvent | None:
        """Trace and statistics; the iteration's event (NOTE: a fault there harms no
        request; then there is no event)."""
        try:
            record = self.trace.record(plan, start, end)
            self.stats.on_step(plan, result, end - start, self.scheduler.num_preemptions)
            self.stats.generation_tokens += self.scheduler.last_extra_tokens  # accepted drafts
        except BaseException as exc:
            if not is_fault(exc):
                raise
            logger.exception("recording iteration %d failed", plan.iteration)
            return None
        finished, self._finished = tuple(self._finished), []
        return IterationEvent(record, finished)

    def _emit(self, seq: SequenceState) -> RequestOutput:
        """`_process`, or, if that raises, an error result for this completion only."""
        try:
            return self._process(seq)
        except BaseException as exc:  # NOTE: a native panic too (isolation.is_fault)
            if not is_fault(exc):
                raise
            logger.exception("building the output of %s failed", seq.request.request_id)
            return self._fail_sequence(seq, f"{type(exc).__name__}: {exc}",
                                       seqs.fault_kind(exc))

    def _fail_sequence(self, seq: SequenceState, message: str,
                       kind: ErrorKind = ErrorKind.INTERNAL) -> RequestOutput:
        """End one completion with an error result, without the detokenizer or stop checks.

        Its blocks are free and the engine forgets it when this returns; the output repeats
        the text already sent (no new text: building that is what may have failed); its
        error_kind is `kind`.
        """
        request = seq.request
        request_id = request.request_id
        seq.error_kind = kind
        if self.scheduler.requests.get(request_id) is request:
            self.scheduler.fail_requests([request_id], message)
        else:  # it finished already (its output failed to build): the error is the result
            seqs.mark_failed(request, message)
        output = seqs.error_output(seq, message)
        try:
            self._forget(seq)
        except BaseException as exc:
            if not is_fault(exc):
                raise
            logger.exception("forgetting %s failed", request_id)
            self._drop(seq)
        return output

    def _process(self, seq: SequenceState) -> RequestOutput:
        """Advance the grammar, detokenize the new tokens, check stop strings, build the output."""
        if seq.grammar is not None:
            seqs.advance_grammar(seq, self.scheduler)
        if seq.detokenizer is not None and not seq.stop_hit:
            seqs.detokenize(seq, self.scheduler)
        return self._output(seq)

    def _output(self, seq: SequenceState) -> RequestOutput:
        """The completion's output since the last one; a finished one is forgotten."""
        finished = seq.request.is_finished
        visible, delta_text, delta_ids = seqs.take_delta(seq)
        if finished:
            self._forget(seq)
        return seqs.build_output(seq, visible, delta_text, delta_ids)

    def _forget(self, seq: SequenceState) -> None:
        request = seq.request
        self._drop(seq)
        self.trace.request_finished(request.request_id, self.scheduler.iteration - 1,
                                    request.finish_reason or "", len(request.output_token_ids))
        self.stats.on_finish(request)
        self._finished.append(finished_completion(request))

    def _drop(self, seq: SequenceState) -> None:
        """Remove a finished completion (and its request once all completions finished)."""
        self._sequences.pop(seq.request.request_id, None)
        siblings = self._parents.get(seq.parent_id, [])
        if all(sid not in self._sequences for sid in siblings):
            self._parents.pop(seq.parent_id, None)

    def check_integrity(self) -> None:
        """Assert the scheduler's invariants and that every request the engine tracks is
        the scheduler's (or pending output)."""
        self.scheduler.check_integrity()
        # NOTE: between steps a finished completion is forgotten already
        assert set(self._sequences) == set(self.scheduler.requests), "engine and scheduler differ"
        for child_id, seq in self._sequences.items():
            assert self.scheduler.requests[child_id] is seq.request, f"{child_id} is stale"
        for request_id, children in self._parents.items():
            assert any(c in self._sequences for c in children), f"{request_id} is stale"
