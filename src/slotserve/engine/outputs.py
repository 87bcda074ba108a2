"""What the engine returns to users: one RequestOutput per request (n completions)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from slotserve.config import FinishReason
from slotserve.request import Request


class ErrorKind(enum.StrEnum):
    """Why a request ended without its answer (`RequestOutput.error_kind`).

    The engine sets it where the failure happens; a server maps it to an HTTP status or an
    SSE error event (server/generation.py). NOTE: `RequestOutput.error` is for people (logs,
    messages): nothing may parse it to decide what happened.

    grammar_failure: the grammar engine cannot follow the request's own constraint (its
    matcher refused a token its own mask allowed): the client's request, HTTP 400.
    slo_unattainable: the deadline policy rejected it (its first token could not come within
    its slo_ttft_ms): HTTP 503. aborted: aborted in the engine (the server is shutting
    down): HTTP 503. internal: the engine failed while running it: HTTP 500.
    """

    GRAMMAR_FAILURE = "grammar_failure"
    SLO_UNATTAINABLE = "slo_unattainable"
    ABORTED = "aborted"
    INTERNAL = "internal"


def error_kind_of(finish_reason: str | None, fault: ErrorKind | None = None
                  ) -> ErrorKind | None:
    """The error kind of a completion that finished with `finish_reason` (None: it runs on,
    or it ended with its answer: stop, length). fault: the kind the engine gave the failure
    when it failed the completion (finish_reason "error"); INTERNAL if it gave none."""
    if finish_reason is None:  # NOTE: every running completion's output, every step
        return None
    match finish_reason:
        case FinishReason.ERROR:
            return fault or ErrorKind.INTERNAL
        case FinishReason.ABORT:
            return ErrorKind.ABORTED
        case FinishReason.REJECTED:
            return ErrorKind.SLO_UNATTAINABLE
    return None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and derived latencies of one sequence.

    NOTE: itls (the gaps between its tokens) only on the output that finishes it, [] before:
    every step's output would copy the whole list (O(n) per token, 5-7 ms a step at 256
    sequences of ~360 tokens).
    """

    arrival: float
    scheduled: float | None
    first_token: float | None
    finished: float | None
    ttft: float | None
    tpot: float | None
    queue_time: float | None
    e2e: float | None
    itls: list[float]
    num_preemptions: int

    @classmethod
    def of(cls, request: Request) -> RequestMetrics:
        t = request.times
        return cls(arrival=t.arrival, scheduled=t.scheduled, first_token=t.first_token,
                   finished=t.finished, ttft=t.ttft, tpot=t.tpot, queue_time=t.queue_time,
                   e2e=t.e2e, itls=t.itls() if request.is_finished else [],
                   num_preemptions=request.num_preemptions)


@dataclass
class CompletionOutput:
    """One completion. delta_text / delta_token_ids: what is new since the last output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its completions (n of them).

    error: what went wrong, for people; error_kind: what the caller acts on (see ErrorKind),
    set whenever the completion ended without its answer (aborted and rejected too).
    num_cached_tokens: prompt tokens the completion's first prefill found in the prefix
    cache (vLLM's field; each completion of n counts its own).
    prompt_logprobs: with SamplingParams.prompt_logprobs, on completion 0's outputs once its
    prefill is done: per prompt token {token id: logprob} (the top N and the token itself),
    None for the first token (nothing comes before it); prompt_logprob_ranks: each prompt
    token's rank (1: the most likely), None for the first.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    error: str | None = None
    error_kind: ErrorKind | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None

    def __post_init__(self) -> None:
        # NOTE: a completion that ended without its answer always has a kind; one built
        # without it (by another EngineClient) gets its finish reason's (error: internal)
        if self.error_kind is None and self.outputs:
            self.error_kind = error_kind_of(self.outputs[0].finish_reason)

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    # Shortcuts to the first completion (n == 1, the common case).
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def metrics(self) -> RequestMetrics | None:
        return self.outputs[0].metrics
