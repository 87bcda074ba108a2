"""The iteration trace: its format (`Trace`, version TRACE_VERSION) and the engine's recorder.

Every trace has this format, whoever wrote it: the engine (`TraceRecorder`), the seed's toy
simulator (`slotserve.lab.simulate`), a replay (`slotserve.lab.replay`) and a replica set
(`source: "replicas"`); `slotserve timeline`, the live view and a replay read it. Requests,
and per iteration which request held which slot, what it did (`SlotKind`: prefill / decode /
stalled: holds its slot, got no tokens) and how many tokens it processed. A request records
`cached_tokens`: the prompt tokens its first prefill skipped because the prefix cache held
them. Times are seconds from the first event (the toy's clock is the iteration: start =
index, end = index + 1, arrival = arrival_iteration).

The recorder is a bounded ring buffer: cheap enough to leave on.

The engine owns its recorder (for `--trace` export and `LLMEngine.export_trace()`); the
layers above it follow iterations through `LLMEngine.subscribe` instead.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypedDict

from slotserve.core.outputs import SchedulerOutput

TRACE_VERSION = 1


class _TraceSlotRequired(TypedDict):
    request: str
    kind: Literal["prefill", "decode", "stalled"]
    tokens: int


class TraceSlot(_TraceSlotRequired, total=False):
    """What one slot did in one iteration; a decode verified with draft tokens (speculative
    decoding) also records how many it `proposed` (among `tokens`) and `accepted`."""

    proposed: int
    accepted: int


class TraceIteration(TypedDict):
    """One iteration: `slots` has exactly `num_slots` entries (None: empty)."""

    index: int
    start: float
    end: float
    slots: list[TraceSlot | None]
    num_waiting: int
    kv_blocks_used: int | None
    preempted: list[str]


class _TraceRequestRequired(TypedDict):
    id: str
    arrival: float
    arrival_iteration: int
    prompt_tokens: int
    output_tokens: int
    first_iteration: int | None
    finish_iteration: int | None
    finish_reason: str | None


class TraceRequest(_TraceRequestRequired, total=False):
    """One request; the engine also records its prefix-cache hit and POLICY_FIELDS."""

    cached_tokens: int
    tenant: str
    priority: int
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None


class _TraceRequired(TypedDict):
    version: int  # TRACE_VERSION
    source: Literal["engine", "simulator", "replay", "replicas"]
    policy: str  # the admission rule: continuous | static
    num_slots: int
    requests: list[TraceRequest]
    iterations: list[TraceIteration]


class Trace(_TraceRequired, total=False):
    """A whole trace (JSON-able). `settings`: what a replay needs beyond the slots, policy
    and KV pool (TRACE_SETTINGS, block_size, enable_prefix_caching); `planner_state`: what
    "auto" speculation had learnt where the trace starts (`Scheduler.planner_state`; only in
    a trace cleared between runs)."""

    kv_blocks_total: int | None
    settings: dict
    planner_state: dict


class TraceRecorder:
    """The engine's trace; written in the engine thread, `export()` from any thread."""

    def __init__(self, num_slots: int, policy: str, kv_blocks_total: int,
                 capacity: int = 4096, settings: dict | None = None,
                 planner_state: Callable[[], dict | None] | None = None) -> None:
        """settings: the scheduling settings the run used (`trace_settings`), exported so a
        replay of the trace runs with them. planner_state: what "auto" speculation has
        learnt now (`Scheduler.planner_state`), read by `clear` so the trace of the run that
        follows carries where its planning started (`planner_state` in `export`).

        NOTE: `clear` reads the scheduler's state: call it between runs, while the engine
        is not stepping (as `LLM.generate(trace=...)` and the benchmarks do)."""
        self.settings = dict(settings or {})
        self._planner_state = planner_state
        self.start_state: dict | None = None  # planner_state() at the last clear
        self._complete = True  # every iteration since the last clear is kept
        self.num_slots = num_slots
        self.policy = policy
        self.kv_blocks_total = kv_blocks_total
        self.capacity = capacity
        self.iterations: deque[dict] = deque(maxlen=capacity)
        self.requests: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()
        self.t0: float | None = None

    def _rel(self, t: float) -> float:
        if self.t0 is None:
            self.t0 = t
        return round(t - self.t0, 6)

    def request_arrived(self, request_id: str, arrival: float, iteration: int,
                        prompt_tokens: int, policy_fields: dict | None = None) -> None:
        """policy_fields: the request's tenant, priority and SLOs (`policy_fields_of`), kept
        in its record so a replay schedules it as the run did."""
        with self._lock:
            self.requests[request_id] = {
                "id": request_id, "arrival": self._rel(arrival), "arrival_iteration": iteration,
                "prompt_tokens": prompt_tokens, "output_tokens": 0, "cached_tokens": 0,
                "first_iteration": None,
                "finish_iteration": None, "finish_reason": None, **(policy_fields or {})}
            while len(self.requests) > self.capacity:
                self.requests.popitem(last=False)

    def request_finished(self, request_id: str, iteration: int, reason: str,
                         output_tokens: int) -> None:
        with self._lock:
            record = self.requests.get(request_id)
            if record is not None:
                record.update(finish_iteration=iteration, finish_reason=reason,
                              output_tokens=output_tokens)

    def record(self, plan: SchedulerOutput, start: float, end: float) -> TraceIteration:
        """Store one iteration; returns its record.

        NOTE: a request's first scheduled chunk starts after the tokens found in the prefix
        cache, so its start position is the prefill that was skipped (`cached_tokens`).
        """
        slots = [None if s is None else
                 {"request": s.request_id, "kind": s.kind, "tokens": s.tokens,
                  **({"proposed": s.proposed, "accepted": s.accepted} if s.proposed else {})}
                 for s in plan.slots]
        record = {"index": plan.iteration, "start": self._rel(start), "end": self._rel(end),
                  "slots": slots, "num_waiting": plan.num_waiting,
                  "kv_blocks_used": plan.kv_blocks_used, "preempted": list(plan.preempted)}
        with self._lock:
            self._complete = self._complete and len(self.iterations) < self.capacity
            self.iterations.append(record)
            for seq in plan.seqs:
                req = self.requests.get(seq.request_id)
                if req is not None and req["first_iteration"] is None:
                    req["first_iteration"] = plan.iteration
                    req["cached_tokens"] = seq.start_pos
        return record

    def export(self) -> Trace:
        with self._lock:
            return {"version": TRACE_VERSION, "source": "engine", "policy": self.policy,
                    "num_slots": self.num_slots, "kv_blocks_total": self.kv_blocks_total,
                    "requests": [dict(r) for r in self.requests.values()],
                    "iterations": list(self.iterations),
                    **({"settings": dict(self.settings)} if self.settings else {}),
                    # NOTE: only where the trace still starts where the state was read
                    **({"planner_state": self.start_state}
                       if self.start_state is not None and self._complete else {})}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.export()))

    def clear(self) -> None:
        """Forget every iteration and request: the trace starts again (see __init__)."""
        state = self._planner_state() if self._planner_state is not None else None
        with self._lock:
            self.iterations.clear()
            self.requests.clear()
            self.t0 = None
            self.start_state, self._complete = state, True


POLICY_FIELDS = ("tenant", "priority", "slo_ttft_ms", "slo_tpot_ms")


def policy_fields_of(request) -> dict:
    """A core Request's scheduling-policy fields, as a trace's request record keeps them."""
    return {name: getattr(request, name) for name in POLICY_FIELDS}


TRACE_SETTINGS = ("max_num_batched_tokens", "max_prefill_tokens_while_decoding",
                  "hold_first_tokens", "max_model_len", "scheduling_policy", "slo_ttft_ms",
                  "slo_tpot_ms", "slo_reject")


def trace_settings(scheduler_config, cache_config, sliding_window: int | None = None) -> dict:
    """The settings a trace records beyond its slots, policy and KV pool (names as
    `slotserve.lab.replay.ReplaySettings`'s); sliding_window: the model's one window on
    every layer (recorded only when there is one: its blocks before it are freed)."""
    settings = {name: getattr(scheduler_config, name) for name in TRACE_SETTINGS}
    settings["scheduling_policy"] = str(settings["scheduling_policy"])
    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    return {**settings, "block_size": cache_config.block_size,
            "enable_prefix_caching": cache_config.enable_prefix_caching, **window}
