""""auto" speculation's per-sequence accounts and the price of a verification (issue 35,
"TPOT p99 no worse than off"): a sequence whose drafts are seldom right is not slowed by
its neighbours' drafts past what it may lose (`ACCOUNT_ALLOWANCE` + `ACCOUNT_SLACK` an
iteration), while sequences that all gain keep drafting; and the decode cost learns what an
iteration with drafts costs beyond its rows (`DecodeStepCost.verify_extra`).
"""

from __future__ import annotations

import math

import pytest

from slotserve.spec import planner
from slotserve.spec.planner import (
    ACCOUNT_ALLOWANCE,
    ACCOUNT_SLACK,
    AcceptanceStats,
    Candidate,
    DecodeStepCost,
    LinearStepCost,
    Speculator,
)
from tests.unit.test_spec_auto_cost import AUTO
from tests.unit.test_spec_proposers import FixedProposer

# 10 ms a step and 1 ms a row: a draft row slows a 2-row step by ~8%.
ROW_COST = LinearStepCost(overhead=10.0, per_token=1.0)


def _plan_steps(spec: Speculator, steps: int) -> dict[str, int]:
    """`steps` iterations of two decoding sequences, "copy" (a span at ~0.6) and "guess"
    (fresh, ~0.1), every draft of "copy" accepted at its rate's mean, none of "guess";
    each iteration's drafts by sequence, summed."""
    candidates = [Candidate(seq_id, [1, 2], [3], 8) for seq_id in ("copy", "guess")]
    drafted = {"copy": 0, "guess": 0}
    for _ in range(steps):
        drafts = spec.plan(candidates, 64, 2, 2)
        for seq_id, tokens in drafts.items():
            drafted[seq_id] += len(tokens)
            spec.observe(seq_id, len(tokens), 0)
        # NOTE: the records stay where the test put them: the accounts are what moves
        spec.stats["copy"].in_span = True
        spec.stats["copy"].span_accepted, spec.stats["copy"].span_rejections = 60, 40
        spec.stats["guess"].accepted, spec.stats["guess"].rejections = 1, 9
        budget = ACCOUNT_ALLOWANCE + ACCOUNT_SLACK * spec.stats["guess"].iterations
        assert spec.stats["guess"].net >= -budget - 1e-9
    return drafted


def _speculator(guess_net: float = 0.0) -> Speculator:
    spec = Speculator(AUTO, proposer=FixedProposer(list(range(8))), step_cost=ROW_COST)
    spec.stats["copy"] = AcceptanceStats(span_accepted=60, span_rejections=40, in_span=True)
    spec.stats["guess"] = AcceptanceStats(accepted=1, rejections=9, net=guess_net)
    return spec


def test_a_sequence_that_gains_nothing_is_not_slowed_past_its_account():
    """Without the account "copy" drafts ~1-2 tokens every iteration (each ~8-16% of the
    step for "guess", which gains nothing: 200 iterations of that is ~20 steps lost);
    with it, "guess" loses at most its allowance and 0.3% an iteration (checked every
    iteration), so "copy" drafts far less."""
    unbounded = _plan_steps(_speculator(guess_net=1e9), 200)
    bounded = _plan_steps(_speculator(), 200)
    assert unbounded["copy"] >= 200, unbounded
    assert 0 < bounded["copy"] < unbounded["copy"] / 4, (bounded, unbounded)


def test_sequences_that_all_gain_keep_drafting():
    """Four sequences copying at the same rate: each one's expected gain covers the step's
    slowdown, so no account binds and every iteration drafts for all four."""
    spec = Speculator(AUTO, proposer=FixedProposer(list(range(8))), step_cost=ROW_COST)
    candidates = [Candidate(f"s{i}", [1, 2], [3], 8) for i in range(4)]
    for seq_id in ("s0", "s1", "s2", "s3"):
        spec.stats[seq_id] = AcceptanceStats(span_accepted=90, span_rejections=10,
                                             in_span=True)
    for _ in range(50):
        drafts = spec.plan(candidates, 64, 4, 4)
        assert set(drafts) == {"s0", "s1", "s2", "s3"}, drafts
    assert min(spec.stats[s].net for s in drafts) > 0


