"""Each family (Qwen3, Gemma 2, Gemma 3 text, Phi-3, Llama with biases) gives HF
transformers' greedy tokens on the fp32 path: tiny random HF models saved as safetensors,
loaded as a user would (`LLM(<dir>, quantization="none")`), ragged prompts, chunked prefill
(a 16-token budget), prefix-cache hits, preemption, fused and reference kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slotserve import LLM, SamplingParams
from slotserve.config import ModelConfig
from slotserve.model.families import FAMILIES, decode_stack_gaps
from tests.conftest import HAS_CXX, random_prompts, tiny_engine
from tests.model.test_vs_hf import hf_greedy

NEW_TOKENS = 12
PROMPTS = random_prompts(5, min_len=3, max_len=44, seed=21)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
# model_type -> the tiny config's keys beyond COMMON (each family's own keys set to values
# that change the tokens: small soft-caps, a query_pre_attn_scalar != head_dim, windows).
FAMILY_CONFIGS = {
    "qwen3": dict(head_dim=32),
    "gemma2": dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
                   layer_types=["sliding_attention", "full_attention"],
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
                        layer_types=["sliding_attention", "full_attention"],
                        rope_theta=10000.0, rope_local_base_freq=100.0,
                        rope_scaling={"rope_type": "linear", "factor": 2.0},
                        final_logit_softcapping=3.0),
    "phi3": dict(original_max_position_embeddings=64,
                 rope_scaling={"rope_type": "longrope",
                               "short_factor": [1.0 + 0.2 * i for i in range(8)],
                               "long_factor": [4.0 + i for i in range(8)]}),
    "llama": dict(attention_bias=True, mlp_bias=True),
}


def tiny_hf(model_type: str, seed: int = 0, **overrides):
    """A small random HF causal LM of `model_type` (2 layers, hidden 64): matrices N(0, 0.08),
    every 1-D parameter (norm weights, biases) moved by N(0, 0.1), so Gemma's (1 + w),
    q/k norms and biases all matter."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_hf(model, folder) -> str:
    model.save_pretrained(folder)  # safetensors, config.json
    return str(folder)


def load_llm(path: str, **kwargs) -> LLM:
    """`LLM(path)` on the fp32 path with a small pool and a 16-token budget (chunked)."""
    settings = dict(quantization="none", block_size=8, num_blocks=128,
                    max_num_batched_tokens=16, max_model_len=256)
    return LLM(path, **{**settings, **kwargs})


def assert_greedy_matches_hf(hf_model, llm: LLM, prompts=PROMPTS, hf_tokens=None) -> None:
    outputs = llm.generate(prompts, GREEDY)
    hf_tokens = hf_tokens or [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    for prompt, out, want in zip(prompts, outputs, hf_tokens):
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens"
    llm.engine.check_integrity()


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """model_type -> (HF model, its saved directory, HF's greedy tokens on PROMPTS)."""
    models = {}
    for i, (model_type, overrides) in enumerate(FAMILY_CONFIGS.items()):
        model = tiny_hf(model_type, seed=30 + i, **overrides)
        path = save_hf(model, tmp_path_factory.mktemp(model_type))
        models[model_type] = (model, path, [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS])
    return models


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("model_type", list(FAMILY_CONFIGS))
def test_family_greedy_matches_hf(family_models, model_type, kernels):
    hf_model, path, hf_tokens = family_models[model_type]
    llm = load_llm(path, kernels=kernels)
    if kernels == "auto" and HAS_CXX:  # the fused kernels are what is tested
        assert llm.engine.runner.fused_cpu_ops
    assert_greedy_matches_hf(hf_model, llm, hf_tokens=hf_tokens)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "qwen3"])
