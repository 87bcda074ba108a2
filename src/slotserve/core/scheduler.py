"""The iteration scheduler: which requests run in the next forward, and how many tokens each.

One token-budget loop, no prefill/decode phases (as vLLM v1): running requests first (a
decode token or their next prefill chunk), then waiting ones while slots, budget and KV
blocks allow. Preemption by recompute frees blocks when a running request needs one and none
is free. The scheduling policy (core/queue_policy.py: fcfs, priority, deadline, fair) picks
the order of both loops, the preemption victim, and caps an iteration's prefill tokens
while requests decode (stall-free batching: `max_prefill_tokens_while_decoding`, tightened
by `deadline` for TPOT SLOs), so admitting many prompts at once does not stall decodes.
With `hold_first_tokens`, a prompt's last token waits while requests that arrived before it
was ready still compute their prompts: a burst's first tokens come together (`_holds`).

Prefix caching: a request starts after the longest prefix of full blocks found in the KV
cache, so only its uncached tokens take budget. A request whose next block is being computed
by another request right now (the n completions of one prompt, or several requests with one
system prompt) takes a slot but computes nothing until that block is cached, then shares it:
a shared prefix is computed once.

Tenants (core/tenant_share.py): while a tenant below its share of the slots waits, no other
tenant is admitted past its share, and one far over it gives up a slot (preemption), under
every policy.

Speculative decoding (spec/, off unless a `Speculator` is given): after the running requests
got their tokens and before waiting ones are admitted, the speculator gives draft tokens to
running decodes (fixed, or "auto" from the step-cost model and acceptance: spec/planner.py);
a drafted decode is planned as a chunk of 1 + k tokens, with blocks for all of them (never
preempting for drafts: fewer drafts instead). `update` keeps the accepted drafts and the token
sampled after them, rewinds `num_computed_tokens` past the rejected drafts' positions (their
K/V is garbage that later tokens overwrite) and gives back the blocks only they needed;
blocks are hashed for the prefix cache only once their tokens are accepted.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable

from slotserve.config import Policy, SchedulerConfig, SlotKind
from slotserve.core import policy
from slotserve.core.context_fit import check_fits_context
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.outputs import (
    RunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
    SlotState,
    is_decode_step,
)
from slotserve.core.queue_policy import CostModel, QueuePolicy, make_policy
from slotserve.core.scheduling_fields import SchedulingFields
from slotserve.core.tenant_share import TenantLoad
from slotserve.request import Request, RequestStatus
from slotserve.spec.planner import (
    Candidate,
    DecodeStepCost,
    PooledAcceptance,
    Speculator,
    count_of,
)

# hold_first_tokens holds a first token for a burst of at least this many other prompts: one
# long prompt beside a short one is the online case, where the short one's first token should
# not wait (its TPOT pays for that prompt's few iterations instead).
HOLD_MIN_GANG = 2


class Scheduler:
    """Decides every iteration; owns the waiting queue, the running batch and the KV blocks."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic,
                 speculator: Speculator | None = None) -> None:
        """clock: seconds, for request timestamps, SLO deadlines and the cost model (tests
        inject a fake one; it must be the clock of the requests' arrival times).
        speculator: speculative decoding's planner and proposer (None: off)."""
        self.config = config
        self.kv = kv
        self.clock = clock
        self.cost = CostModel()
        # NOTE: `deadline`'s prefill allowance never falls below one block per iteration.
        self.queue_policy: QueuePolicy = make_policy(config, self.cost,
                                                     min_prefill_tokens=kv.block_size)
        self.load = TenantLoad(config)  # running / waiting sequences per tenant
        self._prefill_allowance: int | None = None  # prefill tokens left this iteration
        self._scheduled_at: float | None = None  # clock when the last plan was made
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._free_slots = list(range(config.max_num_seqs))
        self.iteration = 0
        self.num_preemptions = 0
        self.speculator = speculator
        # NOTE: "auto" speculation plans with the cost of decode-only iterations (decodes
        # and their drafts): prefill chunks cost more per token (attention over the prompt,
        # on the CPU the general path instead of the decode stack) and would make drafts
        # look dear. Iterations that stalled (a garbage collection) are left out of it.
        self.decode_cost = DecodeStepCost()
        # The drafts a running request may verify, a prefix of those proposed (the engine's:
        # what a structured output's grammar accepts).
        self.filter_drafts: Callable[[Request, list[int]], list[int]] = (
            lambda request, drafts: drafts)
        self._drafts: dict[str, list[int]] = {}  # the plan being built: drafts by request
        self.last_extra_tokens = 0  # accepted drafts appended by the last update
        # hold_first_tokens: each request's arrival number, and for a prompt whose last token
        # came due, the arrivals seen then (its gang: those that arrived before)
        self._arrivals = 0
        self._arrival_of: dict[str, int] = {}
        self._ready_marks: dict[str, int] = {}
        self._prompt_work: list[tuple[int, int]] = []  # this iteration: see _begin_holds
        self._held: list[Request] = []  # this iteration's requests whose last token waits
        self._prompt_planned = False  # this iteration planned prompt work of a first token

    # ----------------------------------------------------------------- requests in / out
    @property
    def max_total_tokens(self) -> int:
        """Longest sequence a request may reach: the model length or the whole pool.

        NOTE: with a uniform sliding window (the KV manager frees the blocks before it), the
        model length whenever one request's window and a whole budget's chunk fit in the
        pool: a request alone then always finds its blocks, however long.
        """
        step_blocks = self.kv.max_blocks_held(self.config.max_num_batched_tokens)
        if step_blocks is not None and step_blocks <= self.kv.num_blocks:
            return self.config.max_model_len
        return min(self.config.max_model_len, self.kv.num_blocks * self.kv.block_size)

    def add_request(self, request: Request) -> None:
        """Queue a request; raise ValueError if it can never fit."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError("prompt must not be empty")
        limit = self.max_total_tokens
        check_fits_context(request.num_prompt_tokens, limit, holder="this engine", why=(
            f" (max_model_len={self.config.max_model_len}, "
            f"KV pool={self.kv.num_blocks * self.kv.block_size})"))
        self._check_policy_fields(request)
        self._set_slos(request)
        request.max_total_tokens = limit
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._arrival_of[request.request_id] = self._arrivals
        self._arrivals += 1
        self.waiting.append(request)
        self.load.move(request.tenant, waiting=1)
        self.queue_policy.on_add(request, self.waiting)

    def _set_slos(self, request: Request) -> None:
        """The SLOs in force: the request's, else the defaults; raised to the floors."""
        cfg = self.config
        ttft = cfg.slo_ttft_ms if request.slo_ttft_ms is None else request.slo_ttft_ms
        tpot = cfg.slo_tpot_ms if request.slo_tpot_ms is None else request.slo_tpot_ms
        request.slo_ttft_ms = None if ttft is None else max(ttft, cfg.min_slo_ttft_ms)
        request.slo_tpot_ms = None if tpot is None else max(tpot, cfg.min_slo_tpot_ms)

    def num_waiting_of(self, tenant: str) -> int:
        """Sequences of `tenant` waiting for a slot (preempted ones included). Any thread."""
        return self.load.num_waiting(tenant)

    @staticmethod
    def _check_policy_fields(request: Request) -> None:
        """ValueError naming a bad scheduling field of a Request built directly (the
        engine's come from a checked SchedulingFields: this is the same check)."""
        SchedulingFields.of(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request now (abort, error, stop string): it leaves and its blocks return."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._arrival_of.pop(request_id, None)
        self._ready_marks.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.finish(request_id, request.output_token_ids, completed=status in (
                RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH))
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._release_slot(request)
            self.load.move(request.tenant, running=-1)
        elif request in self.waiting:
            self.waiting.remove(request)
            self.load.move(request.tenant, waiting=-1)
        self.kv.free(request_id)
        self.queue_policy.on_finish(request)
        request.status = status
        request.times.finished = self.clock()
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

    @property
    def scheduling_policy(self) -> str:
        return self.queue_policy.name

    def policy_state(self) -> dict:
        """Read-only, for metrics: the scheduling policy's name and per-tenant counters
        (virtual counter, prompt/output tokens served, weight, active requests)."""
        return self.queue_policy.state()

    # ----------------------------------------------------------------- one iteration
    def schedule(self) -> SchedulerOutput:
        """Plan the next iteration."""
        now = self.clock()
        budget = self.config.max_num_batched_tokens
        may_admit = policy.may_admit(self.config.policy, len(self.running))
        plan: dict[str, int] = {}
        preempted: list[str] = []
        self.queue_policy.begin_iteration()
        self.queue_policy.order_running(self.running)
        self._prefill_allowance = self.queue_policy.prefill_allowance(self.running, now)
        self._begin_holds(may_admit)
        budget = self._schedule_running(budget, plan, preempted)
        self._drafts = {}
        # NOTE: no drafts in an iteration that had to preempt: memory is short.
        if self.speculator is not None and not preempted:
            budget = self._schedule_drafts(budget, plan)
        if not plan:
            # NOTE: the prefill cap protects running decodes; with none planned it would
            # only idle the iteration, so progress wins (at least one chunk).
            self._prefill_allowance = None
        # NOTE: no admission in an iteration that had to preempt a running request for
        # memory: memory is short. (`priority` preempts for a waiting request in
        # _schedule_waiting, after this check.)
        if may_admit and not preempted:
            self._schedule_waiting(budget, plan, preempted, now)
        if self._held and not self._prompt_planned:
            self._release_held(plan)
        output = self._build_output(plan, preempted)
        self._scheduled_at = self.clock()
        return output

    # ----------------------------------------------------------------- hold_first_tokens
    def _begin_holds(self, may_admit: bool) -> None:
        """This iteration's view for `_holds`: (arrival number, prompt tokens left before
        the last one) of each request with such work that can run while first tokens are
        held, as the iteration starts: the running ones and, where admission is open, as
        many admissible waiting ones (in queue order; tenant shares) as there are free
        slots. NOTE: a request waiting for a slot that held requests keep, or that its
        tenant's share keeps out, is no reason to hold them."""
        self._held, self._prompt_planned = [], False
        if not self.config.hold_first_tokens:
            return
        free = max(self.config.max_num_seqs - len(self.running), 0) if may_admit else 0
        admissible = self._admissible_waiting(self.load.shares()) if free else ()
        can_run = self.running + list(itertools.islice(admissible, free))
        self._prompt_work = [
            (self._arrival_of[r.request_id], r.num_tokens - r.num_computed_tokens - 1)
            for r in can_run if not r.output_token_ids and r.num_tokens - r.num_computed_tokens > 1]

    def _holds(self, request: Request, computed_after: int) -> bool:
        """Whether a chunk that computes `request` up to computed_after tokens must stop one
        short: it would sample the request's first token while the requests that arrived
        before this prompt's last token came due (its gang) are a burst, at least
        HOLD_MIN_GANG of them with more prompt work left than one iteration's budget: work
        the request would otherwise decode through (one iteration of it costs little; a
        burst's, many). A request with a TTFT SLO is never held. NOTE: the gang is fixed
        when the last token comes due: later arrivals never extend a hold, so it ends once
        those prompts are (nearly) computed, or (`_release_held`) when none of them can run."""
        if (not self.config.hold_first_tokens or request.output_token_ids
                or request.slo_ttft_ms is not None or computed_after != request.num_tokens):
            return False
        mark = self._ready_marks.setdefault(request.request_id, self._arrivals)
        own = self._arrival_of[request.request_id]
        gang = [left for arrival, left in self._prompt_work if arrival < mark and arrival != own]
        return len(gang) >= HOLD_MIN_GANG and sum(gang) > self.config.max_num_batched_tokens

    def _hold_last_token(self, request: Request, start: int, num_new: int) -> int:
        """num_new, one fewer where the chunk from `start` would sample a first token that
        `_holds` keeps back; a request held whole goes to `_held`. NOTE: the token goes back
        to the prefill allowance only if `_cap_prefill` charged it (a chunk of a prompt's
        last token alone counts as a decode)."""
        if num_new == 0 or not self._holds(request, start + num_new):
            return num_new
        if self._prefill_allowance is not None and not is_decode_step(start, num_new, True):
            self._prefill_allowance += 1
        if num_new == 1:
            self._held.append(request)
        return num_new - 1

    def _note_prompt_work(self, request: Request) -> None:
        if not request.output_token_ids:
            self._prompt_planned = True

    def _release_held(self, plan: dict[str, int]) -> None:
        """An iteration that could plan no prompt work for the held requests' gangs (a full
        batch, no free blocks, the budget spent): the held last tokens run now, as far as the
        budget and free blocks allow (never preempting for them)."""
        budget = self.config.max_num_batched_tokens - sum(plan.values())
        for request in self._held:
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING or request.request_id in plan:
                continue  # preempted later in this iteration
            if self.kv.allocate_slots(request, request.num_computed_tokens + 1) is None:
                continue
            plan[request.request_id] = 1
            self.queue_policy.on_planned(request, 1)
            budget -= 1

    def _cap_prefill(self, request: Request, num_new: int) -> int:
        """num_new, cut to the iteration's prefill allowance if it is a prefill chunk."""
        if self._prefill_allowance is None or self._is_decode(request, num_new):
            return num_new
        num_new = min(num_new, self._prefill_allowance)
        self._prefill_allowance -= num_new
        return num_new

    def _schedule_running(self, budget: int, plan: dict[str, int], preempted: list[str]) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            request.num_computed_tokens += self.kv.extend_computed(request)
            if self._waits_for_prefix(request):
                index += 1
                continue
            num_new = self._cap_prefill(request, min(request.num_pending_tokens, budget))
            num_new = self._hold_last_token(request, request.num_computed_tokens, num_new)
            if num_new == 0:
                index += 1  # a prefill past the iteration's prefill cap: it waits a turn
                continue
            if not self._allocate_or_preempt(request, num_new, preempted):
                break  # the request preempted itself: it was the newest
            plan[request.request_id] = num_new
            self.queue_policy.on_planned(request, num_new)
            self._note_prompt_work(request)
            budget -= num_new
            index += 1
        return budget

    def _schedule_drafts(self, budget: int, plan: dict[str, int]) -> int:
        """Give draft tokens to running decodes (the speculator's plan) from what is left of
        the budget; returns what is left then."""
        if budget <= 0:
            return budget
        decoding = [r for r in self.running
                    if plan.get(r.request_id) == 1 and self._is_decode(r, 1)]
        candidates = [self._candidate(r) for r in decoding
                      if r.output_token_ids]  # NOTE: drafts continue generated text
        candidates = [c for c in candidates if c.max_tokens > 0]
        if not candidates:
            return budget
        producing = sum(1 for r in self.running if r.request_id in plan
                        and r.num_computed_tokens + plan[r.request_id] == r.num_tokens)
        fit = self.decode_cost
        cost = fit if fit.per_token and fit.overhead > 0 else None  # else the planner's prior
        # NOTE: drafts are priced against the iteration's decodes only, as the decode cost
        # was fit: a prefill chunk beside them is work the iteration does anyway; counted
        # in, a large chunk made the step's tokens per second look low and every draft pay
        # (a 64-slot burst lost up to 5% in replays on a knee-shaped clock).
        proposed = self.speculator.plan(candidates, budget, len(decoding), producing, cost)
        for request_id, drafts in proposed.items():
            request = self.requests[request_id]
            drafts = self.filter_drafts(request, list(drafts))
            num = self._fit_drafts(request, min(len(drafts), budget))
            if num > 0:
                self._drafts[request_id] = list(drafts[:num])
                plan[request_id] += num
                budget -= num
        return budget

    @staticmethod
    def _is_decode(request: Request, num_new: int) -> bool:
        """Whether the request's next num_new tokens are a decode (`is_decode_step`)."""
        start = request.num_computed_tokens
        return is_decode_step(start, num_new, start + num_new == request.num_tokens)

    def _candidate(self, request: Request) -> Candidate:
        """A decoding request as the speculator sees it; max_tokens keeps the drafts and
        the token after them within max_tokens and the length cap."""
        left = min(request.sampling_params.max_tokens - len(request.output_token_ids),
                   request.max_total_tokens - request.num_tokens)
        return Candidate(request.request_id, request.prompt_token_ids,
                         request.output_token_ids,
                         min(left - 1, self.speculator.config.max_tokens))

    def _fit_drafts(self, request: Request, num: int) -> int:
        """The most drafts (<= num) whose positions get blocks now, taken (never preempting)."""
        while num > 0:
            if self.kv.allocate_slots(request, request.num_computed_tokens + 1 + num) is not None:
                return num
            num -= 1
        return 0

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> bool:
        """Find blocks for num_new more tokens, preempting the last running requests (the
        newest; under `priority` the lowest priority: running is in policy order)."""
        while self.kv.allocate_slots(request, request.num_computed_tokens + num_new) is None:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, budget: int, plan: dict[str, int], preempted: list[str],
                          now: float) -> None:
        needs_tokens = policy.admission_needs_tokens(self.config.policy)
        while self.waiting:
            if needs_tokens and (budget <= 0 or self._prefill_allowance == 0):
                break
            shares = self.load.shares()
            admissible = self._admissible_waiting(shares)
            if not admissible:
                break
            request = self.queue_policy.next_waiting(admissible, now)
            slots_full = len(self.running) >= self.config.max_num_seqs
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            waits = self.kv.next_block_in_flight(request, len(computed_blocks))
            num_new = 0 if waits else min(request.num_tokens - num_hit, max(budget, 0))
            num_new = self._cap_prefill(request, num_new)
            num_new = self._hold_last_token(request, num_hit, num_new)
            if slots_full or self.kv.allocate_slots(
                    request, num_hit + num_new, computed_blocks) is None:
                self._uncap_prefill(request, num_new)
                freed = self._preempt_for(request, num_hit + num_new, computed_blocks, plan,
                                          preempted, shares)
                if freed is None:
                    break  # nobody overtakes the policy's head of the queue
                budget += freed
                continue
            self._remove_waiting(request)
            request.num_computed_tokens = num_hit
            self._admit(request)
            self._note_prompt_work(request)  # NOTE: admitted: its gang progresses
            if num_new > 0:
                plan[request.request_id] = num_new
                self.queue_policy.on_planned(request, num_new)
                budget -= num_new

    def _admissible_waiting(self, shares: dict[str, int] | None):
        """The waiting requests the queue policy may pick from now: all, but those of the
        tenants the slot shares block (core/tenant_share.py)."""
        blocked = self.load.blocked(shares) if shares is not None else ()
        if not blocked:
            return self.waiting
        return [r for r in self.waiting if r.tenant not in blocked]

    def _uncap_prefill(self, request: Request, num_new: int) -> None:
        """Give back a chunk `_cap_prefill` counted but that was not scheduled."""
        if self._prefill_allowance is not None and (num_new > 1 or not request.output_token_ids):
            self._prefill_allowance += num_new

    def _remove_waiting(self, request: Request) -> None:
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:
            self.waiting.remove(request)
        self.load.move(request.tenant, waiting=-1)

    def _preempt_for(self, request: Request, num_total: int, computed_blocks: list[int],
                     plan: dict[str, int], preempted: list[str],
                     shares: dict[str, int] | None = None) -> int | None:
        """Preempt the first running request that may go for `request` (`_victims_for`).
        Returns the budget its plan held, or None if none may go, or if even all of them
        going would not make room for `request`'s num_total tokens (then preempting would
        be in vain)."""
        victims = self._victims_for(request, shares)
        if not victims or not self._room_without(victims, num_total, computed_blocks):
            return None
        victim = victims[0]
        freed = plan.pop(victim.request_id, 0)
        self._preempt(victim)
        preempted.append(victim.request_id)
        return freed

    def _victims_for(self, request: Request, shares: dict[str, int] | None) -> list[Request]:
        """Running requests that may be preempted for a waiting one, the first to go first.

        One tenant with work: the policy's (priority: strictly lower priority; others:
        none). Several: first the slot shares' (a tenant over its share gives up a slot to
        an entitled one; never under static admission, which does not change a batch), then
        the policy's within the request's own tenant only. NOTE: so priority never preempts
        across tenants but through the shares, and no two tenants preempt each other back
        and forth within one plan.
        """
        victims = self.queue_policy.victims_for(request, self.running)
        if shares is None:
            return victims
        own = [v for v in victims if v.tenant == request.tenant]
        if self.config.policy == Policy.STATIC:
            return own
        share = self.load.share_victims(request, self.running, shares)
        return share + [v for v in own if v not in share]

    def _room_without(self, victims: list[Request], num_total: int,
                      computed_blocks: list[int]) -> bool:
        """Whether a waiting request holding computed_blocks would find blocks for num_total
        tokens once the victims' blocks are free (a block frees when all its holders go)."""
        pool = self.kv.pool
        holders = Counter(b for v in victims for b in self.kv.block_tables[v.request_id])
        taken = self.kv.hit_blocks_to_hold(computed_blocks)  # NOTE: not those before its window
        hit = set(taken)
        freed = sum(1 for block, count in holders.items()
                    if count == pool.ref_count(block) and block not in hit)
        needed = self.kv.blocks_for(num_total) - len(computed_blocks)
        return needed <= pool.num_free - pool.num_free_among(taken) + freed

    def _waits_for_prefix(self, request: Request) -> bool:
        """Whether a running request, all of whose blocks are computed, should wait for its
        next block: another request is computing the same block now."""
        held = self.kv.num_table_blocks(request.request_id)
        return (request.num_computed_tokens == held * self.kv.block_size
                and self.kv.next_block_in_flight(request, held))

    def _admit(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.slot = heapq.heappop(self._free_slots)
        if request.times.scheduled is None:
            request.times.scheduled = self.clock()
        self.running.append(request)
        self.load.move(request.tenant, running=1)

    def _preempt(self, request: Request) -> None:
        """Take a running request's blocks back; it resumes later by recomputing."""
        self.running.remove(request)
        self._release_slot(request)
        self.kv.free(request.request_id)
        self._ready_marks.pop(request.request_id, None)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.load.move(request.tenant, running=-1, waiting=1)
        self.num_preemptions += 1

    def _release_slot(self, request: Request) -> None:
        if request.slot is not None:
            heapq.heappush(self._free_slots, request.slot)
            request.slot = None

    def _build_output(self, plan: dict[str, int], preempted: list[str]) -> SchedulerOutput:
        seqs: list[ScheduledSeq] = []  # NOTE: in running order
        slots: list[SlotState | None] = [None] * self.config.max_num_seqs
        for request in self.running:  # one pass: every step, for every running sequence
            request_id = request.request_id
            num = plan.get(request_id, 0)
            kind = "stalled"
            if request_id in plan:
                seqs.append(self._scheduled_seq(request, num))
                kind = seqs[-1].kind
            slots[request.slot] = SlotState(request_id, kind, num,
                                            proposed=len(self._drafts.get(request_id, ())))
        output = SchedulerOutput(
            iteration=self.iteration, seqs=seqs, slots=slots, preempted=preempted,
            num_waiting=len(self.waiting), kv_blocks_used=self.kv.pool.num_used)
        self.iteration += 1
        return output

    def _scheduled_seq(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        drafts = self._drafts.get(request.request_id, [])
        num_known = num_new - len(drafts)  # NOTE: drafts follow the request's last token
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.token_ids_between(start, start + num_known) + drafts,
            start_pos=start,
            block_table=self.kv.block_table(request.request_id),
            sample=start + num_known == request.num_tokens,
            sampling_params=request.sampling_params,
            num_output_tokens=len(request.output_token_ids),
            kind=SlotKind.DECODE if self._is_decode(request, num_known) else SlotKind.PREFILL,
            spec_token_ids=list(drafts),
        )

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply an iteration's result: advance progress, append tokens, finish requests.

        Returns the requests that got a token or finished in this iteration. Finished ones
        have left the batch and their blocks are free when this returns.
        """
        now = self.clock()
        if self._scheduled_at is not None and output.seqs:
            self.cost.observe(output.num_batched_tokens, now - self._scheduled_at)
            if self.speculator is not None and all(s.is_decode for s in output.seqs):
                self.decode_cost.observe(output.num_batched_tokens, now - self._scheduled_at,
                                         drafted=any(s.spec_token_ids for s in output.seqs))
        self._scheduled_at = None
        self.last_extra_tokens = 0
        touched: list[Request] = []
        for seq in output.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the forward ran
            if seq.spec_token_ids:
                self._apply_verified(output, seq, request, result, now)
                touched.append(request)
                continue
            self.queue_policy.on_processed(request, seq.start_pos, seq.num_tokens, seq.sample)
            request.num_computed_tokens += seq.num_tokens
            self.kv.on_computed(request)
            if not seq.sample:
                continue
            request.append_token(result.sampled[seq.request_id], now)
            if seq.request_id in result.logprobs:
                request.output_logprobs.append(result.logprobs[seq.request_id])
            touched.append(request)
            status = request.check_stop()
            if status is not None:
                self.finish_request(request.request_id, status)
        if self.config.slo_reject:
            touched += self._reject_hopeless(now)
        return touched

    def _apply_verified(self, output: SchedulerOutput, seq: ScheduledSeq, request: Request,
                        result: RunnerOutput, now: float) -> None:
        """A drafted decode's result: the accepted drafts and the token after them, each
        checked for a stop as if it came alone (what follows a stop is dropped).

        NOTE: num_computed_tokens counts the last token and the accepted drafts (their K/V
        are right); the rejected drafts' positions are not computed, and the blocks only
        they needed go back. Blocks are hashed only up to accepted tokens.
        """
        drafts = seq.spec_token_ids
        accepted = list(result.accepted.get(seq.request_id, []))
        if accepted != drafts[:len(accepted)]:
            raise RuntimeError(f"{seq.request_id}: accepted tokens that were not its drafts")
        tokens = [*accepted, result.sampled[seq.request_id]]
        logprobs = [*result.accepted_logprobs.get(seq.request_id, [None] * len(accepted)),
                    result.logprobs.get(seq.request_id)]
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"{seq.request_id}: {len(logprobs)} logprobs for "
                               f"{len(tokens)} tokens")
        status = None
        appended = 0
        for token, logprob in zip(tokens, logprobs):
            request.append_token(token, now)
            if logprob is not None:
                request.output_logprobs.append(logprob)
            appended += 1
            self.queue_policy.on_processed(request, seq.start_pos + appended - 1,
                                           int(appended == 1), True)
            status = request.check_stop()
            if status is not None:
                break
        self.last_extra_tokens += appended - 1
        if self.speculator is not None:
            self.speculator.observe(seq.request_id, len(drafts), len(accepted))
        slot = output.slots[request.slot] if request.slot is not None else None
        if slot is not None and slot.request_id == request.request_id:
            slot.accepted = len(accepted)
        request.num_computed_tokens = min(seq.start_pos + 1 + len(accepted), request.num_tokens)
        self.kv.on_computed(request)
        if status is not None:
            self.finish_request(request.request_id, status)
        else:
            self.kv.trim(request, request.num_computed_tokens)

    def _reject_hopeless(self, now: float) -> list[Request]:
        """Finish (FINISHED_REJECTED) the waiting requests that can no longer meet their
        TTFT deadline (`deadline` with slo_reject): the engine returns them as finished."""
        rejected = []
        for request in [r for r in self.waiting if self.queue_policy.should_reject(r, now)]:
            self.finish_request(request.request_id, RequestStatus.FINISHED_REJECTED)
            request.error = (f"slo: the first token cannot come within slo_ttft_ms="
                             f"{request.slo_ttft_ms:g} of arrival")
            rejected.append(request)
        return rejected

    def fail_requests(self, request_ids: list[str], message: str) -> list[Request]:
        """End these requests with an error result (an iteration that raised)."""
        failed = []
        for request_id in request_ids:
            request = self.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            if request is not None:
                request.error = message
                failed.append(request)
        return failed

    def planner_state(self) -> dict | None:
        """What "auto" speculation has learnt (JSON-able; None when speculation is off): the
        decode step's cost and the engine's pooled acceptance. A trace records it where it
        starts, so a replay of the trace plans drafts as the engine did then."""
        if self.speculator is None:
            return None
        return {"decode_cost": self.decode_cost.state(),
                "pooled_acceptance": self.speculator.pooled.state(),
                "dry_iterations": self.speculator.dry_iterations}

    def restore_planner_state(self, state: dict) -> None:
        """Start planning from a `planner_state()` (no-op when speculation is off);
        ValueError naming what is malformed (then nothing changed)."""
        if self.speculator is None:
            return
        for name in ("decode_cost", "pooled_acceptance"):
            if not isinstance(state, dict) or not isinstance(state.get(name), dict):
                raise ValueError(f"planner_state.{name} must be an object")
        cost, pooled = DecodeStepCost(), PooledAcceptance()
        cost.restore(state.get("decode_cost"))
        pooled.restore(state.get("pooled_acceptance"))
        dry = count_of(state, "dry_iterations")
        self.decode_cost, self.speculator.pooled = cost, pooled
        self.speculator.dry_iterations = dry

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
            held = self.kv.num_table_blocks(request.request_id)
            # NOTE: with the KV manager's own check, this proves shared blocks are never
            # written: the next write is at num_computed_tokens, past every cached block.
            cached = self.kv.num_cached_blocks(request.request_id)
            assert cached * size <= request.num_computed_tokens <= held * size, (
                f"{request.request_id}: {request.num_computed_tokens} computed, "
                f"{cached} cached and {held} held blocks")
            # NOTE: and no query reads a freed block: they end before the next one's window.
            freed = self.kv.num_freed_blocks(request.request_id)
            assert freed == 0 or freed * size <= (
                request.num_computed_tokens - self.kv.sliding_window + 1), (
                f"{request.request_id}: {freed} blocks freed at "
                f"{request.num_computed_tokens} computed")
        assert set(self._arrival_of) == set(self.requests), "arrival numbers"
        assert set(self._ready_marks) <= set(self.requests), "a finished request's mark"
        if not self.requests:
            assert self.kv.num_free_blocks == self.kv.num_blocks, "idle, but blocks are held"
        active: dict[str, int] = {}
        for request in self.requests.values():
            active[request.tenant] = active.get(request.tenant, 0) + 1
        tenants = self.queue_policy.tenants
        assert all(tenants[t].active == active.get(t, 0) for t in tenants), "tenant counts"
        assert set(active) <= set(tenants), "a request of an unknown tenant"
        assert self.load.running == Counter(r.tenant for r in self.running), "running load"
        assert self.load.waiting == Counter(r.tenant for r in self.waiting), "waiting load"

