"""Replay: the real scheduler and KV manager on a virtual clock.

    result = replay(requests, ReplaySettings(max_num_seqs=16), LinearCost(...))
    result.trace            # the engine's trace format (slotserve timeline draws it)
    result.bench_result()   # what `slotserve bench --out` writes, predicted

The loop is the engine's (`LLMEngine.step` driven by `slotserve bench`): before each
iteration, every request whose arrival time has come joins the scheduler; `schedule()` plans
the iteration; the fake runner "executes" it by moving the clock by the cost model's time and
returning one token per sampling sequence; `update()` applies it. Scheduling decisions are the
scheduler's own (any policy its config accepts), so a replay takes the same decisions as the
engine on the same inputs; only time is modelled.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from slotserve.config import (
    DEFAULT_PREFILL_TOKENS_WHILE_DECODING,
    CacheConfig,
    Policy,
    SchedulerConfig,
    check_policy_fields,
)
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.outputs import SchedulerOutput
from slotserve.core.scheduler import Scheduler
from slotserve.engine.trace import TraceRecorder, policy_fields_of
from slotserve.lab.replay.cost_model import UnitCost
from slotserve.lab.replay.runner import FILLER_TOKEN, VirtualEngineCore, default_num_blocks
from slotserve.lab.replay.speculation import DraftOracle, make_speculator
from slotserve.request import Request
from slotserve.sampling import SamplingParams
from slotserve.spec.config import SpeculativeConfig
from slotserve.spec.config import parse as parse_speculative_config
from slotserve.value_checks import is_int


@dataclass(frozen=True)
class ReplayRequest:
    """One request to replay: its prompt length, its recorded output length, its arrival (s).

    prompt_token_ids: the real prompt (prefix caching then shares what a real run shares);
    None: `prompt_tokens` filler tokens under a per-request cache salt (nothing shared).
    tenant, priority, slo_ttft_ms, slo_tpot_ms: its scheduling-policy fields, as the
    request's (`slotserve.request.Request`); the SLOs None: the replay's defaults.
    verifications: its trace's speculative decoding, (output position, drafts proposed,
    drafts accepted) per verification (`speculation.recorded_verifications`); empty: it
    verified none, so a replay with speculation gives it no drafts.
    """

    id: str
    prompt_tokens: int
    output_tokens: int
    arrival: float = 0.0
    prompt_token_ids: tuple[int, ...] | None = None
    tenant: str = "default"
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    verifications: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"id must be a non-empty string, got {self.id!r}")
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r} "
                                 f"(request {self.id!r})")
        if not isinstance(self.arrival, (int, float)) or not self.arrival >= 0 \
                or math.isinf(self.arrival):
            raise ValueError(f"arrival must be finite seconds >= 0, got {self.arrival!r} "
                             f"(request {self.id!r})")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_tokens:
            raise ValueError(f"prompt_token_ids has {len(self.prompt_token_ids)} tokens, "
                             f"prompt_tokens says {self.prompt_tokens} (request {self.id!r})")
        for record in self.verifications:
            if len(record) != 3 or not all(isinstance(v, int) for v in record) \
                    or not (record[0] >= 0 and 0 <= record[2] <= record[1]):
                raise ValueError(f"verifications: {record!r} is not (position >= 0, proposed, "
                                 f"accepted <= proposed) (request {self.id!r})")
        try:
            check_policy_fields(self.priority, self.tenant, self.slo_ttft_ms, self.slo_tpot_ms)
        except ValueError as exc:
            raise ValueError(f"{exc} (request {self.id!r})") from None


@dataclass(frozen=True)
class ReplaySettings:
    """The engine settings a replay varies (names as `engine_config`'s).

    batching: the admission rule, continuous or static (as `engine_config`'s `batching`;
    formerly `policy` here too). NOTE: a trace names it `policy` (its header's key, format
    version 1); `slotserve replay` reads it from there.
    num_blocks None: the engine's default when memory is plentiful, enough blocks for
    max_num_seqs sequences of max_model_len tokens.
    scheduling_policy, slo_ttft_ms, slo_tpot_ms, slo_reject: as `SchedulerConfig`'s (the
    queue order, the requests' default SLOs, and the deadline policy's rejection).
    speculative_config: speculative decoding as `--speculative-config`'s JSON (None: off);
    drafts go to the requests with recorded `verifications` (see `speculation`).
    sliding_window: the model's one window on every layer (Mistral-style; a trace records
    it): the blocks before a request's window are freed, as the engine frees them; None:
    none (a model without one, or with mixed windows, keeps every block).
    """

    batching: str = Policy.CONTINUOUS
    scheduling_policy: str = "fcfs"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_reject: bool = False
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_prefill_tokens_while_decoding: int | None = DEFAULT_PREFILL_TOKENS_WHILE_DECODING
    hold_first_tokens: bool = True
    max_model_len: int = 4096
    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    prefix_cache_scope: str = "auto"  # as CacheConfig's ("auto": global, as offline)
    speculative_config: str | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        # NOTE: kept as its canonical JSON text (hashable, and asdict writes it as given).
        config = parse_speculative_config(self.speculative_config)
        object.__setattr__(self, "speculative_config",
                           None if config is None else config.to_json())

    def speculation(self) -> SpeculativeConfig | None:
        return parse_speculative_config(self.speculative_config)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_prefill_tokens_while_decoding=self.max_prefill_tokens_while_decoding,
            hold_first_tokens=self.hold_first_tokens,
            max_model_len=self.max_model_len, policy=self.batching,
            scheduling_policy=self.scheduling_policy, slo_ttft_ms=self.slo_ttft_ms,
            slo_tpot_ms=self.slo_tpot_ms, slo_reject=self.slo_reject)

    def resolved_num_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return default_num_blocks(self.max_num_seqs, self.max_model_len, self.block_size)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, num_blocks=self.resolved_num_blocks(),
                           enable_prefix_caching=self.enable_prefix_caching,
                           prefix_cache_scope=self.prefix_cache_scope)


@dataclass
class RequestOutcome:
    """One replayed request's virtual timestamps (seconds from the start of the run)."""

    id: str
    prompt_tokens: int
    arrival: float
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return None if n < 2 else (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass
class ReplayResult:
    """A replay's trace, per-request outcomes and totals."""

    trace: dict
    outcomes: list[RequestOutcome]
    duration: float
    iterations: int
    busy_slot_iterations: int
    preemptions: int
    settings: ReplaySettings
    cost_model: dict
    workload: dict = field(default_factory=dict)
    plans: list[SchedulerOutput] | None = None

    @property
    def utilisation(self) -> float | None:
        slots = self.settings.max_num_seqs * self.iterations
        return self.busy_slot_iterations / slots if slots else None

    def config(self) -> dict:
        return {"target": "simulator", **asdict(self.settings),
                "num_blocks": self.settings.resolved_num_blocks(),
                "cost_model": self.cost_model, "workload": dict(self.workload)}

    def bench_result(self, label: str | None = None):
        """The predicted run as `slotserve bench` reports a measured one (`BenchResult`)."""
        from slotserve.lab.bench.stats import RequestRecord, RunStats, summarize

        records = [RequestRecord(o.id, o.error is None and o.finished is not None,
                                 o.prompt_tokens, len(o.token_times), o.ttft, o.tpot, o.e2e,
                                 [b - a for a, b in zip(o.token_times, o.token_times[1:])],
                                 o.error) for o in self.outcomes]
        run = RunStats(records, self.duration, self.config(), self.utilisation,
                       self.preemptions, self.iterations)
        return summarize(run, label or self.settings.batching, "simulator")


def replay(requests: Sequence[ReplayRequest], settings: ReplaySettings, cost_model, *,
           keep_plans: bool = False, check: bool = False,
           workload: dict | None = None, planner_state: dict | None = None,
           cached_prefixes: Sequence[tuple[str, Sequence[int]]] = ()) -> ReplayResult:
    """Run the requests through the real scheduler on the cost model's clock.

    keep_plans: keep every SchedulerOutput (tests compare them with the engine's).
    check: assert the scheduler's invariants after every iteration (slower).
    planner_state: where "auto" speculation starts (a trace's `planner_state`: what the
    engine had learnt when the run began; None: from nothing, as a fresh engine).
    cached_prefixes: (tenant, token ids) in the prefix cache when the replay starts (what
    the engine had cached before its trace began: `shared_prefix_prompts`); ValueError if
    the KV pool cannot hold one.
    A request the scheduler refuses (e.g. longer than max_model_len) is a failed outcome,
    as `slotserve bench` counts it. Raises ValueError on bad settings or duplicate ids.
    """
    ids = [r.id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    cache = settings.cache_config()
    oracle = DraftOracle({r.id: r.verifications for r in requests if r.verifications})
    core = VirtualEngineCore(settings.scheduler_config(), cache, cost_model,
                             speculator=make_speculator(settings.speculation(), oracle),
                             acceptance=oracle, sliding_window=settings.sliding_window)
    trace = TraceRecorder(settings.max_num_seqs, settings.batching, cache.num_blocks,
                          capacity=1 << 62)
    if planner_state is not None:
        core.scheduler.restore_planner_state(planner_state)
        trace.start_state = core.scheduler.planner_state()  # NOTE: a replay of it starts so
    for index, (tenant, token_ids) in enumerate(cached_prefixes):
        cache_prefix(core.scheduler.kv, f"cached-before:{index}", tenant, token_ids)
    outcomes = {r.id: RequestOutcome(r.id, r.prompt_tokens, float(r.arrival)) for r in requests}
    # NOTE: arrival order, input order among equal arrivals (as a workload's).
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    plans: list[SchedulerOutput] = []
    busy = 0
    while pending or core.scheduler.has_unfinished():
        plan = _next_iteration(core, trace, pending, outcomes)
        if plan is None:
            continue
        busy += len(plan.seqs)
        if keep_plans:
            plans.append(plan)
        if check:
            core.scheduler.check_integrity()
    return _result(core, trace, settings, cost_model, outcomes, busy, workload,
                   plans if keep_plans else None)


def planner_state_for(cost_model, state: dict | None) -> dict | None:
    """The recorded planner `state` a replay on `cost_model` can start from: None on the
    toy clock (`UnitCost`). NOTE: the engine's planner state is in seconds, not in the toy
    clock's iterations."""
    return None if isinstance(cost_model, UnitCost) else state


def cache_prefix(kv: KVCacheManager, request_id: str, tenant: str,
                 token_ids: Sequence[int]) -> None:
    """Put the full blocks of `token_ids` in the prefix cache, free (as a request that
    computed them and left), without a forward or a tick of the clock; nothing without
    prefix caching."""
    if not kv.enable_prefix_caching:
        return
    holder = Request(request_id, list(token_ids), SamplingParams(max_tokens=1), tenant=tenant)
    if kv.allocate_slots(holder, len(token_ids)) is None:
        raise ValueError(f"cached_prefixes: {len(token_ids)} tokens do not fit the KV pool "
                         f"({kv.num_free_blocks} free blocks)")
    holder.num_computed_tokens = len(token_ids)
    kv.cache_full_blocks(holder)
    kv.free(request_id)


def _next_iteration(core: VirtualEngineCore, trace: TraceRecorder, pending: deque,
                    outcomes: dict[str, RequestOutcome]) -> SchedulerOutput | None:
    """Add the requests due now and run one scheduler iteration on the virtual clock.

    None when there was nothing to run: the clock moved on to the next arrival instead.
    """
    scheduler, runner = core.scheduler, core.runner
    _add_due(scheduler, trace, pending, runner.clock.now, outcomes)
    if not scheduler.has_unfinished():
        if pending:
            runner.clock.advance_to(pending[0].arrival)
        return None
    plan, updated = core.step()
    if plan.is_empty:
        if not pending:
            raise RuntimeError(f"the scheduler planned nothing with "
                               f"{len(scheduler.requests)} requests unfinished")
        runner.clock.advance_to(pending[0].arrival)
        return None
    for request in updated:
        _on_token(request, runner.clock.now, scheduler, trace, outcomes)
    trace.record(plan, runner.last_start, runner.last_end)
    return plan


def _result(core: VirtualEngineCore, trace: TraceRecorder, settings: ReplaySettings, cost_model,
            outcomes: dict[str, RequestOutcome], busy: int, workload: dict | None,
            plans: list[SchedulerOutput] | None) -> ReplayResult:
    """The ReplayResult of a finished run: its trace, the outcomes, the clock's end."""
    exported = trace.export()
    exported.update(source="replay", cost_model=cost_model.describe(),
                    settings=asdict(settings))
    return ReplayResult(exported, list(outcomes.values()), core.runner.clock.now,
                        len(exported["iterations"]), busy, core.scheduler.num_preemptions,
                        settings, cost_model.describe(), dict(workload or {}), plans)


def sampling_params_for(request: ReplayRequest) -> SamplingParams:
    """Exactly the recorded length: max_tokens = output_tokens, EOS ignored."""
    return SamplingParams(max_tokens=request.output_tokens, ignore_eos=True)


def scheduler_request(request: ReplayRequest) -> Request:
    """The core Request a replayed request becomes."""
    if request.prompt_token_ids is not None:
        ids, salt = list(request.prompt_token_ids), None
    else:
        # NOTE: filler ids are identical across requests; the salt keeps them from sharing
        # cached blocks, which a real run's different prompts would not share either.
        ids, salt = [FILLER_TOKEN] * request.prompt_tokens, f"replay:{request.id}"
    core = Request(request.id, ids, sampling_params_for(request), priority=request.priority,
                   tenant=request.tenant, slo_ttft_ms=request.slo_ttft_ms,
                   slo_tpot_ms=request.slo_tpot_ms)
    core.cache_salt = salt
    core.times.arrival = float(request.arrival)
    return core


def _add_due(scheduler: Scheduler, trace: TraceRecorder, pending: deque, now: float,
             outcomes: dict[str, RequestOutcome]) -> None:
    while pending and pending[0].arrival <= now:
        request = pending.popleft()
        core = scheduler_request(request)
        try:
            scheduler.add_request(core)
        except ValueError as exc:
            outcomes[request.id].error = str(exc)
            continue
        trace.request_arrived(request.id, float(request.arrival), scheduler.iteration,
                              request.prompt_tokens, policy_fields_of(core))


def _on_token(request: Request, now: float, scheduler: Scheduler, trace: TraceRecorder,
              outcomes: dict[str, RequestOutcome]) -> None:
    """A request update() returned: it got a token, or it finished (maybe without one: the
    deadline policy's slo_reject finishes a waiting request with an error)."""
    outcome = outcomes[request.request_id]
    # NOTE: a verification may add several tokens at once (accepted drafts): same time.
    while len(outcome.token_times) < len(request.output_token_ids):
        outcome.token_times.append(now)
    if request.is_finished:
        outcome.finished = now
        outcome.finish_reason = request.finish_reason
        outcome.error = request.error
        trace.request_finished(request.request_id, scheduler.iteration - 1,
                               request.finish_reason or "", len(request.output_token_ids))
