"""Blocks before a sliding window go back to the pool (no torch): the KV manager with the
window every layer has (`sliding_window`) frees the blocks that end before a request's next
query's window, as vLLM's sliding-window manager does.

A fake windowed model over a fake KV store (block, offset) -> token id: each new token is
written into its block, every query reads back its window (the last WINDOW positions)
through the block table, only from blocks the request holds, and checks they hold the
request's own tokens; its next token is a function of the window it read. So freeing must
give the same tokens as keeping every block, through chunked prefill, preemption, prefix
hits and speculative drafts, while a long request holds a bounded number of blocks.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotserve.config import ModelConfig, SchedulerConfig
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.outputs import RunnerOutput, SchedulerOutput
from slotserve.core.scheduler import Scheduler
from slotserve.engine.events import build_block_map
from slotserve.layer_windows import uniform_window
from slotserve.request import Request
from slotserve.sampling import SamplingParams
from slotserve.spec.config import parse
from slotserve.spec.planner import LinearStepCost, Speculator

WINDOW = 8
BLOCK_SIZE = 4
# A decoding request holds the blocks of its window, and one more where it is not aligned.
DECODE_BOUND = math.ceil(WINDOW / BLOCK_SIZE) + 1


def next_token(window: list[int]) -> int:
    """The fake model: a deterministic function of the window a query reads."""
    return 3 + hash(tuple(window)) % 5


class WindowedModel:
    """Writes each scheduled token's "K/V" into its slot, then reads every query's window
    back through the block table (asserting each block read is held by the request, so
    never a freed one), and samples next_token of the last query's window; drafts are
    accepted while they equal it."""

    def __init__(self, sched: Scheduler, window: int = WINDOW) -> None:
        self.sched = sched
        self.window = window
        self.store: dict[tuple[int, int], int] = {}
        self.blocks_read = 0

    def __call__(self, plan: SchedulerOutput) -> RunnerOutput:
        kv, size = self.sched.kv, self.sched.kv.block_size
        out = RunnerOutput(sampled={})
        for seq in plan.seqs:
            request = self.sched.requests[seq.request_id]
            held = set(kv.block_tables[seq.request_id])
            for i, token in enumerate(seq.token_ids):
                pos = seq.start_pos + i
                block = seq.block_table[pos // size]
                assert block in held, f"writes into block {block}, not held"
                assert kv.pool.ref_count(block) == 1 and kv.pool.hash_of(block) is None
                self.store[(block, pos % size)] = token
            known = request.all_token_ids + seq.spec_token_ids
            windows = [self._read(seq.block_table, held, pos, known)
                       for pos in range(seq.start_pos, seq.context_len)]
            if not seq.sample:
                continue
            num_known = seq.num_tokens - len(seq.spec_token_ids)
            accepted = 0
            drafts = seq.spec_token_ids
            while accepted < len(drafts) and drafts[accepted] == next_token(
                    windows[num_known - 1 + accepted]):
                accepted += 1
            out.sampled[seq.request_id] = next_token(windows[num_known - 1 + accepted])
            if drafts:
                out.accepted[seq.request_id] = list(drafts[:accepted])
        return out

    def _read(self, table: list[int], held: set[int], pos: int, known: list[int]) -> list[int]:
        size = self.sched.kv.block_size
        first = max(0, pos - self.window + 1)
        window = []
        for key in range(first, pos + 1):
            block = table[key // size]
            assert block in held, f"position {pos} reads block {block}, not held"
            window.append(self.store[(block, key % size)])
        assert window == known[first:pos + 1], "wrong K/V read"
        self.blocks_read += 1
        return window


def make_scheduler(num_blocks: int = 64, window: int | None = WINDOW, caching: bool = False,
                   speculate: bool = False, **kwargs) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=caching,
                        sliding_window=window)
    speculator = None
    if speculate:
        speculator = Speculator(parse({"method": "ngram", "num_speculative_tokens": 4}),
                                proposer=WindowGuesser(seed=1, right=0.7),
                                step_cost=LinearStepCost(overhead=8.0, per_token=1.0))
    kwargs.setdefault("max_model_len", 1024)
    return Scheduler(SchedulerConfig(**kwargs), kv, speculator=speculator)


class WindowGuesser:
    """Proposes the windowed model's next token with probability `right`, else a random
    one, for up to max_tokens positions (fewer at random)."""

    def __init__(self, seed: int, right: float) -> None:
        self.rng = random.Random(seed)
        self.right = right

    def propose(self, seq_id, prompt_ids, output_ids, max_tokens):
        context = list(prompt_ids) + list(output_ids)
        drafts = []
        for _ in range(self.rng.randint(0, max_tokens)):
            right = self.rng.random() < self.right
            token = next_token(context[-WINDOW:]) if right else self.rng.randint(3, 7)
            drafts.append(token)
            context.append(token)
        return drafts

    def finish(self, seq_id, output_ids):
        pass

    def forget(self, seq_id):
        pass


def request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, list(prompt), params)


def run(sched: Scheduler, requests: list[Request], on_step=None,
        model: WindowedModel | None = None, max_steps: int = 5_000) -> dict[str, list[int]]:
    """Add the requests, step until all finish (check_integrity after each step, then
    on_step(sched, plan)); their output tokens. model: the scheduler's (its K/V store)."""
    model = model or WindowedModel(sched)
    for r in requests:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update(plan, model(plan))
        sched.check_integrity()
        if on_step is not None:
            on_step(sched, plan)
        steps += 1
        assert steps < max_steps, "did not finish"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return {r.request_id: list(r.output_token_ids) for r in requests}


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 200) for _ in range(length)]


