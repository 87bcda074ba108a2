"""Prompt logprobs (issue 34, item 3): computed in the prefill chunks that run anyway, exact
against log_softmax of HF transformers' full-sequence forward (tiny Llama, fp32), whatever the
chunking, the batch, preemption or the prefix cache (a request that asks bypasses it)."""

from __future__ import annotations

import pytest
import torch

from slotserve.runner.prompt_logprobs import PromptLogprobs
from slotserve.sampling import SamplingParams
from tests.conftest import random_prompts, tiny_engine

TOL = 1e-4


def hf_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """(L - 1, V): log_softmax of HF's logits at positions 0..L-2 (each predicts the next)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


def run(engine, prompts, params_of) -> dict[str, object]:
    """Run every prompt to the end; the last output of each request (completion 0's)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params_of(i))
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].index == 0:
                last[out.request_id] = out
        engine.check_integrity()
    return last


def check_exact(out, prompt: list[int], expected: torch.Tensor, top_n: int) -> None:
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None and out.prompt_logprob_ranks[0] is None
    for pos, (entry, rank) in enumerate(zip(out.prompt_logprobs[1:],
                                           out.prompt_logprob_ranks[1:])):
        row = expected[pos]
        token = prompt[pos + 1]
        assert entry[token] == pytest.approx(float(row[token]), abs=TOL)
        top_vals, top_ids = row.topk(top_n)
        for t, v in zip(top_ids.tolist(), top_vals.tolist()):
            assert entry[t] == pytest.approx(v, abs=TOL)
        assert set(entry) == set(top_ids.tolist()) | {token}
        assert rank == int((row > row[token]).sum()) + 1


@pytest.mark.parametrize("budget", [512, 16])
def test_prompt_logprobs_equal_a_full_forward(tiny_llama, budget):
    prompts = random_prompts(5, min_len=2, max_len=60, seed=3)
    engine = tiny_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=budget,
                         block_size=8)
    tops = [0, 1, 5, 20, 3]
    outs = run(engine, prompts, lambda i: SamplingParams(
        max_tokens=3, temperature=0, prompt_logprobs=tops[i]))
    for i, prompt in enumerate(prompts):
        check_exact(outs[f"r{i}"], prompt, hf_logprobs(tiny_llama, prompt), tops[i])


def test_requests_without_prompt_logprobs_get_none_and_the_same_tokens(tiny_llama):
    prompts = random_prompts(3, seed=4)
    plain = run(tiny_engine(tiny_llama), prompts,
                lambda i: SamplingParams(max_tokens=6, temperature=0))
    mixed = run(tiny_engine(tiny_llama), prompts, lambda i: SamplingParams(
        max_tokens=6, temperature=0, prompt_logprobs=2 if i == 1 else None))
    for rid, out in plain.items():
        assert out.prompt_logprobs is None
        assert mixed[rid].token_ids == out.token_ids
    assert mixed["r1"].prompt_logprobs is not None and mixed["r0"].prompt_logprobs is None


def test_one_token_prompt_has_only_none(tiny_llama):
    outs = run(tiny_engine(tiny_llama), [[7]], lambda i: SamplingParams(
        max_tokens=2, temperature=0, prompt_logprobs=3))
    assert outs["r0"].prompt_logprobs == [None]


def test_prefix_cache_hits_are_bypassed(tiny_llama):
    """A prompt computed before (so cached) still gets all its prompt logprobs, exact; a
    request without them still hits the cache."""
    prompt = random_prompts(1, min_len=40, max_len=40, seed=5)[0]
    engine = tiny_engine(tiny_llama, block_size=8, enable_prefix_caching=True)
    first = run(engine, [prompt], lambda i: SamplingParams(max_tokens=2, temperature=0))
    assert first["r0"].prompt_logprobs is None
    again = run(engine, [prompt], lambda i: SamplingParams(max_tokens=2, temperature=0,
                                                           prompt_logprobs=4))
    assert again["r0"].num_cached_tokens == 0
    check_exact(again["r0"], prompt, hf_logprobs(tiny_llama, prompt), 4)
    plain = run(engine, [prompt], lambda i: SamplingParams(max_tokens=2, temperature=0))
    assert plain["r0"].num_cached_tokens > 0


def test_n_completions_compute_them_once(tiny_llama):
    prompt = random_prompts(1, min_len=30, max_len=30, seed=6)[0]
    engine = tiny_engine(tiny_llama, block_size=8, enable_prefix_caching=True)
    engine.add_request("r", prompt, SamplingParams(max_tokens=3, temperature=0, n=3,
                                                   prompt_logprobs=2))
    by_index = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            by_index[out.outputs[0].index] = out
    check_exact(by_index[0], prompt, hf_logprobs(tiny_llama, prompt), 2)
    assert by_index[1].prompt_logprobs is None and by_index[2].prompt_logprobs is None


def test_preemption_keeps_them_exact(tiny_llama):
    """A KV pool too small for every prompt at once: requests are preempted mid-prefill or
    after it, and recompute; every entry is still exact (none twice, none missing)."""
    prompts = random_prompts(4, min_len=40, max_len=60, seed=7)
    engine = tiny_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
                         num_blocks=14, enable_prefix_caching=True)
    outs = run(engine, prompts, lambda i: SamplingParams(max_tokens=20, temperature=0,
                                                         ignore_eos=True, prompt_logprobs=1))
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        check_exact(outs[f"r{i}"], prompt, hf_logprobs(tiny_llama, prompt), 1)


def test_a_hole_in_the_positions_is_an_error():
    acc = PromptLogprobs([1, 2, 3, 4, 5], 1)
    assert acc.rows_to_compute(0, 2) == range(0, 2)
    with pytest.raises(ValueError, match="skipped"):
        acc.rows_to_compute(2, 2)
    acc.add(torch.zeros(4, 8).log_softmax(dim=-1), 0)
    assert acc.complete and acc.rows_to_compute(0, 5) == range(0)  # recomputed: nothing new
    assert acc.rows_to_compute(4, 1) == range(0)  # the last prompt row predicts nothing
    with pytest.raises(ValueError, match="after"):
        acc.add(torch.zeros(1, 8), 2)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_values_name_the_field(value):
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
