"""The C++ DecodeStack runs GGUF block weights (its `gguf_blocks` kind, csrc/quant_blocks.cpp).

Random models in GGUF blocks (Q4_0 ... Q6_K, mixed within fused q/k/v and gate/up, with and
without biases, next to float linears) decode through the stack exactly as through the
model's Python layers on the same kernels: every forward bit for bit, and the engine's
greedy tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from slotserve import SamplingParams
from slotserve.config import ModelConfig, engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.loader.gguf_blocks import GGUFBlockTensor, to_blocks
from slotserve.model.layers import Linear
from slotserve.model.linear_kernels import (
    GGUFBlockLinear,
    SegmentedLinear,
)
from tests.conftest import random_prompts
from tests.model.test_decode_stack import run_comparing_stack_and_python

Q = GGMLQuantizationType
# gguf-py quantizes these from values; the K-quants are random valid blocks.
GGUF_PY_QUANTIZES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
# K-quants: byte offsets of the fp16 super-block scales, and their range (weights ~0.1).
_K_SCALES = {Q.Q4_K: ((0, 2), 2e-4), Q.Q5_K: ((0, 2), 1e-4), Q.Q6_K: ((208,), 2e-5),
             Q.Q2_K: ((80, 82), 1e-3), Q.Q3_K: ((108,), 5e-4)}

# HF name (per layer) -> GGUF type, per model: every block format, fused q/k/v of mixed types
# (segments in their own formats), gate/up of mixed types (8-bit codes, blocks of 16 once
# Q6_K joins), all-4-bit fusions (one segment of 4-bit codes),
# and None: left as an fp32 tensor (a float linear beside block ones: the bf16 panels).
LAYOUTS = {
    "k_quants": {"q_proj": Q.Q4_K, "k_proj": Q.Q6_K, "v_proj": Q.Q8_0, "o_proj": Q.Q5_K,
                 "gate_proj": Q.Q4_K, "up_proj": Q.Q3_K, "down_proj": Q.Q6_K,
                 "lm_head": Q.Q6_K},
    "legacy_4bit": {"q_proj": Q.Q4_0, "k_proj": Q.Q4_1, "v_proj": Q.Q4_0, "o_proj": Q.Q4_1,
                    "gate_proj": Q.Q4_0, "up_proj": Q.Q4_1, "down_proj": Q.Q2_K,
                    "lm_head": Q.Q8_0},
    "mixed_float": {"q_proj": Q.Q5_1, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": None,
                    "gate_proj": Q.Q5_K, "up_proj": Q.Q8_0, "down_proj": Q.Q4_K,
                    "lm_head": None},
    # a Q8_0 file: 16-bit activations (linear_kernels.activation_bits_for)
    "q8_0": {name: Q.Q8_0 for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                       "up_proj", "down_proj", "lm_head")},
}


def raw_blocks(qtype: GGMLQuantizationType, values: torch.Tensor, seed: int) -> np.ndarray:
    """(rows, row bytes) of `qtype` blocks: gguf-py's quantization of `values` (out, in)
    where it has one, else random bytes with small random fp16 super-block scales."""
    if qtype in GGUF_PY_QUANTIZES:
        return quantize(values.numpy().astype(np.float32), qtype)
    rows, cols = values.shape
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    offsets, top = _K_SCALES[qtype]
    for offset in offsets:
        scale = rng.uniform(0, top, size=raw.shape[0]).astype(np.float16)
        raw[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def gguf_block_model(layout: str, kind: str = "llama", seed: int = 0
                     ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A random model (hidden 256, the K-quants' super-block) with its linears in GGUF
    blocks of `layout`'s types; kind qwen2: q/k/v biases (fp32)."""
    import transformers

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2)
    config = (transformers.Qwen2Config(**common, rope_theta=1e6) if kind == "qwen2"
              else transformers.LlamaConfig(**common, rope_theta=10000.0))
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    types = LAYOUTS[layout]
    for i in range(config.num_hidden_layers):
        for module, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                              ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                full = f"model.layers.{i}.{module}.{name}.weight"
                weights[full] = _weight(full, _shape(config, name), types[name], generator,
                                        seed + len(weights))
                if kind == "qwen2" and name in ("q_proj", "k_proj", "v_proj"):
                    out = weights[full].shape[0]
                    weights[full.replace("weight", "bias")] = 0.1 * torch.randn(
                        out, generator=generator)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(
                config.hidden_size, generator=generator)
    weights["model.embed_tokens.weight"] = torch.randn(config.vocab_size, config.hidden_size,
                                                       generator=generator)
    weights["model.norm.weight"] = torch.ones(config.hidden_size)
    weights["lm_head.weight"] = _weight("output.weight", (config.vocab_size,
                                                          config.hidden_size),
                                        types["lm_head"], generator, seed + 999)
    return ModelConfig.from_hf_dict(config.to_dict()), weights


