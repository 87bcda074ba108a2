"""GGUF linear weights kept quantized: each block format as unsigned codes, scales and mins.

`to_blocks(tensor)` turns a GGUF tensor's raw blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL) into one form, `BlockWeights`: per output row, blocks of `block_len`
unsigned codes u (uint8) with an fp32 scale d and min m per block, such that

    w = d * u + m

reproduces gguf-py's `dequantize` (to fp32 rounding). The conversions:

| type | block_len | u | d | m | bits kept |
| --- | --- | --- | --- | --- | --- |
| Q4_0 | 32 | 4-bit q | d | -8 d | 4 |
| Q4_1 | 32 | 4-bit q | d | m | 4 |
| Q5_0 | 32 | 5-bit q | d | -16 d | 6 |
| Q5_1 | 32 | 5-bit q | d | m | 6 |
| Q8_0 | 32 | q + 128 | d | -128 d | 8 |
| Q2_K | 16 (sub-block) | 2-bit q | d * sc | -dmin * mn | 4 |
| Q3_K | 16 (sub-block) | 3-bit q + 4 | d * (sc - 32) | -4 d * (sc - 32) | 4 |
| Q4_K | 32 (sub-block) | 4-bit q | d * sc | -dmin * mn | 4 |
| Q5_K | 32 (sub-block) | 5-bit q | d * sc | -dmin * mn | 6 |
| Q6_K | 16 (sub-block) | 6-bit q | d * sc | -32 d * sc | 6 |
| IQ4_NL | 32 | kvalues_iq4nl[q] + 128 (q kept: indexed) | d | -128 d | 4 |

The codes are unsigned by construction, which is what AVX512-VNNI's u8 x s8 dot product
takes (csrc/quant_blocks.cpp). Bytes per weight in memory, packed: the codes (4-bit: 0.5,
6-bit 0.75: 5- and 6-bit codes, their top 2 bits apart as llama.cpp's Q6_K; Q8_0's 1) and a
scale and min per block, kept in fp16 where they are fp16 values (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, IQ4_NL: the file's own fp16 d and m, or -8d, -16d, -128d); the K-quants'
factored as the file stores them (`BlockFactors`: an int8 factor per block, sc or mn, and an
fp32 d and m per 256-weight super-block: d * sc is exact in fp32), else fp32: Q4_0/Q4_1
0.625 (as in the file), Q5_0/Q5_1 0.875, Q8_0 1.125, Q4_K 0.59, Q5_K 0.84, Q6_K 0.91,
Q2_K/Q3_K 0.66 (their 2/3-bit codes in 4 bits: more than the file's 0.33/0.43, a third of
bf16's 2), IQ4_NL 0.625.

IQ4_NL (llama.cpp's non-linear 4-bit type: an fp16 d and 32 4-bit indices q into the fixed
table kvalues_iq4nl per block, w = d * table[q]) keeps its indices, 4 bits each
(`BlockWeights.indexed`): its codes are u = table[q] + 128 (1..241, unsigned) with
m = -128 d (an fp16 value, as Q8_0's), and the kernel looks them up itself (one byte shuffle
per 64 codes: csrc/quant_blocks.cpp's format QUANT_CODES_IQ4_NL, ggml's type number 20).
Fused with another type (q/k/v, gate/up), its looked-up codes take a byte.

`GGUFBlockTensor` carries BlockWeights through the model's weight loading
(`LlamaForCausalLM.load_hf_weights`) without ever making fp32 values of a linear layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from slotserve.loader.validation import ModelFileError

Q = GGMLQuantizationType
QK_K = 256

# type -> (block_len, bits the codes are kept in, bytes of a block's scale (and of its min):
# 2 where they are fp16 values, csrc/quant_blocks.cpp's pack_quant_blocks keeps them so)
BLOCK_FORMATS: dict[GGMLQuantizationType, tuple[int, int, int]] = {
    Q.Q4_0: (32, 4, 2), Q.Q4_1: (32, 4, 2), Q.Q5_0: (32, 6, 2), Q.Q5_1: (32, 6, 2),
    Q.Q8_0: (32, 8, 2), Q.Q2_K: (16, 4, 4), Q.Q3_K: (16, 4, 4), Q.Q4_K: (32, 4, 4),
    Q.Q5_K: (32, 6, 4), Q.Q6_K: (16, 6, 4), Q.IQ4_NL: (32, 4, 2),
}
# IQ4_NL's 16 levels (ggml-common.h's kvalues_iq4nl; gguf-py's IQ4_NL.kvalues), and their
# codes u = level + 128 (unsigned, for the u8 x s8 dot product: csrc/quant_blocks.cpp's
# IQ4_NL_CODES), indexed by the file's 4-bit q.
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ4_NL_CODES = torch.tensor(IQ4_NL_LEVELS, dtype=torch.int16).add(128).to(torch.uint8)
# The kernel's `bits` for IQ4_NL's indices (csrc/ops.h's QUANT_CODES_IQ4_NL: ggml's number)
IQ4_NL_KERNEL_BITS = int(Q.IQ4_NL)
# Tensor types kept as they are today (float): never converted to blocks.
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
# The K-quants: scales and mins factored per 256-weight super-block (BlockFactors).
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# The K-quants whose min is minus a multiple of the block's scale (-4 d sc, -32 d sc): one
# factor per block serves both (csrc/ops.h's QUANT_SCALES_FACTORED_SHARED).
SHARED_FACTOR_QUANTS = (Q.Q3_K, Q.Q6_K)
FACTORED = 1  # bytes_per_weight's scale_bytes: an int8 scale and min factor each
SHARED_FACTOR = 0.5  # the same, one int8 factor serving both


def bytes_per_weight(block_len: int, bits: int, scale_bytes: float = 4) -> float:
    """Memory per weight of the packed blocks: the codes and a scale and min per block, of
    `scale_bytes` each (4: fp32, 2: fp16; FACTORED: int8 factors, SHARED_FACTOR: one int8
    factor for both, each plus an fp16 scale and min per super-block of QK_K weights)."""
    supers = 2 * 2 / QK_K if scale_bytes in (FACTORED, SHARED_FACTOR) else 0.0
    return bits / 8 + 2 * scale_bytes / block_len + supers


def type_scale_bytes(qtype: GGMLQuantizationType) -> float:
    """bytes_per_weight's scale_bytes of one GGUF type's packed blocks: SHARED_FACTOR or
    FACTORED for the K-quants, else its own scales' (fp16 or fp32)."""
    if qtype in K_QUANTS:
        return SHARED_FACTOR if qtype in SHARED_FACTOR_QUANTS else FACTORED
    return BLOCK_FORMATS[qtype][2]


