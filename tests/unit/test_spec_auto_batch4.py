""""auto" at grounded batch 4 (issue 35: >= 1.5x off; auto was at or below a fixed 4 drafts).

Measured in process (SmolLM2-135M, bf16, Zen 4 EPYC family 25, 2 cores): a decode step of
n rows took `MEASURED` ms: the weights are read once up to ~12 rows, past them every row
costs ~0.95 ms. Three rules the planner got wrong there, each tested here:
- the scheduler's line through those steps (7.0 ms + 0.82 ms a row) priced a 4-row
  step's first drafts at 0.82 ms a row (0.3 measured): `DecodeStepCost` fits a knee;
- a sequence 40 drafts into its first span rated itself 0.998 (its record cannot show the
  span's end until it comes): `span_prior_weight`;
- the walk over draft increments stopped at the first that did not pay, though one more
  draft for each of the four did: `lookahead_window`;
and one seen in a benchmark run at batch 1: a cost that prices drafts too dear never sees
a draft and never learns: `Speculator._auto_wanted`'s exploration.
"""

from __future__ import annotations

import math

import pytest

from slotserve.config import SchedulerConfig
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.scheduler import Scheduler
from slotserve.request import Request
from slotserve.sampling import SamplingParams
from slotserve.spec.config import AUTO_MAX_SPECULATIVE_TOKENS, parse
from slotserve.spec.planner import (
    MIN_PLAN_GAIN,
    AcceptanceStats,
    Candidate,
    DecodeStepCost,
    Speculator,
    expected_tokens,
)
from tests.unit.test_spec_auto_cost import _Proposer, drafts_after
from tests.unit.test_spec_proposers import FixedProposer

AUTO = parse({"method": "ngram", "num_speculative_tokens": "auto"})
# Decode steps of grounded batch 4 by rows (median ms over the in-process probe's runs).
MEASURED = {1: 9.23, 2: 10.26, 4: 10.61, 7: 11.69, 10: 12.8, 12: 13.17, 16: 16.51,
            20: 20.88, 32: 30.77, 64: 60.81}


class Measured:
    """The measured step cost (seconds), linear between the measured row counts and past
    the last two."""

    verify_extra = 0.0

    def seconds(self, num_tokens: int) -> float:
        rows = sorted(MEASURED)
        low = max([r for r in rows if r <= num_tokens] or rows[:1])
        high = min([r for r in rows if r > low] or rows[-1:])
        if high == low:
            low, high = rows[-2], rows[-1]
        slope = (MEASURED[high] - MEASURED[low]) / (high - low)
        return (MEASURED[low] + slope * (num_tokens - low)) / 1000


def _fitted() -> DecodeStepCost:
    """A DecodeStepCost that saw 120 steps at the measured row counts, +-3% each (a
    deterministic jitter), as a batch-4 run with drafts shows them."""
    cost, rows = DecodeStepCost(), sorted(MEASURED)
    for step in range(120):
        n = rows[(step * 7) % len(rows)]
        cost.observe(n, MEASURED[n] / 1000 * (1 + 0.03 * math.sin(step)))
    return cost


def test_the_decode_cost_finds_the_knee():
    """Its estimates are within 10% of the measured steps over 4-64 rows, and a 4-row step's
    first 8 drafts cost what they cost (2.6 ms; the line: 6.6 ms)."""
    cost = _fitted()
    for rows in (4, 12, 20, 32, 64):
        assert abs(cost.seconds(rows) / Measured().seconds(rows) - 1) < 0.10, rows
    assert abs((cost.seconds(12) - cost.seconds(4)) * 1000 - 2.56) < 1.0
    # past the knee, ~0.93 ms a row measured (20 -> 64 rows)
    assert abs((cost.seconds(64) - cost.seconds(20)) / 44 * 1000 - 0.91) < 0.15


def _speculator(cost) -> Speculator:
    return Speculator(AUTO, proposer=FixedProposer(list(range(100))), step_cost=cost)


def _candidates(count: int) -> list[Candidate]:
    return [Candidate(f"s{i}", [1, 2], [3], AUTO_MAX_SPECULATIVE_TOKENS) for i in range(count)]


