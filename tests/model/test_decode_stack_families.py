"""The C++ DecodeStack runs the families beyond Llama's block that it knows (Qwen3's per-head
q/k RMSNorms; Gemma 3's sandwich norms, GeGLU, embedding scale, q/k norms, sliding layers with
their own RoPE base) bit for bit as the model's Python layers on the same fused kernels, and
greedy decoding through it gives HF transformers' tokens; families it lacks something for
(Gemma 2's soft-capped attention) still decode layer by layer and say why."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slotserve import SamplingParams
from slotserve.config import ModelConfig
from slotserve.model.families import decode_stack_gaps
from tests.conftest import random_prompts, tiny_engine
from tests.model.test_decode_stack import run_comparing_stack_and_python
from tests.model.test_families import FAMILY_CONFIGS, tiny_hf
from tests.model.test_vs_hf import hf_greedy

# Prompts of 3-44 tokens (chunked by a 16-token budget), then 16 decode steps each: past
# Gemma 3's 24-token window.
PROMPTS = random_prompts(4, min_len=3, max_len=44, seed=31)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_qwen3():
    """A random Qwen3ForCausalLM (2 layers, 4 heads of 32, 2 KV heads): q/k norm weights
    moved off 1 (tiny_hf), so a stack that skipped or misplaced them would differ."""
    return tiny_hf("qwen3", seed=41, head_dim=32)


@pytest.fixture(scope="module")
def tiny_gemma3():
    """A random Gemma3ForCausalLM (test_families' config: a sliding layer of window 24 with
    RoPE base 100, a full one with linear scaling, query_pre_attn_scalar 24, 1-D weights
    moved off their init so the (1 + w) norms and q/k norms matter)."""
    return tiny_hf("gemma3_text", seed=42, **FAMILY_CONFIGS["gemma3_text"])


@pytest.fixture(params=["qwen3", "gemma3_text"])
def family_model(request):
    return request.getfixturevalue({"qwen3": "tiny_qwen3", "gemma3_text": "tiny_gemma3"}
                                   [request.param])


def stack_engine(hf_model, **kwargs):
    settings = dict(block_size=8, num_blocks=128, max_num_batched_tokens=16, kernels="auto")
    return tiny_engine(hf_model, **{**settings, **kwargs})


@pytest.mark.parametrize("quantization", [None, "bf16", "int8"])
def test_stack_equals_python_layers_bit_for_bit(cpu_ops, family_model, quantization):
    engine = stack_engine(family_model, quantization=quantization)
    model = engine.runner.model
    assert model.decode_stack is not None
    assert model.layers[0].self_attn.q_norm.ops is cpu_ops  # the same kernel as the stack's

    decode_only = run_comparing_stack_and_python(engine, PROMPTS, max_tokens=NEW_TOKENS)

    assert decode_only >= NEW_TOKENS - 1


def test_stack_gives_hf_greedy_tokens(cpu_ops, family_model):
    engine = stack_engine(family_model)
    assert engine.runner.model.decode_stack is not None
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    for i, prompt in enumerate(PROMPTS):
        assert tokens[f"r{i}"] == hf_greedy(family_model, prompt, NEW_TOKENS), f"prompt {i}"


def test_stack_without_the_qk_norms_differs(cpu_ops, tiny_qwen3):
    """The bit-equality above can fail: a stack built without the q/k norms gives other
    hidden states on the same decode step."""
    engine = stack_engine(tiny_qwen3)
    model = engine.runner.model
    with_norms = model.decode_stack
    for layer in model.layers:
        layer.self_attn.qk_norm = False  # build_decode_stack reads it
    without_norms = model.build_decode_stack(cpu_ops)
    for layer in model.layers:
        layer.self_attn.qk_norm = True
    cfg = model.config
    # a decode at position 5 reading 5 earlier (random) K/V: its scores depend on q and k
    torch.manual_seed(0)
    caches = [torch.randn(4, 8, cfg.num_key_value_heads, cfg.head_dim) for _ in range(4)]
    step = (torch.tensor([7]), torch.tensor([5]), caches, torch.tensor([5]),
            torch.tensor([[0]]), torch.tensor([6]))
    assert not torch.equal(with_norms.forward(*step), without_norms.forward(*step))


def test_gaps_list_only_soft_capping_and_o_mlp_biases():
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    assert decode_stack_gaps(dataclasses.replace(cfg, architecture="qwen3")) == []
    gemma3 = dataclasses.replace(cfg, architecture="gemma3_text", hidden_act="gelu_pytorch_tanh",
                                 local_rope_theta=10000.0, sliding_windows=(4,))
    assert decode_stack_gaps(gemma3) == []
    gemma2 = dataclasses.replace(gemma3, architecture="gemma2", attn_logit_softcapping=50.0)
    assert decode_stack_gaps(gemma2) == ["attention soft-capping"]


def test_start_up_line_names_no_gap(cpu_ops, family_model):
    kernels = stack_engine(family_model).runner.kernels
    assert kernels.decode_stack and "lacks" not in kernels.describe()


HIDDEN, HEAD_DIM = 8, 4


def tiny_stack(cpu_ops):
    """A DecodeStack of 2 heads over 1 KV head of 4 (hidden 8) and one layer's arguments
    (norms, then zero panels for qkv, o, gate_up, down), for the refusal tests."""
    stack = cpu_ops.DecodeStack(2, 1, HEAD_DIM, 1e-6, 0.5, torch.ones(HIDDEN))
    linear = lambda i, o: cpu_ops.linear_weights("panel", cpu_ops.pack_panels(torch.zeros(o, i)),
                                                out_features=o)
    layer = (torch.ones(HIDDEN), torch.ones(HIDDEN), linear(HIDDEN, 16), linear(8, HIDDEN),
             linear(HIDDEN, 12), linear(6, HIDDEN))
    return stack, layer


def test_stack_rejects_bad_qk_norms(cpu_ops):
    stack, layer = tiny_stack(cpu_ops)
    with pytest.raises(RuntimeError, match="both or neither"):
        stack.add_layer(*layer, 0, q_norm=torch.ones(HEAD_DIM))
    with pytest.raises(RuntimeError, match=r"must be \(head_dim,\)"):
        stack.add_layer(*layer, 0, q_norm=torch.ones(HEAD_DIM), k_norm=torch.ones(HIDDEN))
    stack.add_layer(*layer, 0, q_norm=torch.ones(HEAD_DIM), k_norm=torch.ones(HEAD_DIM))


def test_stack_rejects_bad_gemma_pieces(cpu_ops):
    stack, layer = tiny_stack(cpu_ops)
    with pytest.raises(RuntimeError, match="both or neither"):
        stack.add_layer(*layer, 0, pre_feedforward_norm=torch.ones(HIDDEN))
    with pytest.raises(RuntimeError, match=r"must be \(H,\)"):
        stack.add_layer(*layer, 0, pre_feedforward_norm=torch.ones(HIDDEN),
                        post_feedforward_norm=torch.ones(HEAD_DIM))
    with pytest.raises(RuntimeError, match="activation must be"):
        stack.set_activation("relu")
    with pytest.raises(RuntimeError, match="shaped as cos"):
        stack.set_lookup_tables(torch.zeros(10, HIDDEN), torch.zeros(5, 2), torch.zeros(5, 2),
                                cos_local=torch.zeros(4, 2), sin_local=torch.zeros(4, 2))
    stack.add_layer(*layer, 0, local_rope=True)
    one = torch.tensor([0])
    stack.set_lookup_tables(torch.zeros(10, HIDDEN), torch.zeros(5, 2), torch.zeros(5, 2))
    caches = [torch.zeros(2, 4, 1, HEAD_DIM) for _ in range(2)]
    with pytest.raises(RuntimeError, match="local RoPE tables"):
        stack.forward(one, one, caches, one, one.view(1, 1), one + 1)
