"""GGUF blocks unpacked at load by the fused CPU kernels (csrc/gguf_unpack.cpp, through
loader/gguf_blocks.py's `to_blocks`) against the numpy conversions they replaced, kept here
as the reference (`reference_arrays`): every supported type's codes, scales, mins and
factors to the bit, on random blocks with extreme fp16 scales (zero, -0, subnormals, the
largest finite); their packing into the kernel's panels (pack_quant_blocks) against the
layout csrc/quant_blocks.cpp's code_of reads (`reference_packing`); the loader's checks
of malformed blocks; and the fp32 values a GGUF's block weights give kernels that do not
run blocks (LazyBlocks.dequantized: the kernels' dequantize_gguf_blocks against gguf-py's
dequantize, or the file's own conversion where there are no kernels).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from slotserve.loader import ModelFileError, gguf_blocks
from slotserve.loader.gguf import _block_tensor, unpermute_qk
from slotserve.loader.gguf_blocks import (
    BLOCK_FORMATS,
    IQ4_NL_KERNEL_BITS,
    K_QUANTS,
    FileBlocks,
    LazyBlocks,
    check_blocks,
    concat_rows,
    to_blocks,
)
from slotserve.loader.gguf_reader import GGUFTensor

Q = GGMLQuantizationType
QK_K = 256

# -- the reference: the numpy conversions loader/gguf_blocks.py ran before the kernels ------
# Each takes (n, block bytes) raw GGUF blocks and returns codes (n, weights), scales and
# mins (n, per block) or (n, 1), and for a K-quant (scale factors, min factors, d, m).


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    return raw[:, start:start + 2].copy().view(np.float16).astype(np.float32)  # (n, 1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16k) bytes -> (n, 32k): per 16 bytes, their low nibbles, then their high ones."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """(n, 4) bytes, a little-endian uint32 of `count` bits -> (n, count) of 0/1."""
    bits = qh.copy().view(np.uint32) >> np.arange(count, dtype=np.uint32).reshape(1, count)
    return (bits & 1).astype(np.uint8)


def _q4_0(raw):
    d = _f16(raw, 0)
    return _nibbles(raw[:, 2:]), d, -8.0 * d


def _q4_1(raw):
    return _nibbles(raw[:, 4:]), _f16(raw, 0), _f16(raw, 2)


def _q5_0(raw):
    d = _f16(raw, 0)
    return _nibbles(raw[:, 6:]) | (_high_bits(raw[:, 2:6], 32) << 4), d, -16.0 * d


def _q5_1(raw):
    return _nibbles(raw[:, 8:]) | (_high_bits(raw[:, 4:8], 32) << 4), _f16(raw, 0), _f16(raw, 2)


def _q8_0(raw):
    d = _f16(raw, 0)
    return raw[:, 2:] ^ np.uint8(0x80), d, -128.0 * d  # q + 128 as the byte's bits


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 64 bytes of 2-bit values -> (n, 256): per 32 bytes, bits 0-1 of each,
    then bits 2-3, 4-5, 6-7 (gguf-py's order)."""
    n = qs.shape[0]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(n, -1, 1, 32) >> shifts) & 0x03).reshape(n, QK_K)


def _q2_k(raw):
    sc = raw[:, :16]  # per sub-block of 16: scale (low nibble) and min (high nibble)
    d, dmin = _f16(raw, 80), _f16(raw, 82)
    scale = d * (sc & 0x0F).astype(np.float32)
    return (_crumbs(raw[:, 16:80]), scale, -(dmin * (sc >> 4).astype(np.float32)),
            (sc & 0x0F, sc >> 4, d, -dmin))


