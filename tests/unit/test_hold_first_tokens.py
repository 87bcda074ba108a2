"""hold_first_tokens: a burst's first tokens come together (scheduler, fake runner).

Without it, the requests admitted first in a burst decode through the other prompts'
prefill chunks, whose time counts in their TPOT (W's TPOT p99 / p50 at 1B: 1.9). With it, a
prompt's last token waits while the requests that arrived before it came due have more
prompt work left than one budget; the hold never waits on work that cannot run.
"""

from __future__ import annotations

from slotserve.core.outputs import SchedulerOutput
from tests.unit.test_scheduler import make_request, make_scheduler, run_to_end, step


def first_token_iterations(plans: list[SchedulerOutput]) -> dict[str, int]:
    """request id -> the iteration that sampled its first token."""
    first: dict[str, int] = {}
    for plan in plans:
        for seq in plan.seqs:
            if seq.sample and seq.num_output_tokens == 0:
                first.setdefault(seq.request_id, plan.iteration)
    return first


def decodes_beside_prompt_work(plans: list[SchedulerOutput]) -> int:
    """Iterations in which a request decodes beside another's prefill chunk."""
    return sum(1 for p in plans if any(s.kind == "decode" for s in p.seqs)
               and any(s.kind == "prefill" and s.num_tokens > 1 for s in p.seqs))


def burst(hold: bool, n: int = 16, prompt_len: int = 40, slots: int = 16):
    sched = make_scheduler(num_blocks=512, block_size=4, max_num_seqs=slots,
                           max_num_batched_tokens=64, hold_first_tokens=hold)
    for i in range(n):
        sched.add_request(make_request(f"r{i}", prompt_len, 8))
    return sched, run_to_end(sched)


def test_a_burst_s_first_tokens_come_together():
    _, held = burst(hold=True)
    _, free = burst(hold=False)
    first_held, first_free = first_token_iterations(held), first_token_iterations(free)
    assert len(first_held) == len(first_free) == 16
    # 640 prompt tokens at 64 a step: without the hold the first tokens spread over the
    # prefill; with it they come in the last two iterations of prompt work
    assert max(first_free.values()) - min(first_free.values()) >= 8
    assert max(first_held.values()) - min(first_held.values()) <= 1
    assert decodes_beside_prompt_work(free) >= 8
    assert decodes_beside_prompt_work(held) <= 1


def test_online_arrivals_are_left_alone():
    """Requests arriving one by one, each prompt well under a budget: the same plans."""
    plans = {}
    for hold in (False, True):
        sched = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=8,
                               max_num_batched_tokens=64, hold_first_tokens=hold)
        trace = []
        for i in range(12):
            sched.add_request(make_request(f"r{i}", 20, 6))
            for _ in range(3):
                trace.append([(s.request_id, s.num_tokens) for s in step(sched).seqs])
        trace += [[(s.request_id, s.num_tokens) for s in p.seqs] for p in run_to_end(sched)]
        plans[hold] = trace
    assert plans[True] == plans[False]


def test_a_hold_never_waits_for_a_request_without_a_slot():
    """More requests than slots: the running ones' first tokens do not wait for prompts
    that need their slots; every request finishes with all its tokens."""
    sched, plans = burst(hold=True, n=12, prompt_len=40, slots=4)
    first = first_token_iterations(plans)
    assert len(first) == 12
    # the first four get their tokens before any of the last eight is even admitted
    assert max(first[f"r{i}"] for i in range(4)) < min(first[f"r{i}"] for i in range(4, 12))
    assert not sched.has_unfinished()


def test_a_hold_ends_when_no_prompt_work_can_run():
    """A KV pool too small for the gang's prompts: the held requests' last tokens run as
    soon as an iteration can plan no prompt work, and everything finishes."""
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=8,
                           max_num_batched_tokens=32, hold_first_tokens=True)
    for i in range(8):
        sched.add_request(make_request(f"r{i}", 30, 4))
    plans = run_to_end(sched)
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == 24
    assert len(first_token_iterations(plans)) == 8
