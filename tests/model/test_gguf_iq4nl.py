"""IQ4_NL GGUF weights kept in blocks (loader/gguf_blocks.py; csrc/gguf_unpack.cpp's IQ4_NL):
the file's 4-bit indices, which the kernel (csrc/quant_blocks.cpp) looks up as the codes
u = level + 128, with m = -128 d; fused with other types, the looked-up codes in bytes.

The kernel's error against gguf-py's `dequantize` + an fp32 matmul is bounded as in
tests/model/test_gguf_quant.py's docstring (`error_bound`): the activations' int8 rounding,
half a step per value, plus fp32 rounding; the conversion itself is exact (d * (level + 128)
- 128 d, each an fp16 d times an integer below 2^8, is d * level exactly in fp32).
gguf-py has no IQ4_NL quantizer: the blocks are random fp16 scales and random indices, or
(for files) the nearest level of each value.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from slotserve.config import engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.loader import ModelFileError, load_model
from slotserve.loader.gguf_blocks import (
    BLOCK_FORMATS,
    IQ4_NL_LEVELS,
    GGUFBlockTensor,
    concat_rows,
    to_blocks,
)
from slotserve.loader.gguf_reader import read_gguf
from slotserve.model.kernels import size_text
from slotserve.model.layers import Linear
from slotserve.model.linear_kernels import GGUFBlockLinear
from tests.conftest import random_prompts
from tests.model.test_gguf_quant import error_bound, raw_tensor, reference_weights

Q = GGMLQuantizationType
BLOCK, BLOCK_BYTES = GGML_QUANT_SIZES[Q.IQ4_NL]  # 32 weights in 18 bytes: fp16 d, 16 bytes


def random_iq4_nl(rows: int, cols: int, seed: int = 0, top: float = 1e-3) -> np.ndarray:
    """(rows, row bytes) of IQ4_NL blocks: random indices, random fp16 scales in [0, top)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // BLOCK, BLOCK_BYTES), dtype=np.uint8)
    scales = rng.uniform(0, top, size=len(raw)).astype(np.float16)
    raw[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def quantize_iq4_nl(values: np.ndarray) -> np.ndarray:
    """(rows, cols) fp32 -> (rows, row bytes) IQ4_NL blocks: d = max|x| / 127 per block and
    each value's nearest level (a plain quantizer, for test files: llama.cpp's searches d)."""
    rows = values.shape[0]
    blocks = values.reshape(-1, BLOCK).astype(np.float32)
    d = (np.abs(blocks).max(axis=1, keepdims=True) / 127).astype(np.float16)
    scaled = blocks / np.maximum(d.astype(np.float32), np.float32(1e-30))
    levels = np.array(IQ4_NL_LEVELS, dtype=np.float32)
    index = np.abs(scaled[:, :, None] - levels).argmin(axis=2).astype(np.uint8)
    packed = index[:, :16] | (index[:, 16:] << 4)  # low nibbles: 0-15, high: 16-31
    return np.concatenate([d.view(np.uint8), packed], axis=1).reshape(rows, -1)


def test_iq4_nl_blocks_match_gguf_dequantize_and_an_fp32_matmul(block_ops):
    rows, cols = 40, 512  # 40: the last panel of 16 rows is partly padding
    raw = random_iq4_nl(rows, cols)
    blocks = to_blocks(raw, Q.IQ4_NL, "blk.0.ffn_up.weight", "test.gguf")
    weights = reference_weights(raw, Q.IQ4_NL)
    assert torch.equal(blocks.dequantize(), weights)  # the conversion is exact
    assert (blocks.block_len, blocks.bits, blocks.indexed) == (32, 4, True)
    codes = blocks.unpacked_codes()
    assert int(codes.min()) >= 1 and int(codes.max()) <= 241
    assert set(blocks.stored_codes().unique().tolist()) == set(range(16))
    kernel = GGUFBlockLinear(blocks, None, block_ops)
    assert kernel.bits == int(Q.IQ4_NL) == 20  # csrc/block_ops.h's QUANT_CODES_IQ4_NL
    assert kernel.scales_mins.dtype == torch.float16  # d and -128 d: fp16 values
    packed = kernel.codes.numel() + kernel.scales_mins.numel() * 2
    assert packed / (48 * cols) == blocks.bytes_per_weight == 0.625  # 3 panels of 16 rows
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(1))
    y = kernel(x)
    error = (y - x @ weights.T).abs()
    assert (error <= error_bound(x, blocks)).all(), error.max()
    assert error.max() > 0  # the activations really are quantized
    plain = block_ops.quant_block_linear(x, kernel.codes, kernel.scales_mins, rows, 32, 20,
                                         force_plain=True)
    assert torch.equal(plain, y)
    as_bytes = GGUFBlockLinear(blocks.with_code_bits(8), None, block_ops)  # looked up at load
    assert as_bytes.bits == 8 and torch.equal(as_bytes(x), y)  # the same integer sums