def _q3_k(raw):
    n = raw.shape[0]
    hmask, qs, packed = raw[:, :32], raw[:, 32:96], raw[:, 96:108]
    d = _f16(raw, 108)
    # 16 6-bit scales: low nibbles in bytes 0-7 (then their high nibbles), 2 high bits each
    # in bytes 8-11 (gguf-py's dequantize, ggml's dequantize_row_q3_K)
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1))
    high = (packed[:, 8:].reshape(n, 1, 4)
            >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1))
    sc = (low.reshape(n, 16) & 0x0F) | ((high.reshape(n, 16) & 0x03) << 4)
    scale = d * (sc.astype(np.float32) - 32.0)
    bit = (hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    # q = low bits - 4 unless the high bit is set: u = q + 4 = low bits + 4 * bit
    signed = sc.astype(np.int16) - 32
    return (_crumbs(qs) | (bit.reshape(n, QK_K) << 2), scale, -4.0 * scale,
            (signed, signed, d, -4.0 * d))


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (n, 8) each (ggml's get_scale_min_k4)."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8).astype(np.float32), mn.reshape(n, 8).astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes -> (n, 256): per 32 bytes, the low nibbles then the high ones."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(n, QK_K)


def _q4_k(raw):
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    sc, mn = _k_scales_mins(raw[:, 4:16])
    return _k_nibbles(raw[:, 16:]), d * sc, -(dmin * mn), (sc, mn, d, -dmin)


def _q5_k(raw):
    n = raw.shape[0]
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    sc, mn = _k_scales_mins(raw[:, 4:16])
    qh = raw[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    high = (qh & 1).reshape(n, QK_K)  # sub-block j's high bits: bit j of each byte
    return _k_nibbles(raw[:, 48:]) | (high << 4), d * sc, -(dmin * mn), (sc, mn, d, -dmin)


def _q6_k(raw):
    n = raw.shape[0]
    ql, qh = raw[:, :128], raw[:, 128:192]
    sc = raw[:, 192:208].copy().view(np.int8).astype(np.float32)  # (n, 16)
    d = _f16(raw, 208)
    low = ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & 0x0F).reshape(n, -1, 32)
    high = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & 0x03).reshape(n, -1, 32)
    scale = d * sc
    return (low | (high << 4)).reshape(n, QK_K), scale, -32.0 * scale, (sc, sc, d, -32.0 * d)


def _iq4_nl(raw):
    d = _f16(raw, 0)
    return _nibbles(raw[:, 2:]), d, -128.0 * d  # the indices q: BlockWeights.indexed


_CONVERT = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
            Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
            Q.IQ4_NL: _iq4_nl}


# Byte offsets of each type's fp16 fields (d, and m or dmin) in its block.
F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
              Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
              Q.Q6_K: (208,), Q.IQ4_NL: (0,)}
# fp16 bit patterns at the edges: 0, -0, the smallest and largest subnormals, the smallest
# normal, 1, -1, the largest finite and its negative
EXTREME_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF],
                       dtype=np.uint16)