# ------------------------------------------------------------------------- the KV manager
def test_blocks_before_the_window_go_back_as_the_request_advances():
    kv = KVCacheManager(16, BLOCK_SIZE, sliding_window=WINDOW)
    r = request("a", prompt_of(30, 1), 1)
    assert kv.allocate_slots(r, 30) is not None  # 8 blocks, positions 0..29
    r.num_computed_tokens = 30
    # the next query (position 30) reads 23..30: blocks 0..4 (positions 0..19) end before
    assert kv.free_outside_window(r) == 5
    assert kv.num_freed_blocks("a") == 5 and len(kv.block_tables["a"]) == 3
    assert kv.num_table_blocks("a") == 8 and kv.num_free_blocks == 16 - 3
    held = kv.block_tables["a"]
    # the runner's table: freed entries repeat a held block, the rest as held
    assert kv.block_table("a") == [held[0]] * 5 + held
    assert kv.free_outside_window(r) == 0  # nothing more until the query moves on
    kv.check_integrity()
    assert kv.allocate_slots(r, 31) == [] and kv.allocate_slots(r, 33) is not None
    r.num_computed_tokens = 33  # reads 26..33: block 5 (20..23) ends before 26
    assert kv.free_outside_window(r) == 1
    assert kv.num_table_blocks("a") == 9 and len(kv.block_tables["a"]) == 3
    kv.check_integrity()
    kv.free("a")
    assert kv.num_free_blocks == 16 and kv.num_freed_blocks("a") == 0
    kv.check_integrity()


def test_a_block_is_freed_only_once_it_ends_before_the_window():
    kv = KVCacheManager(16, BLOCK_SIZE, sliding_window=WINDOW)
    r = request("a", prompt_of(12, 2), 1)
    kv.allocate_slots(r, 12)
    for computed, freed in ((8, 0), (11, 1), (12, 1), (15, 2), (16, 2)):
        if computed > 12:
            kv.allocate_slots(r, computed)
        r.num_computed_tokens = computed
        kv.free_outside_window(r)
        # the query at `computed` reads from computed - 7: block b ends at 4b + 3
        assert kv.num_freed_blocks("a") == freed, computed
        assert all(4 * b + 3 < computed - WINDOW + 1 for b in range(freed))


def test_without_a_uniform_window_nothing_is_freed():
    kv = KVCacheManager(16, BLOCK_SIZE)
    r = request("a", prompt_of(40, 3), 1)
    kv.allocate_slots(r, 40)
    r.num_computed_tokens = 40
    assert kv.free_outside_window(r) == 0 and len(kv.block_tables["a"]) == 10
    # Gemma 3's layers (five sliding, one global) or differing windows: no window to free by
    assert uniform_window((WINDOW,) * 5 + (None,)) is None
    assert uniform_window((WINDOW, 2 * WINDOW)) is None
    assert uniform_window(()) is None
    assert uniform_window((WINDOW,) * 3) == WINDOW