def test_iq4_nl_rows_do_not_depend_on_their_batch(block_ops):
    kernel = GGUFBlockLinear(to_blocks(random_iq4_nl(48, 256, seed=2), Q.IQ4_NL, "w", "t.gguf"),
                             None, block_ops)
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([kernel(x[i:i + 1]) for i in range(len(x))])
    for batch in (2, 3, 8, 9, 17):
        together = torch.cat([kernel(x[i:i + batch]) for i in range(0, len(x), batch)])
        assert torch.equal(together, alone), batch


def test_iq4_nl_fused_with_other_types_keeps_its_values(block_ops):
    parts = [to_blocks(random_iq4_nl(32, 256, seed=4), Q.IQ4_NL, "w", "t.gguf"),
             to_blocks(raw_tensor(Q.Q4_K, 32, 256, seed=5), Q.Q4_K, "w", "t.gguf")]
    fused = concat_rows(parts)
    assert (fused.block_len, fused.bits, fused.types) == (32, 8, ("IQ4_NL", "Q4_K"))
    assert not fused.indexed  # the indices looked up: one format for the fused rows
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(6))
    error = (GGUFBlockLinear(fused, None, block_ops)(x) - x @ fused.dequantize().T).abs()
    assert (error <= error_bound(x, fused)).all()


def test_iq4_nl_fused_with_iq4_nl_keeps_its_indices(block_ops):
    parts = [to_blocks(random_iq4_nl(rows, 256, seed=rows), Q.IQ4_NL, "w", "t.gguf")
             for rows in (32, 16, 16)]  # q, k, v
    fused = concat_rows(parts)
    assert (fused.block_len, fused.bits, fused.indexed) == (32, 4, True)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    kernel = GGUFBlockLinear(fused, None, block_ops)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    expected = torch.cat([GGUFBlockLinear(p, None, block_ops)(x) for p in parts], dim=1)
    assert torch.equal(kernel(x), expected)  # each row's sums as in its own tensor


def test_the_kernel_refuses_an_unknown_codes_format(block_ops):
    blocks = to_blocks(random_iq4_nl(16, 64), Q.IQ4_NL, "w", "t.gguf")
    kernel = GGUFBlockLinear(blocks, None, block_ops)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"bits must be 4, 6 or 8 \(or 20: IQ4_NL's indices\)"):
        block_ops.quant_block_linear(x, kernel.codes, kernel.scales_mins, 16, 32, 5)
    with pytest.raises(RuntimeError, match="bits must be 4, 6 or 8"):
        block_ops.pack_quant_blocks(blocks.stored_codes(), blocks.scales, blocks.mins, 21)
    with pytest.raises(RuntimeError, match="a 4-bit code above 15"):  # indices are 4-bit
        block_ops.pack_quant_blocks(blocks.unpacked_codes(), blocks.scales, blocks.mins, 20)
    with pytest.raises(RuntimeError, match="block_len 16 or 32 and bits 4, 6 or 8 \\(or 20"):
        block_ops.linear_weights("gguf_blocks", kernel.codes, kernel.scales_mins, None, 16,
                                 block_len=32, bits=5)


