"""GGUF weights kept in their own blocks (loader/gguf_blocks.py, csrc/quant_blocks.cpp).

Tolerance of the block matmul: the kernel rounds each activation block of L values to a
code, a = round(x / s) with s = max|x| / limit (127 for int8 codes, 32512 for the 16-bit
codes beside Q8_0: linear_kernels.activation_bits_for), so |x_i - s a_i| <= s / 2; the
integer sums are exact and the block scales and mins enter in fp32. Hence, for one output,

    |y - sum_i w_i x_i| <= sum_i |w_i| s_b(i) / 2 + fp32 rounding,

with w the dequantized weights (gguf-py's `dequantize`, which the blocks reproduce exactly).
The fp32 rounding is a few ulps per block: bounded here by 1e-5 x sum_i (|d u_i| + |m|) |x_i|.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from slotserve.config import engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.lab.quality import greedy_continuations, teacher_forced_agreement
from slotserve.loader import ModelFileError, default_model_path, gguf_blocks, load_model
from slotserve.loader.gguf_blocks import (
    BLOCK_FORMATS,
    GGUFBlockTensor,
    concat_rows,
    to_blocks,
)
from slotserve.loader.gguf_reader import read_gguf
from slotserve.model.kernels import gguf_bytes_text
from slotserve.model.layers import Linear
from slotserve.model.linear_kernels import GGUFBlockLinear, activation_bits_for

Q = GGMLQuantizationType
# gguf-py quantizes these; the K-quants are built from random valid blocks.
GGUF_PY_QUANTIZES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
# The activations' codes' largest magnitude by their bits (csrc/quant_blocks.cpp).
ACTIVATION_LIMIT = {8: 127, 16: 127 * 256}
# Byte offsets of the fp16 scales (and mins) inside each type's block.
_F16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,),
               Q.IQ4_NL: (0,)}  # IQ4_NL: random indices, as tests/model/test_gguf_iq4nl.py


def raw_tensor(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A (rows, row bytes) uint8 tensor of `qtype` blocks: gguf-py's quantization of random
    values where it has one, else random bytes with finite random fp16 scales."""
    rng = np.random.default_rng(seed)
    if qtype in GGUF_PY_QUANTIZES:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in _F16_FIELDS[qtype]:
        scale = rng.uniform(0, 0.01, size=raw.shape[0]).astype(np.float16)
        raw[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def reference_weights(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).copy())


def error_bound(x: torch.Tensor, blocks, activation_bits: int = 8) -> torch.Tensor:
    """The docstring's bound, (T, out), for x (T, in) against `blocks` (out, in), the
    activations rounded to `activation_bits`."""
    rows, cols = blocks.shape
    length = blocks.block_len
    limit = ACTIVATION_LIMIT[activation_bits]
    steps = x.abs().reshape(len(x), -1, length).amax(dim=2) / limit  # (T, blocks)
    half_step = steps.repeat_interleave(length, dim=1) / 2  # (T, in)
    weights = blocks.dequantize()
    magnitude = ((blocks.unpacked_codes().float() * blocks.scales[:, :, None]).abs()
                 + blocks.mins[:, :, None].abs()).reshape(rows, cols)
    return half_step @ weights.abs().T + 1e-5 * (x.abs() @ magnitude.T)


# Each format with int8 activations, and Q8_0 with the 16-bit ones of an all-Q8_0 model.
FORMATS_AND_ACTIVATIONS = [(qtype, 8) for qtype in BLOCK_FORMATS] + [(Q.Q8_0, 16)]


@pytest.mark.parametrize(("qtype", "activation_bits"), FORMATS_AND_ACTIVATIONS,
                         ids=lambda v: getattr(v, "name", f"a{v}"))