def reference_arrays(raw: np.ndarray, qtype: GGMLQuantizationType) -> dict[str, np.ndarray]:
    """What to_blocks made of (rows, row bytes) raw blocks before the kernels unpacked them:
    codes (rows, blocks, L) one a byte, scales and mins (rows, blocks) fp32, and for a
    K-quant scale_factors, min_factors (rows, blocks) int8 and supers (rows, supers, 2)."""
    block_len = BLOCK_FORMATS[qtype][0]
    weights, size = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    blocks = raw.reshape(-1, size)
    n, per_block = blocks.shape[0], weights // block_len
    codes, scales, mins, *factored = _CONVERT[qtype](blocks)
    out = {"codes": np.asarray(codes, dtype=np.uint8).reshape(rows, -1, block_len),
           "scales": np.broadcast_to(scales, (n, per_block)).astype(np.float32).reshape(rows, -1),
           "mins": np.broadcast_to(mins, (n, per_block)).astype(np.float32).reshape(rows, -1)}
    if factored:
        scale_factors, min_factors, d, m = factored[0]
        out["scale_factors"] = np.asarray(scale_factors).astype(np.int8).reshape(rows, -1)
        out["min_factors"] = np.asarray(min_factors).astype(np.int8).reshape(rows, -1)
        out["supers"] = np.concatenate([d, m], axis=1).astype(np.float32).reshape(rows, -1, 2)
    return out


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, row bytes) of random `qtype` blocks: random bytes, every fp16 field finite,
    a quarter of them at the edges of fp16 (EXTREME_F16)."""
    rng = np.random.default_rng(seed)
    weights, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // weights, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        bits = rng.integers(0, 1 << 16, size=len(raw), dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # inf and NaN -> finite
        edges = rng.random(len(raw)) < 0.25
        bits[edges] = rng.choice(EXTREME_F16, size=int(edges.sum()))
        raw[:, offset:offset + 2] = bits.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def assert_same_bits(ours: torch.Tensor, theirs: np.ndarray, what: str) -> None:
    """Equal dtypes, shapes and bytes (floats compared as their bits: -0 is not 0)."""
    theirs = torch.from_numpy(np.ascontiguousarray(theirs))
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (what, ours.shape,
                                                                      theirs.shape)
    if ours.dtype == torch.float32:
        ours, theirs = ours.view(torch.int32), theirs.view(torch.int32)
    assert torch.equal(ours, theirs), what


def assert_blocks_equal(blocks, expected: dict[str, np.ndarray]) -> None:
    for name in ("codes", "scales", "mins"):
        assert_same_bits(getattr(blocks, name), expected[name], name)
    if "supers" not in expected:
        assert blocks.factors is None
        return
    for name in ("scale_factors", "min_factors", "supers"):
        assert_same_bits(getattr(blocks.factors, name), expected[name], name)


@pytest.mark.parametrize("qtype", list(BLOCK_FORMATS), ids=lambda t: t.name)
def test_every_type_unpacks_as_the_numpy_conversions_did(qtype, cpu_ops):
    raw = random_blocks(qtype, 40, 512)
    blocks = to_blocks(raw, qtype, "blk.0.ffn_up.weight", "test.gguf")
    assert_blocks_equal(blocks, reference_arrays(raw, qtype))
    assert (blocks.bits, blocks.indexed) == (BLOCK_FORMATS[qtype][1], qtype == Q.IQ4_NL)
    assert (blocks.factors is not None) == (qtype in K_QUANTS)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_1, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_large_tensor_unpacks_in_parallel_to_the_same_bits(qtype, cpu_ops):
    """Enough rows that the unpacking runs in many chunks (at least 64 KB of blocks each)."""
    raw = random_blocks(qtype, 1024, 1024, seed=5)
    blocks = to_blocks(raw, qtype, "blk.0.ffn_down.weight", "test.gguf")
    assert_blocks_equal(blocks, reference_arrays(raw, qtype))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q3_K], ids=lambda t: t.name)
def test_rows_come_in_the_order_asked(qtype, cpu_ops):
    raw = random_blocks(qtype, 64, 256, seed=1)
    order = unpermute_qk(np.arange(64), 4)  # the loader's order for a llama q/k weight
    expected = {name: array[order] for name, array in reference_arrays(raw, qtype).items()}
    assert_blocks_equal(to_blocks(raw, qtype, "w", "t.gguf", order), expected)
    for bad in (np.arange(63), np.full(64, 64)):  # too short; a row that is not there
        with pytest.raises(RuntimeError, match="order"):
            to_blocks(raw, qtype, "w", "t.gguf", bad)


def reference_packing(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                      bits: int) -> tuple[np.ndarray, np.ndarray]:
    """pack_quant_blocks' output, in numpy: code i of row o's block b at the byte (and
    bits) that csrc/quant_blocks.cpp's code_of reads it from; the scales and mins (panels,
    blocks, 2, 16), fp16 where every value is one; padding rows zero."""
    out, blocks, length = codes.shape
    stored = 4 if bits == IQ4_NL_KERNEL_BITS else bits
    panels = -(-out // 16)
    packed = np.zeros((panels, blocks, length * 16 * stored // 8), dtype=np.uint8)
    o, b, i = np.meshgrid(np.arange(out), np.arange(blocks), np.arange(length), indexing="ij")
    p, at, k, c = o // 16, 4 * (o % 16) + i % 4, i // 4, codes.numpy()
    if stored == 8:
        packed[p, b, 64 * k + at] = c
    else:
        np.bitwise_or.at(packed, (p, b, 64 * (k // 2) + at),
                         ((c & 0x0F) << (4 * (k & 1))).astype(np.uint8))
        if stored == 6:
            np.bitwise_or.at(packed, (p, b, length * 8 + 64 * (k // 4) + at),
                             ((c >> 4) << (2 * (k % 4))).astype(np.uint8))
    sm = np.zeros((panels, blocks, 2, 16), dtype=np.float32)
    rows = np.arange(out)
    sm[rows // 16, :, 0, rows % 16] = scales.numpy()
    sm[rows // 16, :, 1, rows % 16] = mins.numpy()
    half = sm.astype(np.float16)
    return packed, half if np.array_equal(half.astype(np.float32), sm) else sm


@pytest.mark.parametrize("bits,block_len", [(4, 32), (4, 16), (6, 32), (6, 16), (8, 32),
                                            (8, 16), (IQ4_NL_KERNEL_BITS, 32)])
@pytest.mark.parametrize("fp16_scales", [True, False], ids=["fp16", "fp32"])
def test_packing_lays_codes_out_as_the_kernel_reads_them(bits, block_len, fp16_scales,
                                                         cpu_ops):
    out, blocks = 40, 6  # 40 rows: the last panel of 16 is half padding
    gen = torch.Generator().manual_seed(bits + block_len)
    top = 1 << (4 if bits == IQ4_NL_KERNEL_BITS else bits)
    codes = torch.randint(0, top, (out, blocks, block_len), dtype=torch.uint8, generator=gen)
    scales, mins = torch.randn(2, out, blocks, generator=gen)
    if fp16_scales:
        scales, mins = scales.half().float(), mins.half().float()
    packed, sm = cpu_ops.pack_quant_blocks(codes, scales, mins, bits)
    expected_packed, expected_sm = reference_packing(codes, scales, mins, bits)
    assert torch.equal(packed, torch.from_numpy(expected_packed))
    assert sm.dtype == (torch.float16 if fp16_scales else torch.float32)
    assert torch.equal(sm, torch.from_numpy(expected_sm))


@pytest.mark.parametrize("bits", [4, 6, IQ4_NL_KERNEL_BITS])
def test_packing_refuses_a_code_wider_than_its_bits(bits, cpu_ops):
    width = 4 if bits == IQ4_NL_KERNEL_BITS else bits
    codes = torch.zeros(20, 2, 32, dtype=torch.uint8)
    codes[19, 1, 31] = 1 << width  # the very last code
    scales = torch.ones(20, 2)
    with pytest.raises(RuntimeError, match=f"a {width}-bit code above {(1 << width) - 1}"):
        cpu_ops.pack_quant_blocks(codes, scales, scales, bits)
    codes[19, 1, 31] -= 1
    cpu_ops.pack_quant_blocks(codes, scales, scales, bits)  # the widest code it has


@pytest.mark.parametrize("qtype", list(BLOCK_FORMATS), ids=lambda t: t.name)
def test_every_non_finite_scale_field_is_the_loaders_clear_error(qtype, cpu_ops):
    raw = random_blocks(qtype, 8, 512, seed=2)
    size = GGML_QUANT_SIZES[qtype][1]
    check_blocks(raw, qtype, "w", "m.gguf")  # every field finite (the largest included)
    for offset in F16_FIELDS[qtype]:
        for bits in (0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF):  # inf, -inf, NaNs
            for block in (3, raw.size // size - 1):  # one inside, the tensor's last
                bad = raw.copy()
                bad.reshape(-1, size)[block, offset:offset + 2] = np.array(
                    [bits], dtype=np.uint16).view(np.uint8)
                with pytest.raises(ModelFileError, match=rf"'blk.2.ffn_up.weight': block "
                                                         rf"{block} \({qtype.name}\) has a "
                                                         "non-finite"):
                    to_blocks(bad, qtype, "blk.2.ffn_up.weight", "m.gguf")


def test_a_truncated_row_is_the_loaders_clear_error():
    raw = random_blocks(Q.Q4_K, 4, 512)
    with pytest.raises(ModelFileError, match="not whole Q4_K blocks of 144 bytes"):
        to_blocks(raw[:, :-1], Q.Q4_K, "w", "m.gguf")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_K, Q.Q6_K, Q.IQ4_NL],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.ffn_up.weight"])
def test_kernels_without_blocks_get_the_blocks_values_from_the_file(qtype, name, cpu_ops):
    """A GGUF weight's LazyBlocks (loader/gguf.py): its blocks (q's rows un-permuted) and,
    for kernels that do not run blocks, its fp32 values made straight from the file (the
    fused kernels' dequantize_gguf_blocks), equal to the blocks' dequantized values."""
    rows, cols, heads = 64, 256, 4
    raw = random_blocks(qtype, rows, cols, seed=3)
    tensor = GGUFTensor(name, (cols, rows), qtype, raw)
    config = SimpleNamespace(architecture="llama", num_attention_heads=heads,
                             num_key_value_heads=heads)
    lazy = _block_tensor(tensor, config, "m.gguf", "llama").source
    order = unpermute_qk(np.arange(rows), heads) if "attn_q" in name else np.arange(rows)
    expected = {key: array[order] for key, array in reference_arrays(raw, qtype).items()}
    assert_blocks_equal(lazy.load(), expected)
    values = lazy.dequantized()
    assert values.shape == (rows, cols)
    assert torch.equal(values, lazy.load().dequantize())


def test_without_the_kernels_block_weights_still_dequantize_from_the_file(monkeypatch):
    """SLOTSERVE_CPU_OPS=0 or no compiler: the engine's kernels do not run blocks, so it
    takes every weight's fp32 values, which the loader makes from the file (numpy), never
    through to_blocks (which needs the kernels, and says so)."""
    from slotserve.model import cpu_ops

    monkeypatch.setattr(cpu_ops, "_LOADED", [])
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    monkeypatch.setattr(cpu_ops, "load_cpu_ops", cpu_ops.load_cpu_ops.__wrapped__)
    raw = random_blocks(Q.Q4_K, 32, 256, seed=4)
    tensor = GGUFTensor("blk.0.ffn_gate.weight", (256, 32), Q.Q4_K, raw)
    config = SimpleNamespace(architecture="llama", num_attention_heads=4, num_key_value_heads=4)
    lazy = _block_tensor(tensor, config, "m.gguf", "llama").source
    with pytest.raises(RuntimeError, match="unpacked by the fused CPU kernels"):
        lazy.load()
    expected = reference_arrays(raw, Q.Q4_K)
    values = expected["codes"] * expected["scales"][:, :, None] + expected["mins"][:, :, None]
    assert torch.equal(lazy.dequantized(), torch.from_numpy(values.reshape(32, 256)))


def test_to_blocks_unpacks_with_the_build_already_loaded(monkeypatch, cpu_ops):
    """A CPU class forced lower loads its own build first: the unpacking takes it (the last
    loaded), never building this CPU's as well."""
    from slotserve.model import cpu_ops as module

    calls = []

    class Forced:
        def unpack_gguf_blocks(self, raws, qtype, orders):
            calls.append(qtype)
            return cpu_ops.unpack_gguf_blocks(raws, qtype, orders)

    monkeypatch.setattr(module, "_LOADED", [cpu_ops, Forced()])
    raw = random_blocks(Q.Q6_K, 16, 256)
    assert_blocks_equal(to_blocks(raw, Q.Q6_K, "w", "m.gguf"), reference_arrays(raw, Q.Q6_K))
    assert calls == [int(Q.Q6_K)]


def file_weight(qtype: GGMLQuantizationType, name: str, rows: int, seed: int) -> LazyBlocks:
    """The loader's LazyBlocks of a (rows, 256) weight in `qtype` (a llama of 4 heads)."""
    raw = random_blocks(qtype, rows, 256, seed=seed)
    config = SimpleNamespace(architecture="llama", num_attention_heads=4, num_key_value_heads=2)
    return _block_tensor(GGUFTensor(name, (256, rows), qtype, raw), config, "m.gguf",
                         "llama").source


def test_a_fusion_of_one_type_unpacks_its_parts_together(monkeypatch, cpu_ops):
    """q and k (rows un-permuted) of one type unpack into one set of arrays, equal to the
    concatenation of each one's blocks (which is then never made); parts of two types
    (Q4_0 and Q4_1: one packing) are concatenated."""
    q = file_weight(Q.Q4_K, "blk.0.attn_q.weight", 64, seed=6)
    k = file_weight(Q.Q4_K, "blk.0.attn_k.weight", 32, seed=7)
    expected = concat_rows([q.load(), k.load()])
    with monkeypatch.context() as patch:
        patch.setattr(gguf_blocks, "concat_rows", None)  # a call would fail
        fused = LazyBlocks.fused([q, k]).load()
    assert fused.shape == (96, 256) and fused.types == ("Q4_K",)
    assert_blocks_equal(fused, {name: getattr(expected, name).numpy()
                                for name in ("codes", "scales", "mins")}
                        | {name: getattr(expected.factors, name).numpy()
                           for name in ("scale_factors", "min_factors", "supers")})
    parts = [file_weight(Q.Q4_0, "blk.0.ffn_gate.weight", 32, seed=8),
             file_weight(Q.Q4_1, "blk.0.ffn_up.weight", 32, seed=9)]
    mixed = LazyBlocks.fused(parts).load()
    assert mixed.types == ("Q4_0", "Q4_1")
    assert torch.equal(mixed.dequantize(), torch.cat([p.load().dequantize() for p in parts]))


def gguf_py_values(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32))


