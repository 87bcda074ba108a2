"""`Speculator`: how many draft tokens each running decode verifies this iteration (no torch).

The scheduler calls `plan` once per iteration, after the running requests got their decode
tokens and prefill chunks and before waiting requests are admitted, so draft tokens draw on
what is left of the token budget then. A drafted sequence is verified as a chunk of k + 1
tokens (its last sampled token and the k drafts), with logits at each of them.

How many:
- fixed (`num_speculative_tokens` an integer): that many, fewer when the proposer has fewer,
  the sequence's max_tokens or length cap is closer, or the budget is short;
- "auto": the plan that maximises the geometric mean of the producing sequences' expected
  token rates (at batch 1: expected tokens per second). A sequence whose drafts are each
  accepted with probability a (given the ones before were: its observed rate in its
  present state, see `AcceptanceStats`) gains a^j expected tokens from its j-th draft; the
  iteration costs `cost.seconds(tokens)`. Draft increments are taken in order of gain
  (log1p(a^j / the sequence's expected tokens so far)) while they raise the sum over the B
  producing sequences of log(expected tokens / step seconds). It is zero when the batch is
  large: a sequence's first draft pays only while log1p(a) > B x log1p(per_token /
  seconds); B x per_token / seconds nears 1 as decodes fill the step, and past log 2 no
  draft pays.

NOTE: the proposer is only asked for the sequences that get drafts, so a large batch costs
no proposal work.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from slotserve.core.queue_policy import CostModel
from slotserve.spec.config import SpeculativeConfig
from slotserve.spec.proposers import NgramProposer, Proposer, SuffixProposer

# A sequence's acceptance prior in each state: PRIOR_WEIGHT drafts at the engine's pooled
# rate of that state (`PooledAcceptance`; Beta(1, 1), i.e. 0.5, before it has seen any).
PRIOR_WEIGHT = 2.0
# The pooled record forgets a verification's weight by this factor at each new one (a memory
# of ~1/(1 - f) verifications: it follows a change of workload).
POOL_FORGET = 0.99
# The default step cost until the scheduler's own fit knows a fixed cost per step: an
# iteration costs as much as DEFAULT_OVERHEAD_TOKENS tokens' work besides its tokens (reading
# the weights; a small model on a CPU measured 20-60; a GPU is in the hundreds).
DEFAULT_OVERHEAD_TOKENS = 32.0
# `DecodeStepCost`: an iteration slower than STALL_FACTOR x the line's estimate is a stall,
# not its tokens' cost; after MAX_STALLS such iterations in a row the host's speed changed
# and they count again.
STALL_FACTOR = 3.0
MAX_STALLS = 3


class StepCost(Protocol):
    """The estimated seconds (or any unit) of an iteration of num_tokens batched tokens."""

    def seconds(self, num_tokens: int) -> float: ...


class LinearStepCost:
    """overhead + per_token x n (the default: DEFAULT_OVERHEAD_TOKENS tokens of overhead)."""

    def __init__(self, overhead: float = DEFAULT_OVERHEAD_TOKENS, per_token: float = 1.0
                 ) -> None:
        self.overhead = overhead
        self.per_token = per_token

    def seconds(self, num_tokens: int) -> float:
        return self.overhead + self.per_token * num_tokens


class DecodeStepCost(CostModel):
    """The scheduler's cost of an iteration of decodes and their drafts, for "auto": the
    recency-weighted line of `CostModel` over the iterations it observes, deaf to stalls.

    NOTE: a pause of the whole process (~330 ms ones in the in-process benchmark's traces,
    against 15 ms steps; a garbage collection; the host taking the core) is no cost of the
    step's tokens, but one such point at a small batch tilts a least-squares line: after one in
    workload W's tail the line turned proportional (no fixed cost: the planner fell back to
    its prior and drafted at 23 sequences), then all fixed cost (drafts looked free), and
    auto drafted where each draft row cost ~0.4 ms for ~0.5 tokens. An iteration slower than
    STALL_FACTOR x the estimate is left out, unless MAX_STALLS come in a row (then the host
    is slower now, and the line follows it).
    """

    def __init__(self, forget: float = 0.98) -> None:
        super().__init__(forget)
        self.stalls_skipped = 0  # observations left out as stalls, since start
        self._slow_in_a_row = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or not seconds >= 0:
            return
        estimate = self.seconds(num_tokens)
        if not (estimate > 0 and seconds > STALL_FACTOR * estimate):
            self._slow_in_a_row = 0
        else:
            # NOTE: the first MAX_STALLS slow iterations in a row are stalls; from the next
            # one on (until one is not slow) the host is slower, and they count.
            self._slow_in_a_row += 1
            if self._slow_in_a_row <= MAX_STALLS:
                self.stalls_skipped += 1
                return
        super().observe(num_tokens, seconds)


FIRST, FRESH, SPAN = "first", "fresh", "span"  # the states of `AcceptanceStats`


@dataclass
class AcceptanceStats:
    """One sequence's record, in three states: its `first` verification (a guess before
    anything is known of it: the engine's pooled rate alone), `fresh` ones (accepted,
    rejections: after a verification that rejected a draft, or an iteration without
    drafts) and those `in_span` (span_accepted, span_rejections: right after a verification
    that accepted every draft, i.e. the sequence is copying a span its proposer follows).

    NOTE: a verification of k drafts that accepts a of them is a successes and, if a < k,
    one failure of a geometric law, so `rate_given` estimates the probability that a draft
    is accepted given that the ones before it were. The states differ several-fold on text
    that copies its input (SmolLM2, the benchmark's grounded prompts: a draft right after a
    fully accepted verification is right ~98% of the time; a first guess at the start of an
    answer that quotes its input nearly as often; a guess after a span ended rarely): one
    record mixing them drafted 8-16 tokens into every guess after a span ended, each such
    verification 2-3x a decode step's time for nothing.
    """

    accepted: int = 0
    rejections: int = 0
    span_accepted: int = 0
    span_rejections: int = 0
    in_span: bool = False
    verifications: int = 0

    @property
    def state(self) -> str:
        """FIRST, FRESH or SPAN: the state the sequence's next drafts are planned in."""
        if self.in_span:
            return SPAN
        if self.verifications == 0 and self.accepted == 0 and self.rejections == 0:
            return FIRST
        return FRESH

    def record(self, verification: tuple[int, int], state: str) -> None:
        """Count a verification (drafts, accepted) planned in `state` (a first one only in
        the pool: the sequence's own record of fresh guesses starts after it)."""
        drafts, accepted = verification
        rejected = int(accepted < drafts)
        self.verifications += 1
        if state == SPAN:
            self.span_accepted += accepted
            self.span_rejections += rejected
        elif state == FRESH:
            self.accepted += accepted
            self.rejections += rejected

    def rate_given(self, prior: float) -> float:
        """The present state's acceptance: its record and PRIOR_WEIGHT drafts at `prior`."""
        state = self.state
        accepted, rejections = ((self.span_accepted, self.span_rejections) if state == SPAN
                                else (self.accepted, self.rejections) if state == FRESH
                                else (0, 0))
        return ((accepted + PRIOR_WEIGHT * prior)
                / (accepted + rejections + PRIOR_WEIGHT))