def test_each_block_format_matches_gguf_dequantize_and_an_fp32_matmul(qtype, activation_bits,
                                                                      block_ops):
    rows, cols = 40, 512  # 40: the last panel of 16 rows is partly padding
    raw = raw_tensor(qtype, rows, cols)
    blocks = to_blocks(raw, qtype, "blk.0.ffn_up.weight", "test.gguf")
    weights = reference_weights(raw, qtype)
    assert torch.equal(blocks.dequantize(), weights)  # the conversion is exact
    kernel = GGUFBlockLinear(blocks, None, block_ops, activation_bits)
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(1))
    y = kernel(x)
    error = (y - x @ weights.T).abs()
    assert (error <= error_bound(x, blocks, activation_bits)).all(), error.max()
    assert error.max() > 0  # the activations really are quantized
    plain = block_ops.quant_block_linear(x, kernel.codes, kernel.scales_mins, rows,
                                         blocks.block_len, kernel.bits, kernel.activation_bits,
                                         force_plain=True)  # bits: the codes' format
    assert torch.equal(plain, y)  # the fallback does the same float operations in order


@pytest.mark.parametrize(("qtype", "activation_bits"), [(Q.Q4_1, 8), (Q.Q6_K, 8), (Q.Q8_0, 16)],
                         ids=lambda v: getattr(v, "name", f"a{v}"))
def test_a_rows_result_does_not_depend_on_its_batch(qtype, activation_bits, block_ops):
    raw = raw_tensor(qtype, 48, 256, seed=2)
    kernel = GGUFBlockLinear(to_blocks(raw, qtype, "w", "test.gguf"), None, block_ops,
                             activation_bits)
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([kernel(x[i:i + 1]) for i in range(len(x))])
    for batch in (2, 3, 8, 9, 17):
        together = torch.cat([kernel(x[i:i + batch]) for i in range(0, len(x), batch)])
        assert torch.equal(together, alone), batch


def test_fused_rows_of_mixed_types_keep_their_values(block_ops):
    parts = [to_blocks(raw_tensor(t, 32, 256, seed=i), t, "w", "test.gguf")
             for i, t in enumerate((Q.Q4_K, Q.Q6_K, Q.Q8_0))]
    fused = concat_rows(parts)
    assert (fused.block_len, fused.bits, fused.types) == (16, 8, ("Q4_K", "Q6_K", "Q8_0"))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(5, 256)
    error = (GGUFBlockLinear(fused, None, block_ops)(x) - x @ fused.dequantize().T).abs()
    assert (error <= error_bound(x, fused)).all()


def test_block_tensor_allows_only_the_loading_operations():
    blocks = to_blocks(raw_tensor(Q.Q8_0, 16, 64), Q.Q8_0, "w", "test.gguf")
    tensor = GGUFBlockTensor(blocks)
    assert tensor.shape == (16, 64) and tensor.t().shape == (64, 16)
    for compute in (lambda: torch.add(tensor, 1), tensor.sum, lambda: torch.mm(tensor, tensor.t())):
        with pytest.raises(TypeError, match="only loading"):
            compute()
    target = torch.empty(16, 64)
    target.copy_(tensor)  # untransposed (the embedding): its values
    assert torch.equal(target, blocks.dequantize())
    param = torch.nn.Parameter(torch.empty(64, 16), requires_grad=False)
    with torch.no_grad():
        param.copy_(tensor.t())  # transposed (a linear's weight): the blocks, attached
    assert param.gguf_blocks.load() is blocks  # made when the kernel packs them (LazyBlocks)
    assert torch.equal(gguf_blocks.dequantized(tensor.t()), blocks.dequantize().t())


