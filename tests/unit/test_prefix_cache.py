"""Prefix caching with a fake runner (no torch) that keeps real "K/V" (the token ids).

The fake runner writes each new token into its block slot, then reads the whole context back
through the block table and checks it is the request's own tokens: a wrong hit, a stale or
evicted block, or a shared block written would all show up. Its next token is a function of
the context it read, so caching on and off must produce the same tokens.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.config import SchedulerConfig
from slotserve.core.block_pool import BlockPool, hash_block
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.outputs import RunnerOutput, SchedulerOutput
from slotserve.core.scheduler import Scheduler
from slotserve.request import Request, RequestStatus
from slotserve.sampling import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, caching=True, **kwargs) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(**kwargs), kv)


def make_request(rid: str, prompt: list[int], max_tokens: int,
                 cache_salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, list(prompt), params, cache_salt=cache_salt)


class KVRunner:
    """A fake model over a fake KV store: (block, offset) -> token id."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.store: dict[tuple[int, int], int] = {}
        self.computed_tokens = 0  # K/V positions written (prefill and decode)

    def __call__(self, plan: SchedulerOutput) -> RunnerOutput:
        kv, size = self.sched.kv, self.sched.kv.block_size
        sampled = {}
        for seq in plan.seqs:
            for i, token in enumerate(seq.token_ids):
                pos = seq.start_pos + i
                block = seq.block_table[pos // size]
                assert kv.pool.ref_count(block) == 1, f"writes into shared block {block}"
                assert kv.pool.hash_of(block) is None, f"writes into cached block {block}"
                self.store[(block, pos % size)] = token
            self.computed_tokens += seq.num_tokens
            context = [self.store.get((seq.block_table[p // size], p % size))
                       for p in range(seq.context_len)]
            request = self.sched.requests[seq.request_id]
            assert context == request.all_token_ids[:seq.context_len], "wrong K/V read"
            if seq.sample:
                sampled[seq.request_id] = 3 + hash(tuple(context)) % 5
        return RunnerOutput(sampled=sampled)


def step(sched: Scheduler, runner: KVRunner) -> SchedulerOutput:
    plan = sched.schedule()
    cfg = sched.config
    assert plan.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    sched.update(plan, runner(plan))
    sched.check_integrity()
    return plan


def run_to_end(sched: Scheduler, runner: KVRunner, max_steps: int = 5_000) -> int:
    steps = 0
    while sched.has_unfinished() and steps < max_steps:
        step(sched, runner)
        steps += 1
    assert not sched.has_unfinished(), "did not finish"
    return steps


# ------------------------------------------------------------------------- hashing
def test_block_hash_depends_on_parent_tokens_and_salt():
    base = hash_block(None, [1, 2, 3, 4], None)
    assert base == hash_block(None, [1, 2, 3, 4], None)
    assert base != hash_block(None, [1, 2, 3, 5], None)
    assert base != hash_block(None, [1, 2, 3, 4], "tenant")
    assert hash_block(None, [1, 2, 3, 4], "a") != hash_block(None, [1, 2, 3, 4], "b")
    assert hash_block(base, [5, 6], None) != hash_block(hash_block(None, [9], None), [5, 6], None)


def test_block_hash_is_stable_across_processes():
    code = ("from slotserve.core.block_pool import hash_block;"
            "print(hash_block(hash_block(None, [1, 2], 's'), [3, 4], 's').hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed, "PYTHONPATH": ":".join(sys.path)},
                           check=True).stdout.strip() for seed in ("1", "2")}
    assert outs == {hash_block(hash_block(None, [1, 2], "s"), [3, 4], "s").hex()}


# ------------------------------------------------------------------------- block pool
def test_pool_takes_plain_blocks_before_evicting_cached_ones_lru():
    pool = BlockPool(4)
    blocks = pool.allocate(3)  # 0, 1, 2
    for block, name in zip(blocks, (b"a", b"b", b"c")):
        assert pool.cache_block(block, name)
    pool.free([2, 0, 1])  # freed in this order: 2 is the least recently used
    assert pool.num_free == 4 and pool.num_cached == 3
    assert pool.allocate(1) == [3]  # the never-hashed block first
    assert pool.lookup(b"c") == 2
    assert pool.allocate(1) == [2]  # then the LRU cached one, whose hash goes
    assert pool.lookup(b"c") is None and pool.num_evictions == 1
    pool.touch([pool.lookup(b"a")])  # a hit takes a free cached block out of the queue
    assert pool.ref_count(0) == 1 and pool.num_free == 1
    assert pool.allocate(1) == [1]
    pool.check_integrity()


def test_pool_keeps_the_first_block_of_a_duplicate_hash():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    assert pool.cache_block(first, b"h")
    assert not pool.cache_block(second, b"h")
    assert pool.lookup(b"h") == first and pool.hash_of(second) is None
    pool.free([first, second])
    pool.check_integrity()


def test_integrity_check_catches_a_shared_writable_block():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    request = make_request("a", list(range(1, 7)), 1)
    kv.allocate_slots(request, 6, [])
    kv.check_integrity()
    kv.block_tables["b"] = [kv.block_tables["a"][1]]  # a second holder of an uncached block
    kv.pool._ref_counts[kv.block_tables["a"][1]] += 1
    with pytest.raises(AssertionError, match="writable but shared"):
        kv.check_integrity()


# ------------------------------------------------------------------------- scheduler
def test_second_request_starts_after_the_cached_prefix():
    sched = make_scheduler(block_size=4)
    runner = KVRunner(sched)
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks + 2
    first, second = make_request("a", prompt, 3), make_request("b", prompt + [99], 3)
    sched.add_request(first)
    run_to_end(sched, runner)
    runner.computed_tokens = 0
    sched.add_request(second)
    plan = step(sched, runner)
    assert plan.seqs[0].start_pos == 8 and plan.seqs[0].num_tokens == 3
    assert second.num_cached_tokens == 8
    assert (sched.kv.prefix_cache_queries, sched.kv.prefix_cache_hits) == (10 + 11, 8)
    run_to_end(sched, runner)
    assert runner.computed_tokens == 3 + 2  # its 3 uncached prompt tokens, then 2 decodes


def test_fully_cached_prompt_recomputes_its_last_block_in_a_block_of_its_own():
    sched = make_scheduler(block_size=4)
    runner = KVRunner(sched)
    prompt = list(range(10, 18))  # exactly 2 blocks
    sched.add_request(make_request("a", prompt, 1))
    run_to_end(sched, runner)
    again = make_request("b", prompt, 1)
    sched.add_request(again)
    plan = step(sched, runner)  # the runner asserts it writes no shared block
    assert plan.seqs[0].start_pos == 4 and again.num_cached_tokens == 4
    assert again.output_token_ids  # sampled after the recomputed last token


def test_generated_tokens_are_cached_for_the_next_turn():
    sched = make_scheduler(block_size=4)
    runner = KVRunner(sched)
    turn1 = make_request("t1", list(range(10, 16)), 7)  # 6 + 7 = 13 tokens: 3 full blocks
    sched.add_request(turn1)
    run_to_end(sched, runner)
    history = turn1.all_token_ids
    turn2 = make_request("t2", history + [50, 51, 52], 2)
    sched.add_request(turn2)
    step(sched, runner)
    # Turn 1 computed the K/V of its first 12 tokens (never of its last sampled one): 3 full
    # blocks, 6 prompt and 6 answer tokens, all hit by turn 2.
    assert turn2.num_cached_tokens == 12


def test_different_salts_never_share():
    sched = make_scheduler(block_size=4)
    runner = KVRunner(sched)
    prompt = list(range(10, 30))
    sched.add_request(make_request("a", prompt, 1, cache_salt="x"))
    run_to_end(sched, runner)
    for rid, salt, hit in (("b", "y", 0), ("c", None, 0), ("d", "x", 16)):
        request = make_request(rid, prompt, 1, cache_salt=salt)
        sched.add_request(request)
        run_to_end(sched, runner)
        assert request.num_cached_tokens == hit, rid


def test_caching_off_never_hits():
    sched = make_scheduler(block_size=4, caching=False)
    runner = KVRunner(sched)
    for rid in "ab":
        sched.add_request(make_request(rid, list(range(10, 30)), 2))
        run_to_end(sched, runner)
    assert runner.computed_tokens == 2 * (20 + 1)
    assert sched.kv.prefix_cache_queries == 0 and sched.kv.pool.num_cached == 0


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("budget", [4, 7, 64])
def test_n_copies_of_a_prompt_compute_its_blocks_once(policy, budget):
    """The n completions of one prompt: the later ones wait for the first one's blocks."""
    sched = make_scheduler(block_size=4, max_num_batched_tokens=budget, policy=policy)
    runner = KVRunner(sched)
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks, then 1
    copies = [make_request(f"r#{i}", prompt, 1) for i in range(4)]
    for request in copies:
        sched.add_request(request)
    run_to_end(sched, runner)
    # The first computes all 21; each other copy only the token after the 5 cached blocks.
    assert runner.computed_tokens == 21 + 3 * 1
    assert [r.num_cached_tokens for r in copies] == [0, 20, 20, 20]
    assert len({tuple(r.output_token_ids) for r in copies}) == 1


# ------------------------------------------------------------------------- property test
def shared_prefix_workload(rng: random.Random, n: int, block_size: int):
    """(arrival iteration, request id, prompt, max_tokens, salt, copies) with shared starts."""
    prefixes = [[rng.randint(3, 9) for _ in range(rng.randint(0, 3 * block_size))]
                for _ in range(3)]
    work = []
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randint(3, 9) for _ in range(rng.randint(1, 9))]
        salt = rng.choice([None, None, None, "s"])
        work.append((rng.randint(0, 25), f"r{i}", prompt, rng.randint(1, 12), salt,
                     rng.choice([1, 1, 1, 3])))
    return sorted(work, key=lambda w: w[0])


def run_workload(work, caching: bool, abort_seed: int, **kwargs):
    sched = make_scheduler(caching=caching, **kwargs)
    runner = KVRunner(sched)
    rng = random.Random(abort_seed)
    pending = list(work)
    requests: dict[str, Request] = {}
    aborted: set[str] = set()
    for it in range(5_000):
        while pending and pending[0][0] <= it:
            _, rid, prompt, max_tokens, salt, copies = pending.pop(0)
            for c in range(copies):
                request = make_request(f"{rid}#{c}", prompt, max_tokens, salt)
                sched.add_request(request)
                requests[request.request_id] = request
        if rng.random() < 0.03 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.abort_request(victim)
            aborted.add(victim)
        step(sched, runner)
        if not pending and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.kv.block_tables
    return requests, aborted, sched, runner


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    policy=st.sampled_from(["continuous", "static"]),
    slots=st.integers(1, 6),
    budget=st.integers(1, 40),
    num_blocks=st.integers(8, 40),
    n=st.integers(1, 10),
)
def test_random_shared_prefixes_produce_the_uncached_tokens(seed, policy, slots, budget,
                                                           num_blocks, n):
    rng = random.Random(seed)
    work = shared_prefix_workload(rng, n, block_size=4)
    kwargs = dict(num_blocks=num_blocks, block_size=4, max_num_seqs=slots,
                  max_num_batched_tokens=budget, policy=policy)
    cached, cached_aborted, sched, _ = run_workload(work, True, seed, **kwargs)
    plain, plain_aborted, _, _ = run_workload(work, False, seed, **kwargs)
    for rid, request in cached.items():
        if rid in cached_aborted or rid in plain_aborted:
            continue
        assert request.status != RequestStatus.FINISHED_ABORTED
        assert request.output_token_ids == plain[rid].output_token_ids, rid
    assert sched.kv.prefix_cache_hits <= sched.kv.prefix_cache_queries