@pytest.mark.parametrize("qtype", list(BLOCK_FORMATS), ids=lambda t: t.name)
def test_every_type_dequantizes_straight_from_the_file_as_gguf_py_does(qtype, cpu_ops):
    """csrc/gguf_unpack.cpp's dequantize_row: the fp32 values kernels that do not run blocks
    take (--quantization none/bf16/int8 on a GGUF), equal to gguf-py's (-0 may be +0:
    torch.equal compares values), extreme fp16 scales included; a large tensor in many
    parallel chunks alike."""
    for rows, cols in ((40, 512), (1024, 1024)):
        raw = random_blocks(qtype, rows, cols, seed=11)
        values = gguf_blocks.dequantize_files([FileBlocks(raw, qtype, "w", "m.gguf")])
        assert values.dtype == torch.float32 and values.shape == (rows, cols)
        assert torch.equal(values, gguf_py_values(raw, qtype))


def test_a_fusion_of_several_types_dequantizes_in_one_pass(monkeypatch, cpu_ops):
    """q, k, v of Q4_K, Q4_K and Q6_K (a Q4_K_M file's; q/k rows un-permuted) dequantize
    into one tensor, rows in turn: equal to each part's gguf-py values, q and k in the
    loader's order; nothing concatenated."""
    parts = [file_weight(Q.Q4_K, "blk.0.attn_q.weight", 64, seed=12),
             file_weight(Q.Q4_K, "blk.0.attn_k.weight", 32, seed=13),
             file_weight(Q.Q6_K, "blk.0.attn_v.weight", 32, seed=14)]
    expected = torch.cat([gguf_py_values(p.file.data, p.file.qtype)[p.file.order]
                          if p.file.order is not None
                          else gguf_py_values(p.file.data, p.file.qtype) for p in parts])
    monkeypatch.setattr(torch, "cat", None)  # a call would fail
    values = LazyBlocks.fused(parts).dequantized()
    assert values.shape == (128, 256)
    monkeypatch.undo()
    assert torch.equal(values, expected)


