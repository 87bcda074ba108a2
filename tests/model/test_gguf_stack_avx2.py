"""The GGUF block kernel's AVX2 path (no VNNI: vpmaddubsw for 4- and 6-bit codes, 8-bit ones
widened to int16 for vpmaddwd), in the avx2 CPU class's own build (gcc -march=x86-64-v3, as
SLOTSERVE_CPU_ISA=avx2 selects).

Its integer sums are exact and its float operations those of the VNNI path and the plain
loops, in the same order: all three give the same bits, whatever the batch.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from slotserve.loader.gguf_blocks import to_blocks
from slotserve.model import kernels as kernel_choice
from slotserve.model.cpu_ops import load_cpu_ops
from slotserve.model.linear_kernels import GGUFBlockLinear
from tests.conftest import random_prompts
from tests.model.test_decode_stack import run_comparing_stack_and_python
from tests.model.test_gguf_quant import (
    FORMATS_AND_ACTIVATIONS,
    assert_quantization_edges_match_the_plain_loops,
    error_bound,
    raw_tensor,
    reference_weights,
)
from tests.model.test_gguf_stack import gguf_engine

Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def avx2_ops():
    if not kernel_choice.cpu_class().at_least("avx2"):
        pytest.skip("this CPU has no AVX2")
    ops = load_cpu_ops(kernel_choice.cpu_class("avx2").march)
    if ops is None:
        pytest.skip("the avx2 class's kernels did not build")
    assert ops.quant_blocks_isa() == "avx2"
    return ops


@pytest.mark.parametrize(("qtype", "activation_bits"), FORMATS_AND_ACTIVATIONS,
                         ids=lambda v: getattr(v, "name", f"a{v}"))
def test_avx2_path_equals_the_plain_loops_and_vnni(qtype, activation_bits, avx2_ops, cpu_ops):
    rows, cols = 40, 512  # the last panel of 16 rows is partly padding
    raw = raw_tensor(qtype, rows, cols, seed=4)
    blocks = to_blocks(raw, qtype, "blk.0.ffn_up.weight", "test.gguf")
    kernel = GGUFBlockLinear(blocks, None, avx2_ops, activation_bits)
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(5))  # 4 + 4 + 3 rows
    y = kernel(x)
    plain = avx2_ops.quant_block_linear(x, kernel.codes, kernel.scales_mins, rows,
                                        blocks.block_len, kernel.bits, kernel.activation_bits,
                                        force_plain=True)
    assert torch.equal(y, plain)
    error = (y - x @ reference_weights(raw, qtype).T).abs()
    assert (error <= error_bound(x, blocks, activation_bits)).all(), error.max()
    if cpu_ops.quant_blocks_isa() == "avx512vnni":
        assert torch.equal(GGUFBlockLinear(blocks, None, cpu_ops, activation_bits)(x), y)


@pytest.mark.parametrize(("qtype", "activation_bits"), [(Q.Q8_0, 8), (Q.Q6_K, 8), (Q.Q8_0, 16)],
                         ids=lambda v: getattr(v, "name", f"a{v}"))
def test_avx2_activation_quantization_edges_match_the_plain_loops(qtype, activation_bits,
                                                                  avx2_ops):
    assert_quantization_edges_match_the_plain_loops(avx2_ops, qtype, activation_bits)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
def test_avx2_path_is_batch_invariant(qtype, avx2_ops):
    raw = raw_tensor(qtype, 48, 256, seed=6)
    kernel = GGUFBlockLinear(to_blocks(raw, qtype, "w", "test.gguf"), None, avx2_ops)
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(7))
    alone = torch.cat([kernel(x[i:i + 1]) for i in range(len(x))])
    for batch in (3, 4, 5, 8, 9, 17):
        together = torch.cat([kernel(x[i:i + batch]) for i in range(0, len(x), batch)])
        assert torch.equal(together, alone), batch


def test_the_avx2_class_decodes_gguf_blocks_through_the_stack(avx2_ops, monkeypatch):
    monkeypatch.setenv(kernel_choice.CPU_ISA_ENV, "avx2")
    engine = gguf_engine("k_quants", "qwen2")
    kernels = engine.runner.kernels
    assert kernels.cpu_class == "avx2" and kernels.ops is avx2_ops
    assert kernels.weights == "gguf" and engine.runner.model.decode_stack is not None
    assert "GGUF blocks x int8 activations (AVX2, fused CPU kernel)" in kernels.describe()
    decode_only = run_comparing_stack_and_python(engine, random_prompts(5), max_tokens=16)
    assert decode_only >= 10


@pytest.mark.parametrize(("qtype", "activation_bits"), FORMATS_AND_ACTIVATIONS,
                         ids=lambda v: getattr(v, "name", f"a{v}"))
def test_the_largest_codes_and_activations_sum_exactly(qtype, activation_bits, avx2_ops):
    """Every code at its format's largest value (all bits set: 15, 63 or 255) times every
    activation at its code's largest magnitude (+-127, or +-32512 for 16 bits), and 16-bit
    codes of 128 (halves 1 and -128): vpmaddubsw's int16 sums (4- and 6-bit codes, added over
    steps) reach their bound here and must not saturate, nor vpmaddwd's pairs of 16-bit
    codes: the AVX2 path equals the plain loops."""
    rows, cols = 32, 512
    raw = raw_tensor(qtype, rows, cols, seed=8)
    blocks = to_blocks(raw, qtype, "blk.0.ffn_up.weight", "test.gguf")
    kernel = GGUFBlockLinear(blocks, None, avx2_ops, activation_bits)
    codes = torch.full_like(kernel.codes, 0xFF)
    x = torch.ones(5, cols)
    x[1] = -1
    x[2, cols // 2:] = -1  # one sign per half: every block still all one sign
    x[3] *= 1e4
    x[4] = -128.0 / (127 * 256)  # 16-bit codes of -128 (halves 0 and -128) but each
    x[4, ::blocks.block_len] = -1.0  # block's first: the scale's, -32512
    args = (codes, kernel.scales_mins, rows, blocks.block_len, kernel.bits,
            kernel.activation_bits)
    y = avx2_ops.quant_block_linear(x, *args)
    assert torch.equal(y, avx2_ops.quant_block_linear(x, *args, force_plain=True))
    assert torch.equal(y[1], -y[0]) and y[0].abs().min() > 0
