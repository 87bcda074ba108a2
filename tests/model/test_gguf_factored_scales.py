"""The K-quants' block scales kept factored, as their files store them (issue 31, memory).

Q2_K..Q6_K scale each block (16 or 32 weights) by an fp16 d of its 256-weight super-block
times a small integer (sc, mn): kept as int8 factors per block and an fp16 pair per
super-block, multiplied in the kernel, instead of an fp32 scale and min per block (Q3_K's
and Q6_K's mins are -4 d sc and -32 d sc: one factor serves both). The products are exact
in fp32, so every output is bit-equal to the fp32 layout's, at 0.578 bytes/weight for Q4_K
instead of 0.75 (the file's 0.5625). And 5- and 6-bit codes (Q5_*, Q6_K) kept in 6 bits,
not a byte: Q6_K 0.828 bytes/weight (the file's 0.820; 1.5 with both a byte and fp32
scales).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType

from slotserve.loader.gguf_blocks import K_QUANTS, SHARED_FACTOR_QUANTS, concat_rows, to_blocks
from slotserve.model.linear_kernels import (
    GGUFBlockLinear,
    held_bytes,
)
from tests.model.test_gguf_quant import raw_tensor

Q = GGMLQuantizationType
ROWS, COLS = 40, 512  # 40 rows: the last of 3 panels partly filled; 2 super-blocks a row


def _blocks(qtype, seed=1, rows=ROWS):
    return to_blocks(raw_tensor(qtype, rows, COLS, seed=seed), qtype, "blk.0.w", "test.gguf")


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_the_factors_are_the_fp32_scales_and_mins_to_the_bit(qtype):
    blocks = _blocks(qtype)
    f = blocks.factors
    assert f is not None and f.scale_factors.dtype == torch.int8
    per_super = blocks.scales.shape[1] // f.supers.shape[1]
    supers = f.supers.repeat_interleave(per_super, dim=1)  # (rows, blocks, 2)
    assert torch.equal(supers[..., 0] * f.scale_factors.float(), blocks.scales)
    assert torch.equal(supers[..., 1] * f.min_factors.float(), blocks.mins)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("force_plain", [False, True])
def test_factored_panels_compute_as_the_fp32_ones(block_ops, qtype, force_plain):
    blocks = _blocks(qtype)
    factored = GGUFBlockLinear(blocks, None, block_ops)
    full = GGUFBlockLinear(dataclasses.replace(blocks, factors=None), None, block_ops)
    shared = qtype in SHARED_FACTOR_QUANTS  # one int8 factor for the scale and the min
    assert factored.scales_mins.dtype == (torch.int8 if shared else torch.uint8)
    assert full.scales_mins.dtype == torch.float32
    torch.manual_seed(0)
    for tokens in (1, 3, 8, 9, 17):
        x = torch.randn(tokens, COLS)
        ours = block_ops.quant_block_linear(x, factored.codes, factored.scales_mins, ROWS,
                                            factored.block_len, factored.bits,
                                            force_plain=force_plain)
        theirs = block_ops.quant_block_linear(x, full.codes, full.scales_mins, ROWS, full.block_len,
                                              full.bits, force_plain=force_plain)
        assert torch.equal(ours, theirs), tokens
    ids = torch.tensor([0, 39, 16, 7])
    assert torch.equal(factored.rows(ids), blocks.dequantize()[ids])


@pytest.mark.parametrize(("qtype", "expected"), [(Q.Q4_K, 0.578125), (Q.Q6_K, 0.828125),
                                                 (Q.Q5_K, 0.828125), (Q.Q2_K, 0.640625),
                                                 (Q.Q3_K, 0.578125)])
def test_factored_scales_take_the_bytes_stated(block_ops, qtype, expected):
    blocks = _blocks(qtype, rows=48)  # 3 whole panels
    kernel = GGUFBlockLinear(blocks, None, block_ops)
    assert blocks.bytes_per_weight == expected
    assert held_bytes(kernel) / (48 * COLS) == expected
    full = GGUFBlockLinear(dataclasses.replace(blocks, factors=None), None, block_ops)
    assert held_bytes(full) > held_bytes(kernel)


def test_fusions_keep_factors_only_among_k_quants():
    q4k, q6k, q8 = _blocks(Q.Q4_K), _blocks(Q.Q6_K, seed=2), _blocks(Q.Q8_0, seed=3)
    fused = concat_rows([q4k, q6k])  # Q4_K's blocks of 32 split into Q6_K's 16
    assert fused.block_len == 16 and fused.factors is not None
    per_super = fused.scales.shape[1] // fused.factors.supers.shape[1]
    supers = fused.factors.supers.repeat_interleave(per_super, dim=1)
    assert torch.equal(supers[..., 0] * fused.factors.scale_factors.float(), fused.scales)
    assert concat_rows([q4k, q8]).factors is None


def test_shared_factors_only_where_the_mins_follow_the_scales():
    """Q3_K's and Q6_K's min factors are their scale factors (one byte a block kept);
    Q4_K's, Q5_K's and Q2_K's are their own."""
    for qtype in K_QUANTS:
        assert _blocks(qtype).factors.shared == (qtype in SHARED_FACTOR_QUANTS), qtype.name


