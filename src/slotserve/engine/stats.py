"""The engine's running totals (`EngineStats`) and the record of a finished completion."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import InitVar, dataclass, field

from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.outputs import RunnerOutput, SchedulerOutput
from slotserve.engine.events import FinishedCompletion
from slotserve.engine.outputs import RequestMetrics
from slotserve.request import Request


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


def finished_completion(request: Request) -> FinishedCompletion:
    """What an IterationEvent tells of a completion that finished (metrics None if they
    cannot be built)."""
    metrics = None
    with suppress(Exception):
        metrics = RequestMetrics.of(request)
    return FinishedCompletion(
        request_id=request.request_id, finish_reason=request.finish_reason or "unknown",
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=len(request.output_token_ids),
        num_cached_tokens=request.num_cached_tokens, metrics=metrics, tenant=request.tenant,
        met_slo=request.met_slo)