def test_dequantizing_refuses_parts_of_different_widths_or_an_unknown_type(cpu_ops):
    wide, narrow = random_blocks(Q.Q8_0, 4, 512), random_blocks(Q.Q8_0, 4, 256)
    with pytest.raises(RuntimeError, match="as many weights"):
        cpu_ops.dequantize_gguf_blocks([wide, narrow], [int(Q.Q8_0)] * 2, [None, None])
    with pytest.raises(RuntimeError, match="no block dequantizing"):
        cpu_ops.dequantize_gguf_blocks([wide], [int(Q.IQ2_XXS)], [None])
    with pytest.raises(RuntimeError, match="order"):
        cpu_ops.dequantize_gguf_blocks([wide], [int(Q.Q8_0)], [torch.tensor([0, 1, 2, 4])])


def test_a_weights_unpacked_memory_is_reused_once_dropped_and_released(cpu_ops):
    """csrc/gguf_unpack.cpp's NOTE (reused memory): the next weight's arrays take the
    memory of the last one's once they are dropped, never while one of them lives; the
    memory is unmapped on release."""
    cpu_ops.release_unpack_memory()
    raw = [random_blocks(Q.Q4_K, 64, 512, seed=seed) for seed in range(3)]
    first = to_blocks(raw[0], Q.Q4_K, "w", "m.gguf")
    address = first.codes.data_ptr()
    del first
    assert cpu_ops.unpack_memory_spare_bytes() >= 64 * 512
    second = to_blocks(raw[1], Q.Q4_K, "w", "m.gguf")
    assert second.codes.data_ptr() == address and cpu_ops.unpack_memory_spare_bytes() == 0
    scales = second.scales  # one array alive holds the memory
    del second
    third = to_blocks(raw[2], Q.Q4_K, "w", "m.gguf")
    assert third.codes.data_ptr() != address
    assert_same_bits(scales, reference_arrays(raw[1], Q.Q4_K)["scales"], "scales")
    assert_blocks_equal(third, reference_arrays(raw[2], Q.Q4_K))
    del third, scales
    assert cpu_ops.unpack_memory_spare_bytes() > 0
    cpu_ops.release_unpack_memory()
    assert cpu_ops.unpack_memory_spare_bytes() == 0