def test_fresh_guesses_at_batch_4_draft_where_rows_are_cheap_not_in_a_full_batch():
    """Four sequences guessing at ~0.33 (after a span ended): below the knee a draft costs
    each of them ~3% of the step, so a first draft each pays (the line: 8% each, none). A
    full batch of 64 copying at ~0.97 drafts nothing: past the knee a row costs 1.5% of
    the step for each of the 64."""
    spec = _speculator(_fitted())
    for i in range(4):
        spec.stats[f"s{i}"] = AcceptanceStats(accepted=3, rejections=7)
    assert 0.3 < spec.rate("s0") < 0.36
    drafts = spec.plan(_candidates(4), 512, 4, 4)
    assert sorted(len(d) for d in drafts.values()) == [1, 1, 1, 1], drafts
    for i in range(64):
        spec.stats[f"s{i}"] = AcceptanceStats(span_accepted=60, span_rejections=2,
                                              in_span=True)
    assert spec.plan(_candidates(64), 2048, 64, 64) == {}


def test_a_first_span_does_not_rule_its_rate():
    """The engine's spans ended after ~27 drafts (pooled ~0.96); a sequence 40 drafts into
    its first span (no rejection yet: it comes when the span ends) stays near that, not at
    0.998 (16 drafts for 16.7 expected tokens, where ~11 was the engine's record)."""
    spec = _speculator(Measured())
    for seq_id in ("a", "b", "c"):
        for verification in [(4, 4), (8, 8), (8, 8), (8, 8), (8, 3)]:
            spec.observe(seq_id, *verification)
        spec.finish(seq_id, [3], completed=True)
    assert 0.94 < spec.pooled.rate("span") < 0.97
    for verification in [(4, 4), (16, 16), (16, 16), (8, 8)]:
        spec.observe("s", *verification)
    assert spec.stats["s"].in_span
    assert 0.96 < spec.rate("s") < 0.99
    assert expected_tokens(spec.rate("s"), 16) < 15.5  # 16.7 at 0.998


def _objective(spec: Speculator, plan: dict[str, int], seq_ids, cost, planned: int) -> float:
    """The planner's objective: the sum over the sequences of log(expected tokens / step
    seconds)."""
    rows = planned + sum(plan.values())
    return sum(math.log(expected_tokens(spec.rate(s), plan.get(s, 0)) / cost.seconds(rows))
               for s in seq_ids)


@pytest.mark.parametrize("count, span_accepted, span_rejections",
                         [(4, 20, 2), (6, 50, 2), (8, 100, 1)])
def test_one_more_draft_for_each_is_found(count, span_accepted, span_rejections):
    """Sequences copying (at ~0.88, 0.94, 0.98 for 4, 6, 8 of them) on the measured cost:
    past some plan one more draft for one sequence does not pay (it slows all of them),
    one more for each does: the walk that stopped at the first increment that did not pay
    planned 2, 1-2 and 1 each; now the plan is at least as good as the best equal plan."""
    cost = Measured()
    spec = _speculator(cost)
    seq_ids = [f"s{i}" for i in range(count)]
    for s in seq_ids:
        spec.stats[s] = AcceptanceStats(span_accepted=span_accepted,
                                        span_rejections=span_rejections, in_span=True)
    drafts = spec.plan(_candidates(count), 512, count, count)
    plan = {s: len(d) for s, d in drafts.items()}
    best_equal = max(_objective(spec, dict.fromkeys(seq_ids, k), seq_ids, cost, count)
                     for k in range(AUTO_MAX_SPECULATIVE_TOKENS + 1))
    assert _objective(spec, plan, seq_ids, cost, count) >= best_equal - 1e-9, plan


