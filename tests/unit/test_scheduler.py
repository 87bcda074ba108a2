"""Scheduler with a fake runner (no torch): limits, admission rules, blocks always return."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from slotserve.config import SchedulerConfig
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.outputs import RunnerOutput, SchedulerOutput
from slotserve.core.scheduler import Scheduler
from slotserve.request import Request, RequestStatus
from slotserve.sampling import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, **kwargs) -> Scheduler:
    return Scheduler(SchedulerConfig(**kwargs), KVCacheManager(num_blocks, block_size))


def make_request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, list(range(1, prompt_len + 1)), params)


def fake_run(plan: SchedulerOutput) -> RunnerOutput:
    """Token 7 for every sampling sequence."""
    return RunnerOutput(sampled={s.request_id: 7 for s in plan.seqs if s.sample})


def step(sched: Scheduler) -> SchedulerOutput:
    plan = sched.schedule()
    check_plan(sched, plan)
    sched.update(plan, fake_run(plan))
    sched.check_integrity()
    return plan


def prefill_tokens(plan: SchedulerOutput) -> int:
    return sum(s.num_tokens for s in plan.seqs if s.kind == "prefill")


def check_plan(sched: Scheduler, plan: SchedulerOutput) -> None:
    cfg = sched.config
    assert len(sched.running) <= cfg.max_num_seqs
    assert plan.num_batched_tokens <= cfg.max_num_batched_tokens
    cap = cfg.max_prefill_tokens_while_decoding
    if cap is not None and any(s.kind == "decode" for s in plan.seqs):
        assert prefill_tokens(plan) <= cap, "prefill past the cap while requests decode"
    tables = [b for s in plan.seqs for b in s.block_table]
    assert len(tables) == len(set(tables)), "a block is in two requests' tables"
    for seq in plan.seqs:
        assert seq.context_len <= len(seq.block_table) * sched.kv.block_size


def run_to_end(sched: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    plans = []
    while sched.has_unfinished() and len(plans) < max_steps:
        plans.append(step(sched))
    assert not sched.has_unfinished(), "did not finish"
    return plans


def test_block_table_grows_one_block_at_a_time():
    sched = make_scheduler(num_blocks=8, block_size=4)
    sched.add_request(make_request("a", 5, 4))
    plan = step(sched)  # prefill 5 tokens -> 2 blocks, lowest ids first
    assert plan.seqs[0].block_table == [0, 1]
    step(sched), step(sched)  # positions 5, 6
    assert sched.kv.block_tables["a"] == [0, 1]
    step(sched)  # position 7 still in block 1; the request reaches max_tokens and leaves
    assert "a" not in sched.kv.block_tables
    assert sched.kv.num_free_blocks == 8


def test_slots_and_budget_never_exceeded():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(8):
        sched.add_request(make_request(f"r{i}", 7, 3 + i))
    plans = run_to_end(sched)
    assert max(sum(s is not None for s in p.slots) for p in plans) == 3
    assert max(p.num_batched_tokens for p in plans) <= 10


def test_long_prompt_is_chunked():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("long", 30, 2))
    plans = run_to_end(sched)
    assert [p.seqs[0].num_tokens for p in plans[:4]] == [8, 8, 8, 6]
    assert [p.seqs[0].sample for p in plans[:4]] == [False, False, False, True]


# ---------------------------------------------------------------- stall-free batching
def test_prefill_is_capped_while_requests_decode():
    sched = make_scheduler(num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64,
                           max_prefill_tokens_while_decoding=8)
    for i in range(2):
        sched.add_request(make_request(f"d{i}", 6, 40))
    assert prefill_tokens(step(sched)) == 12  # nothing decodes yet: both prompts at once
    for i in range(4):
        sched.add_request(make_request(f"p{i}", 30, 2))
    for _ in range(10):
        plan = step(sched)
        kinds = sorted(s.kind for s in plan.seqs)
        assert kinds.count("decode") >= 2 and prefill_tokens(plan) == 8, kinds
    assert all(s.kind == "decode" for s in plan.seqs if s.request_id.startswith("d"))


def test_full_budget_when_nothing_decodes():
    sched = make_scheduler(num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64,
                           max_prefill_tokens_while_decoding=8)
    for i in range(4):
        sched.add_request(make_request(f"p{i}", 30, 3))
    first, second = step(sched), step(sched)
    assert prefill_tokens(first) == 64  # p0, p1 whole, p2 a 4-token chunk
    # p0 and p1 decode now: p2's rest and p3 share the capped 8 tokens.
    assert [s.kind for s in second.seqs].count("decode") == 2
    assert prefill_tokens(second) == 8
    run_to_end(sched)


def test_capped_long_prompt_is_not_starved():
    # Decoding requests keep arriving: the long prompt still gets the cap every iteration,
    # before any newcomer (FCFS), and finishes its prefill in ceil(100 / 8) iterations.
    sched = make_scheduler(num_blocks=400, max_num_seqs=16, max_num_batched_tokens=64,
                           max_prefill_tokens_while_decoding=8)
    sched.add_request(make_request("d", 4, 200))
    step(sched)
    long = make_request("long", 100, 2)
    sched.add_request(long)
    chunks = []
    for i in range(13):
        sched.add_request(make_request(f"new{i}", 3, 50))
        plan = step(sched)
        chunks += [s.num_tokens for s in plan.seqs if s.request_id == "long"]
    assert chunks == [8] * 12 + [4] and long.output_token_ids
    run_to_end(sched)


def test_no_cap_prefills_at_the_whole_budget():
    sched = make_scheduler(num_blocks=200, max_num_batched_tokens=64,
                           max_prefill_tokens_while_decoding=None)
    sched.add_request(make_request("d", 4, 40))
    step(sched)
    sched.add_request(make_request("p", 100, 2))
    assert prefill_tokens(step(sched)) == 63  # the budget less d's decode


def test_static_never_admits_mid_flight():
    sched = make_scheduler(max_num_seqs=3, policy="static")
    lengths = [2, 8, 3, 4, 3, 2]
    for i, m in enumerate(lengths):
        sched.add_request(make_request(f"R{i + 1}", 1, m))
    plans = run_to_end(sched)
    members = [frozenset(s.request_id for s in p.slots if s) for p in plans]
    # Batch 1 (R1-R3) holds until R2's 8 tokens are done, then R4-R6 run 4 iterations.
    assert len(plans) == 12
    for before, after in zip(members, members[1:]):
        assert after <= before or not before & after, "admitted while the batch ran"


def test_continuous_admits_in_the_iteration_a_slot_frees():
    sched = make_scheduler(max_num_seqs=3, policy="continuous")
    for i, m in enumerate([2, 8, 3, 4, 3, 2]):
        sched.add_request(make_request(f"R{i + 1}", 1, m))
    plans = run_to_end(sched)
    assert len(plans) == 8
    first = {}
    for p in plans:
        for s in p.seqs:
            first.setdefault(s.request_id, p.iteration)
    assert first == {"R1": 0, "R2": 0, "R3": 0, "R4": 2, "R5": 3, "R6": 6}


def test_preemption_returns_blocks_and_resumes():
    # 6 blocks of 4 = 24 positions; three requests that grow to 12 each must preempt.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=3)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 4, 8))
    plans = run_to_end(sched)
    assert sched.num_preemptions > 0
    assert any(p.preempted for p in plans)
    assert sched.kv.num_free_blocks == 6


def test_preempted_request_keeps_its_tokens():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a, b = make_request("a", 4, 6), make_request("b", 4, 6)
    sched.add_request(a), sched.add_request(b)
    while b.num_preemptions == 0:
        step(sched)
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    kept = list(b.output_token_ids)
    run_to_end(sched)
    assert b.output_token_ids[:len(kept)] == kept and len(b.output_token_ids) == 6


def test_abort_frees_blocks_running_and_waiting():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", 9, 50))
    sched.add_request(make_request("wait", 3, 5))
    step(sched)
    assert sched.kv.num_free_blocks < sched.kv.num_blocks
    assert sched.abort_request("run").status == RequestStatus.FINISHED_ABORTED
    assert sched.abort_request("wait").status == RequestStatus.FINISHED_ABORTED
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.has_unfinished()


def test_request_that_can_never_fit_is_rejected():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="prompt"):
        sched.add_request(make_request("big", 16, 1))  # the pool holds 16 positions
    with pytest.raises(ValueError, match="prompt"):
        sched.add_request(Request("empty", [], SamplingParams()))


def test_output_capped_by_pool_size():
    sched = make_scheduler(num_blocks=4, block_size=4)
    req = make_request("r", 10, 100)
    sched.add_request(req)
    run_to_end(sched)
    assert req.num_tokens == 16 and req.finish_reason == "length"


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    policy=st.sampled_from(["continuous", "static"]),
    slots=st.integers(1, 6),
    budget=st.integers(1, 40),
    num_blocks=st.integers(6, 40),
    n=st.integers(1, 12),
    cap=st.one_of(st.none(), st.integers(1, 40)),
    hold=st.booleans(),
)
# A prompt's last one-token chunk is labelled a decode: the cap holds beside it too.
@example(seed=0, policy="continuous", slots=2, budget=3, num_blocks=6, n=4, cap=1, hold=True)
def test_random_workloads_keep_invariants(seed, policy, slots, budget, num_blocks, n, cap,
                                          hold):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=slots,
                           max_num_batched_tokens=budget, policy=policy,
                           max_prefill_tokens_while_decoding=cap, hold_first_tokens=hold)
    pending = [(rng.randint(0, 30), make_request(f"r{i}", rng.randint(1, 20),
                                                 rng.randint(1, 20))) for i in range(n)]
    pending.sort(key=lambda x: x[0])
    requests = [r for _, r in pending]
    aborted = set()
    for it in range(5_000):
        while pending and pending[0][0] <= it:
            sched.add_request(pending.pop(0)[1])
        if rng.random() < 0.02 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.abort_request(victim)
            aborted.add(victim)
        if policy == "static":
            before = {r.request_id for r in sched.running}
        plan = step(sched)
        if policy == "static" and before:
            assert {s.request_id for s in plan.seqs} <= before
        if not pending and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert sched.kv.num_free_blocks == num_blocks
    for r in requests:
        if r.request_id in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
        else:
            room = sched.max_total_tokens - r.num_prompt_tokens
            expected = min(r.sampling_params.max_tokens, room)
            assert len(r.output_token_ids) == expected
