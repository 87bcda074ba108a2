"""LLMEngine: the synchronous loop. One `step()` is one iteration of continuous batching:

    plan   = scheduler.schedule()         # which requests run now, how many tokens each
    result = runner.execute(plan)         # ONE forward over a ragged batch, then sampling
    done   = scheduler.update(plan, result)   # append tokens, check stops, free blocks

Fault isolation: a request must not be able to fail another. An iteration whose forward or
sampling raises is retried in smaller groups (bisection down to single requests) and only the
request(s) that still raise on their own fail; a fault while building one request's output
fails that request only. Faults outside those (schedule(), update()) escape `step()`; the
caller (AsyncEngine) then fails what is in flight with `fail_all`.

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
import logging
import os
import threading
import time
from contextlib import suppress
from dataclasses import InitVar, dataclass, field, replace
from typing import TYPE_CHECKING

from slotserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from slotserve.core.scheduler import Scheduler
from slotserve.engine.events import EngineSnapshot, FinishedCompletion, IterationEvent
from slotserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from slotserve.engine.snapshot import build_snapshot
from slotserve.engine.trace import TraceRecorder, policy_fields_of, trace_settings
from slotserve.model.kernels import KernelSet, kernels_for
from slotserve.request import Request, RequestStatus
from slotserve.runner.model_runner import ModelRunner, kv_block_bytes, resolve_dtype
from slotserve.sampling import SamplingParams
from slotserve.structured.grammar import GrammarCompiler, GrammarMatcher

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("slotserve.engine")

Prompt = str | list[int]


def _holding_state_lock(method):
    """Run an LLMEngine method under its state lock (see the module NOTE on threads)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._state_lock:
            return method(self, *args, **kwargs)

    return locked


@dataclass
class _Sequence:
    """Engine-side state of one completion: detokenizer and what was already returned."""

    request: Request
    parent_id: str
    index: int
    prompt: str | None
    detokenizer: object | None
    text: str = ""
    sent_text_len: int = 0
    sent_tokens: int = 0
    stop_hit: bool = False
    hold_back: int = 0  # chars kept from streaming while they may start a stop string
    logprobs: list = field(default_factory=list)
    grammar: GrammarMatcher | None = None  # structured outputs: where the output stands


