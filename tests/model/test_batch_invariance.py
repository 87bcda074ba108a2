"""A request's greedy output does not depend on who else is in the batch.

One batch of 12+ ragged requests under continuous, static, chunked prefill with a small
budget, and a KV pool so small that preemption must happen: all equal the output of each
request run alone (DESIGN.md's rule: equal ids, or a differing token in the other's top-5).
"""

from __future__ import annotations

import pytest

from slotserve import SamplingParams
from tests.conftest import random_prompts, tiny_llm

MAX_TOKENS = [5 + (7 * i) % 23 for i in range(14)]  # ragged output lengths 5..27


def run(model, prompts, **engine_kwargs):
    llm = tiny_llm(model, block_size=8, **engine_kwargs)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=5)
              for m in MAX_TOKENS]
    outputs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    return llm, outputs


def assert_close(reference, outputs):
    """vLLM's check_logprobs_close: first differing token must be in the other's top-5."""
    for ref, out in zip(reference, outputs):
        a, b = ref.token_ids, out.token_ids
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                assert y in ref.outputs[0].logprobs[i] and x in out.outputs[0].logprobs[i], (
                    f"token {i}: {x} vs {y} not within each other's top-5")
                break


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(len(MAX_TOKENS), min_len=2, max_len=60, seed=7)


@pytest.fixture(scope="module")
def alone(tiny_llama, prompts):
    """Each request run by itself: the reference."""
    llm = tiny_llm(tiny_llama, block_size=8, max_num_seqs=1, num_blocks=64)
    outs = []
    for prompt, m in zip(prompts, MAX_TOKENS):
        outs += llm.generate([prompt], SamplingParams(max_tokens=m, temperature=0.0,
                                                      ignore_eos=True, logprobs=5))
    return outs


def test_continuous_equals_alone(tiny_llama, prompts, alone):
    _, outputs = run(tiny_llama, prompts, max_num_seqs=6, num_blocks=256)
    assert_close(alone, outputs)


def test_static_equals_alone(tiny_llama, prompts, alone):
    _, outputs = run(tiny_llama, prompts, max_num_seqs=6, num_blocks=256, batching="static")
    assert_close(alone, outputs)


def test_chunked_prefill_small_budget_equals_alone(tiny_llama, prompts, alone):
    llm, outputs = run(tiny_llama, prompts, max_num_seqs=8, num_blocks=256,
                       max_num_batched_tokens=16)
    assert_close(alone, outputs)
    # Prompts longer than the budget really were split over several iterations.
    trace = llm.engine.trace.export()
    prefill_chunks = [s for it in trace["iterations"] for s in it["slots"]
                      if s and s["kind"] == "prefill" and s["tokens"] < 60]
    assert max(it_tokens(it) for it in trace["iterations"]) <= 16
    assert prefill_chunks


def it_tokens(iteration):
    return sum(s["tokens"] for s in iteration["slots"] if s)


def test_preemption_equals_alone(tiny_llama, prompts, alone):
    # 14 blocks of 8 = 112 positions for 8 slots of up to 87 tokens: preemption is certain.
    llm, outputs = run(tiny_llama, prompts, max_num_seqs=8, num_blocks=14)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert_close(alone, outputs)
    assert llm.engine.kv.num_free_blocks == 14
