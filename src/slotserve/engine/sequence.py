"""A completion in the engine: its prompt, its state, its output (text, stop strings, grammar)."""

from __future__ import annotations

import time
from contextlib import suppress
from dataclasses import dataclass, field

from slotserve.core.scheduler import Scheduler
from slotserve.engine.outputs import (
    CompletionOutput,
    ErrorKind,
    RequestMetrics,
    RequestOutput,
    error_kind_of,
)
from slotserve.request import Request, RequestStatus
from slotserve.runner.logit_shaping import SequenceShaping
from slotserve.runner.prompt_logprobs import PromptLogprobs, unique_salt
from slotserve.sampling import SamplingParams
from slotserve.structured.grammar import GrammarCompiler, GrammarMatcher, GrammarRejectedToken
from slotserve.value_checks import is_int

Prompt = str | list[int]


def tokenize_prompt(prompt: Prompt, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids); ValueError on an empty or unusable prompt."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids")
        return prompt, tokenizer.encode(prompt)
    try:
        ids = list(prompt)
    except TypeError:  # a number, None, ...: a clear ValueError like every bad prompt
        raise ValueError("prompt must be a string or a list of token ids, got "
                         f"{type(prompt).__name__}") from None
    if not ids:
        raise ValueError("prompt must not be empty")
    if not all(is_int(t) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    return None, ids


@dataclass
class SequenceState:
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
    shaping: SequenceShaping | None = None  # penalties, logit_bias, bad_words... (or None)
    prompt_logprobs: PromptLogprobs | None = None  # filled by the runner in the prefill
    error_kind: ErrorKind | None = None  # set when the engine fails it (see fault_kind)


def new_sequence(parent_id: str, index: int, text: str | None, ids: list[int],
                 params: SamplingParams, arrival: float | None, *, tokenizer,
                 eos_token_ids: tuple[int, ...],
                 grammar: GrammarMatcher | None = None) -> SequenceState:
    """Completion `index` of request `parent_id` (its own request id when n > 1).

    grammar: its matcher (`build_matchers`), given iff params.structured_outputs is set.
    """
    child_params = params.for_choice(index) if params.n > 1 else params
    child_id = parent_id if params.n == 1 else f"{parent_id}#{index}"
    request = Request(child_id, list(ids), child_params, eos_token_ids=eos_token_ids)
    if arrival is not None:
        request.times.arrival = arrival
    detok = None
    if tokenizer is not None:
        from slotserve.loader import IncrementalDetokenizer

        detok = IncrementalDetokenizer(tokenizer, ids, params.skip_special_tokens)
    hold = max((len(s) for s in params.stop), default=1) - 1
    if (grammar is None) != (params.structured_outputs is None):
        raise ValueError("a constrained completion needs its grammar matcher, and only it")
    return SequenceState(request, parent_id, index, text, detok, hold_back=hold, grammar=grammar)


def ask_prompt_logprobs(seq: SequenceState, cache_salt: str | None) -> None:
    """Give a completion whose params ask for prompt logprobs its accumulator and a cache
    salt of its own: it must compute every prompt row, so it bypasses the prefix cache
    (runner/prompt_logprobs.py's NOTE). Call after the request's cache_salt is set."""
    request = seq.request
    top_n = request.sampling_params.prompt_logprobs
    if top_n is None:
        return
    seq.prompt_logprobs = PromptLogprobs(request.prompt_token_ids, top_n)
    request.cache_salt = unique_salt(cache_salt)


def build_matchers(grammars: GrammarCompiler, params: SamplingParams
                   ) -> list[GrammarMatcher | None]:
    """One grammar matcher per completion (None each when unconstrained): the spec compiled
    once (or taken from the cache) and copied n times. ValueError naming the field if the
    spec is rejected.

    NOTE: compiling can take a second for a large spec: AsyncEngine calls this on a worker
    thread, never on the engine thread (the offline LLMEngine.add_request may: no other
    tenant waits there).
    """
    if params.structured_outputs is None:
        return [None] * params.n
    return list(grammars.matchers(params.structured_outputs, params.n))


def check_matchers(matchers: list, params: SamplingParams) -> None:
    """ValueError unless `matchers` fits `params`: n of them, matchers iff constrained, each
    fresh (nothing consumed) and for this spec."""
    spec = params.structured_outputs
    if len(matchers) != params.n:
        raise ValueError(f"{len(matchers)} grammar matchers for n={params.n} completions")
    for matcher in matchers:
        if (matcher is None) != (spec is None):
            raise ValueError("a constrained completion needs its grammar matcher, and only it")
        if matcher is not None and (matcher.spec != spec or matcher.num_consumed):
            raise ValueError("a grammar matcher must be fresh and for the request's spec")
    given = [id(m) for m in matchers if m is not None]
    if len(set(given)) != len(given):
        raise ValueError("each completion needs its own grammar matcher")


def finish_stopped(scheduler: Scheduler, request: Request) -> None:
    """End a request with "stop" (a stop string or a complete grammar).

    NOTE: the length cap on the same token: "stop" is the reason (as vLLM reports it); the
    request has left the scheduler already.
    """
    if not request.is_finished:
        scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
    elif request.status == RequestStatus.FINISHED_LENGTH:
        request.status = RequestStatus.FINISHED_STOPPED


def advance_grammar(seq: SequenceState, scheduler: Scheduler) -> None:
    """Feed the new tokens to the completion's matcher; finish it ("stop") once its
    grammar allows nothing more.

    NOTE: the matcher counts what it consumed, so the tokens a preempted completion
    recomputes (not re-samples) are not fed twice.
    NOTE: several new tokens (accepted drafts) are fed one at a time; the tokens after the
    one that completes the grammar are dropped, as one token per step would have stopped.
    """
    output = seq.request.output_token_ids
    for end in range(seq.grammar.num_consumed + 1, len(output)):
        seq.grammar.advance(output[:end])
        if seq.grammar.is_finished:
            drop_output_after(seq.request, end)
            break
    seq.grammar.advance(seq.request.output_token_ids)
    if seq.grammar.is_finished:
        finish_stopped(scheduler, seq.request)


def detokenize(seq: SequenceState, scheduler: Scheduler) -> None:
    """Append the new tokens' text; at the finish also what the detokenizer held back.

    NOTE: the flush comes before the stop-string check, so a stop string in the held-back
    text still cuts the text (and whatever follows it).
    NOTE: several new tokens (accepted draft tokens of speculative decoding) with stop
    strings are added and checked one at a time, and the tokens after the one that completes
    a stop string are dropped: the output is what one token per step would have given.
    """
    request = seq.request
    new = request.output_token_ids[seq.sent_tokens:]
    if len(new) > 1 and request.sampling_params.stop:
        for index, token in enumerate(new[:-1]):
            seq.text += seq.detokenizer.add([token])
            if cut_at_stop_string(seq, seq.sent_tokens + index + 1):
                drop_output_after(request, seq.sent_tokens + index + 1)
                finish_stopped(scheduler, request)
                return
        new = new[-1:]
    seq.text += seq.detokenizer.add(new)
    if request.is_finished:  # the output may end inside a character (or in a real U+FFFD)
        seq.text += seq.detokenizer.flush()
    if cut_at_stop_string(seq):
        finish_stopped(scheduler, request)


def drop_output_after(request: Request, num_tokens: int) -> None:
    """Keep only the first num_tokens output tokens (and their logprobs and times)."""
    del request.output_token_ids[num_tokens:]
    del request.output_logprobs[num_tokens:]
    del request.times.token_times[num_tokens:]


def cut_at_stop_string(seq: SequenceState, num_output: int | None = None) -> bool:
    """Cut the text at the first stop string in its new tail; True if one was found.

    num_output: the output tokens the text holds (default: all of the request's), for the
    min_tokens rule.
    """
    params = seq.request.sampling_params
    if num_output is None:
        num_output = len(seq.request.output_token_ids)
    if not params.stop or num_output < params.min_tokens:  # NOTE: as vLLM
        return False
    # Only the tail can hold a new match: the new text plus a stop string's length.
    window_start = max(0, seq.sent_text_len - seq.hold_back)
    hits = [i for i in (seq.text.find(s, window_start) for s in params.stop) if i >= 0]
    if not hits:
        return False
    seq.text = seq.text[:min(hits)]
    seq.stop_hit = True
    return True


def take_delta(seq: SequenceState) -> tuple[int, str, list[int]]:
    """(visible text length, new text, new token ids) since the last output; marks them sent.

    NOTE: until the finish, the last hold_back chars stay unsent (they may start a stop string).
    """
    request = seq.request
    visible = len(seq.text) if request.is_finished else max(seq.sent_text_len,
                                                            len(seq.text) - seq.hold_back)
    delta_text = seq.text[seq.sent_text_len:visible]
    delta_ids = request.output_token_ids[seq.sent_tokens:]
    seq.sent_text_len, seq.sent_tokens = visible, len(request.output_token_ids)
    return visible, delta_text, delta_ids


def build_output(seq: SequenceState, visible: int, delta_text: str,
                 delta_ids: list[int]) -> RequestOutput:
    """The RequestOutput of one completion (see `take_delta`)."""
    request = seq.request
    completion = CompletionOutput(
        index=seq.index, text=seq.text[:visible], token_ids=list(request.output_token_ids),
        finish_reason=request.finish_reason,
        logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None
        else None,
        delta_text=delta_text, delta_token_ids=delta_ids, metrics=RequestMetrics.of(request))
    prompt_lp = seq.prompt_logprobs.result() if seq.prompt_logprobs is not None else None
    entries, ranks = prompt_lp if prompt_lp is not None else (None, None)
    return RequestOutput(seq.parent_id, seq.prompt, request.prompt_token_ids, [completion],
                         error=request.error,
                         error_kind=error_kind_of(request.finish_reason, seq.error_kind),
                         num_cached_tokens=request.num_cached_tokens,
                         prompt_logprobs=entries, prompt_logprob_ranks=ranks)


def fault_kind(exc: BaseException) -> ErrorKind:
    """The error kind of a fault that fails one completion: the grammar engine refusing a
    token its own mask allowed is the request's constraint (GRAMMAR_FAILURE); anything else
    is the engine's (INTERNAL)."""
    if isinstance(exc, GrammarRejectedToken):
        return ErrorKind.GRAMMAR_FAILURE
    return ErrorKind.INTERNAL


def mark_failed(request: Request, message: str) -> None:
    """Turn a request that finished already into an error result (its output failed)."""
    request.status = RequestStatus.FINISHED_ERROR
    request.error = message
    if request.times.finished is None:
        request.times.finished = time.monotonic()


def error_output(seq: SequenceState, message: str) -> RequestOutput:
    """The error result of a failed completion: the text already sent, no new text (building
    that is what may have failed), metrics None if they cannot be built."""
    request = seq.request
    metrics = None
    with suppress(Exception):
        metrics = RequestMetrics.of(request)
    sent = seq.sent_tokens
    completion = CompletionOutput(
        index=seq.index, text=seq.text[:seq.sent_text_len],
        token_ids=list(request.output_token_ids), finish_reason=request.finish_reason,
        delta_token_ids=list(request.output_token_ids[sent:]), metrics=metrics)
    return RequestOutput(seq.parent_id, seq.prompt, list(request.prompt_token_ids),
                         [completion], error=message,
                         error_kind=error_kind_of(request.finish_reason, seq.error_kind),
                         num_cached_tokens=request.num_cached_tokens)