class LLMEngine:
    """Continuous batching over a paged KV cache, driven one `step()` at a time."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights: dict,
                 tokenizer=None, *, kernel_set: KernelSet | None = None) -> None:
        """kernel_set: the kernels the model runs; default: resolved from `config` once
        (model/kernels.py). Benchmarks pass another to compare kernels."""
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        sched = _fit_scheduler_config(config.scheduler, model_config)
        num_blocks = resolve_num_blocks(config.cache, model_config, sched, config.device,
                                        config.dtype)
        self.runner = ModelRunner(model_config, weights, config.cache, num_blocks,
                                  config.device, config.dtype, config.seed,
                                  kernels=kernel_set or kernels_for(config))
        self.kv = KVCacheManager(num_blocks, config.cache.block_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.kv)
        self.trace = TraceRecorder(sched.max_num_seqs, sched.policy, num_blocks,
                                   config.trace_capacity,
                                   settings=trace_settings(sched, config.cache))
        self.eos_token_ids = _eos_ids(model_config, tokenizer)
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size, self.eos_token_ids)
        self.runner.grammar_of = self._grammar_of
        self.runner.sampler.eos_token_ids = self.eos_token_ids  # min_tokens masks them
        self._sequences: dict[str, _Sequence] = {}
        self._parents: dict[str, list[str]] = {}
        self._pending: list[RequestOutput] = []
        self.stats = EngineStats(kv=self.kv)
        self._state_lock = threading.RLock()
        self._subscribers: list = []
        self._subscriber_faults: dict = {}  # callback -> faults so far (logged in full once)
        self._finished: list[FinishedCompletion] = []  # since the last IterationEvent

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load the model named by config.model (None: the embedded SmolLM2)."""
        from slotserve.loader import load_model

        set_torch_threads()
        loaded = load_model(config.model)
        return cls(config, loaded.config, loaded.weights, loaded.tokenizer)

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

    # ------------------------------------------------------------------ read side
    def snapshot(self, include_blocks: bool = False) -> EngineSnapshot:
        """The engine now, as frozen data; include_blocks: with the block map. Any thread."""
        with self._state_lock:
            return build_snapshot(self, include_blocks)

    def subscribe(self, callback) -> None:
        """callback(IterationEvent) after every iteration that ran, in the engine's thread
        (outside the state lock). A callback that raises is logged and harms nothing else;
        a slow one slows the engine, so hand the work to another thread."""
        self._subscribers.append(callback)

    def unsubscribe(self, callback) -> None:
        if callback in self._subscribers:
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
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        try:
            ids = list(prompt)
        except TypeError:  # a number, None, ...: a clear ValueError like every bad prompt
            raise ValueError("prompt must be a string or a list of token ids, got "
                             f"{type(prompt).__name__}") from None
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, ids

    @_holding_state_lock
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    arrival: float | None = None, prompt_text: str | None = None,
                    cache_salt: str | None = None, priority: int = 0,
                    tenant: str = "default", slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None) -> None:
        """Queue a request (n completions of it). ValueError if it is malformed or can never fit.

        prompt_text: the text of a prompt passed as token ids (shown in outputs).
        cache_salt: a non-empty string; requests with different salts never share cached
        blocks (so one tenant cannot time another's prompts through the prefix cache).
        priority, tenant, slo_ttft_ms, slo_tpot_ms: for the scheduling policy (see
        core/queue_policy.py); every completion gets them.
        """
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string if given")
        text, ids = self.tokenize(prompt)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):  # NOTE: SamplingParams: ints >= 0
            raise ValueError(f"stop_token_ids must be integers in [0, {vocab})")
        text = text if text is not None else prompt_text
        children = [self._new_sequence(request_id, i, text, ids, params, arrival)
                    for i in range(params.n)]
        for seq in children:
            seq.request.cache_salt = cache_salt
            seq.request.priority, seq.request.tenant = priority, tenant
            seq.request.slo_ttft_ms, seq.request.slo_tpot_ms = slo_ttft_ms, slo_tpot_ms
        try:
            self._register(request_id, children)
        except BaseException:
            self._unregister(request_id, children)
            raise
        self.stats.prompt_tokens += len(ids) * params.n

    def _register(self, request_id: str, children: list[_Sequence]) -> None:
        for seq in children:
            self.scheduler.add_request(seq.request)
        for seq in children:
            req = seq.request
            self._sequences[req.request_id] = seq
            self.trace.request_arrived(req.request_id, req.times.arrival,
                                       self.scheduler.iteration, req.num_prompt_tokens,
                                       policy_fields_of(req))
        self._parents[request_id] = [s.request.request_id for s in children]

    def _unregister(self, request_id: str, children: list[_Sequence]) -> None:
        """Undo a partial `_register` (NOTE: add_request is all or nothing)."""
        for seq in children:
            child_id = seq.request.request_id
            if self.scheduler.requests.get(child_id) is seq.request:
                self.scheduler.abort_request(child_id)
            if self._sequences.get(child_id) is seq:
                del self._sequences[child_id]
        self._parents.pop(request_id, None)  # add_request checked it was not in use

    def _new_sequence(self, parent_id: str, index: int, text: str | None, ids: list[int],
                      params: SamplingParams, arrival: float | None) -> _Sequence:
        child_params = params.for_choice(index) if params.n > 1 else params
        child_id = parent_id if params.n == 1 else f"{parent_id}#{index}"
        request = Request(child_id, list(ids), child_params, eos_token_ids=self.eos_token_ids)
        if arrival is not None:
            request.times.arrival = arrival
        detok = None
        if self.tokenizer is not None:
            from slotserve.loader import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        hold = max((len(s) for s in params.stop), default=1) - 1
        grammar = None
        if params.structured_outputs is not None:  # ValueError naming the field if rejected
            grammar = self.grammars.matcher(params.structured_outputs)
        return _Sequence(request, parent_id, index, text, detok, hold_back=hold, grammar=grammar)

    def _grammar_of(self, request_id: str) -> GrammarMatcher | None:
        """The grammar matcher of a running completion (None: unconstrained); the runner's."""
        seq = self._sequences.get(request_id)
        return None if seq is None else seq.grammar

    def _advance_grammar(self, seq: _Sequence) -> None:
        """Feed the new tokens to the completion's matcher; finish it ("stop") once its
        grammar allows nothing more.

        NOTE: the matcher counts what it consumed, so the tokens a preempted completion
        recomputes (not re-samples) are not fed twice.
        """
        request = seq.request
        seq.grammar.advance(request.output_token_ids)
        if not seq.grammar.is_finished:
            return
        if not request.is_finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        elif request.status == RequestStatus.FINISHED_LENGTH:  # NOTE: complete on the last
            request.status = RequestStatus.FINISHED_STOPPED     # allowed token: a "stop"

    @_holding_state_lock
    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its completions); its blocks are free when this returns."""
        for child_id in list(self._parents.get(request_id, [])):
            request = self.scheduler.abort_request(child_id)
            if request is not None:
                self._pending.append(self._emit(self._sequences[child_id]))

    @_holding_state_lock
    def abort_all(self) -> None:
        """Abort every request (their outputs come with the next step)."""
        for request_id in list(self._parents):
            self.abort_request(request_id)

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
        for request_id in list(self.scheduler.requests):  # NOTE: none without a _Sequence
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
        own (see `_execute_isolated`); a fault building one request's output fails that one.
        NOTE: the forward runs outside the state lock (the module NOTE on threads).
        """
        with self._state_lock:
            plan = self.scheduler.schedule()
            outputs, self._pending = self._pending, []  # NOTE: after schedule(): if it raises,
            if plan.is_empty:                            # fail_all still returns them
                return outputs
        start = time.monotonic()
        result, culprits = self._execute_isolated(plan)
        with self._state_lock:
            outputs += self._fail_culprits(culprits)
            touched = self.scheduler.update(plan, result)
            outputs += [self._emit(self._sequences[r.request_id]) for r in touched]
            event = self._observe(plan, result, start, time.monotonic())
        self._publish(event)
        return outputs

    def _execute_isolated(self, plan: SchedulerOutput
                          ) -> tuple[RunnerOutput, list[tuple[ScheduledSeq, Exception]]]:
        """runner.execute(plan); if it raises, find the requests that cause it by bisection.

        Returns the tokens of the requests that ran and the culprits with their exception.

        NOTE: retrying is sound because a failed execute changes nothing the retry depends
        on: num_computed_tokens only moves in scheduler.update, each ScheduledSeq keeps its
        positions and block table, so a retry rewrites the same K/V into the same slots
        (each sequence attends only to its own blocks), and a seeded request's sampler draws
        from a generator seeded by (seed, output index). Unseeded random requests draw
        from the runner's shared generator, which a failed attempt may have advanced.
        """
        try:
            return self.runner.execute(plan), []
        except Exception as exc:
            if len(plan.seqs) == 1:
                return RunnerOutput(sampled={}), [(plan.seqs[0], exc)]
            logger.warning("iteration %d failed (%s: %s); retrying its %d requests in smaller "
                           "groups", plan.iteration, type(exc).__name__, exc, len(plan.seqs))
        merged = RunnerOutput(sampled={}, logprobs={})
        culprits: list[tuple[ScheduledSeq, Exception]] = []
        self._bisect(plan, plan.seqs, merged, culprits)
        return merged, culprits

    def _bisect(self, plan: SchedulerOutput, seqs: list[ScheduledSeq], merged: RunnerOutput,
                culprits: list[tuple[ScheduledSeq, Exception]]) -> None:
        """Run seqs' two halves separately; split again any half that raises."""
        middle = len(seqs) // 2
        for half in (seqs[:middle], seqs[middle:]):
            try:
                result = self.runner.execute(replace(plan, seqs=half))
            except Exception as exc:
                if len(half) == 1:
                    culprits.append((half[0], exc))
                else:
                    self._bisect(plan, half, merged, culprits)
                continue
            merged.sampled.update(result.sampled)
            merged.logprobs.update(result.logprobs)

    def _fail_culprits(self, culprits: list[tuple[ScheduledSeq, Exception]]
                       ) -> list[RequestOutput]:
        outputs = []
        for seq, exc in culprits:
            logger.error("request %s failed the iteration on its own: %s: %s",
                         seq.request_id, type(exc).__name__, exc, exc_info=exc)
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
        except Exception:
            logger.exception("recording iteration %d failed", plan.iteration)
            return None
        finished, self._finished = tuple(self._finished), []
        return IterationEvent(record, finished)

    def _publish(self, event: IterationEvent | None) -> None:
        """Hand the event to every subscriber (NOTE: one's fault harms nothing else)."""
        if event is None:
            return
        for callback in list(self._subscribers):
            try:
                callback(event)
            except Exception:
                faults = self._subscriber_faults.get(callback, 0) + 1
                self._subscriber_faults[callback] = faults
                log = logger.exception if faults == 1 else logger.debug
                log("subscriber %r failed (%d times)", callback, faults)

    def _emit(self, seq: _Sequence) -> RequestOutput:
        """`_process`, or, if that raises, an error result for this completion only."""
        try:
            return self._process(seq)
        except Exception as exc:
            logger.exception("building the output of %s failed", seq.request.request_id)
            return self._fail_sequence(seq, f"{type(exc).__name__}: {exc}")

    def _fail_sequence(self, seq: _Sequence, message: str) -> RequestOutput:
        """End one completion with an error result, without the detokenizer or stop checks.

        Its blocks are free and the engine forgets it when this returns; the output repeats
        the text already sent (no new text: building that is what may have failed).
        """
        request = seq.request
        request_id = request.request_id
        if self.scheduler.requests.get(request_id) is request:
            self.scheduler.fail_requests([request_id], message)
        else:  # it finished already (its output failed to build): the error is the result
            request.status = RequestStatus.FINISHED_ERROR
            request.error = message
            if request.times.finished is None:
                request.times.finished = time.monotonic()
        metrics = None
        with suppress(Exception):
            metrics = RequestMetrics.of(request)
        sent = seq.sent_tokens
        completion = CompletionOutput(
            index=seq.index, text=seq.text[:seq.sent_text_len],
            token_ids=list(request.output_token_ids), finish_reason=request.finish_reason,
            delta_token_ids=list(request.output_token_ids[sent:]), metrics=metrics)
        try:
            self._forget(seq)
        except Exception:
            logger.exception("forgetting %s failed", request_id)
            self._drop(seq)
        return RequestOutput(seq.parent_id, seq.prompt, list(request.prompt_token_ids),
                             [completion], error=message,
                             num_cached_tokens=request.num_cached_tokens)

    def _process(self, seq: _Sequence) -> RequestOutput:
        """Advance the grammar, detokenize the new tokens, check stop strings, build the output."""
        if seq.grammar is not None:
            self._advance_grammar(seq)
        if seq.detokenizer is not None and not seq.stop_hit:
            self._detokenize(seq)
        return self._output(seq)

    def _detokenize(self, seq: _Sequence) -> None:
        """Append the new tokens' text; at the finish also what the detokenizer held back.

        NOTE: the flush comes before the stop-string check, so a stop string in the held-back
        text still cuts the text (and whatever follows it).
        """
        request = seq.request
        seq.text += seq.detokenizer.add(request.output_token_ids[seq.sent_tokens:])
        if request.is_finished:  # the output may end inside a character (or in a real U+FFFD)
            seq.text += seq.detokenizer.flush()
        self._check_stop_strings(seq)

    def _check_stop_strings(self, seq: _Sequence) -> None:
        params = seq.request.sampling_params
        if not params.stop or not seq.request.reached_min_tokens:  # NOTE: as vLLM
            return
        # Only the tail can hold a new match: the new text plus a stop string's length.
        window_start = max(0, seq.sent_text_len - seq.hold_back)
        hits = [i for i in (seq.text.find(s, window_start) for s in params.stop) if i >= 0]
        if not hits:
            return
        seq.text = seq.text[:min(hits)]
        seq.stop_hit = True
        if not seq.request.is_finished:
            self.scheduler.finish_request(seq.request.request_id, RequestStatus.FINISHED_STOPPED)
        elif seq.request.status == RequestStatus.FINISHED_LENGTH:
            # NOTE: the length cap and a stop string on the same token: the stop string is
            # the reason (as vLLM reports it); the request has left the scheduler already.
            seq.request.status = RequestStatus.FINISHED_STOPPED

    def _output(self, seq: _Sequence) -> RequestOutput:
        request = seq.request
        finished = request.is_finished
        visible = len(seq.text) if finished else max(seq.sent_text_len,
                                                     len(seq.text) - seq.hold_back)
        delta_text = seq.text[seq.sent_text_len:visible]
        delta_ids = request.output_token_ids[seq.sent_tokens:]
        seq.sent_text_len, seq.sent_tokens = visible, len(request.output_token_ids)
        if finished:
            self._forget(seq)
        completion = CompletionOutput(
            index=seq.index, text=seq.text[:visible], token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None
            else None,
            delta_text=delta_text, delta_token_ids=delta_ids, metrics=RequestMetrics.of(request))
        return RequestOutput(seq.parent_id, seq.prompt, request.prompt_token_ids, [completion],
                             error=request.error, num_cached_tokens=request.num_cached_tokens)

    def _forget(self, seq: _Sequence) -> None:
        request = seq.request
        self._drop(seq)
        self.trace.request_finished(request.request_id, self.scheduler.iteration - 1,
                                    request.finish_reason or "", len(request.output_token_ids))
        self.stats.on_finish(request)
        self._finished.append(_finished_completion(request))

    def _drop(self, seq: _Sequence) -> None:
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


