"""The scheduler with speculative decoding (no torch): a fake model over a fake KV store
(block, offset) -> token id, whose next token is a function of the context it reads, and a
proposer that guesses it right or wrong at random. Over random workloads (hypothesis):
check_integrity after every step, drafts within the budget, the config and the sequences'
caps, a request holds exactly the blocks its computed tokens need after every step (the
rejected drafts' blocks went back), positions before a chunk hold the request's accepted
tokens (rewinding works), and the output equals speculation off, token for token."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotserve.config import SchedulerConfig
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.outputs import RunnerOutput, SchedulerOutput
from slotserve.core.scheduler import Scheduler
from slotserve.request import Request, RequestStatus
from slotserve.sampling import SamplingParams
from slotserve.spec.config import parse
from slotserve.spec.planner import Candidate, LinearStepCost, Speculator

SETTINGS = settings(deadline=None, database=None, derandomize=True, max_examples=120,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of everything before the new token."""
    return 3 + hash(tuple(context)) % 5


class FakeModel:
    """Writes each scheduled token's "K/V" (the token id) into its block slot, reads the
    context back through the block table, and samples next_token of it at each sampled row
    (greedy), accepting drafts while they equal it."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.store: dict[tuple[int, int], int] = {}

    def __call__(self, plan: SchedulerOutput) -> RunnerOutput:
        size = self.sched.kv.block_size
        out = RunnerOutput(sampled={})
        for seq in plan.seqs:
            request = self.sched.requests[seq.request_id]
            for i, token in enumerate(seq.token_ids):
                pos = seq.start_pos + i
                self.store[(seq.block_table[pos // size], pos % size)] = token
            context = [self.store[(seq.block_table[p // size], p % size)]
                       for p in range(seq.context_len)]
            known = request.all_token_ids
            # NOTE: every position before the drafts holds the request's own tokens, so a
            # rejected draft's K/V is never read as computed
            num_known = seq.context_len - len(seq.spec_token_ids)
            assert context[:num_known] == known[:num_known], "wrong K/V read"
            if not seq.sample:
                continue
            drafts = seq.spec_token_ids
            accepted = 0
            while (accepted < len(drafts)
                   and drafts[accepted] == next_token(context[:num_known + accepted])):
                accepted += 1
            out.sampled[seq.request_id] = next_token(context[:num_known + accepted])
            if drafts:
                out.accepted[seq.request_id] = list(drafts[:accepted])
        return out


class GuessingProposer:
    """Proposes the true continuation with probability `right`, else a random token, for
    up to max_tokens positions (fewer at random)."""

    def __init__(self, seed: int, right: float) -> None:
        self.rng = random.Random(seed)
        self.right = right

    def propose(self, seq_id, prompt_ids, output_ids, max_tokens):
        context = list(prompt_ids) + list(output_ids)
        drafts = []
        for _ in range(self.rng.randint(0, max_tokens)):
            token = next_token(context) if self.rng.random() < self.right else \
                self.rng.randint(3, 7)
            drafts.append(token)
            context.append(token)
        return drafts

    def finish(self, seq_id, output_ids):
        pass

    def forget(self, seq_id):
        pass


WORKLOAD = st.fixed_dictionaries({
    "prompts": st.lists(st.tuples(st.lists(st.integers(3, 9), min_size=1, max_size=30),
                                  st.integers(1, 30), st.integers(0, 6)),
                        min_size=1, max_size=8),
    "num_blocks": st.integers(10, 40),
    "budget": st.integers(4, 64),
    "max_num_seqs": st.integers(1, 6),
    "caching": st.booleans(),
    "k": st.sampled_from([1, 2, 4, 8, "auto"]),
    "right": st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    "seed": st.integers(0, 1000),
})


def make_scheduler(w: dict, speculate: bool) -> Scheduler:
    kv = KVCacheManager(w["num_blocks"], 4, enable_prefix_caching=w["caching"])
    config = SchedulerConfig(max_num_seqs=w["max_num_seqs"],
                             max_num_batched_tokens=w["budget"], max_model_len=256)
    speculator = None
    if speculate:
        speculator = Speculator(parse({"method": "ngram", "num_speculative_tokens": w["k"]}),
                                proposer=GuessingProposer(w["seed"], w["right"]),
                                step_cost=LinearStepCost(overhead=8.0, per_token=1.0))
    return Scheduler(config, kv, speculator=speculator)


def run_workload(w: dict, speculate: bool) -> dict[str, list[int]]:
    sched = make_scheduler(w, speculate)
    model = FakeModel(sched)
    pending = list(enumerate(w["prompts"]))
    outputs: dict[str, list[int]] = {}
    steps = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][1][2] <= steps:  # arrivals at their step
            index, (prompt, max_tokens, _) = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            sched.add_request(Request(f"r{index}", list(prompt), params))
        plan = sched.schedule()
        check_plan(sched, plan)
        for request in sched.update(plan, model(plan)):
            if request.is_finished:
                outputs[request.request_id] = list(request.output_token_ids)
        sched.check_integrity()
        check_blocks_fit(sched)
        steps += 1
        assert steps < 3000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return outputs


def check_plan(sched: Scheduler, plan: SchedulerOutput) -> None:
    cfg = sched.config
    assert plan.num_batched_tokens <= cfg.max_num_batched_tokens
    for seq in plan.seqs:
        drafts = seq.spec_token_ids
        if not drafts:
            continue
        request = sched.requests[seq.request_id]
        assert seq.sample and seq.kind == "decode" and seq.token_ids[1:] == drafts
        assert len(drafts) <= sched.speculator.config.max_tokens
        # the drafts and the token after them stay within max_tokens and the length cap
        assert len(request.output_token_ids) + len(drafts) + 1 <= request.sampling_params.max_tokens
        assert request.num_tokens + len(drafts) + 1 <= request.max_total_tokens
        assert len(seq.block_table) * sched.kv.block_size >= seq.context_len
        slot = plan.slots[request.slot]
        assert slot.proposed == len(drafts) and slot.tokens == 1 + len(drafts)


def check_blocks_fit(sched: Scheduler) -> None:
    """Between steps a running request holds exactly the blocks of its computed tokens."""
    for request in sched.running:
        held = len(sched.kv.block_tables[request.request_id])
        assert held == sched.kv.blocks_for(request.num_computed_tokens), (
            f"{request.request_id}: {held} blocks for {request.num_computed_tokens} tokens")


@SETTINGS
@given(WORKLOAD)
def test_invariants_and_identity_with_drafts(w):
    off = run_workload(w, speculate=False)
    on = run_workload(w, speculate=True)
    assert on == off
    limit = min(256, w["num_blocks"] * 4)  # the length cap: model length or the whole pool
    for rid, tokens in on.items():
        prompt, max_tokens, _ = w["prompts"][int(rid[1:])]
        assert len(tokens) == min(max_tokens, limit - len(prompt))


def test_drafts_are_accepted_and_rejected_and_counted():
    w = {"prompts": [([3, 4, 5, 6] * 5, 20, 0), ([7, 8] * 6, 20, 0)], "num_blocks": 48,
         "budget": 64, "max_num_seqs": 4, "caching": True, "k": 4, "right": 0.7, "seed": 3}
    sched = make_scheduler(w, speculate=True)
    model = FakeModel(sched)
    for index, (prompt, max_tokens, _) in enumerate(w["prompts"]):
        sched.add_request(Request(f"r{index}", prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    proposed = accepted = steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update(plan, model(plan))
        sched.check_integrity()
        proposed += sum(s.proposed for s in plan.slots if s)
        accepted += sum(s.accepted for s in plan.slots if s)
        steps += 1
    spec = sched.speculator
    assert spec.num_draft_tokens == proposed > spec.num_accepted_tokens == accepted > 0
    assert steps < 40  # 2 x 20 tokens in fewer steps than one token per step


def test_no_drafts_while_preempting_or_without_budget():
    w = {"prompts": [([3] * 8, 10, 0)], "num_blocks": 16, "budget": 1, "max_num_seqs": 2,
         "caching": False, "k": 4, "right": 1.0, "seed": 0}
    sched = make_scheduler(w, speculate=True)
    sched.add_request(Request("r0", [3] * 8, SamplingParams(max_tokens=10, temperature=0.0,
                                                            ignore_eos=True)))
    model = FakeModel(sched)
    while sched.has_unfinished():
        plan = sched.schedule()
        assert all(not s.spec_token_ids for s in plan.seqs)  # the budget is one token
        sched.update(plan, model(plan))


def test_auto_drafts_at_small_batch_not_when_compute_bound():
    """"auto" with a step cost of 8 tokens' overhead: a lone decode drafts, 48 decodes at
    once (the step compute-bound) draft nothing, and the proposer is not even asked."""

    class Counting(GuessingProposer):
        calls = 0

        def propose(self, *args):
            Counting.calls += 1
            return super().propose(*args)

    for count, expect_drafts in ((1, True), (48, False)):
        kv = KVCacheManager(512, 4)
        config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512)
        speculator = Speculator(parse({"method": "ngram"}), proposer=Counting(0, 1.0),
                                step_cost=LinearStepCost(overhead=8.0, per_token=1.0))
        sched = Scheduler(config, kv, speculator=speculator)
        for i in range(count):
            sched.add_request(Request(f"r{i}", [3, 4, 5], SamplingParams(
                max_tokens=30, temperature=0.0, ignore_eos=True)))
        model = FakeModel(sched)
        Counting.calls = 0
        drafted = 0
        for _ in range(6):
            plan = sched.schedule()
            drafted += sum(len(s.spec_token_ids) for s in plan.seqs)
            sched.update(plan, model(plan))
        assert (drafted > 0) == expect_drafts, (count, drafted)
        assert (Counting.calls > 0) == expect_drafts


def test_planner_candidates_respect_caps():
    spec = Speculator(parse({"method": "ngram", "num_speculative_tokens": 8}),
                      proposer=GuessingProposer(0, 1.0))
    drafts = spec.plan([Candidate("a", [3], [4], 2)], budget=100, planned_tokens=1,
                       producing=1)
    assert len(drafts.get("a", [])) <= 2
    assert RequestStatus.FINISHED_LENGTH.finished