def type_bytes_per_weight(qtype: GGMLQuantizationType) -> float:
    """Memory per weight of one GGUF type's packed blocks (the K-quants' factored)."""
    block_len, bits, _ = BLOCK_FORMATS[qtype]
    return bytes_per_weight(block_len, bits, type_scale_bytes(qtype))


@dataclass(frozen=True)
class BlockFactors:
    """The K-quants' block scales and mins as their file stores them (`BlockWeights.factors`):
    scales = supers[:, s, 0] * scale_factors and mins = supers[:, s, 1] * min_factors for the
    blocks of super-block s (QK_K weights). NOTE: exact in fp32 (an fp16 d, dmin, -32 d or
    -4 d times an integer of at most 8 bits), so they are the fp32 scales and mins bit for bit.

    scale_factors, min_factors: int8 (rows, blocks); supers: fp32 (rows, super-blocks, 2).
    """

    scale_factors: torch.Tensor
    min_factors: torch.Tensor
    supers: torch.Tensor

    @property
    def shared(self) -> bool:
        """One factor per block serves the scale and the min (Q3_K, Q6_K: the kernel then
        keeps one byte a block, not two)."""
        return torch.equal(self.scale_factors, self.min_factors)

    @property
    def packable(self) -> bool:
        """The kernel keeps the super-blocks' d and m in fp16: they must be fp16 values (every
        GGUF's are, but for a -32 d past fp16's range)."""
        return torch.equal(self.supers.half().float(), self.supers)

    def split(self, parts: int) -> BlockFactors:
        """Each block as `parts` blocks of the same factors (BlockWeights.with_block_len)."""
        return BlockFactors(self.scale_factors.repeat_interleave(parts, dim=1),
                            self.min_factors.repeat_interleave(parts, dim=1), self.supers)

    def rows(self, index: torch.Tensor) -> BlockFactors:
        return BlockFactors(self.scale_factors.index_select(0, index),
                            self.min_factors.index_select(0, index),
                            self.supers.index_select(0, index))