def _shape(config, name: str) -> tuple[int, int]:
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    return {"q_proj": (hidden, hidden), "k_proj": (config.num_key_value_heads * head_dim, hidden),
            "v_proj": (config.num_key_value_heads * head_dim, hidden), "o_proj": (hidden, hidden),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}[name]


def _weight(name: str, shape: tuple[int, int], qtype, generator, seed: int) -> torch.Tensor:
    values = 0.06 * torch.randn(*shape, generator=generator)
    if qtype is None:
        return values
    return GGUFBlockTensor(to_blocks(raw_blocks(qtype, values, seed), qtype, name, "test.gguf"))


def gguf_engine(layout: str, kind: str = "llama", **kwargs) -> LLMEngine:
    config, weights = gguf_block_model(layout, kind)
    settings = dict(quantization="gguf", max_model_len=512, block_size=16, max_num_seqs=8)
    return LLMEngine(engine_config(**{**settings, **kwargs}), config, weights, tokenizer=None)


@pytest.mark.parametrize("layout,kind", [("k_quants", "llama"), ("legacy_4bit", "qwen2"),
                                         ("mixed_float", "qwen2"), ("q8_0", "llama")])
def test_stack_equals_python_layers_on_gguf_blocks(block_ops, layout, kind):
    engine = gguf_engine(layout, kind)
    model, kernels = engine.runner.model, engine.runner.kernels
    assert model.decode_stack is not None and kernels.decode_stack
    activations = "16-bit" if layout == "q8_0" else "int8"
    assert kernels.describe_linears().startswith(f"GGUF blocks x {activations} activations (")
    assert kernels.describe_linears().endswith("(decodes: one C++ call for all layers)")
    block_linears = [m for m in model.modules() if isinstance(m, Linear)
                     and isinstance(m.kernel, (GGUFBlockLinear, SegmentedLinear))]
    floats = sum(t is None for t in LAYOUTS[layout].values())
    # 3 layers x (qkv, o, gate_up, down) + the LM head; a float o_proj is 3 fewer
    assert len(block_linears) == 13 - (3 + 1 if floats else 0)
    fused = model.layers[0].self_attn.qkv_proj.kernel
    assert all(k.activation_bits == (16 if layout == "q8_0" else 8)
               for m in block_linears
               for k in getattr(m.kernel, "segments", [m.kernel]))
    if layout in ("legacy_4bit", "q8_0"):  # one packing, one kernel (of 4-bit, 8-bit codes)
        assert isinstance(fused, GGUFBlockLinear) and fused.bits == (4 if layout != "q8_0" else 8)
    else:  # three types of three packings: each keeps its own (k_quants: 4-bit blocks of 32,
        # 6-bit of 16, 8-bit of 32)
        assert isinstance(fused, SegmentedLinear)
        expected = [(32, 4), (16, 6), (32, 8)] if layout == "k_quants" else [
            (32, 6), (32, 8)]  # Q5_1 and Q5_0 pack alike: q and k one segment
        assert [(s.block_len, s.bits) for s in fused.segments] == expected

    # contexts of 3-70 tokens growing by 24: tables of 1 to 6 blocks, batches of 1-5 rows
    decode_only = run_comparing_stack_and_python(engine, random_prompts(5), max_tokens=24)

    assert decode_only >= 15


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]], max_tokens: int
                  ) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
    return tokens


@pytest.mark.parametrize("layout", ["k_quants", "mixed_float"])
def test_engine_greedy_tokens_equal_with_and_without_the_stack(block_ops, layout):
    """Batches of 1 to 8 sequences (prompts arriving over the run), greedy: the same tokens."""
    config, weights = gguf_block_model(layout)
    settings = engine_config(quantization="gguf", max_model_len=512, block_size=16,
                             max_num_seqs=8)
    with_stack = LLMEngine(settings, config, weights)
    without = LLMEngine(settings, config, weights,
                        kernel_set=replace(with_stack.runner.kernels, decode_stack=False))
    assert with_stack.runner.model.decode_stack is not None
    assert without.runner.model.decode_stack is None
    prompts = random_prompts(8, seed=3)

    expected = greedy_tokens(without, prompts, 20)
    got = greedy_tokens(with_stack, prompts, 20)

    assert got == expected and len(got) == 8 and all(len(t) == 20 for t in got.values())
    assert len({tuple(t) for t in got.values()}) > 1  # not one degenerate answer