def test_the_configs_uniform_window():
    mistral = {"model_type": "mistral", "num_hidden_layers": 3, "sliding_window": 8,
               "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
               "num_attention_heads": 2, "num_key_value_heads": 1}
    assert uniform_window(ModelConfig.from_hf_dict(mistral).sliding_windows) == 8
    gemma3 = {**mistral, "model_type": "gemma3_text", "sliding_window_pattern": 2,
              "head_dim": 8}
    assert ModelConfig.from_hf_dict(gemma3).sliding_windows == (8, None, 8)
    assert uniform_window(ModelConfig.from_hf_dict(gemma3).sliding_windows) is None


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "8"])
def test_a_bad_window_is_a_value_error(bad):
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        KVCacheManager(8, BLOCK_SIZE, sliding_window=bad)


def test_the_window_changes_only_while_no_blocks_are_held():
    kv = KVCacheManager(8, BLOCK_SIZE)
    kv.set_sliding_window(WINDOW)
    kv.allocate_slots(request("a", [5, 6], 1), 2)
    with pytest.raises(RuntimeError, match="no request holds blocks"):
        kv.set_sliding_window(None)
    kv.free("a")
    kv.set_sliding_window(None)
    assert kv.sliding_window is None


def test_integrity_checks_catch_a_freed_block_a_query_could_read():
    sched = make_scheduler()
    model = WindowedModel(sched)
    sched.add_request(request("a", prompt_of(30, 4), 5))
    plan = sched.schedule()
    sched.update(plan, model(plan))  # 30 computed: the next query reads 23..30
    sched.check_integrity()
    kv = sched.kv
    assert kv.num_freed_blocks("a") == 5
    kv._num_freed["a"] += 1  # free block 5 (20..23) too, which position 30 reads
    kv.pool.free([kv.block_tables["a"].pop(0)])
    kv.check_integrity()  # the KV manager cannot tell: it does not know the position
    with pytest.raises(AssertionError, match="6 blocks freed at 30 computed"):
        sched.check_integrity()
    kv.sliding_window = None
    with pytest.raises(AssertionError, match="freed without a sliding window"):
        kv.check_integrity()


def test_trim_keeps_freed_entries_and_gives_back_the_tail():
    kv = KVCacheManager(16, BLOCK_SIZE, sliding_window=WINDOW)
    r = request("a", prompt_of(30, 5), 1)
    kv.allocate_slots(r, 34)  # 9 blocks: 30 computed + 4 draft positions
    r.num_computed_tokens = 30
    kv.free_outside_window(r)
    assert kv.trim(r, 31) == 1  # the draft-only block 8 (32..35) goes back
    assert kv.num_table_blocks("a") == 8 and kv.num_freed_blocks("a") == 5
    with pytest.raises(RuntimeError, match="cached or freed blocks"):
        kv.trim(r, 12)
    kv.check_integrity()


def test_freed_cached_blocks_stay_hittable_and_show_as_cached_free_in_the_block_map():
    """With prefix caching, a freed block keeps its hash (a cached free block, evictable,
    as a finished request's): the live view's block map draws it free, not owned."""
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True, sliding_window=WINDOW)
    prompt = prompt_of(30, 6)
    r = request("a", prompt, 4)
    kv.allocate_slots(r, 30, [])
    r.num_computed_tokens = 30
    kv.on_computed(r)  # registers blocks 0..6, then frees 0..4
    freed = kv.pool.cached_free_blocks()
    assert len(freed) == 5 and not set(freed) & set(kv.block_tables["a"])
    block_map = build_block_map(kv.block_tables, kv.pool.cached_free_blocks())
    owned = {b for first, count, _ in block_map.runs for b in range(first, first + count)}
    assert owned == set(kv.block_tables["a"]) and len(owned) == 3
    cached_free = {b for first, count in block_map.cached_free
                   for b in range(first, first + count)}
    assert cached_free == set(freed)
    # a second request with the prompt hits all 7 full blocks, freed ones included
    blocks, tokens = kv.get_computed_blocks(request("b", prompt, 1))
    assert tokens == 28 and set(freed) <= set(blocks)
    kv.check_integrity()


def test_a_prefix_hit_takes_only_the_blocks_of_its_window():
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True, sliding_window=WINDOW)
    prompt = prompt_of(30, 9)
    first = request("a", prompt, 1)
    kv.allocate_slots(first, 30, [])
    first.num_computed_tokens = 30
    kv.on_computed(first)
    kv.free("a")
    second = request("b", prompt + [7, 8], 1)
    blocks, tokens = kv.get_computed_blocks(second)
    assert tokens == 28 and len(blocks) == 7
    # its first query (position 28) reads 21..28: blocks 5 and 6 of the hit
    assert kv.hit_blocks_to_hold(blocks) == blocks[5:]
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(second, 32, blocks) is not None  # one new block: 28..31
    assert kv.block_tables["b"] == blocks[5:] + kv.block_tables["b"][2:]
    assert kv.num_freed_blocks("b") == 5 and kv.num_table_blocks("b") == 8
    assert kv.num_free_blocks == free_before - 3
    assert kv.prefix_cache_hits == 28  # the whole hit saved its compute
    assert all(kv.pool.ref_count(b) == 0 for b in blocks[:5])  # still cached free
    kv.check_integrity()


