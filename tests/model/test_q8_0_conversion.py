"""`--quantization q8_0`: float linear weights quantized to GGUF Q8_0 blocks as they load
(loader/gguf_blocks.py's q8_0_blocks, gguf-py's quantizer) and run by the block kernel.

The check that matters: an HF directory served as q8_0 computes what llama-quantize's way
gives, i.e. the same tokens and logprobs, bit for bit, as a Q8_0 GGUF written by gguf-py
from the same weights and served in its own blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

from slotserve import LLM, SamplingParams
from slotserve.config import EngineConfig, engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.loader import load_model
from slotserve.loader.gguf_blocks import GGUFBlockTensor, as_q8_0, q8_0_blocks
from slotserve.model.kernels import resolve_kernels
from slotserve.model.layers import Linear
from slotserve.model.linear_kernels import (
    BlockEmbedding,
    GGUFBlockLinear,
)
from tests.conftest import random_prompts

Q = GGMLQuantizationType


def awkward_weight(rows: int = 300, cols: int = 96) -> torch.Tensor:
    """Random values with a zero block, codes exactly half a step from two integers (both
    signs), an outlier (fp16's largest range), subnormals and tiny blocks."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(rows, cols, generator=gen) * 3
    weight[0, :32] = 0
    weight[1, 32:64] = torch.tensor([0.5, -0.5, 1.5, -2.5] * 8) * (127 / 2.5)
    weight[2, 7] = 6e4
    weight[3, :32] = torch.randn(32, generator=gen) * 1e-40
    weight[4, 32:] = torch.randn(cols - 32, generator=gen) * 1e-30
    return weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_writes_gguf_py_q8_0_blocks_bit_for_bit(block_ops, dtype):
    """The raw blocks (fp16 d, 32 int8 codes) equal gguf-py's quantize of the fp32 values, for
    every dtype a weight is stored in; unpacked, the values are gguf-py's dequantize."""
    weight = awkward_weight().to(dtype)
    expected = gguf_quants.quantize(weight.float().numpy(), Q.Q8_0)
    assert np.array_equal(block_ops.quantize_q8_0(weight).numpy(), expected)
    assert torch.equal(q8_0_blocks(weight).dequantize(),
                       torch.from_numpy(gguf_quants.dequantize(expected, Q.Q8_0)))


def test_only_whole_blocks_of_finite_values_are_quantized(block_ops):
    weight = awkward_weight(8, 64)
    assert isinstance(as_q8_0(weight), GGUFBlockTensor)
    norm, ragged = torch.randn(96), torch.randn(8, 40)
    assert as_q8_0(norm) is norm and as_q8_0(ragged) is ragged
    weight[5, 9] = float("nan")
    with pytest.raises(ValueError, match="q8_0.*NaN or infinite"):
        q8_0_blocks(weight)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        block_ops.quantize_q8_0(torch.randn(4, 40))


@pytest.fixture(scope="module")
def hf_and_q8_0_gguf(tmp_path_factory):
    """A tiny random Qwen3 (untied head) as an HF directory, and as a GGUF whose linear
    weights, head and embedding gguf-py quantized to Q8_0 (the norms float32), as
    llama-quantize writes a Q8_0 file."""
    from tests.model.test_families import tiny_hf
    from tests.model.test_gguf_families import GGUF_FAMILY_CONFIGS, write_gguf

    model = tiny_hf("qwen3", seed=41, **GGUF_FAMILY_CONFIGS["qwen3"])
    assert not model.config.tie_word_embeddings
    folder = tmp_path_factory.mktemp("q8_0")
    model.save_pretrained(folder / "hf")
    add_tensor = GGUFWriter.add_tensor

    def add_quantized(writer, name, tensor, *args, **kwargs):
        linear = name.startswith("blk.") and name.endswith(".weight") and "norm" not in name
        if linear or name in ("output.weight", "token_embd.weight"):
            tensor = gguf_quants.quantize(np.ascontiguousarray(tensor), Q.Q8_0)
            kwargs = {**kwargs, "raw_dtype": Q.Q8_0}
        return add_tensor(writer, name, tensor, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GGUFWriter, "add_tensor", add_quantized)
        write_gguf(folder / "q8_0.gguf", model, "qwen3")
    return str(folder / "hf"), str(folder / "q8_0.gguf")


def generate(engine: LLMEngine, prompts: list[list[int]]) -> list:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    return LLM(engine=engine).generate(prompts, params, use_tqdm=False)


def test_an_hf_directory_as_q8_0_computes_as_its_q8_0_gguf(block_ops, hf_and_q8_0_gguf):
    hf_dir, gguf_file = hf_and_q8_0_gguf
    settings = dict(max_model_len=256, block_size=16, max_num_seqs=4)
    hf = load_model(hf_dir)
    converted = LLMEngine(engine_config(quantization="q8_0", **settings), hf.config,
                          hf.weights)
    blocks = load_model(gguf_file, keep_quantized=True, use_cache=False)
    served = LLMEngine(engine_config(quantization="gguf", **settings), blocks.config,
                       blocks.weights)
    kernels = [m.kernel for m in converted.runner.model.modules() if isinstance(m, Linear)]
    assert sum(isinstance(k, GGUFBlockLinear) for k in kernels) == 2 * 4 + 1  # and lm_head
    assert isinstance(converted.runner.model.embed_tokens, BlockEmbedding)
    assert converted.runner.kernels.describe().startswith(
        "float weights quantized to GGUF Q8_0 blocks as they load (1.125 bytes/weight), ")
    assert "GGUF blocks x 16-bit activations (" in converted.runner.kernels.describe()
    assert {k.activation_bits for k in kernels if isinstance(k, GGUFBlockLinear)} == {16}

    prompts = random_prompts(4, seed=9)
    for ours, theirs in zip(generate(converted, prompts), generate(served, prompts)):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].logprobs == theirs.outputs[0].logprobs


def test_q8_0_without_the_block_kernel_or_off_the_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="q8_0.*block kernel"):
        resolve_kernels("reference", "q8_0")
    with pytest.raises(ValueError, match="q8_0.*CPU only"):
        EngineConfig(device="cuda", quantization="q8_0")
    with pytest.raises(ValueError, match="q8_0.*float32"):
        resolve_kernels("auto", "q8_0", dtype="bfloat16")