@dataclass(frozen=True)
class BlockWeights:
    """A (rows, cols) weight as blocks: w[r, b*L + i] = scales[r, b] * codes[r, b, i] + mins[r, b].

    codes: uint8 (rows, blocks, L) when bits is 6 or 8 (6: every code < 64, packed into 6
        bits by the kernel's packing); when bits == 4, two codes a byte, (rows, blocks, L / 2),
        byte j = u[2j] | u[2j + 1] << 4 (`unpacked_codes` for all L).
    scales, mins: fp32 (rows, blocks).
    types: the GGUF types it came from (several once q/k/v are fused).
    indexed: the stored 4-bit values are IQ4_NL's indices q, whose codes are
        IQ4_NL_CODES[q] (`unpacked_codes` looks them up; the kernel does too).
    factors: the K-quants' scales and mins as factors (BlockFactors; what GGUFBlockLinear
        keeps), None for other types or a fusion with one.
    NOTE: 4-bit codes stay packed while the model loads: the loading's transient copies (the
    weights dict and the fused q/k/v and gate/up) then take half the bytes.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bits: int
    types: tuple[str, ...]
    indexed: bool = False
    factors: BlockFactors | None = None

    @property
    def block_len(self) -> int:
        return self.codes.shape[2] * (2 if self.bits == 4 else 1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * self.block_len

    @property
    def bytes_per_weight(self) -> float:
        """Packed (GGUFBlockLinear): factored scales where it has factors, fp16 where every
        type's are fp16 values, else fp32."""
        if self.factors is not None and self.factors.packable:
            scale_bytes = SHARED_FACTOR if self.factors.shared else FACTORED
        else:
            scale_bytes = max(BLOCK_FORMATS[Q[t]][2] for t in self.types)
        return bytes_per_weight(self.block_len, self.bits, scale_bytes)

    @property
    def kernel_bits(self) -> int:
        """The codes' format as csrc/quant_blocks.cpp takes it (`bits`): 4, 8, or IQ4_NL's
        indices (QUANT_CODES_IQ4_NL: ggml's number for the type)."""
        return IQ4_NL_KERNEL_BITS if self.indexed else self.bits

    def stored_codes(self) -> torch.Tensor:
        """uint8 (rows, blocks, L): one stored value a byte whatever `bits` (indexed: the
        indices), what pack_quant_blocks takes."""
        if self.bits != 4:
            return self.codes
        return torch.stack([self.codes & 0x0F, self.codes >> 4], dim=-1).reshape(
            *self.codes.shape[:2], self.block_len)

    def unpacked_codes(self) -> torch.Tensor:
        """uint8 (rows, blocks, L): one code a byte whatever `bits` (indexed: looked up)."""
        stored = self.stored_codes()
        return IQ4_NL_CODES[stored.long()] if self.indexed else stored

    def with_code_bits(self, bits: int) -> BlockWeights:
        """The same values with codes kept in `bits` (6 or 8; at least this one's; IQ4_NL's
        indices looked up as codes)."""
        return BlockWeights(self.unpacked_codes(), self.scales, self.mins, bits, self.types,
                            factors=self.factors)

    def dequantize(self) -> torch.Tensor:
        """The fp32 (rows, cols) values (tests, the embedding, non-block kernels)."""
        values = self.unpacked_codes().float() * self.scales[:, :, None] + self.mins[:, :, None]
        return values.reshape(self.shape)

    def with_block_len(self, block_len: int) -> BlockWeights:
        """The same values in blocks of `block_len` (a divisor of this block_len)."""
        if block_len == self.block_len:
            return self
        split = self.block_len // block_len
        rows, blocks, size = self.codes.shape  # NOTE: packed 4-bit pairs never straddle blocks
        return BlockWeights(self.codes.reshape(rows, blocks * split, size // split),
                            self.scales.repeat_interleave(split, dim=1),
                            self.mins.repeat_interleave(split, dim=1), self.bits, self.types,
                            self.indexed,
                            None if self.factors is None else self.factors.split(split))

    def rows(self, order: np.ndarray) -> BlockWeights:
        """The rows in `order` (an index array)."""
        index = torch.from_numpy(np.ascontiguousarray(order))
        return BlockWeights(self.codes.index_select(0, index), self.scales.index_select(0, index),
                            self.mins.index_select(0, index), self.bits, self.types,
                            self.indexed,
                            None if self.factors is None else self.factors.rows(index))


def concat_rows(parts: list[BlockWeights]) -> BlockWeights:
    """Row-wise concatenation (fused q/k/v, gate/up): the finest block length, the codes'
    format of the parts where they share one, else the widest bits (6 for 4 and 6: Q4_K's
    q/k beside Q6_K's v; 8 with IQ4_NL's indices looked up; exact: a block of 32 is two of 16
    with the same scale and min); factored scales where every part has them (K-quants
    only), else none."""
    block_len = min(p.block_len for p in parts)
    parts = [p.with_block_len(block_len) for p in parts]
    if len({(p.bits, p.indexed) for p in parts}) > 1:
        bits = 8 if any(p.indexed or p.bits == 8 for p in parts) else 6
        parts = [p if (p.bits, p.indexed) == (bits, False) else p.with_code_bits(bits)
                 for p in parts]
    types = tuple(dict.fromkeys(t for p in parts for t in p.types))
    factors = None
    if all(p.factors is not None for p in parts):
        factors = BlockFactors(*(torch.cat([getattr(p.factors, name) for p in parts])
                                 for name in ("scale_factors", "min_factors", "supers")))
    return BlockWeights(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                        torch.cat([p.mins for p in parts]), parts[0].bits, types,
                        parts[0].indexed, factors)


# -- conversions: raw GGUF blocks -> (codes (n, L'), scales (n, S), mins (n, S)) -------------


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


# Byte offsets of each type's fp16 fields (d, and m or dmin) in its GGUF block: a block's
# scales and mins (d times small integers) are finite exactly when these are.
_F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
               Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
               Q.Q6_K: (208,), Q.IQ4_NL: (0,)}