def test_stack_equals_python_layers_on_iq4_nl(block_ops, monkeypatch):
    """A random Llama in IQ4_NL blocks (q/k/v and gate/up fused as indices; the LM head in
    Q8_0) decodes through the C++ DecodeStack exactly as through the Python layers."""
    from tests.model import test_gguf_stack
    from tests.model.test_decode_stack import run_comparing_stack_and_python

    layout = dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"), Q.IQ4_NL)
    monkeypatch.setitem(test_gguf_stack.LAYOUTS, "iq4_nl", {**layout, "lm_head": Q.Q8_0})
    monkeypatch.setitem(test_gguf_stack._K_SCALES, Q.IQ4_NL, ((0,), 1e-3))
    engine = test_gguf_stack.gguf_engine("iq4_nl")
    model = engine.runner.model
    assert model.decode_stack is not None
    assert model.layers[0].self_attn.qkv_proj.kernel.bits == int(Q.IQ4_NL)
    assert model.layers[0].mlp.gate_up_proj.kernel.bits == int(Q.IQ4_NL)
    assert run_comparing_stack_and_python(engine, random_prompts(4), max_tokens=16) >= 10


def test_a_bad_iq4_nl_scale_or_length_is_a_clear_error():
    raw = random_iq4_nl(4, 64)
    raw[1, BLOCK_BYTES:BLOCK_BYTES + 2] = np.array([np.inf], np.float16).view(np.uint8)
    with pytest.raises(ModelFileError, match=r"'blk.1.ffn_down.weight': block 3 \(IQ4_NL\) "
                                             r"has a non-finite scale"):
        to_blocks(raw, Q.IQ4_NL, "blk.1.ffn_down.weight", "m.gguf")
    assert Q.IQ4_NL in BLOCK_FORMATS
    with pytest.raises(ModelFileError, match=r"'blk.1.ffn_down.weight': rows of 35 bytes are "
                                             r"not whole IQ4_NL blocks of 18 bytes"):
        to_blocks(raw[:, :-1], Q.IQ4_NL, "blk.1.ffn_down.weight", "m.gguf")


# -- a GGUF file with IQ4_NL linears -------------------------------------------------------


@pytest.fixture(scope="module")
def iq4_nl_file(tmp_path_factory):
    """A tiny random Qwen3 GGUF (tests/model/test_gguf_families.py's writer) whose linear
    weights are IQ4_NL blocks (the norms, embedding and LM head stay float32)."""
    from tests.model.test_gguf_families import GGUF_FAMILY_CONFIGS, tiny_hf, write_gguf

    model = tiny_hf("qwen3", seed=31, **GGUF_FAMILY_CONFIGS["qwen3"])
    path = tmp_path_factory.mktemp("iq4nl") / "qwen3-iq4_nl.gguf"
    add_tensor = GGUFWriter.add_tensor

    def add_quantized(writer, name, tensor, *args, **kwargs):
        if name.startswith("blk.") and name.endswith(".weight") and "norm" not in name:
            tensor = quantize_iq4_nl(tensor)
            kwargs = {**kwargs, "raw_dtype": Q.IQ4_NL}
        return add_tensor(writer, name, tensor, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GGUFWriter, "add_tensor", add_quantized)
        write_gguf(path, model, "qwen3")
    return path


