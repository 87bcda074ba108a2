"""LLMEngine.score / ModelRunner.score: teacher-forced logits in one pass, blocks returned."""

from __future__ import annotations

import torch

from slotserve.sampling import SamplingParams
from tests.conftest import random_prompts, tiny_engine


def test_score_matches_hf_logits_and_returns_its_blocks(tiny_llama):
    engine = tiny_engine(tiny_llama, num_blocks=64, kernels="reference")
    ids = random_prompts(1, min_len=40, max_len=40, seed=3)[0]
    free_before = engine.kv.num_free_blocks
    logits = engine.score(ids)  # (L, V)
    with torch.no_grad():
        expected = tiny_llama(torch.tensor([ids])).logits[0]
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert engine.kv.num_free_blocks == free_before
    engine.check_integrity()


def test_score_agrees_with_greedy_generation(tiny_llama):
    engine = tiny_engine(tiny_llama, num_blocks=64)
    prompt = random_prompts(1, min_len=20, max_len=20, seed=5)[0]
    engine.add_request("g", prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    generated = out.outputs[0].token_ids
    forced = engine.score(prompt + generated[:-1])[len(prompt) - 1:].argmax(-1).tolist()
    assert forced == generated