def test_an_unsupported_type_or_a_bad_scale_is_a_clear_error():
    raw = raw_tensor(Q.Q4_0, 4, 64)
    with pytest.raises(ModelFileError, match=r"'blk.1.attn_q.weight' has type IQ2_XXS"):
        to_blocks(raw, Q.IQ2_XXS, "blk.1.attn_q.weight", "m.gguf")
    raw[1, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # row 1: block 2 of 8
    with pytest.raises(ModelFileError, match=r"'blk.1.attn_q.weight': block 2 .*non-finite"):
        to_blocks(raw, Q.Q4_0, "blk.1.attn_q.weight", "m.gguf")


@pytest.fixture(scope="module")
def default_copy(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    shutil.copyfile(default_model_path(), path)
    return path


def test_the_loader_reports_a_malformed_block(default_copy, tmp_path):
    _, tensors = read_gguf(str(default_copy))
    first_bytes = next(bytes(t.data[0, :64]) for t in tensors if t.name == "blk.3.ffn_down.weight")
    del tensors
    offset = default_copy.read_bytes().index(first_bytes)
    bad = tmp_path / "bad_scale.gguf"
    shutil.copyfile(default_copy, bad)
    with open(bad, "r+b") as f:  # the first block's fp16 scale d -> inf
        f.seek(offset)
        f.write(np.array([np.inf], dtype=np.float16).tobytes())
    with pytest.raises(ModelFileError, match=r"'blk.3.ffn_down.weight': block 0 \(Q4_1\)"):
        load_model(str(bad), keep_quantized=True)
    short = tmp_path / "truncated.gguf"
    with open(default_copy, "rb") as src, open(short, "wb") as dst:
        dst.write(src.read(os.path.getsize(default_copy) - 1000))
    with pytest.raises(ModelFileError, match="out of bounds"):
        load_model(str(short), keep_quantized=True)


def test_the_default_model_loads_in_blocks_without_an_fp32_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    loaded = load_model(keep_quantized=True)
    blocks = {n: w for n, w in loaded.weights.items() if isinstance(w, GGUFBlockTensor)}
    assert len(blocks) == 7 * 30 + 1  # every linear, and the tied embedding / LM head
    held = sum(t.numel() * t.element_size() for w in blocks.values()
               for t in (w.blocks.codes, w.blocks.scales, w.blocks.mins))
    fp32 = sum(w.numel() * 4 for w in blocks.values())
    assert held < fp32 / 2.5
    assert not (tmp_path / "cache").exists()  # nothing written: no fp32 copy on disk


_PEAK_SCRIPT = """
import resource, sys
from slotserve.config import engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.model.cpu_ops import load_cpu_ops
load_cpu_ops()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
engine = LLMEngine.from_config(engine_config(max_num_seqs=4, num_blocks=64,
                                             quantization=sys.argv[1]))
print(engine.runner.kernels.weights,
      (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


def test_serving_a_gguf_in_blocks_never_holds_an_fp32_model(block_ops, tmp_path):
    """A subprocess's peak RSS while it loads the default model under quantization=gguf
    grows by less than the fp32 bytes of its layers alone: neither an fp32 copy of the model
    nor an fp32 embedding table is made (the tokens are looked up in the tied head's blocks,
    BlockEmbedding). Here ~280 MiB (the blocks and the transient copies of loading) against
    367 MiB of fp32 layers; with the fp32 table it grew by ~410, and bf16, which dequantizes
    everything to fp32 first, by ~1.4 GiB."""
    env = {**os.environ, "SLOTSERVE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, "gguf"], env=env,
                            capture_output=True, text=True, timeout=300, check=True)
    weights, grew = result.stdout.split()
    config = load_model(keep_quantized=True).config
    per_layer = config.hidden_size * (config.hidden_size + 2 * config.num_key_value_heads
                                      * config.head_dim + 3 * config.intermediate_size)
    fp32_layers = 4 * config.num_hidden_layers * per_layer
    assert config.tie_word_embeddings and weights == "gguf"
    assert int(grew) < fp32_layers, (int(grew) >> 20, fp32_layers >> 20)


def test_the_default_model_in_its_own_types_agrees_with_fp32(block_ops):
    """End to end: SmolLM2 (Q4_1 layers, Q8_0 embedding) served in its blocks, teacher-forced
    greedy agreement with the fp32-dequantized reference on 8 chat prompts x 24 tokens."""
    from slotserve.lab.workload import generate_workload

    quantized = load_model(keep_quantized=True)
    settings = dict(max_num_seqs=8, num_blocks=256)
    engine = LLMEngine(engine_config(quantization="gguf", **settings), quantized.config,
                       quantized.weights, quantized.tokenizer)
    kernels = engine.runner.kernels
    assert kernels.describe().startswith(
        f"GGUF Q4_1/Q8_0 weights as 4/6/8-bit code blocks ({gguf_bytes_text(('Q4_1', 'Q8_0'))})")
    linears = [m.kernel for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert all(isinstance(k, GGUFBlockLinear) for k in linears)
    reference_model = load_model()
    reference = LLMEngine(engine_config(quantization="none", **settings),
                          reference_model.config, reference_model.weights,
                          reference_model.tokenizer)
    prompts = generate_workload(8, prompts="chat", seed=0).chat_prompt_ids(quantized.tokenizer)
    continuations = greedy_continuations(reference, prompts, 24)
    assert teacher_forced_agreement(engine, prompts, continuations) >= 0.9


def test_kernels_that_do_not_run_blocks_get_them_dequantized():
    """quantization none/bf16/int8 (or kernels passed by hand) over block weights: fp32."""
    from slotserve.model.kernels import REFERENCE

    blocks = to_blocks(raw_tensor(Q.Q4_K, 16, 256), Q.Q4_K, "w", "test.gguf")
    prepared = REFERENCE.prepare_weight(GGUFBlockTensor(blocks).t())
    assert type(prepared) is torch.Tensor
    assert torch.equal(prepared, blocks.dequantize().t())


@pytest.mark.parametrize(("qtype", "activation_bits"), [(Q.Q8_0, 8), (Q.Q6_K, 8), (Q.Q8_0, 16)],
                         ids=lambda v: getattr(v, "name", f"a{v}"))
def test_activation_quantization_edges_match_the_plain_loops(qtype, activation_bits, block_ops):
    assert_quantization_edges_match_the_plain_loops(block_ops, qtype, activation_bits)


def assert_quantization_edges_match_the_plain_loops(ops, qtype: GGMLQuantizationType,
                                                    activation_bits: int = 8) -> None:
    """The vectorised activation quantizer gives the plain loops' bits on the blocks where
    they could part: ties (x / s exactly k + 0.5: to even), zeros, denormals, a huge value,
    -0.0, blocks holding inf or NaN (their row's outputs NaN), and 16-bit codes whose
    halves are at their ends."""
    raw = raw_tensor(qtype, 32, 256, seed=4)
    kernel = GGUFBlockLinear(to_blocks(raw, qtype, "w", "test.gguf"), None, ops,
                             activation_bits)
    length = kernel.block_len
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    top = float(ACTIVATION_LIMIT[kernel.activation_bits])
    ties = torch.tensor([top, 2.5, 3.5, -2.5, -0.5, 0.5, top - 0.5, -(top - 0.5)])
    x[0, :8] = ties  # block 0 of row 0: its scale 1, every tie exact
    x[1, :length] = 0.0
    x[1, length:2 * length] = -0.0
    x[2, :length] = 1e-40  # denormals only: below FLT_MIN, codes of zero
    x[2, length] = 1e30
    x[7] = 0.0  # one value of 1e-37, zeros beside it: limit / top overflows, codes of zero
    x[7, 3] = -1e-37
    x[3, 5] = float("inf")
    x[4, 7] = float("nan")
    past = torch.nextafter(torch.tensor(top), torch.tensor(float("inf")))
    x[5, :length] = torch.linspace(-1.0, 1.0, length) * past  # x / s just past top
    # 16-bit codes whose halves are at their ends: 128 = 256 - 128, 127, -128, 32511, ...
    x[6, :8] = torch.tensor([top, 128.0, 127.0, -128.0, top - 1, -127.5, 383.5, 1 - top])
    y = kernel(x)
    plain = ops.quant_block_linear(x, kernel.codes, kernel.scales_mins, 32, length,
                                   kernel.bits, kernel.activation_bits, force_plain=True)
    torch.testing.assert_close(y, plain, rtol=0, atol=0, equal_nan=True)
    assert y[3].isnan().all() and y[4].isnan().all() and not y[[0, 1, 2, 5, 6]].isnan().any()
    assert not y[7].any()  # the tiny block adds nothing, as zeros would


def test_only_an_all_q8_0_model_gets_16_bit_activations():
    """linear_kernels.activation_bits_for: 16 bits where every block weight is Q8_0 (where
    int8 activations doubled the weights' own error), int8 where 4-6-bit weights are there
    (a Q4_K_M file's Q8_0 or Q6_K head included)."""
    assert activation_bits_for(("Q8_0",)) == 16
    for types in [("Q4_K", "Q6_K"), ("Q4_1", "Q8_0"), ("IQ4_NL",), ("Q6_K",), ()]:
        assert activation_bits_for(types) == 8, types


def test_the_policy_counts_the_weights_the_linears_run():
    """gguf_blocks.block_types (the KernelSet's gguf_types): a Q8_0 model's embedding of
    another type, looked up a row at a time, leaves its linears 16-bit activations; tied (no
    lm_head.weight), it is the head and counts; alone in blocks, its type is named."""
    def blocks(qtype):
        return GGUFBlockTensor(to_blocks(raw_tensor(qtype, 16, 256), qtype, "w", "t.gguf"))
    linears = {"model.layers.0.mlp.up_proj.weight": blocks(Q.Q8_0),
               "lm_head.weight": blocks(Q.Q8_0)}
    embedding = {"model.embed_tokens.weight": blocks(Q.Q6_K)}
    assert gguf_blocks.block_types({**embedding, **linears}) == ("Q8_0",)
    assert activation_bits_for(gguf_blocks.block_types({**embedding, **linears})) == 16
    del linears["lm_head.weight"]
    assert gguf_blocks.block_types({**embedding, **linears}) == ("Q6_K", "Q8_0")
    assert gguf_blocks.block_types({**embedding, "lm_head.weight": torch.zeros(1)}) == ("Q6_K",)
    assert gguf_blocks.block_types({"lm_head.weight": torch.zeros(1)}) == ()


def test_bad_activation_bits_are_a_clear_error(block_ops):
    """16 bits take 8-bit codes only (the wide kernels read bytes): the Python kernel, the
    kernel call and the decode stack's linear each refuse another pairing, naming it."""
    four_bit = to_blocks(raw_tensor(Q.Q4_0, 16, 64), Q.Q4_0, "w", "t.gguf")
    with pytest.raises(ValueError, match="activation_bits must be 8, or 16 for 8-bit codes"):
        GGUFBlockLinear(four_bit, None, block_ops, activation_bits=16)
    with pytest.raises(ValueError, match="activation_bits must be 8"):
        GGUFBlockLinear(four_bit, None, block_ops, activation_bits=12)
    kernel = GGUFBlockLinear(four_bit, None, block_ops)
    x = torch.randn(2, 64)
    args = (kernel.codes, kernel.scales_mins, 16, kernel.block_len, kernel.bits)
    with pytest.raises(RuntimeError, match="16-bit activations take 8-bit codes only"):
        block_ops.quant_block_linear(x, *args, 16)
    with pytest.raises(RuntimeError, match="activation_bits must be 8 or 16, got 4"):
        block_ops.quant_block_linear(x, *args, 4)
    with pytest.raises(RuntimeError, match="16-bit activations take 8-bit codes only"):
        block_ops.linear_weights("gguf_blocks", kernel.codes, kernel.scales_mins, None, 16,
                                 block_len=kernel.block_len, bits=kernel.bits,
                                 activation_bits=16)