def test_the_decode_cost_learns_what_a_verification_costs_beyond_its_rows():
    """Decodes of 3 and 4 rows (11.3, 11.7 ms) and iterations with drafts of 4 and 5 rows
    (12.4, 12.9 ms): a drafted iteration costs ~0.7 ms besides its rows, and the 4-row
    decode's estimate is the decodes' (not a mix with the drafted 4-row iterations)."""
    cost = DecodeStepCost()
    assert cost.verify_extra == 0.0
    for step in range(200):
        cost.observe(3, 0.0113)
        cost.observe(4, 0.0117)
        if step % 4 == 0:
            cost.observe(4, 0.0124, drafted=True)
            cost.observe(5, 0.0129, drafted=True)
    assert cost.verify_extra == pytest.approx(0.0007, rel=0.05)
    assert cost.seconds(4) == pytest.approx(0.0117, rel=0.02)
    assert cost.seconds(5) + cost.verify_extra == pytest.approx(0.0129, rel=0.02)


def test_the_price_of_a_verification_stops_a_draft_that_rows_alone_would_pay():
    """Three sequences, one guessing at ~0.36 (the measured case at free batch 4), the
    others with nothing to draft: priced by rows alone (+0.4 ms on a 11.3 ms step) its draft
    pays; with the verification's extra 0.7 ms it does not."""
    def plan(extra: float) -> dict[str, list[int]]:
        cost = LinearStepCost(overhead=0.0101, per_token=0.0004)
        cost.verify_extra = extra
        spec = Speculator(AUTO, proposer=FixedProposer(list(range(8))), step_cost=cost)
        for seq_id in ("a", "b", "c"):
            spec.stats[seq_id] = AcceptanceStats(accepted=4, rejections=7, net=1e9)
        candidates = [Candidate("a", [1, 2], [3], 8), Candidate("b", [1, 2], [3], 0),
                      Candidate("c", [1, 2], [3], 0)]
        return spec.plan(candidates, 64, 3, 3)

    assert plan(0.0), "rows alone: a draft pays"
    assert plan(0.0007) == {}
    assert math.isclose(AcceptanceStats(accepted=4, rejections=7).rate_given(0.36), 0.36,
                        abs_tol=0.01)


def test_the_bins_fade_as_each_observation_weighed_forget_to_its_age(monkeypatch):
    """The bins' sums kept in a growing unit (one division an observation, rescaled past
    MAX_BIN_UNIT: forced here every ~35 observations) give each bin the weight and means of
    a plain fade: observation i of n weighs forget^(n - 1 - i); bins faded under
    BIN_MIN_WEIGHT are gone after a refit."""
    monkeypatch.setattr(planner, "MAX_BIN_UNIT", 2.0)
    cost, rows = DecodeStepCost(), [1, 2, 3, 5, 8, 20, 40, 64]
    observed = []
    for step in range(600):
        n = rows[(step * 5 + step // 7) % len(rows)] if step < 200 else 1 + step % 3
        drafted = step % 3 == 0
        seconds = 0.01 + 0.0004 * n + (0.0007 if drafted else 0.0) + 1e-5 * (step % 5)
        cost.observe(n, seconds, drafted)
        observed.append(((planner.row_bin(n), drafted), n, seconds))
    cost.refit()
    expected: dict = {}
    for age, (key, n, seconds) in enumerate(reversed(observed)):
        weight = cost.forget ** age
        sums = expected.setdefault(key, [0.0, 0.0, 0.0])
        for i, value in enumerate((weight, weight * n, weight * seconds)):
            sums[i] += value
    kept = {key: sums for key, sums in expected.items() if sums[0] >= planner.BIN_MIN_WEIGHT}
    assert len(kept) < len(expected)  # the rows last seen 400 observations ago
    assert set(cost._bins) == set(kept)
    for key, (w, wn, wt) in kept.items():
        got_w, got_wn, got_wt = cost._bins[key]
        assert got_w / cost._unit == pytest.approx(w, rel=1e-9)
        assert got_wn / got_w == pytest.approx(wn / w, rel=1e-9)
        assert got_wt / got_w == pytest.approx(wt / w, rel=1e-9)