def test_an_iq4_nl_file_loads_in_blocks_and_decodes(block_ops, iq4_nl_file):
    kept = load_model(str(iq4_nl_file), keep_quantized=True, use_cache=False)
    fp32 = load_model(str(iq4_nl_file), use_cache=False)
    blocks = {n: w for n, w in kept.weights.items() if isinstance(w, GGUFBlockTensor)}
    assert len(blocks) == 2 * 7 and {w.blocks.types for w in blocks.values()} == {("IQ4_NL",)}
    for name, weight in blocks.items():  # the same values as the dequantizing load
        assert torch.equal(weight.blocks.dequantize(), fp32.weights[name]), name
    settings = dict(max_model_len=256, block_size=16, max_num_seqs=4)
    engine = LLMEngine(engine_config(quantization="gguf", **settings), kept.config,
                       kept.weights)
    assert engine.runner.kernels.describe().startswith("GGUF IQ4_NL weights as")
    assert "0.625 bytes/weight" in engine.runner.kernels.describe()
    linears = [m.kernel for m in engine.runner.model.modules() if isinstance(m, Linear)]
    blocks_kernels = [k for k in linears if isinstance(k, GGUFBlockLinear)]
    assert len(blocks_kernels) == 2 * 4  # fused qkv and gate_up: still IQ4_NL's indices
    assert {k.bits for k in blocks_kernels} == {int(Q.IQ4_NL)}
    reference = LLMEngine(engine_config(quantization="none", **settings), fp32.config,
                          fp32.weights)
    from slotserve.lab.quality import greedy_continuations, teacher_forced_agreement

    prompts = random_prompts(4, seed=7)
    continuations = greedy_continuations(reference, prompts, 16)
    assert teacher_forced_agreement(engine, prompts, continuations) >= 0.9


def test_the_start_up_line_names_types_kernels_and_bytes_per_decode_step(block_ops, iq4_nl_file):
    """For a GGUF served in blocks: its types, the block kernel, and the bytes of linear
    weights a decode step reads (each linear's packed codes and scales, or panels, once)."""
    loaded = load_model(str(iq4_nl_file), keep_quantized=True, use_cache=False)
    engine = LLMEngine(engine_config(quantization="gguf", max_model_len=256, block_size=16,
                                     max_num_seqs=4), loaded.config, loaded.weights)
    expected = 0
    for module in engine.runner.model.modules():
        if isinstance(module, Linear):
            kernel = module.kernel
            held = ((kernel.codes, kernel.scales_mins) if isinstance(kernel, GGUFBlockLinear)
                    else (kernel.panels,)) + ((kernel.bias,) if kernel.bias is not None else ())
            expected += sum(t.numel() * t.element_size() for t in held)
    text = engine.runner.kernels.describe()
    assert engine.runner.kernels.step_weight_bytes == expected
    assert text.startswith(f"GGUF IQ4_NL weights as 4/6/8-bit code blocks (0.625 bytes/weight), "
                           f"{size_text(expected)} read per decode step (")
    assert "linears: GGUF blocks x int8 activations (" in text
    assert engine.snapshot().kernels == text  # the start-up line's field (server/startup.py)


def test_a_malformed_iq4_nl_block_in_a_file_is_the_loaders_clear_error(iq4_nl_file, tmp_path):
    _, tensors = read_gguf(str(iq4_nl_file))
    target = next(t for t in tensors if t.name == "blk.1.ffn_up.weight")
    first_bytes = bytes(target.data[0, :BLOCK_BYTES * 2])
    del tensors, target
    offset = iq4_nl_file.read_bytes().index(first_bytes)
    bad = tmp_path / "bad_scale.gguf"
    shutil.copyfile(iq4_nl_file, bad)
    with open(bad, "r+b") as f:  # the second block's fp16 scale d -> NaN
        f.seek(offset + BLOCK_BYTES)
        f.write(np.array([np.nan], dtype=np.float16).tobytes())
    with pytest.raises(ModelFileError, match=r"'blk.1.ffn_up.weight': block 1 \(IQ4_NL\)"):
        load_model(str(bad), keep_quantized=True, use_cache=False)
    short = tmp_path / "truncated.gguf"
    with open(iq4_nl_file, "rb") as src, open(short, "wb") as dst:
        dst.write(src.read(os.path.getsize(iq4_nl_file) - 100))
    with pytest.raises(ModelFileError, match="out of bounds"):
        load_model(str(short), keep_quantized=True, use_cache=False)