# ------------------------------------------------------------------------- the scheduler
def test_requests_longer_than_the_pool_fit_when_a_window_and_a_chunk_do():
    """Pool 8 blocks (32 tokens), window 8, budget 8: a request holds at most 5 blocks at a
    time, so sequences reach max_model_len (an engine without the window: the pool's 32)."""
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=8, max_model_len=400)
    assert sched.kv.max_blocks_held(8) == 5 and sched.max_total_tokens == 400
    assert make_scheduler(num_blocks=8, window=None, max_num_batched_tokens=8,
                          max_model_len=400).max_total_tokens == 32
    # a budget whose chunk and window may not fit: the pool limits the length again
    assert make_scheduler(num_blocks=8, max_num_batched_tokens=24,
                          max_model_len=400).max_total_tokens == 32
    prompts = [prompt_of(n, 50 + n) for n in (100, 70, 45)]
    reference = run(make_scheduler(num_blocks=512, window=None, max_num_batched_tokens=8,
                                   max_model_len=400),
                    [request(f"r{i}", p, 150) for i, p in enumerate(prompts)])
    out = run(sched, [request(f"r{i}", p, 150) for i, p in enumerate(prompts)],
              on_step=bounded(5))
    assert out == reference and all(len(t) == 150 for t in out.values())
    assert sched.num_preemptions > 0  # three at once do not fit: one at a time does


def bounded(window_blocks: int):
    """on_step: every request the step ran holds at most window_blocks blocks afterwards."""
    def check(sched: Scheduler, plan: SchedulerOutput) -> None:
        for seq in plan.seqs:
            held = sched.kv.block_tables.get(seq.request_id)
            if held is not None:
                assert len(held) <= window_blocks, (
                    f"{seq.request_id} holds {len(held)} blocks at {seq.context_len}")
    return check


def test_a_long_generation_holds_a_bounded_number_of_blocks():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=512)
    long = request("long", prompt_of(50, 7), 200)
    peak = []
    run(sched, [long], on_step=lambda s, _: peak.append(s.kv.pool.num_used))
    # 250 tokens would need 63 blocks; the window needs 3 between steps
    assert max(peak[1:]) <= DECODE_BOUND
    assert len(long.output_token_ids) == 200


def test_freeing_gives_the_tokens_of_keeping_every_block():
    prompts = [prompt_of(n, 10 + n) for n in (5, 17, 40, 63)]

    def outputs(window):
        sched = make_scheduler(window=window, max_num_batched_tokens=512, max_num_seqs=4)
        return run(sched, [request(f"r{i}", p, 40) for i, p in enumerate(prompts)],
                   on_step=bounded(DECODE_BOUND) if window else None)

    assert outputs(WINDOW) == outputs(None)


@pytest.mark.parametrize("budget", [1, 3, 6, 13])
def test_chunked_prefill_holds_the_window_and_the_chunk(budget):
    """A chunk of c new tokens needs its own blocks and its window's: at most
    ceil((WINDOW - 1 + c) / BLOCK_SIZE) + 1."""
    sched = make_scheduler(max_num_batched_tokens=budget)
    bound = math.ceil((WINDOW - 1 + budget) / BLOCK_SIZE) + 1
    reference = run(make_scheduler(window=None, max_num_batched_tokens=budget),
                    [request("a", prompt_of(70, 8), 30)])
    assert run(sched, [request("a", prompt_of(70, 8), 30)], on_step=bounded(bound)) == reference


def test_preempted_requests_recompute_from_the_start_and_free_again():
    """A pool too small for all of them at once: requests are preempted (all their blocks
    go back, freed entries forgotten) and recomputed from position 0 through the window."""
    prompts = [prompt_of(n, 20 + n) for n in (30, 45, 40, 22, 38)]

    def outputs(window, num_blocks):
        sched = make_scheduler(num_blocks=num_blocks, window=window, max_model_len=64,
                               max_num_batched_tokens=16, max_num_seqs=5)
        out = run(sched, [request(f"r{i}", p, 24) for i, p in enumerate(prompts)])
        return out, sched.num_preemptions

    reference, _ = outputs(None, 256)
    freed, preemptions = outputs(WINDOW, 16)
    assert preemptions > 0 and freed == reference