def check_blocks(data: np.ndarray, qtype: GGMLQuantizationType, name: str, path: str) -> None:
    """What `to_blocks` would refuse, found without converting (the loader checks every
    weight first, and converts each only when its kernel packs it): a type without a block
    conversion, rows that are not whole blocks, or a non-finite scale or min raise
    ModelFileError naming the tensor."""
    if qtype not in _CONVERT:
        raise ModelFileError(path, f"tensor {name!r} has type {qtype.name}, which is not kept "
                                   f"quantized (supported: "
                                   f"{', '.join(t.name for t in BLOCK_FORMATS)}); "
                                   "use --quantization bf16, int8 or none to dequantize it")
    from gguf import GGML_QUANT_SIZES

    type_size = GGML_QUANT_SIZES[qtype][1]
    if data.ndim != 2:
        raise ModelFileError(path, f"tensor {name!r}: a linear weight must be 2-D")
    if data.shape[1] % type_size:
        raise ModelFileError(path, f"tensor {name!r}: rows of {data.shape[1]} bytes are not "
                                   f"whole {qtype.name} blocks of {type_size} bytes")
    raw = data.reshape(-1, type_size)  # one GGUF block per line
    finite = np.ones(raw.shape[0], dtype=bool)
    for offset in _F16_FIELDS[qtype]:
        finite &= np.isfinite(raw[:, offset:offset + 2].copy().view(np.float16)[:, 0])
    if not finite.all():
        bad = int(np.flatnonzero(~finite)[0])
        raise ModelFileError(path, f"tensor {name!r}: block {bad} ({qtype.name}) has a "
                                   "non-finite scale or min")