class PooledAcceptance:
    """Every sequence's verifications in each state (FIRST, FRESH, SPAN), each one's weight
    fading by POOL_FORGET per verification since: the prior of a sequence that has shown
    little (`rate`, with a Beta(1, 1) of its own)."""

    def __init__(self) -> None:
        self._counts = {state: [0.0, 0.0] for state in (FIRST, FRESH, SPAN)}

    def observe(self, num_drafts: int, num_accepted: int, state: str) -> None:
        for counts in self._counts.values():
            counts[0] *= POOL_FORGET
            counts[1] *= POOL_FORGET
        counts = self._counts[state]  # accepted, rejections
        counts[0] += num_accepted
        counts[1] += int(num_accepted < num_drafts)

    def rate(self, state: str) -> float:
        accepted, rejections = self._counts[state]
        return (accepted + 1.0) / (accepted + rejections + 2.0)


@dataclass(frozen=True)
class Candidate:
    """A running sequence that decodes this iteration and may speculate.

    max_tokens: most drafts it may take (its output and length caps, the config's bound).
    """

    seq_id: str
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    max_tokens: int


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixProposer(config.suffix_decoding_max_tree_depth,
                          config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_max_spec_factor,
                          config.suffix_decoding_min_token_prob)


class Speculator:
    """The speculation state of one engine: the proposer, each sequence's acceptance, totals.

    proposer: default: the config's method. step_cost: the cost model "auto" plans with;
    None: the scheduler passes its own (or `LinearStepCost()` while that knows too little).
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None,
                 step_cost: StepCost | None = None) -> None:
        self.config = config
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.step_cost = step_cost
        self.stats: dict[str, AcceptanceStats] = {}
        self.pooled = PooledAcceptance()
        self.num_drafts = 0  # verifications (sequences that had drafts), as vLLM counts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.max_tokens

    # ----------------------------------------------------------------- planning
    def plan(self, candidates: list[Candidate], budget: int, planned_tokens: int,
             producing: int, cost: StepCost | None = None) -> dict[str, list[int]]:
        """Draft tokens per sequence id (only those with some), within `budget` tokens.

        planned_tokens: tokens of the step the drafts are priced against (the scheduler
        passes its decodes': a prefill chunk beside them is work done anyway); producing:
        sequences that will sample a token in it (decodes and last prefill chunks); cost:
        the scheduler's step cost model (used when this speculator has none of its own).
        """
        if budget <= 0 or not candidates:
            return {}
        if self.config.auto:
            wanted = self._auto_lengths(candidates, budget, planned_tokens, producing,
                                        self.step_cost or cost or LinearStepCost())
        else:
            wanted = {c.seq_id: min(c.max_tokens, self.config.max_tokens) for c in candidates}
        drafts: dict[str, list[int]] = {}
        for cand in candidates:
            k = min(wanted.get(cand.seq_id, 0), budget)
            if k <= 0:
                continue
            tokens = self.proposer.propose(cand.seq_id, cand.prompt_ids, cand.output_ids, k)
            if tokens:
                drafts[cand.seq_id] = tokens[:k]
                budget -= len(drafts[cand.seq_id])
        self._end_spans(candidates, drafts)
        return drafts

    def _end_spans(self, candidates: list[Candidate], drafts: dict[str, list[int]]) -> None:
        """A decoding sequence without drafts this iteration is no longer in a span: it
        decodes a token of its own, so its next drafts are a fresh guess."""
        for cand in candidates:
            stats = self.stats.get(cand.seq_id)
            if stats is not None and stats.in_span and cand.seq_id not in drafts:
                stats.in_span = False

    def _auto_lengths(self, candidates: list[Candidate], budget: int, planned_tokens: int,
                      producing: int, cost: StepCost) -> dict[str, int]:
        """Each sequence's draft count maximising the sum over the step's producing
        sequences of log(the sequence's expected tokens / step cost), i.e. the geometric
        mean of their token rates: increments taken best gain first (a sequence's j-th draft
        raises its log tokens by log1p(rate^j / its expected tokens so far); ties in
        candidate order) while they raise the sum.

        NOTE: why not the sum of tokens over the step cost (the rule until 2026-12-05): a
        draft row slows every sequence in the step, and that rule charged it to the step's
        total, so sequences in a span took all the drafts: at batch 4 of the grounded
        prompts two copying sequences drafted 16 each (36-row steps of ~39 ms against
        9.4 ms decodes) while the other two, not yet copying, got none and ran at a quarter
        of their speed, and the run ended on their tail (auto 0.87x of fixed length 4).
        With one producing sequence the two rules are the same. A heap holds each
        sequence's next increment only, so an iteration whose best draft does not pay (a
        full batch: the usual case at 64 slots) costs one look at each sequence's rate.
        """
        heap = []
        for index, cand in enumerate(candidates):
            rate, limit = self.rate(cand.seq_id), min(cand.max_tokens, self.config.max_tokens)
            if limit > 0:
                heap.append((-math.log1p(rate), index, 1, rate, limit, 1.0))
        heapq.heapify(heap)
        tokens = max(planned_tokens, 1)
        weight = float(max(producing, 1))  # NOTE: each producing sequence feels the step
        seconds = cost.seconds(tokens)
        wanted: dict[str, int] = {}
        while heap and budget > 0:
            negative_gain, index, j, rate, limit, produced = heapq.heappop(heap)
            more = cost.seconds(tokens + 1)
            if not (seconds > 0 and more > 0
                    and -negative_gain > weight * math.log(more / seconds)):
                break  # NOTE: gains only fall from here, so no later increment pays
            tokens, seconds = tokens + 1, more
            produced += rate ** j
            seq_id = candidates[index].seq_id
            wanted[seq_id] = wanted.get(seq_id, 0) + 1
            budget -= 1
            if j < limit:
                gain = math.log1p(rate ** (j + 1) / produced)
                heapq.heappush(heap, (-gain, index, j + 1, rate, limit, produced))
        return wanted

    def rate(self, seq_id: str) -> float:
        """A sequence's per-draft acceptance in its present state (first, fresh or in a
        span): its own record, the pooled rate of that state as the prior."""
        stats = self.stats.get(seq_id)
        own = stats if stats is not None else AcceptanceStats()
        return own.rate_given(self.pooled.rate(own.state))

    # ----------------------------------------------------------------- outcomes
    def observe(self, seq_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of num_drafts drafts accepted the first num_accepted."""
        if num_drafts <= 0:
            return
        stats = self.stats.setdefault(seq_id, AcceptanceStats())
        state = stats.state
        stats.record((num_drafts, num_accepted), state)
        self.pooled.observe(num_drafts, num_accepted, state)
        # NOTE: the state of the next drafts: in a span while every draft was accepted
        stats.in_span = num_accepted == num_drafts
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(min(num_accepted, len(self.accepted_per_position))):
            self.accepted_per_position[position] += 1

    def finish(self, seq_id: str, output_ids: Sequence[int], completed: bool) -> None:
        """The sequence left; completed (stop or length): its output may serve others."""
        self.stats.pop(seq_id, None)
        if completed:
            self.proposer.finish(seq_id, output_ids)
        else:
            self.proposer.forget(seq_id)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens since start (0.0 before any)."""
        return (self.num_accepted_tokens / self.num_draft_tokens
                if self.num_draft_tokens else 0.0)


def expected_tokens(rate: float, k: int) -> float:
    """Expected tokens of a verification of k drafts at per-draft acceptance `rate` (the
    accepted drafts plus the one token sampled after them)."""
    if k <= 0:
        return 1.0
    if math.isclose(rate, 1.0):
        return k + 1.0
    return (1 - rate ** (k + 1)) / (1 - rate)
