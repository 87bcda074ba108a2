"""An HF directory's bf16 weights: widened as the model loads them, one linear at a time.

The loader keeps an HF directory's bf16/fp16 tensors as stored and the model widens each as it
copies it in, packing each Linear's kernel as soon as its weights are in (LinearKernelSwap):
no fp32 copy of the whole file, and no fp32 model beside the packed kernels. The embedding
table stays as stored (WidenedEmbedding: rows widened as they are looked up, exactly).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from slotserve.config import engine_config
from slotserve.engine.llm import LLM
from slotserve.engine.llm_engine import LLMEngine
from slotserve.loader import load_model

SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4)


def write_bf16_hf_dir(path, vocab_size, hidden_size, intermediate_size, num_hidden_layers,
                      num_attention_heads, num_key_value_heads, seed=0) -> int:
    """A random untied Llama as an HF directory of bf16 safetensors; returns its bytes."""
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden_size // num_attention_heads

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    def norm():
        return (1 + torch.randn(hidden_size, generator=g) * 0.1).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(vocab_size, hidden_size),
               "lm_head.weight": rand(vocab_size, hidden_size), "model.norm.weight": norm()}
    for i in range(num_hidden_layers):
        layer = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (num_attention_heads * head_dim, hidden_size),
                  "self_attn.k_proj": (num_key_value_heads * head_dim, hidden_size),
                  "self_attn.v_proj": (num_key_value_heads * head_dim, hidden_size),
                  "self_attn.o_proj": (hidden_size, num_attention_heads * head_dim),
                  "mlp.gate_proj": (intermediate_size, hidden_size),
                  "mlp.up_proj": (intermediate_size, hidden_size),
                  "mlp.down_proj": (hidden_size, intermediate_size)}
        weights.update({f"{layer}{name}.weight": rand(*shape) for name, shape in shapes.items()})
        weights[f"{layer}input_layernorm.weight"] = norm()
        weights[f"{layer}post_attention_layernorm.weight"] = norm()
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama",
                  vocab_size=vocab_size, hidden_size=hidden_size,
                  intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
                  num_attention_heads=num_attention_heads,
                  num_key_value_heads=num_key_value_heads, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, hidden_act="silu")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return sum(t.numel() * t.element_size() for t in weights.values())


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16-hf")
    write_bf16_hf_dir(path, **SHAPE)
    return str(path)


def test_bf16_tensors_stay_bf16_until_the_model_widens_them(bf16_dir):
    loaded = load_model(bf16_dir)
    assert {w.dtype for w in loaded.weights.values()} == {torch.bfloat16}


@pytest.mark.parametrize("quantization", ["none", "bf16"])
def test_bf16_weights_load_exactly_as_their_fp32_widening(bf16_dir, quantization):
    """Loading the stored bf16 tensors computes the same logits, to the last bit, as loading
    the same values widened to fp32 first (what the loader did before)."""
    loaded = load_model(bf16_dir)
    widened = {name: w.float() for name, w in loaded.weights.items()}
    config = engine_config(max_num_seqs=2, num_blocks=32, quantization=quantization)
    tokens = list(range(5, 40))
    ours = LLMEngine(config, loaded.config, loaded.weights, None).score(tokens)
    reference = LLMEngine(config, loaded.config, widened, None).score(tokens)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_embedding_stays_16_bit_and_looks_up_exactly(bf16_dir, dtype):
    """The embedding table stays in the checkpoint's 16-bit dtype (WidenedEmbedding: half the
    fp32 table's memory) and every path computes as with the table widened to fp32: greedy
    tokens and logprobs through prefill and the decode stack, to the last bit."""
    from slotserve import SamplingParams
    from slotserve.model.layers import WidenedEmbedding

    loaded = load_model(bf16_dir)
    weights = dict(loaded.weights)
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].to(dtype)
    widened = {name: w.float() for name, w in weights.items()}
    config = engine_config(max_num_seqs=4, num_blocks=64, quantization="bf16")
    ours = LLMEngine(config, loaded.config, weights, None)
    reference = LLMEngine(config, loaded.config, widened, None)
    table = ours.runner.model.embed_tokens
    assert isinstance(table, WidenedEmbedding) and table.weight.dtype == dtype
    assert torch.equal(table.weight, weights["model.embed_tokens.weight"])
    assert ours.runner.model.decode_stack is not None  # the stack's own lookup runs too
    prompts = [list(range(5, 40)), list(range(100, 107)), [7] * 20]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = [LLM(engine=engine).generate(prompts, params) for engine in (ours, reference)]
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


_PEAK_SCRIPT = """
import resource, sys
from slotserve.config import engine_config
from slotserve.engine.llm import LLM
from slotserve.engine.llm_engine import LLMEngine
from slotserve.model.cpu_ops import load_cpu_ops
load_cpu_ops()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
engine = LLMEngine.from_config(engine_config(model=sys.argv[1], max_num_seqs=4, num_blocks=64,
                                             quantization="bf16"))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


def test_loading_a_bf16_dir_never_holds_an_fp32_copy_of_it(tmp_path):
    """A subprocess's peak RSS while it loads a 256 MiB bf16 directory (134M parameters) for
    bf16 serving grows by less than 2x the file: measured 286 MiB (1.1x: the file's mapped
    pages, the packed panels, the embedding table as stored (WidenedEmbedding; 346 MiB with
    it widened to fp32) and one linear in fp32 at a time); when the loader widened the file
    to fp32 and the model held every linear in fp32 until all were packed, 1296 MiB (5.1x)."""
    file_bytes = write_bf16_hf_dir(tmp_path, vocab_size=16384, hidden_size=1024,
                                   intermediate_size=4096, num_hidden_layers=6,
                                   num_attention_heads=16, num_key_value_heads=16)
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path)],
                            capture_output=True, text=True, timeout=600, check=True)
    grew = int(result.stdout.split()[-1])
    assert grew < 2 * file_bytes, (grew >> 20, file_bytes >> 20)
