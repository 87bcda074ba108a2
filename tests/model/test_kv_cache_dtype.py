"""CacheConfig.kv_cache_dtype: "auto" resolves from the weights; a bf16 cache holds half the
bytes, and the fused kernels and the torch reference agree over it."""

from __future__ import annotations

import pytest
import torch

from slotserve.config import engine_config
from slotserve.model.kernels import KernelSet, resolve_kv_cache_dtype
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine


@pytest.mark.parametrize("weights,setting,expected", [
    ("fp32", "auto", torch.float32),      # the reference stays fp32 end to end
    ("bf16", "auto", torch.bfloat16),
    ("int8", "auto", torch.bfloat16),
    ("bf16", "float32", torch.float32),   # named: as named
    ("fp32", "bfloat16", torch.bfloat16),
])
def test_auto_follows_the_weights(weights, setting, expected):
    assert resolve_kv_cache_dtype(setting, KernelSet(weights=weights), torch.float32) == expected


def test_auto_keeps_a_bf16_model_in_its_dtype():
    assert resolve_kv_cache_dtype("auto", KernelSet(weights="bfloat16"),
                                  torch.bfloat16) == torch.bfloat16


def test_a_bad_setting_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine_config(kv_cache_dtype="fp8")


def test_a_bf16_cache_halves_the_block_bytes_and_the_snapshot_says_so(tiny_llama):
    fp32 = tiny_engine(tiny_llama, num_blocks=8)
    bf16 = tiny_engine(tiny_llama, num_blocks=8, kv_cache_dtype="bfloat16")
    assert fp32.runner.kv_caches[0][0].dtype == torch.float32
    assert bf16.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert bf16.snapshot().kv_block_bytes * 2 == fp32.snapshot().kv_block_bytes
    assert (fp32.snapshot().kv_cache_dtype, bf16.snapshot().kv_cache_dtype) == ("float32",
                                                                                "bfloat16")


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_fused_kernels_and_torch_agree_over_a_bf16_cache(tiny_llama, cpu_ops):
    """Prefill chunks (torch attention over the gathered cache), then decodes (the fused
    kernel or torch's), with K/V stored as bf16 by each path: the same greedy tokens."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)] for i in range(5)]
    kwargs = dict(num_blocks=64, kv_cache_dtype="bfloat16", max_num_batched_tokens=16)
    fused = tiny_engine(tiny_llama, **kwargs)
    reference = tiny_engine(tiny_llama, kernels="reference", **kwargs)
    assert fused.runner.fused_cpu_ops and not reference.runner.fused_cpu_ops
    assert greedy(fused, prompts, 24) == greedy(reference, prompts, 24)