def test_the_kept_memory_shrinks_to_the_largest_of_the_last_weights(cpu_ops):
    """A big weight's memory, kept, shrinks to the largest of the last 8 weights' (the NOTE
    (peak memory)): the tied embedding, unpacked first, is not kept through the layers."""
    cpu_ops.release_unpack_memory()
    to_blocks(random_blocks(Q.Q6_K, 256, 1024), Q.Q6_K, "w", "m.gguf")  # dropped at once
    big = cpu_ops.unpack_memory_spare_bytes()
    assert big >= 256 * 1024 * 1.5  # codes, scales and mins
    small = random_blocks(Q.Q6_K, 16, 1024)
    for _ in range(7):  # the big one is among the last 8: kept whole
        to_blocks(small, Q.Q6_K, "w", "m.gguf")
        assert cpu_ops.unpack_memory_spare_bytes() == big
    to_blocks(small, Q.Q6_K, "w", "m.gguf")
    assert 16 * 1024 <= cpu_ops.unpack_memory_spare_bytes() <= big / 8
    cpu_ops.release_unpack_memory()


def test_the_loading_releases_the_unpacked_memory_when_its_model_is_dropped(tmp_path,
                                                                            cpu_ops):
    from slotserve.loader import load_model
    from tests.unit.test_gguf_fuzz import tiny_gguf_bytes

    path = tmp_path / "m.gguf"
    path.write_bytes(tiny_gguf_bytes(tmp_path))
    cpu_ops.release_unpack_memory()
    loaded = load_model(str(path), keep_quantized=True)
    blocks = loaded.weights["model.layers.0.mlp.up_proj.weight"].blocks
    assert blocks.types == ("Q4_1",)
    del blocks  # unpacked, then dropped: its memory kept for the next weight's
    assert cpu_ops.unpack_memory_spare_bytes() > 0
    del loaded
    assert cpu_ops.unpack_memory_spare_bytes() == 0
