"""One definition of "decode" (core.outputs.is_decode_step): a preempted request's
one-token recompute chunks are classified the same by the scheduler (prefill cap, kinds,
trace slots), the attention metadata and the decode graphs."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from slotserve.attention.metadata import build_metadata
from slotserve.config import SchedulerConfig, SlotKind
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput, is_decode_step
from slotserve.core.scheduler import Scheduler
from slotserve.request import Request
from slotserve.runner.decode_graphs import DecodeGraphs
from slotserve.sampling import SamplingParams

BLOCK_SIZE = 4


def make_request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, list(range(1, prompt_len + 1)), params)


def step(sched: Scheduler) -> SchedulerOutput:
    plan = sched.schedule()
    sched.update(plan, RunnerOutput(sampled={s.request_id: 7 for s in plan.seqs if s.sample}))
    return plan


def attention_decodes(seq: ScheduledSeq, group_decodes: bool) -> bool:
    meta = build_metadata([seq], BLOCK_SIZE, torch.device("cpu"), group_decodes)
    return meta.num_decodes == 1 and not meta.prefills


def attention_rows(seq: ScheduledSeq) -> int:
    """Rows of the one decode group the fused CPU path's metadata makes (0: not so)."""
    meta = build_metadata([seq], BLOCK_SIZE, torch.device("cpu"), group_decodes=False,
                          short_chunks_as_rows=True)
    return meta.num_decodes if meta.decode_only else 0


def graphs_run(seq: ScheduledSeq) -> bool:
    return DecodeGraphs.runs(SimpleNamespace(rows=8, tables_width=64), [seq])


def recompute_chunks() -> list[tuple[SchedulerOutput, ScheduledSeq]]:
    """A request preempted after 3 tokens, recomputed one token an iteration beside a
    decoding one (budget 2, prefill cap 1)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=2,
                                      max_prefill_tokens_while_decoding=1),
                      KVCacheManager(32, BLOCK_SIZE))
    busy, victim = make_request("busy", 2, 40), make_request("victim", 3, 8)
    sched.add_request(busy), sched.add_request(victim)
    while len(victim.output_token_ids) < 3:
        step(sched)
    sched._preempt(victim)  # NOTE: the scheduler's own preemption, forced here
    chunks = []
    while len(victim.output_token_ids) < 5:
        plan = step(sched)
        chunks += [(plan, s) for s in plan.seqs if s.request_id == "victim"]
    return chunks


def test_preempted_one_token_recompute_is_classified_the_same_everywhere():
    chunks = recompute_chunks()
    one_token = [(p, s) for p, s in chunks if s.num_tokens == 1]
    mid = [s for _, s in one_token if not s.sample]
    assert any(s.start_pos > 0 for s in mid) and all(s.num_output_tokens == 3 for s in mid), \
        "the scenario must recompute one token at a time"
    for plan, seq in one_token:
        decode = is_decode_step(seq.start_pos, 1, seq.sample)
        expected = SlotKind.DECODE if decode else SlotKind.PREFILL
        assert seq.is_decode == decode and seq.kind == expected
        assert plan.slots[[s and s.request_id for s in plan.slots].index("victim")].kind \
            == expected  # the trace's slot kind
        assert attention_decodes(seq, True) == decode
        assert attention_decodes(seq, False) == decode
        # the fused CPU path runs any short chunk as rows of its one decode group, decode or
        # not (core.outputs.runs_as_rows): one row here
        assert attention_rows(seq) == 1
        assert graphs_run(seq) == decode
    assert [s.is_decode for s in mid] == [False] * len(mid)  # prefill chunks, sampling none


def test_decode_step_definition():
    assert is_decode_step(5, 1, True)
    assert not is_decode_step(5, 1, False)  # a recompute's middle chunk
    assert not is_decode_step(0, 1, True)  # a one-token prompt
    assert not is_decode_step(5, 2, True)
    drafted = ScheduledSeq("d", [1, 2, 3], 5, [0, 1], True, SamplingParams(), 2,
                           SlotKind.DECODE, spec_token_ids=[2, 3])
    assert drafted.is_decode and not drafted.is_one_token_decode
    assert not attention_decodes(drafted, True)  # verified with 3 query rows