@dataclass
class EngineStats:
    """Running totals for metrics and benchmarks."""

    iterations: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    busy_seconds: float = 0.0
    slot_iterations_busy: int = 0
    finished_by_reason: dict = field(default_factory=dict)
    # NOTE: an InitVar, not a field: asdict() of the stats must not copy the KV manager.
    kv: InitVar[KVCacheManager | None] = None

    def __post_init__(self, kv: KVCacheManager | None) -> None:
        self._kv = kv

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up in the prefix cache: a request's length at each admission."""
        return self._kv.prefix_cache_queries if self._kv is not None else 0

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, tokens found cached (not computed again)."""
        return self._kv.prefix_cache_hits if self._kv is not None else 0

    def on_step(self, plan: SchedulerOutput, result: RunnerOutput, seconds: float,
                preemptions: int) -> None:
        self.iterations += 1
        self.generation_tokens += len(result.sampled)
        self.preemptions = preemptions
        self.busy_seconds += seconds
        self.slot_iterations_busy += len(plan.seqs)

    def on_finish(self, request: Request) -> None:
        reason = request.finish_reason or "unknown"
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1


def _finished_completion(request: Request) -> FinishedCompletion:
    metrics = None
    with suppress(Exception):
        metrics = RequestMetrics.of(request)
    return FinishedCompletion(
        request_id=request.request_id, finish_reason=request.finish_reason or "unknown",
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=len(request.output_token_ids),
        num_cached_tokens=request.num_cached_tokens, metrics=metrics, tenant=request.tenant,
        met_slo=request.met_slo)


def _eos_ids(model_config: ModelConfig, tokenizer) -> tuple[int, ...]:
    ids = set(model_config.eos_token_ids)
    if tokenizer is not None:
        ids.update(tokenizer.eos_token_ids)
    return tuple(sorted(ids))


def _fit_scheduler_config(sched: SchedulerConfig, model: ModelConfig) -> SchedulerConfig:
    """Cap max_model_len at the model's positions (the RoPE table is that long)."""
    if sched.max_model_len > model.max_position_embeddings:
        return replace(sched, max_model_len=model.max_position_embeddings)
    return sched


def resolve_num_blocks(cache: CacheConfig, model: ModelConfig, sched: SchedulerConfig,
                       device: str, dtype: str | None) -> int:
    """Pool size: num_blocks, else memory_bytes, else a share of free memory.

    The default never exceeds what max_num_seqs full-length sequences could use.
    """
    if cache.num_blocks is not None:
        return cache.num_blocks
    block_bytes = kv_block_bytes(model, cache.block_size, resolve_dtype(device, dtype))
    useful = sched.max_num_seqs * -(-sched.max_model_len // cache.block_size)
    if cache.memory_bytes is not None:
        return max(1, cache.memory_bytes // block_bytes)
    return max(1, min(useful, int(0.25 * available_memory(device)) // block_bytes))


def available_memory(device: str) -> int:
    """Free bytes on the device (CUDA) or available system memory (CPU)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def set_torch_threads() -> None:
    """One torch thread per core we may run on (the CPUs here have no SMT)."""
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