def test_prefix_cache_hits_and_preemption_match_hf(family_models, model_type):
    """The same prompts twice (the second time from cached blocks), then a pool so small
    that requests are preempted and recomputed: HF's tokens every time."""
    hf_model, path, hf_tokens = family_models[model_type]
    llm = load_llm(path)
    assert_greedy_matches_hf(hf_model, llm, hf_tokens=hf_tokens)
    assert_greedy_matches_hf(hf_model, llm, hf_tokens=hf_tokens)
    assert llm.engine.stats.prefix_cache_hits > 0
    small = load_llm(path, num_blocks=12, max_num_batched_tokens=64)
    assert_greedy_matches_hf(hf_model, small, hf_tokens=hf_tokens)
    assert small.engine.stats.preemptions > 0


def test_each_family_key_changes_hf_tokens(family_models):
    """The tests above can fail: without its family's keys (plain Llama-like values), each
    tiny model's HF tokens differ on some prompt."""
    for model_type in ("gemma2", "gemma3_text", "phi3", "llama"):
        hf_model, _, hf_tokens = family_models[model_type]
        plain = {"gemma2": dict(attn_logit_softcapping=None, final_logit_softcapping=None,
                                query_pre_attn_scalar=32),
                 "gemma3_text": dict(rope_scaling=None, rope_local_base_freq=10000.0,
                                     final_logit_softcapping=None),
                 "phi3": dict(rope_scaling=None),
                 "llama": dict(attention_bias=False, mlp_bias=False)}[model_type]
        other = tiny_hf(model_type, **{**FAMILY_CONFIGS[model_type], **plain})
        other.load_state_dict(hf_model.state_dict(), strict=False)
        assert [hf_greedy(other, p, NEW_TOKENS) for p in PROMPTS] != hf_tokens, model_type


def test_start_up_line_says_what_runs_in_torch(family_models):
    """Families whose ops the decode stack lacks decode layer by layer, and the kernels'
    description (the start-up line) says why; Phi-3 keeps the stack."""
    if not HAS_CXX:
        pytest.skip("no C++ compiler: no fused kernels to describe")
    gemma = load_llm(family_models["gemma2"][1], kernels="auto").engine.runner
    assert gemma.model.decode_stack is None
    text = gemma.kernels.describe()
    assert "soft-capped attention" in text and "decode stack lacks" in text
    phi = load_llm(family_models["phi3"][1], kernels="auto").engine.runner
    assert phi.model.decode_stack is not None and "lacks" not in phi.kernels.describe()


def test_every_family_is_described():
    """Each family the config gate accepts has a description, and the Llama-like ones run the
    decode stack."""
    from slotserve.config_gate import SUPPORTED_MODEL_TYPES

    assert set(SUPPORTED_MODEL_TYPES) <= set(FAMILIES)
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    for name in ("llama", "mistral", "qwen2", "phi3"):
        assert decode_stack_gaps(dataclasses.replace(cfg, architecture=name)) == []


@pytest.mark.parametrize(("model_type", "quantization"), [
    ("gemma3_text", "bf16"), ("qwen3", "bf16"), ("gemma2", "int8"), ("phi3", "int8")])
def test_quantized_weights_agree_with_fp32(family_models, model_type, quantization):
    """bf16 / int8 weights at the agreement bar the Llama family has (teacher-forced >= 97%
    against fp32)."""
    from slotserve.lab.quality import greedy_agreement

    hf_model = family_models[model_type][0]

    def engine(quantization):
        return tiny_engine(hf_model, block_size=8, num_blocks=128, max_model_len=256,
                           quantization=quantization)

    agreement = greedy_agreement(engine("none"), engine(quantization), PROMPTS, max_tokens=16)
    assert agreement.teacher_forced >= 0.97, agreement


def test_phi3_decode_stack_equals_python_layers(cpu_ops, family_models):
    """Phi-3 (longrope tables, fused HF weights) runs the C++ decode stack, bit for bit as
    its Python layers."""
    from tests.model.test_decode_stack import run_comparing_stack_and_python

    engine = tiny_engine(family_models["phi3"][0], block_size=8, kernels="auto")
    assert engine.runner.model.decode_stack is not None
    assert run_comparing_stack_and_python(engine, PROMPTS[:3], max_tokens=12) >= 8