def test_stack_rejects_bad_gguf_block_weights(block_ops):
    blocks = to_blocks(raw_blocks(Q.Q8_0, torch.randn(24, 64), 0), Q.Q8_0, "w", "t.gguf")
    kernel = GGUFBlockLinear(blocks, None, block_ops)
    with pytest.raises(RuntimeError, match="block_len 16 or 32 and bits 4, 6 or 8"):
        block_ops.linear_weights("gguf_blocks", kernel.codes, kernel.scales_mins, None, 24)
    with pytest.raises(RuntimeError, match="gguf_blocks linear needs out_features"):
        block_ops.linear_weights("gguf_blocks", kernel.codes, kernel.scales_mins, None,
                                 block_len=32, bits=8)
    with pytest.raises(RuntimeError, match="needs its second tensor"):
        block_ops.linear_weights("gguf_blocks", kernel.codes, None, None, 24, block_len=32, bits=8)
    hidden, heads, kv_heads, head_dim = 64, 2, 1, 16  # qkv: 64 outputs, o: 32 inputs
    stack = block_ops.DecodeStack(heads, kv_heads, head_dim, 1e-6, 0.25, torch.ones(hidden))

    def linear(qtype, out, inputs, seed):
        raw = raw_blocks(qtype, torch.randn(out, inputs), seed)
        return GGUFBlockLinear(to_blocks(raw, qtype, "w", "t.gguf"), None, block_ops)

    qkv, gate_up = linear(Q.Q8_0, 64, 64, 1), linear(Q.Q8_0, 64, 64, 3)  # gate_up: I = 32
    o_or_down = linear(Q.Q4_0, 64, 32, 2).cpp_weights(block_ops)  # 32 inputs, 64 outputs
    norms = (torch.ones(hidden), torch.ones(hidden))
    with pytest.raises(RuntimeError, match="the blocks cover 64 inputs, not 32"):
        stack.add_layer(*norms, qkv.cpp_weights(block_ops), qkv.cpp_weights(block_ops),
                        gate_up.cpp_weights(block_ops), o_or_down)
    with pytest.raises(RuntimeError, match="gives 24 outputs where 64 are needed"):
        stack.add_layer(*norms, qkv.cpp_weights(block_ops), o_or_down,
                        gate_up.cpp_weights(block_ops), kernel.cpp_weights(block_ops))
    # bits that do not match the codes (8-bit codes said to be 4-bit)
    bad_bits = block_ops.linear_weights("gguf_blocks", qkv.codes, qkv.scales_mins, None, 64,
                                        block_len=32, bits=4)
    with pytest.raises(RuntimeError, match="codes do not match block_len and bits"):
        stack.add_layer(*norms, bad_bits, o_or_down, gate_up.cpp_weights(block_ops), o_or_down)
    stack.add_layer(*norms, qkv.cpp_weights(block_ops), o_or_down, gate_up.cpp_weights(block_ops),
                    o_or_down)  # the same layer, right: accepted
    # segments: every one takes the layer's inputs, together the outputs it needs
    q, kv = linear(Q.Q4_0, 32, 64, 4), linear(Q.Q8_0, 32, 64, 5)
    segmented = block_ops.segmented_linear_weights([q.cpp_weights(block_ops),
                                                    kv.cpp_weights(block_ops)])
    stack.add_layer(*norms, segmented, o_or_down, gate_up.cpp_weights(block_ops), o_or_down)
    short = block_ops.segmented_linear_weights([q.cpp_weights(block_ops)])
    with pytest.raises(RuntimeError, match="gives 32 outputs where 64 are needed"):
        stack.add_layer(*norms, short, o_or_down, gate_up.cpp_weights(block_ops), o_or_down)
    wrong_inputs = block_ops.segmented_linear_weights([q.cpp_weights(block_ops), o_or_down])
    with pytest.raises(RuntimeError, match="the blocks cover 32 inputs, not 64"):
        stack.add_layer(*norms, wrong_inputs, o_or_down, gate_up.cpp_weights(block_ops), o_or_down)
    with pytest.raises(RuntimeError, match="at least one segment"):
        block_ops.segmented_linear_weights([])
    with pytest.raises(RuntimeError, match="do not nest"):
        block_ops.segmented_linear_weights([segmented])


