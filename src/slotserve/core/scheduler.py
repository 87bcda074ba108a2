"""The iteration scheduler: which requests run in the next forward, and how many tokens each.

One token-budget loop, no prefill/decode phases (as vLLM v1): running requests first (a
decode token or their next prefill chunk), then waiting ones in FCFS order while slots,
budget and KV blocks allow. Preemption by recompute frees blocks when a running request
needs one and none is free.

Prefix caching: a request starts after the longest prefix of full blocks found in the KV
cache, so only its uncached tokens take budget. A request whose next block is being computed
by another request right now (the n completions of one prompt, or several requests with one
system prompt) takes a slot but computes nothing until that block is cached, then shares it:
a shared prefix is computed once.
"""

from __future__ import annotations

import heapq
import time
from collections import deque

from slotserve.config import SchedulerConfig
from slotserve.core import policy
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput, SlotState
from slotserve.request import Request, RequestStatus


class Scheduler:
    """Decides every iteration; owns the waiting queue, the running batch and the KV blocks."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._free_slots = list(range(config.max_num_seqs))
        self.iteration = 0
        self.num_preemptions = 0

    # ----------------------------------------------------------------- requests in / out
    @property
    def max_total_tokens(self) -> int:
        """Longest sequence a request may reach: the model length or the whole pool."""
        return min(self.config.max_model_len, self.kv.num_blocks * self.kv.block_size)

    def add_request(self, request: Request) -> None:
        """Queue a request; raise ValueError if it can never fit."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError("prompt must not be empty")
        limit = self.max_total_tokens
        if request.num_prompt_tokens >= limit:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, but this engine fits at most "
                f"{limit} tokens per sequence (max_model_len={self.config.max_model_len}, "
                f"KV pool={self.kv.num_blocks * self.kv.block_size}); the prompt and at least "
                "one output token must fit")
        request.max_total_tokens = limit
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request now (abort, error, stop string): it leaves and its blocks return."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._release_slot(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request_id)
        request.status = status
        request.times.finished = time.monotonic()
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ----------------------------------------------------------------- one iteration
    def schedule(self) -> SchedulerOutput:
        """Plan the next iteration."""
        budget = self.config.max_num_batched_tokens
        may_admit = policy.may_admit(self.config.policy, len(self.running))
        plan: dict[str, int] = {}
        preempted: list[str] = []
        budget = self._schedule_running(budget, plan, preempted)
        # NOTE: no admission in an iteration that had to preempt: memory is short.
        if may_admit and not preempted:
            self._schedule_waiting(budget, plan)
        return self._build_output(plan, preempted)

    def _schedule_running(self, budget: int, plan: dict[str, int], preempted: list[str]) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            request.num_computed_tokens += self.kv.extend_computed(request)
            if self._waits_for_prefix(request):
                index += 1
                continue
            num_new = min(request.num_pending_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, preempted):
                break  # the request preempted itself: it was the newest
            plan[request.request_id] = num_new
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> bool:
        """Find blocks for num_new more tokens, preempting the newest running requests."""
        while self.kv.allocate_slots(request, request.num_computed_tokens + num_new) is None:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, budget: int, plan: dict[str, int]) -> None:
        needs_tokens = policy.admission_needs_tokens(self.config.policy)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            if needs_tokens and budget <= 0:
                break
            request = self.waiting[0]
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            waits = self.kv.next_block_in_flight(request, len(computed_blocks))
            num_new = 0 if waits else min(request.num_tokens - num_hit, max(budget, 0))
            if self.kv.allocate_slots(request, num_hit + num_new, computed_blocks) is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            self._admit(request)
            if num_new > 0:
                plan[request.request_id] = num_new
                budget -= num_new

    def _waits_for_prefix(self, request: Request) -> bool:
        """Whether a running request, all of whose blocks are computed, should wait for its
        next block: another request is computing the same block now."""
        held = len(self.kv.block_tables[request.request_id])
        return (request.num_computed_tokens == held * self.kv.block_size
                and self.kv.next_block_in_flight(request, held))

    def _admit(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.slot = heapq.heappop(self._free_slots)
        if request.times.scheduled is None:
            request.times.scheduled = time.monotonic()
        self.running.append(request)

    def _preempt(self, request: Request) -> None:
        """Take a running request's blocks back; it resumes later by recomputing."""
        self.running.remove(request)
        self._release_slot(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release_slot(self, request: Request) -> None:
        if request.slot is not None:
            heapq.heappush(self._free_slots, request.slot)
            request.slot = None

    def _build_output(self, plan: dict[str, int], preempted: list[str]) -> SchedulerOutput:
        seqs = [self._scheduled_seq(r, plan[r.request_id])
                for r in self.running if r.request_id in plan]
        slots: list[SlotState | None] = [None] * self.config.max_num_seqs
        kinds = {seq.request_id: seq.kind for seq in seqs}
        for request in self.running:
            num = plan.get(request.request_id, 0)
            slots[request.slot] = SlotState(
                request.request_id, kinds.get(request.request_id, "stalled"), num)
        output = SchedulerOutput(
            iteration=self.iteration, seqs=seqs, slots=slots, preempted=preempted,
            num_waiting=len(self.waiting), kv_blocks_used=self.kv.pool.num_used)
        self.iteration += 1
        return output

    def _scheduled_seq(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        is_decode = num_new == 1 and request.output_token_ids and start == request.num_tokens - 1
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:start + num_new],
            start_pos=start,
            block_table=list(self.kv.block_tables[request.request_id]),
            sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            num_output_tokens=len(request.output_token_ids),
            kind="decode" if is_decode else "prefill",
        )

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply an iteration's result: advance progress, append tokens, finish requests.

        Returns the requests that got a token or finished in this iteration. Finished ones
        have left the batch and their blocks are free when this returns.
        """
        now = time.monotonic()
        touched: list[Request] = []
        for seq in output.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the forward ran
            request.num_computed_tokens += seq.num_tokens
            self.kv.cache_full_blocks(request)
            if not seq.sample:
                continue
            request.append_token(result.sampled[seq.request_id], now)
            if seq.request_id in result.logprobs:
                request.output_logprobs.append(result.logprobs[seq.request_id])
            touched.append(request)
            status = request.check_stop()
            if status is not None:
                self.finish_request(request.request_id, status)
        return touched

    def fail_requests(self, request_ids: list[str], message: str) -> list[Request]:
        """End these requests with an error result (an iteration that raised)."""
        failed = []
        for request_id in request_ids:
            request = self.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            if request is not None:
                request.error = message
                failed.append(request)
        return failed

    def check_integrity(self) -> None:
        """Assert the scheduler's invariants (tests call this after every step)."""
        self.kv.check_integrity()
        assert len(self.running) <= self.config.max_num_seqs
        slots = [r.slot for r in self.running]
        assert None not in slots and len(set(slots)) == len(slots), f"slots {slots}"
        assert set(self.kv.block_tables) <= set(self.requests)
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.request_id not in self.kv.block_tables, "a waiting request holds blocks"
        size = self.kv.block_size
        for request in self.running:
            held = len(self.kv.block_tables[request.request_id])
            # NOTE: with the KV manager's own check, this proves shared blocks are never
            # written: the next write is at num_computed_tokens, past every cached block.
            cached = self.kv.num_cached_blocks(request.request_id)
            assert cached * size <= request.num_computed_tokens <= held * size, (
                f"{request.request_id}: {request.num_computed_tokens} computed, "
                f"{cached} cached and {held} held blocks")
        if not self.requests:
            assert self.kv.num_free_blocks == self.kv.num_blocks, "idle, but blocks are held"