class _Clock:
    """The scheduler's clock: a decode step of n rows takes 8 ms + 0.3 ms x n."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def run(self, rows: int) -> None:
        self.now += 0.008 + 0.0003 * rows


def test_a_cost_that_prices_drafts_too_dear_learns_from_an_exploration():
    """A warm-up's few slow steps of 2 sequences (13 ms against 8 ms for 1) leave a line that
    prices a batch-1 draft at 5 ms (it costs 0.3): no draft pays on it, so none is planned
    and the line never learns (a benchmark run drafted nothing for ~430 iterations). After
    EXPLORE_AFTER dry iterations one draft is planned on the prior; the steps it shows
    bring the price down and the drafts back."""
    clock = _Clock()
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                             max_prefill_tokens_while_decoding=None)
    speculator = Speculator(AUTO, proposer=_Proposer(0.9, 3))
    sched = Scheduler(config, KVCacheManager(1024, 16), clock=clock, speculator=speculator)
    for step in range(40):
        sched.decode_cost.observe(1 if step % 5 else 2, 0.008 if step % 5 else 0.013)
    assert sched.decode_cost.seconds(2) / sched.decode_cost.seconds(1) > 1.5
    sched.add_request(Request("r", [3, 4, 5, 6],
                              SamplingParams(max_tokens=1500, temperature=0.0,
                                             ignore_eos=True)))
    late_drafts = drafts_after(sched, clock, steps=80, start=40)
    assert late_drafts >= 100, late_drafts  # ~10 a step once learnt
    assert speculator.explorations >= 1


class _HalfProposer:
    """Drafts for the even-numbered sequences only (the others' n-grams found nothing)."""

    def propose(self, seq_id, prompt_ids, output_ids, max_tokens):
        return list(range(max_tokens)) if int(seq_id[1:]) % 2 == 0 else []

    def finish(self, seq_id, output_ids):
        pass

    def forget(self, seq_id):
        pass


def test_a_plan_that_pays_only_whole_is_not_cut_by_the_proposer():
    """16 sequences copying at ~0.93 on the measured cost: one draft each pays as a whole
    (16 x log1p(0.93) against 16 x log(cost(32) / cost(16))), but the proposer has drafts
    for 8 of them, and 8 drafts in a 24-row step do not pay: nothing is planned (it
    planned the 16, and verified the 8 it got)."""
    cost = Measured()
    spec = Speculator(AUTO, proposer=_HalfProposer(), step_cost=cost)
    seq_ids = [f"s{i}" for i in range(16)]
    for s in seq_ids:
        spec.stats[s] = AcceptanceStats(span_accepted=60, span_rejections=3, in_span=True)
    assert 0.93 < spec.rate("s0") < 0.94
    every = dict.fromkeys(seq_ids, 1)
    half = {s: 1 for s in seq_ids[::2]}
    assert (_objective(spec, every, seq_ids, cost, 16) > _objective(spec, {}, seq_ids, cost, 16)
            > _objective(spec, half, seq_ids, cost, 16))
    assert spec.plan(_candidates(16), 512, 16, 16) == {}
    # with drafts for every sequence, the whole plan is taken (the spans were ended by
    # the iteration without drafts: set again)
    spec.proposer = FixedProposer(list(range(100)))
    for s in seq_ids:
        spec.stats[s] = AcceptanceStats(span_accepted=60, span_rejections=3, in_span=True)
    assert len(spec.plan(_candidates(16), 512, 16, 16)) == 16


def test_a_plan_within_the_estimates_error_is_not_taken():
    """16 sequences copying at ~0.875 on the measured cost: one draft each raises the mean
    log rate by 0.6% (log1p(0.875) against log(cost(32) / cost(16)) = 0.623), within the
    estimates' error (grounded 16 measured such plans at tok/s 0.99x, TPOT p99 1.03x):
    nothing is planned (before MIN_PLAN_GAIN: 16 drafts). At ~0.94 (3.9%) they are."""
    cost = Measured()
    spec = _speculator(cost)
    seq_ids = [f"s{i}" for i in range(16)]

    def in_span(accepted: int) -> None:
        for s in seq_ids:
            spec.stats[s] = AcceptanceStats(span_accepted=accepted, span_rejections=2,
                                            in_span=True)

    in_span(20)
    assert 0.87 < spec.rate("s0") < 0.88
    every = dict.fromkeys(seq_ids, 1)
    gain = (_objective(spec, every, seq_ids, cost, 16)
            - _objective(spec, {}, seq_ids, cost, 16)) / 16
    assert 0 < gain < MIN_PLAN_GAIN
    assert spec.plan(_candidates(16), 512, 16, 16) == {}
    in_span(45)
    assert 0.93 < spec.rate("s0") < 0.95
    assert len(spec.plan(_candidates(16), 512, 16, 16)) == 16