def to_blocks(data: np.ndarray, qtype: GGMLQuantizationType, name: str, path: str
              ) -> BlockWeights:
    """BlockWeights of a 2-D GGUF tensor's raw data (`GGUFTensor.data`: (rows, row bytes)).

    What `check_blocks` refuses raises ModelFileError naming the tensor.
    """
    check_blocks(data, qtype, name, path)
    from gguf import GGML_QUANT_SIZES

    block_len, bits, _ = BLOCK_FORMATS[qtype]
    type_block, type_size = GGML_QUANT_SIZES[qtype]
    rows = data.shape[0]
    raw = np.ascontiguousarray(data).reshape(-1, type_size)  # one GGUF block per line
    n, per_block = raw.shape[0], type_block // block_len
    codes = np.empty((n, type_block // 2 if bits == 4 else type_block), dtype=np.uint8)
    scales = np.empty((n, per_block), dtype=np.float32)
    mins = np.empty_like(scales)
    factors = (np.empty((n, per_block), dtype=np.int8), np.empty((n, per_block), dtype=np.int8),
               np.empty((n, 2), dtype=np.float32)) if qtype in K_QUANTS else None
    for first in range(0, n, CONVERT_CHUNK):  # NOTE: bounds the conversion's temporaries
        part = slice(first, min(n, first + CONVERT_CHUNK))
        _convert_into(_CONVERT[qtype](raw[part]), part, bits, codes, scales, mins, factors)
    return BlockWeights(
        codes=torch.from_numpy(codes).reshape(rows, -1, block_len // 2 if bits == 4
                                               else block_len),
        scales=torch.from_numpy(scales).reshape(rows, -1),
        mins=torch.from_numpy(mins).reshape(rows, -1),
        bits=bits, types=(qtype.name,), indexed=qtype == Q.IQ4_NL,
        factors=None if factors is None else BlockFactors(
            torch.from_numpy(factors[0]).reshape(rows, -1),
            torch.from_numpy(factors[1]).reshape(rows, -1),
            torch.from_numpy(factors[2]).reshape(rows, -1, 2)))


# GGUF blocks converted at a time by to_blocks (~4M weights of a K-quant): a converter's
# temporaries (several times its output) stay small beside the model.
CONVERT_CHUNK = 1 << 14


def _convert_into(converted, part: slice, bits: int, codes, scales, mins, factors) -> None:
    """One chunk's converter output (codes (c, block), scales and mins (c, per_block) or
    (c, 1), and for a K-quant its factors) written into to_blocks' arrays at `part`."""
    chunk_codes, chunk_scales, chunk_mins, *factored = converted
    chunk_codes = np.asarray(chunk_codes, dtype=np.uint8)
    if bits == 4:  # two codes a byte: pairs within a block, as blocks are whole pairs
        chunk_codes = chunk_codes[:, 0::2] | (chunk_codes[:, 1::2] << 4)
    codes[part] = chunk_codes
    scales[part] = chunk_scales  # NOTE: (c, 1) broadcasts over a GGUF block's sub-blocks
    mins[part] = chunk_mins
    if factors is not None:
        scale_factors, min_factors, d, m = factored[0]
        factors[0][part] = scale_factors
        factors[1][part] = min_factors
        factors[2][part, 0:1] = d
        factors[2][part, 1:2] = m


def packing(types: tuple[str, ...]) -> tuple:
    """What the kernel keeps of blocks of GGUF `types`: block length, code bits, IQ4_NL's
    indices or not, and the scales' form (factored, shared factors, or bytes each). Weights
    of one packing concatenate (concat_rows) with nothing widened."""
    def one(name: str) -> tuple:
        qtype = Q[name]
        block_len, bits, _ = BLOCK_FORMATS[qtype]
        return block_len, bits, qtype == Q.IQ4_NL, type_scale_bytes(qtype)
    # NOTE: the scales' form as a number (type_scale_bytes): tuples that tie on the rest
    # (Q4_K and Q4_1: blocks of 32 at 4 bits) must still sort
    return tuple(sorted({one(t) for t in types}))


# -- carrying blocks through load_hf_weights -------------------------------------------------


@dataclass(frozen=True)
class LazyBlocks:
    """A weight's blocks, made when asked (`load`): its GGUF types and shape are known
    without converting it. NOTE: each `load` converts afresh and nothing keeps the result,
    so the loading holds one weight's converted blocks at a time (the one its kernel is
    packing), not a second copy of the model beside the packed one."""

    types: tuple[str, ...]
    shape: tuple[int, int]
    make: Callable[[], BlockWeights]
    parts: tuple[LazyBlocks, ...] = ()  # a fusion's parts (LazyBlocks.fused), in row order

    def load(self) -> BlockWeights:
        return self.make()

    def segments(self) -> list[LazyBlocks]:
        """This weight as row segments that each keep one format: consecutive parts whose
        types pack alike (`packing`) fused, so a q/k/v of Q4_K, Q4_K and Q6_K is [q+k, v]
        (concat_rows would widen q and k to v's 6-bit blocks of 16), one of Q4_0, Q4_1 and
        Q4_0 stays one. One segment for a weight that is no fusion."""
        if len({packing(p.types) for p in self.parts}) <= 1:
            return [self]
        groups: list[list[LazyBlocks]] = []
        for part in self.parts:
            if groups and packing(groups[-1][-1].types) == packing(part.types):
                groups[-1].append(part)
            else:
                groups.append([part])
        return [g[0] if len(g) == 1 else LazyBlocks.fused(g) for g in groups]

    @staticmethod
    def of(blocks: BlockWeights) -> LazyBlocks:
        """Blocks already made."""
        return LazyBlocks(blocks.types, blocks.shape, lambda: blocks)

    @staticmethod
    def fused(parts: list[LazyBlocks]) -> LazyBlocks:
        """The row-wise concatenation of `parts` (concat_rows), made when asked."""
        types = tuple(dict.fromkeys(t for p in parts for t in p.types))
        rows = sum(p.shape[0] for p in parts)
        return LazyBlocks(types, (rows, parts[0].shape[1]),
                          lambda: concat_rows([p.load() for p in parts]), tuple(parts))

# Tensor attribute names a GGUFBlockTensor answers itself (shape checks in the loading code).
_METADATA = frozenset({"shape", "size", "dim", "numel", "dtype", "device", "ndim", "is_sparse",
                       "requires_grad", "__format__", "__repr__", "layout"})
# The attribute a Linear's weight parameter gets when a transposed GGUFBlockTensor is copied
# into it: the linear kernel (model/linear_kernels.py, GGUFBlockLinear) takes the blocks from
# there; the parameter's own values are then never written.
BLOCKS_ATTRIBUTE = "gguf_blocks"


class GGUFBlockTensor(torch.Tensor):
    """A weight in GGUF blocks, standing in for an fp32 tensor while the model loads it.

    It supports exactly what `LlamaForCausalLM.load_hf_weights` does with a weight: its shape,
    `torch.cat` along rows (q/k/v, gate/up fused), `.t()` (a Linear's (in, out) layout) and
    `target.copy_(it)`. Copied as a transposed weight (a linear layer's), it attaches its
    blocks to the target (attribute `gguf_blocks`: a LazyBlocks) and writes nothing: the
    linear kernel takes them. Copied untransposed (the embedding table), it writes its fp32
    values. Any other operation raises a TypeError: never a computation over placeholder
    values. `source` is a LazyBlocks; `blocks` makes them (afresh each time).
    """

    source: LazyBlocks
    transposed: bool

    @staticmethod
    def __new__(cls, source: LazyBlocks | BlockWeights, transposed: bool = False):
        source = source if isinstance(source, LazyBlocks) else LazyBlocks.of(source)
        rows, cols = source.shape
        shape = (cols, rows) if transposed else (rows, cols)
        placeholder = torch.zeros((), dtype=torch.float32).expand(shape)  # no memory
        tensor = torch.Tensor._make_subclass(cls, placeholder)
        tensor.source, tensor.transposed = source, transposed
        return tensor

    @property
    def blocks(self) -> BlockWeights:
        return self.source.load()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _func_name(func)
        if func is torch.cat:
            return _cat(*args, **kwargs)
        if name == "t":
            (self,) = args
            return GGUFBlockTensor(self.source, not self.transposed)
        if name == "copy_":
            return _copy_into(*args)
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise TypeError(f"GGUF block weights support only loading (shape, cat, t, copy_), "
                        f"not {name!r}")


def _func_name(func) -> str:
    if getattr(func, "__name__", "") == "__get__":  # a property: Tensor.shape.__get__
        return getattr(func.__self__, "__name__", "")
    return getattr(func, "__name__", "")


def _cat(tensors, dim: int = 0) -> torch.Tensor:
    if dim != 0 or any(not isinstance(t, GGUFBlockTensor) or t.transposed for t in tensors):
        if dim == 0 and all(isinstance(t, torch.Tensor) for t in tensors):
            # NOTE: a float GGUF tensor fused with block ones: the fused weight is fp32.
            return torch.cat([dequantized(t) for t in tensors])
        raise TypeError("GGUF block weights concatenate only untransposed, along rows")
    return GGUFBlockTensor(LazyBlocks.fused([t.source for t in tensors]))


def _copy_into(target: torch.Tensor, source, non_blocking: bool = False) -> torch.Tensor:
    if not isinstance(source, GGUFBlockTensor) or isinstance(target, GGUFBlockTensor):
        raise TypeError("GGUF block weights can only be copied into a plain tensor")
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"shape {tuple(source.shape)} copied into {tuple(target.shape)}")
    if source.transposed:
        setattr(target, BLOCKS_ATTRIBUTE, source.source)
        return target
    with torch._C.DisableTorchFunctionSubclass():
        return target.copy_(source.blocks.dequantize())


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """A plain fp32 tensor: a GGUFBlockTensor's values, any other tensor as it is."""
    if not isinstance(tensor, GGUFBlockTensor):
        return tensor
    values = tensor.blocks.dequantize()
    return values.t() if tensor.transposed else values


def block_types(weights: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """The GGUF types of the block weights among `weights` (empty: none is in blocks)."""
    found = (t for w in weights.values() if isinstance(w, GGUFBlockTensor)
             for t in w.source.types)
    return tuple(dict.fromkeys(sorted(found)))


def dequantize_all(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with every GGUFBlockTensor replaced by its fp32 values."""
    return {name: dequantized(w) for name, w in weights.items()}
