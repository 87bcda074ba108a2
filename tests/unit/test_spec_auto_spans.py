""""auto" speculation on text that copies spans of its input (issue 35): a draft right after
a verification that accepted every draft continues a span and is nearly always right; a
fresh guess (the first, or after a rejection) is right far less often. The planner keeps
the two apart per sequence (`AcceptanceStats`), takes a new sequence's prior from what the
engine's sequences showed in each state (`PooledAcceptance`), and drafts up to
AUTO_MAX_SPECULATIVE_TOKENS in a span where the step cost says they pay."""

from __future__ import annotations

from slotserve.spec.config import AUTO_MAX_SPECULATIVE_TOKENS, parse
from slotserve.spec.planner import AcceptanceStats, Candidate, LinearStepCost, Speculator
from tests.unit.test_spec_proposers import FixedProposer

AUTO = parse({"method": "ngram", "num_speculative_tokens": "auto"})
# A batch-1 step on the 2-core Zen 4 host while loaded (ms): 16 a step, 2.5 a row.
STEP = LinearStepCost(overhead=16.0, per_token=2.5)
# SmolLM2 on the benchmark's code-edit prompt (its trace): a first guess accepted, a span
# copied, then fresh guesses that the model did not follow.
SPAN_THEN_GUESSES = [(1, 1), (2, 2), (5, 5), (8, 8), (8, 5), (8, 0), (8, 2), (8, 0)]


def _speculator() -> Speculator:
    return Speculator(AUTO, proposer=FixedProposer(list(range(100))), step_cost=STEP)


def _plan_one(spec: Speculator, seq_id: str) -> int:
    """Drafts planned for `seq_id` alone at batch 1."""
    cands = [Candidate(seq_id, [1, 2], [3], AUTO_MAX_SPECULATIVE_TOKENS)]
    return len(spec.plan(cands, budget=512, planned_tokens=1, producing=1).get(seq_id, ()))


def test_a_fresh_guess_after_a_span_gets_few_drafts():
    """One record over both states put this sequence at 0.83 and drafted 8 into each guess
    (each such step ~2.2x a decode's time at these costs); its guesses alone show ~0.5."""
    spec = _speculator()
    for verification in SPAN_THEN_GUESSES:
        spec.observe("s", *verification)
    assert not spec.stats["s"].in_span
    assert spec.rate("s") < 0.6
    assert 1 <= _plan_one(spec, "s") <= 3


def test_a_span_gets_long_drafts():
    """Back in a span the sequence's span record (20 of 21 drafts, one rejection) rules:
    more than the 8 drafts auto could give before."""
    spec = _speculator()
    for verification in [*SPAN_THEN_GUESSES, (2, 2)]:
        spec.observe("s", *verification)
    assert spec.stats["s"].in_span and spec.rate("s") > 0.9
    assert _plan_one(spec, "s") > 8


def test_a_new_sequence_starts_from_the_engine_s_pooled_acceptance():
    """Sequences that copied their input (first guesses right, spans accepted) leave a
    pooled prior near theirs: a new sequence drafts like them at once, not at 0.5."""
    spec = _speculator()
    for seq_id in ("a", "b", "c"):
        for verification in [(4, 4), (8, 8), (8, 8), (8, 8)]:
            spec.observe(seq_id, *verification)
        spec.finish(seq_id, [3], completed=True)
    assert spec.rate("new") > 0.8
    assert _plan_one(spec, "new") >= 4
    # and the other way: sequences whose guesses all failed make a new one cautious
    spec = _speculator()
    for seq_id in ("a", "b", "c"):
        for verification in [(4, 0), (4, 0), (4, 0)]:
            spec.observe(seq_id, *verification)
    assert spec.rate("new") < 0.3


def test_an_iteration_without_drafts_ends_the_span():
    spec = _speculator()
    spec.observe("s", 4, 4)
    assert spec.stats["s"].in_span
    spec.proposer = FixedProposer([])  # the proposer finds nothing: the span is over
    assert _plan_one(spec, "s") == 0
    assert not spec.stats["s"].in_span


def test_sequences_not_in_a_span_still_get_drafts_beside_ones_that_are():
    """Batch 4 of the grounded prompts on this host (9.8 ms a 4-row step, ~0.95 ms a row):
    two sequences copying a span (~0.97) and two guessing (~0.58). On the step's tokens per
    second the copying two took every draft (16 each: a 36-row step, ~4x a decode, for the
    guessing two's one token each); on the geometric mean of the four rates each guessing
    sequence drafts too, and the copying ones fewer."""
    spec = Speculator(AUTO, proposer=FixedProposer(list(range(100))),
                      step_cost=LinearStepCost(overhead=6.0, per_token=0.95))
    for seq_id in ("a", "b"):
        spec.stats[seq_id] = AcceptanceStats(span_accepted=60, span_rejections=1,
                                             in_span=True)
    for seq_id in ("c", "d"):
        spec.stats[seq_id] = AcceptanceStats(accepted=6, rejections=4)
    cands = [Candidate(s, [1, 2], [3], AUTO_MAX_SPECULATIVE_TOKENS) for s in "abcd"]
    drafts = spec.plan(cands, budget=512, planned_tokens=4, producing=4)
    assert all(len(drafts.get(s, ())) >= 1 for s in "cd"), drafts
    assert all(len(drafts[s]) < AUTO_MAX_SPECULATIVE_TOKENS for s in "ab"), drafts


def test_a_first_guess_and_a_guess_after_a_miss_are_told_apart():
    """Answers that quote their input: each one's first guess was right (it starts
    copying at once), its guesses after a span ended were not. A new sequence drafts long
    at once; one that has just missed drafts little (one 'fresh' record for both put them
    at the same ~0.6)."""
    spec = _speculator()
    for seq_id in ("a", "b", "c"):
        for verification in [(6, 6), (16, 16), (16, 3), (8, 0), (6, 0), (4, 1)]:
            spec.observe(seq_id, *verification)
    assert spec.stats["a"].state == "fresh"
    assert spec.rate("new") > 0.8 and spec.rate("a") < 0.35
    assert _plan_one(spec, "new") >= 6
    assert _plan_one(spec, "a") <= 2