@pytest.mark.parametrize("qtype,dtype", [
    (Q.Q4_0, torch.float16), (Q.Q4_1, torch.float16), (Q.Q5_0, torch.float16),
    (Q.Q5_1, torch.float16), (Q.Q8_0, torch.float16), (Q.Q4_K, torch.uint8),
    (Q.Q5_K, torch.uint8), (Q.Q6_K, torch.int8), (Q.Q2_K, torch.uint8),
    (Q.Q3_K, torch.int8)], ids=lambda v: getattr(v, "name", str(v)))
def test_compact_scales_compute_as_fp32_ones(block_ops, qtype, dtype):
    """The legacy types' scales and mins (GGUF's fp16 d, m, -8d, -16d, -128d) are packed
    in fp16, the K-quants' (d * sc) factored (int8 factors, fp16 per super-block: a uint8
    tensor, int8 where one factor serves the scale and the min); both give the same bits
    as the same values in fp32, through the kernel and its plain loops
    (tests/model/test_gguf_factored_scales.py has the factors' own tests)."""
    values = 0.05 * torch.randn(40, 512, generator=torch.Generator().manual_seed(8))
    blocks = to_blocks(raw_blocks(qtype, values, 9), qtype, "w", "t.gguf")
    kernel = GGUFBlockLinear(blocks, None, block_ops)
    assert kernel.scales_mins.dtype == dtype
    scale_bytes = kernel.scales_mins.element_size()
    packed_bytes = kernel.codes.numel() + kernel.scales_mins.numel() * scale_bytes
    assert packed_bytes / (40 + 8) / 512 == blocks.bytes_per_weight  # 48 rows: 3 panels
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(10))
    y = kernel(x)
    fp32 = (kernel.scales_mins.float() if dtype == torch.float16 else
            GGUFBlockLinear(dataclasses.replace(blocks, factors=None), None, block_ops).scales_mins)
    assert fp32.dtype == torch.float32
    as_fp32 = block_ops.quant_block_linear(x, kernel.codes, fp32, 40, blocks.block_len, blocks.bits,
                                           kernel.activation_bits)
    assert torch.equal(y, as_fp32)
    assert torch.equal(y, block_ops.quant_block_linear(x, kernel.codes, kernel.scales_mins, 40,
                                                       blocks.block_len, blocks.bits,
                                                       kernel.activation_bits, force_plain=True))
    with pytest.raises(RuntimeError, match="scales_mins must be float32, float16 or"):
        block_ops.quant_block_linear(x, kernel.codes, kernel.scales_mins.double(), 40,
                                     blocks.block_len, blocks.bits)


def test_the_embedded_model_in_blocks_decodes_the_same_through_the_stack(block_ops):
    """The real SmolLM2 GGUF (Q4_1 layers, Q8_0 embedding and tied LM head; 9 query heads of
    64, 3 KV heads, hidden 576) under quantization=gguf: greedy chat answers with the stack
    equal those of the Python layers, batched."""
    from slotserve.lab.workload import generate_workload
    from slotserve.loader import load_model

    loaded = load_model(keep_quantized=True)
    settings = engine_config(quantization="gguf", max_num_seqs=4, num_blocks=128)
    with_stack = LLMEngine(settings, loaded.config, loaded.weights, loaded.tokenizer)
    without = LLMEngine(settings, loaded.config, loaded.weights, loaded.tokenizer,
                        kernel_set=replace(with_stack.runner.kernels, decode_stack=False))
    assert with_stack.runner.kernels.gguf_types == ("Q4_1", "Q8_0")
    assert with_stack.runner.model.decode_stack is not None
    # both run short chunks as rows (the C++ CPU kernels' rule, stack or not): the same sums
    assert with_stack.runner.short_chunks_as_rows and without.runner.short_chunks_as_rows
    prompts = generate_workload(4, prompts="chat", seed=1).chat_prompt_ids(loaded.tokenizer)

    assert greedy_tokens(with_stack, prompts, 16) == greedy_tokens(without, prompts, 16)
