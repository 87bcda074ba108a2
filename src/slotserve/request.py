"""Request: one sequence's tokens, progress, status and timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from slotserve.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model/pool length cap
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    # NOTE: the `deadline` policy with slo_reject=True: the request could no longer meet its
    # TTFT deadline and was never run; error is "slo: ..." (a server answers HTTP 503).
    FINISHED_REJECTED = "rejected"

    @property
    def finished(self) -> bool:
        # NOTE: `_value_`, not `value` (an enum descriptor): read for every sequence of
        # every step
        return self._value_ in _FINISHED_VALUES


_FINISHED_VALUES = frozenset(("stop", "length", "abort", "error", "rejected"))


@dataclass
class RequestTimes:
    """Wall-clock timestamps (time.monotonic seconds) of one request's life."""

    arrival: float = field(default_factory=time.monotonic)
    scheduled: float | None = None  # first iteration it ran in
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        if n < 2 or self.first_token is None:
            return None
        return (self.token_times[-1] - self.first_token) / (n - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    def itls(self) -> list[float]:
        """Gaps between consecutive tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class Request:
    """One sequence in the engine.

    NOTE: `num_computed_tokens` counts the positions whose K/V are in the cache. The tokens
    still to process are all_token_ids[num_computed_tokens:]; preemption resets it to 0 and
    keeps the generated tokens, so the request resumes by recomputing them (from the prefix
    cache where its blocks are still there).
    cache_salt: requests with different salts never share cached blocks.
    num_cached_tokens: prompt tokens its first prefill found in the prefix cache.
    block_hashes: hashes of its full blocks of tokens (the KV manager fills them in).
    priority: lower runs first under the `priority` scheduling policy (as vLLM).
    tenant: whose request it is, for the `fair` scheduling policy.
    slo_ttft_ms / slo_tpot_ms: this request's SLOs (None: the scheduler's defaults, which
    `Scheduler.add_request` writes here, so after it they are the SLOs in force).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_total_tokens: int = 2048  # prompt + output cap (model length / whole pool)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    num_preemptions: int = 0
    error: str | None = None
    cache_salt: str | None = None
    num_cached_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    priority: int = 0
    tenant: str = "default"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    times: RequestTimes = field(default_factory=RequestTimes)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without building all of it (a decode's one token each
        step: O(1), not O(prompt + output))."""
        prompt, num_prompt = self.prompt_token_ids, len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:stop - num_prompt]
        if stop <= num_prompt:
            return prompt[start:stop]
        return prompt[start:] + self.output_token_ids[:stop - num_prompt]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V are not computed yet (prompt chunk or the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        value = self.status._value_
        return value if value in _FINISHED_VALUES else None

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.token_times.append(now)

    def check_stop(self) -> RequestStatus | None:
        """The finish status the last token triggers, if any (stop strings: the engine).

        NOTE: before min_tokens output tokens only the length caps end a request (as
        vLLM); the sampler keeps EOS and stop_token_ids out of those tokens anyway.
        """
        params = self.sampling_params
        if self.reached_min_tokens:
            last = self.output_token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_set:  # NOTE: a frozenset, built once
                return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def reached_min_tokens(self) -> bool:
        """It has its min_tokens output tokens: stops (EOS, tokens, strings) may end it."""
        return len(self.output_token_ids) >= self.sampling_params.min_tokens

    # ----------------------------------------------------------------- goodput
    @property
    def met_ttft_slo(self) -> bool | None:
        """First token within slo_ttft_ms of arrival (True if no SLO); None before it came."""
        if self.slo_ttft_ms is None:
            return True
        ttft = self.times.ttft
        return None if ttft is None else ttft * 1000.0 <= self.slo_ttft_ms

    @property
    def met_tpot_slo(self) -> bool | None:
        """Mean time per output token after the first within slo_tpot_ms (True if no SLO or
        fewer than two tokens); None before the first token."""
        if self.slo_tpot_ms is None:
            return True
        if self.times.first_token is None:
            return None
        tpot = self.times.tpot
        return True if tpot is None else tpot * 1000.0 <= self.slo_tpot_ms

    @property
    def met_slo(self) -> bool:
        """Goodput: the request finished normally (stop or length) and met both SLOs.

        NOTE: False for a request still running, aborted, failed or rejected.
        """
        if self.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return False
        return bool(self.met_ttft_slo) and bool(self.met_tpot_slo)
