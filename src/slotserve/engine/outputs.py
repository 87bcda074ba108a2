"""What the engine returns to users: one RequestOutput per request (n completions)."""

from __future__ import annotations

from dataclasses import dataclass, field

from slotserve.request import Request


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and derived latencies of one sequence."""

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
                   e2e=t.e2e, itls=t.itls(), num_preemptions=request.num_preemptions)


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
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None

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
