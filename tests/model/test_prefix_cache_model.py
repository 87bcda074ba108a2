"""Prefix caching on the tiny model: the same tokens as without it, fewer tokens computed.

Prompts share prefixes (and some are equal); each engine configuration runs once with
caching and once without: greedy and seeded sampling must give the same token ids, under
chunked prefill, a KV pool small enough to preempt and evict, static and continuous.
A cached block's K/V are read by a prefill chunk that starts at a nonzero position.
"""

from __future__ import annotations

import random

import pytest

from slotserve import SamplingParams
from tests.conftest import tiny_llm

BLOCK = 8


@pytest.fixture(scope="module")
def shared_prompts() -> list[list[int]]:
    rng = random.Random(3)
    prefixes = [[rng.randint(3, 511) for _ in range(n)] for n in (19, 37, 50)]
    prompts = []
    for i in range(12):
        suffix = [rng.randint(3, 511) for _ in range(rng.randint(1, 12))]
        prompts.append(prefixes[i % 3] + suffix)
    prompts.append(list(prompts[4]))  # an exact repeat
    prompts.append(prefixes[1][:32])  # a prompt that is whole blocks of another's prefix
    return prompts


def generate(model, prompts, params, caching: bool, **kwargs):
    llm = tiny_llm(model, block_size=BLOCK, enable_prefix_caching=caching, **kwargs)
    outputs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    return llm, [[c.token_ids for c in out.outputs] for out in outputs]


CONFIGS = {
    "continuous": dict(max_num_seqs=6, num_blocks=256),
    "chunked": dict(max_num_seqs=6, num_blocks=256, max_num_batched_tokens=16),
    "preempt": dict(max_num_seqs=8, num_blocks=24, max_num_batched_tokens=40),
    "static": dict(max_num_seqs=5, num_blocks=64, batching="static"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_tokens_equal_uncached(tiny_llama, shared_prompts, name):
    params = [SamplingParams(max_tokens=4 + (5 * i) % 17, temperature=0.0, ignore_eos=True)
              for i in range(len(shared_prompts))]
    cached_llm, cached = generate(tiny_llama, shared_prompts, params, True, **CONFIGS[name])
    _, plain = generate(tiny_llama, shared_prompts, params, False, **CONFIGS[name])
    assert cached == plain
    stats = cached_llm.engine.stats
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_hits <= stats.prefix_cache_queries
    if name == "preempt":
        assert cached_llm.engine.scheduler.num_preemptions > 0
        assert cached_llm.engine.kv.pool.num_evictions > 0


def test_seeded_sampling_and_n_equal_uncached(tiny_llama, shared_prompts):
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i,
                             n=1 + i % 3, ignore_eos=True)
              for i in range(len(shared_prompts))]
    kwargs = dict(max_num_seqs=8, num_blocks=48, max_num_batched_tokens=32)
    cached_llm, cached = generate(tiny_llama, shared_prompts, params, True, **kwargs)
    _, plain = generate(tiny_llama, shared_prompts, params, False, **kwargs)
    assert cached == plain
    assert cached_llm.engine.stats.prefix_cache_hits > 0


def count_prefill_tokens(llm) -> list[int]:
    """Wrap the runner: record the prefill tokens each forward computes."""
    counts: list[int] = []
    execute = llm.engine.runner.execute

    def counting(plan):
        counts.append(sum(s.num_tokens for s in plan.seqs if s.kind == "prefill"))
        return execute(plan)

    llm.engine.runner.execute = counting
    return counts


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_n_completions_prefill_the_prompt_once(tiny_llama, policy):
    prompt = random.Random(5).sample(range(3, 511), 45)  # 5 full blocks of 8, then 5 tokens
    params = SamplingParams(n=4, max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)
    outs = {}
    for caching in (True, False):
        llm = tiny_llm(tiny_llama, block_size=BLOCK, enable_prefix_caching=caching,
                       batching=policy)
        counts = count_prefill_tokens(llm)
        outs[caching] = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
        llm.engine.check_integrity()
        # Uncached: each completion prefills all 45; cached: the first does, the other three
        # only the 5 tokens after the cached blocks.
        assert sum(counts) == (45 + 3 * 5 if caching else 4 * 45)
    assert outs[True] == outs[False]


def test_next_turn_hits_the_previous_answer(tiny_llama):
    llm = tiny_llm(tiny_llama, block_size=BLOCK)
    turn1 = random.Random(9).sample(range(3, 511), 12)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    answer = llm.generate([turn1], params)[0].outputs[0].token_ids
    turn2 = turn1 + answer + [7, 8, 9]
    hits_before = llm.engine.stats.prefix_cache_hits
    counts = count_prefill_tokens(llm)
    cached_out = llm.generate([turn2], params)[0].outputs[0].token_ids
    # 12 + 20 = 32 tokens, of which the first 31 have K/V: 3 full blocks of 8 are cached.
    assert llm.engine.stats.prefix_cache_hits - hits_before == 24
    assert counts[0] == len(turn2) - 24
    plain = tiny_llm(tiny_llama, block_size=BLOCK, enable_prefix_caching=False)
    assert cached_out == plain.generate([turn2], params)[0].outputs[0].token_ids


def test_cache_salt_separates_and_is_validated(tiny_llama):
    llm = tiny_llm(tiny_llama, block_size=BLOCK)
    engine = llm.engine
    prompt = random.Random(11).sample(range(3, 511), 30)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    hits = []
    for rid, salt in (("a", "alice"), ("b", "bob"), ("c", "alice")):
        before = engine.stats.prefix_cache_hits
        engine.add_request(rid, prompt, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        hits.append(engine.stats.prefix_cache_hits - before)
    assert hits == [0, 0, 24]
    for bad in ("", 5):
        with pytest.raises(ValueError, match="cache_salt"):
            engine.add_request("bad", prompt, params, cache_salt=bad)
    assert not engine.has_unfinished_requests()