def test_supers_outside_fp16_fall_back_to_fp32_scales(block_ops):
    """A super-block scale that is not an fp16 value (a -32 d past fp16's range) cannot be
    kept in the factored panels' fp16: the kernel keeps fp32 scales and mins instead, the
    same outputs."""
    blocks = _blocks(Q.Q6_K)
    supers = blocks.factors.supers.clone()
    supers[0, 0, 1] = 70000.0 * 32  # m of row 0's first super-block
    wide = dataclasses.replace(blocks, factors=dataclasses.replace(blocks.factors,
                                                                   supers=supers))
    assert not wide.factors.packable
    kernel = GGUFBlockLinear(wide, None, block_ops)
    assert kernel.scales_mins.dtype == torch.float32
    with pytest.raises(RuntimeError, match="fp16 values"):
        block_ops.pack_factored_scales(wide.factors.scale_factors, None, supers)


def test_bad_factors_are_refused(block_ops):
    factors = _blocks(Q.Q4_K).factors
    with pytest.raises(RuntimeError, match="int8"):
        block_ops.pack_factored_scales(factors.scale_factors.float(), factors.min_factors,
                                       factors.supers)
    with pytest.raises(RuntimeError, match="super-block"):
        block_ops.pack_factored_scales(factors.scale_factors[:, :3], factors.min_factors[:, :3],
                                       factors.supers)


# -- 5- and 6-bit codes kept in 6 bits -----------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("force_plain", [False, True])
def test_six_bit_codes_compute_as_bytes(block_ops, qtype, force_plain):
    """Q5_*/Q6_K codes packed in 6 bits (their top 2 bits apart) give the same bits as the
    same codes a byte each, at 0.75 bytes of codes per weight instead of 1."""
    blocks = _blocks(qtype, rows=48)
    assert blocks.bits == 6
    six = GGUFBlockLinear(blocks, None, block_ops)
    eight = GGUFBlockLinear(blocks.with_code_bits(8), None, block_ops)
    assert six.codes.numel() * 4 == eight.codes.numel() * 3
    torch.manual_seed(1)
    for tokens in (1, 5, 8, 11):
        x = torch.randn(tokens, COLS)
        ours = block_ops.quant_block_linear(x, six.codes, six.scales_mins, 48, six.block_len, 6,
                                            force_plain=force_plain)
        theirs = block_ops.quant_block_linear(x, eight.codes, eight.scales_mins, 48,
                                              eight.block_len, 8, force_plain=force_plain)
        assert torch.equal(ours, theirs), tokens
    ids = torch.tensor([47, 0, 21])
    assert torch.equal(six.rows(ids), blocks.dequantize()[ids])


def test_q4_k_fused_with_q6_k_takes_six_bits_and_a_code_of_64_is_refused(block_ops):
    fused = concat_rows([_blocks(Q.Q4_K), _blocks(Q.Q6_K, seed=2)])
    assert fused.bits == 6 and fused.block_len == 16
    bad = fused.stored_codes().clone()
    bad[0, 0, 0] = 64
    with pytest.raises(RuntimeError, match="6-bit code above 63"):
        block_ops.pack_quant_blocks(bad, fused.scales, fused.mins, 6)