def test_prefix_hits_after_freed_blocks_give_the_same_tokens():
    """A shared 41-token system prompt: the first request frees its early blocks as cached
    free blocks; the next ones hit all 10 full blocks (freed ones included) and free the
    ones before their window after their first step."""
    system = prompt_of(41, 30)
    prompts = [system + prompt_of(n, 31 + n) for n in (3, 9, 20)]

    def outputs(window, caching):
        sched = make_scheduler(window=window, caching=caching, max_num_batched_tokens=24)
        model = WindowedModel(sched)
        first = run(sched, [request("r0", prompts[0], 20)], model=model)
        rest = [request(f"r{i}", p, 20) for i, p in enumerate(prompts[1:], 1)]
        out = run(sched, rest, model=model, on_step=bounded(
            math.ceil((WINDOW - 1 + 24) / BLOCK_SIZE) + 1) if window else None)
        return {**first, **out}, [r.num_cached_tokens for r in rest]

    reference, _ = outputs(None, False)
    freed, cached = outputs(WINDOW, True)
    assert freed == reference and cached == [40, 40]


def test_speculative_drafts_over_freed_blocks_give_the_same_tokens():
    prompts = [prompt_of(n, 40 + n) for n in (12, 33, 50)]

    def outputs(window, speculate):
        sched = make_scheduler(window=window, speculate=speculate, max_num_batched_tokens=64,
                               max_num_seqs=3)
        return run(sched, [request(f"r{i}", p, 50) for i, p in enumerate(prompts)])

    assert outputs(WINDOW, True) == outputs(None, False)


WORKLOAD = st.fixed_dictionaries({
    "prompts": st.lists(st.tuples(st.integers(1, 90), st.integers(1, 60), st.integers(0, 3)),
                        min_size=1, max_size=8),
    "shared": st.integers(0, 30),  # a shared prefix: prefix hits across requests
    "num_blocks": st.integers(4, 24),
    "max_model_len": st.integers(24, 200),  # often past the pool: windows make that fit
    "budget": st.integers(1, 48),
    "max_num_seqs": st.integers(1, 6),
    "caching": st.booleans(),
    "window": st.integers(1, 13),
})


@settings(deadline=None, database=None, derandomize=True, max_examples=80,
          suppress_health_check=[HealthCheck.too_slow])
@given(WORKLOAD)
def test_random_workloads_free_blocks_and_keep_the_tokens(w):
    """Any workload: integrity after every step, no block read outside the requests' own,
    a request that ran holds at most its window's and its chunk's blocks, and the tokens of
    keeping every block in a pool big enough for all (same length limit)."""
    shared = prompt_of(w["shared"], 99)
    bound = bounded(math.ceil((w["window"] - 1 + w["budget"]) / BLOCK_SIZE) + 1)

    def scheduler(window: int | None, num_blocks: int, max_model_len: int) -> Scheduler:
        kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=w["caching"],
                            sliding_window=window)
        return Scheduler(SchedulerConfig(max_num_seqs=w["max_num_seqs"],
                                         max_num_batched_tokens=w["budget"],
                                         max_model_len=max_model_len), kv)

    freeing = scheduler(w["window"], w["num_blocks"], w["max_model_len"])
    limit = freeing.max_total_tokens
    keeping = scheduler(None, 4 * 256, limit)
    assert keeping.max_total_tokens == limit

    def outputs(sched: Scheduler):
        model = WindowedModel(sched, w["window"])
        requests = [request(f"r{i}", (shared + prompt_of(n, i))[:limit - 1], m)
                    for i, (n, m, _) in enumerate(w["prompts"])]
        pending = sorted(zip((a for _, _, a in w["prompts"]), range(len(requests))))
        steps = 0
        while pending or sched.has_unfinished():
            while pending and pending[0][0] <= steps:
                sched.add_request(requests[pending.pop(0)[1]])
            plan = sched.schedule()
            sched.update(plan, model(plan))
            sched.check_integrity()
            if sched.kv.sliding_window is not None:
                bound(sched, plan)
            steps += 1
            assert steps < 5_000
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        return [r.output_token_ids for r in requests]

    assert outputs(freeing) == outputs(keeping)
