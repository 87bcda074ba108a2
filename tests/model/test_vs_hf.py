"""Greedy token ids equal HF transformers' generate on the same weights."""

from __future__ import annotations

import pytest
import torch

from slotserve import SamplingParams
from tests.conftest import HAS_CXX, random_prompts, tiny_llm


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kernels", ["auto", "mkl", "reference"])
@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_llama_tied", "tiny_qwen2"])
def test_greedy_matches_hf(model_name, kernels, request):
    model = request.getfixturevalue(model_name)
    # Prompts of 3..40 tokens with 20 new tokens: contexts cross the 8-token block boundaries.
    prompts = random_prompts(6, min_len=3, max_len=40, seed=3)
    llm = tiny_llm(model, block_size=8, num_blocks=128, kernels=kernels)
    if kernels == "auto" and HAS_CXX:  # the fused kernels are what is tested
        assert llm.engine.runner.fused_cpu_ops
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(model, prompt, 20)
    llm.engine.check_integrity()
