"""Sliding-window models (Mistral's window on every layer, Qwen2's on layers from
max_window_layers on) give HF transformers' greedy tokens on the fp32 path, with prompts
well past the window, through every attention path: prefill, chunked prefill, decode (the
torch path, the fused kernel, the decode stack) and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from slotserve import SamplingParams
from slotserve.config import ModelConfig
from tests.conftest import HAS_CXX, random_prompts, tiny_engine, tiny_llm
from tests.model.test_decode_stack import run_comparing_stack_and_python
from tests.model.test_vs_hf import hf_greedy

WINDOW = 24
BLOCK_SIZE = 16
NEW_TOKENS = 16


def tiny_window_model(kind: str, seed: int = 4):
    """A small random MistralForCausalLM (window 24 on every layer) or Qwen2ForCausalLM with
    use_sliding_window (layer 0 full, layers 1-2 windowed: max_window_layers=1)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, sliding_window=WINDOW)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1e6, use_sliding_window=True,
                                       max_window_layers=1)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.MistralConfig(**common, rope_theta=10000.0)
        model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_mistral():
    return tiny_window_model("mistral")


@pytest.fixture(scope="module")
def tiny_qwen2_window():
    return tiny_window_model("qwen2", seed=5)


PROMPTS = random_prompts(6, min_len=10, max_len=80, seed=11)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral_hf_tokens(tiny_mistral):
    return [hf_greedy(tiny_mistral, prompt, NEW_TOKENS) for prompt in PROMPTS]


def test_the_configs_windows(tiny_mistral, tiny_qwen2_window):
    assert ModelConfig.from_hf_dict(tiny_mistral.config.to_dict()).sliding_windows == (24,) * 3
    qwen = ModelConfig.from_hf_dict(tiny_qwen2_window.config.to_dict())
    assert qwen.sliding_windows == (None, 24, 24)
    assert max(len(p) for p in PROMPTS) > 3 * WINDOW  # well past the window


def test_the_window_changes_hf_tokens(tiny_mistral, mistral_hf_tokens):
    """Otherwise the tests below would prove nothing: full attention gives other tokens."""
    tiny_mistral.config.sliding_window = None
    try:
        full = [hf_greedy(tiny_mistral, prompt, NEW_TOKENS) for prompt in PROMPTS]
    finally:
        tiny_mistral.config.sliding_window = WINDOW
    assert sum(a != b for a, b in zip(full, mistral_hf_tokens)) >= 3


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("budget", [512, 20], ids=["whole-prefill", "chunked-prefill"])
def test_mistral_greedy_matches_hf(tiny_mistral, mistral_hf_tokens, kernels, budget):
    """auto: the fused decode kernel and the decode stack; reference: torch's paths."""
    llm = tiny_llm(tiny_mistral, block_size=BLOCK_SIZE, num_blocks=128, kernels=kernels,
                   max_num_batched_tokens=budget)
    if kernels == "auto" and HAS_CXX:
        assert llm.engine.runner.fused_cpu_ops
        assert llm.engine.runner.model.decode_stack is not None
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [out.token_ids for out in outputs] == mistral_hf_tokens
    llm.engine.check_integrity()


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_mistral_prefix_cache_hits_match_hf(tiny_mistral, kernels):
    """A 56-token system prefix (3.5 blocks, past the window) cached by the first request;
    the rest start after its 3 full blocks and read them through the window."""
    prefix = random_prompts(1, min_len=56, max_len=56, seed=12)[0]
    tails = random_prompts(4, min_len=3, max_len=40, seed=13)
    prompts = [prefix + tail for tail in tails]
    llm = tiny_llm(tiny_mistral, block_size=BLOCK_SIZE, num_blocks=128, kernels=kernels,
                   max_num_batched_tokens=24)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    assert [out.num_cached_tokens for out in rest] == [48, 48, 48]
    for prompt, out in zip(prompts, first + rest):
        assert out.token_ids == hf_greedy(tiny_mistral, prompt, NEW_TOKENS)
    llm.engine.check_integrity()


def test_mistral_preemption_matches_hf(tiny_mistral, mistral_hf_tokens):
    """A pool too small for all six: requests are preempted and recomputed through the
    window, and still give HF's tokens.

    NOTE: 13 blocks preempt twice with held first tokens (the default); 14 preempted once
    before them and not at all with them (the schedule, not the window, decides)."""
    llm = tiny_llm(tiny_mistral, block_size=BLOCK_SIZE, num_blocks=13, kernels="auto",
                   max_num_batched_tokens=64)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert sum(out.outputs[0].metrics.num_preemptions for out in outputs) > 0
    assert [out.token_ids for out in outputs] == mistral_hf_tokens
    llm.engine.check_integrity()


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_qwen2_window_layers_match_hf(tiny_qwen2_window, kernels):
    """use_sliding_window with max_window_layers=1: layer 0 attends fully, 1 and 2 slide."""
    llm = tiny_llm(tiny_qwen2_window, block_size=BLOCK_SIZE, num_blocks=128, kernels=kernels,
                   max_num_batched_tokens=32)
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(tiny_qwen2_window, prompt, NEW_TOKENS)


def test_decode_stack_equals_python_layers_with_windows(cpu_ops, tiny_qwen2_window):
    """The stack's per-layer windows (a full layer, then windowed ones) bit for bit."""
    engine = tiny_engine(tiny_qwen2_window, block_size=BLOCK_SIZE, kernels="auto")
    assert engine.runner.model.decode_stack is not None
    decode_only = run_comparing_stack_and_python(engine, PROMPTS[:4], max_tokens=24)
    assert decode_only >= 15


def test_bf16_weights_agree_with_fp32_on_a_windowed_model(tiny_mistral):
    from slotserve.lab.quality import greedy_agreement

    prompts = random_prompts(6, min_len=30, max_len=80, seed=14)

    def engine(quantization):
        return tiny_engine(tiny_mistral, block_size=BLOCK_SIZE, num_blocks=128,
                           quantization=quantization)

    agreement = greedy_agreement(engine("none"), engine("bf16"), prompts, max_tokens=24)
    assert agreement.tokens == 6 * 24
    assert agreement.teacher_forced >= 0.97, agreement
