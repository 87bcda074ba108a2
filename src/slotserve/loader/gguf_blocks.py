"""GGUF linear weights kept quantized: each block format as unsigned codes, scales and mins.

`to_blocks(tensor)` turns a GGUF tensor's raw blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL) into one form, `BlockWeights`: per output row, blocks of `block_len`
unsigned codes u (uint8) with an fp32 scale d and min m per block, such that

    w = d * u + m

reproduces gguf-py's `dequantize` (to fp32 rounding). The fused CPU kernels unpack the
raw blocks (csrc/gguf_unpack.cpp: one decoder per type, rows in parallel; the numpy
conversions they replaced are the reference in tests/model/test_gguf_unpack.py). The
conversions:

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

import functools
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


@dataclass(frozen=True)
class BlockWeights:
    """A (rows, cols) weight as blocks: w[r, b*L + i] = scales[r, b] * codes[r, b, i] + mins[r, b].

    codes: uint8 (rows, blocks, L), one stored value a byte: codes below 2**bits (4 or 6:
        packed into 4 or 6 bits by the kernel's packing), or IQ4_NL's indices (`indexed`).
    scales, mins: fp32 (rows, blocks).
    types: the GGUF types it came from (several once q/k/v are fused).
    indexed: the stored 4-bit values are IQ4_NL's indices q, whose codes are
        IQ4_NL_CODES[q] (`unpacked_codes` looks them up; the kernel does too).
    factors: the K-quants' scales and mins as factors (BlockFactors; what GGUFBlockLinear
        keeps), None for other types or a fusion with one.
    NOTE: one value a byte, as pack_quant_blocks takes them: the loading holds one weight's
    BlockWeights at a time (LazyBlocks), and 4-bit codes kept two a byte here were unpacked
    again (a copy of the codes) before every packing.
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
        return self.codes.shape[2]

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
        return self.codes

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
        rows, blocks, size = self.codes.shape
        return BlockWeights(self.codes.reshape(rows, blocks * split, size // split),
                            self.scales.repeat_interleave(split, dim=1),
                            self.mins.repeat_interleave(split, dim=1), self.bits, self.types,
                            self.indexed,
                            None if self.factors is None else self.factors.split(split))


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


# -- raw GGUF blocks -> BlockWeights ---------------------------------------------------------


# Byte offsets of each type's fp16 fields (d, and m or dmin) in its GGUF block: a block's
# scales and mins (d times small integers) are finite exactly when these are.
_F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
               Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
               Q.Q6_K: (208,), Q.IQ4_NL: (0,)}
_F16_EXPONENT = 0x7C00  # an fp16's exponent bits: all set for inf and NaN


def check_blocks(data: np.ndarray, qtype: GGMLQuantizationType, name: str, path: str) -> None:
    """What `to_blocks` would refuse, found without converting (the loader checks every
    weight first, and converts each only when its kernel packs it): a type without a block
    conversion, rows that are not whole blocks, or a non-finite scale or min raise
    ModelFileError naming the tensor."""
    if qtype not in BLOCK_FORMATS:
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
    # NOTE: every supported block is an even number of bytes with its fp16 fields at even
    # offsets: each field is one uint16 column of the blocks, read in place (no copy)
    words = np.ascontiguousarray(data).reshape(-1, type_size).view(np.uint16)
    finite = np.ones(words.shape[0], dtype=bool)
    for offset in _F16_FIELDS[qtype]:
        finite &= (words[:, offset // 2] & _F16_EXPONENT) != _F16_EXPONENT
    if not finite.all():
        bad = int(np.flatnonzero(~finite)[0])
        raise ModelFileError(path, f"tensor {name!r}: block {bad} ({qtype.name}) has a "
                                   "non-finite scale or min")


@dataclass(frozen=True)
class FileBlocks:
    """A weight's raw blocks as its file holds them, to unpack (`unpack_files`): the data
    (`GGUFTensor.data`: (rows, row bytes)), its type, the tensor's name and file (for
    errors), the row order (order[r]: the data's row that is row r; None: as stored),
    `release`, called once the blocks are unpacked (GGUFTensor.release: the file's pages
    dropped), and `checked`: check_blocks passed it already (the loader checks every
    weight first), so unpack_files does not read it a second time for that."""

    data: np.ndarray
    qtype: GGMLQuantizationType
    name: str
    path: str
    order: np.ndarray | None = None
    release: Callable[[], None] = lambda: None
    checked: bool = False


def to_blocks(data: np.ndarray, qtype: GGMLQuantizationType, name: str, path: str,
              order: np.ndarray | None = None) -> BlockWeights:
    """BlockWeights of a 2-D GGUF tensor's raw data (`GGUFTensor.data`: (rows, row bytes));
    its row r is the data's row order[r] where `order` (a permutation of the rows) is given.
    See unpack_files."""
    return unpack_files([FileBlocks(data, qtype, name, path, order)])


def unpack_files(files: list[FileBlocks]) -> BlockWeights:
    """BlockWeights of GGUF tensors of one type, their rows one after the other (what
    concat_rows makes of their to_blocks, made at once: no copy of them concatenated),
    unpacked by the fused CPU kernels (csrc/gguf_unpack.cpp, rows in parallel); each
    file's `release` called after.

    What `check_blocks` refuses raises ModelFileError naming the tensor. NOTE: the kernels
    must load here (model/cpu_ops.py); without them a GGUF's weights are dequantized
    straight from the file instead (LazyBlocks.dequantized), never through this.
    """
    from slotserve.model.cpu_ops import loaded_cpu_ops

    qtype = files[0].qtype
    if any(f.qtype != qtype for f in files):
        raise ValueError(f"one GGUF type at a time, not {sorted({f.qtype.name for f in files})}")
    for f in files:
        if not f.checked:
            check_blocks(f.data, f.qtype, f.name, f.path)
    ops = loaded_cpu_ops()
    if ops is None:
        raise RuntimeError(f"tensor {files[0].name!r}: GGUF blocks are unpacked by the fused "
                           "CPU kernels, which are not available here")
    orders = [None if f.order is None
              else torch.from_numpy(np.ascontiguousarray(f.order, dtype=np.int64))
              for f in files]
    codes, scales, mins, *factors = ops.unpack_gguf_blocks(
        [np.ascontiguousarray(f.data) for f in files], int(qtype), orders)
    for f in files:
        f.release()
    return BlockWeights(codes, scales, mins, BLOCK_FORMATS[qtype][1], (qtype.name,),
                        indexed=qtype == Q.IQ4_NL,
                        factors=BlockFactors(*factors) if factors else None)


def dequantize_files(files: list[FileBlocks]) -> torch.Tensor | None:
    """The fp32 (rows, cols) values of GGUF tensors of any block types, their rows one after
    the other (what concat_rows' dequantize makes of their to_blocks, made at once: neither
    their blocks nor a concatenation), dequantized by the fused CPU kernels (rows in
    parallel, in the unpacking's reused memory); each file's `release` called after. None
    where no build of the kernels is loaded (the caller dequantizes another way: a GPU or
    reference engine never builds them for this).
    NOTE: the same values as gguf-py's dequantize (csrc/gguf_unpack.cpp, dequantize_row)."""
    from slotserve.model.cpu_ops import already_loaded_cpu_ops

    ops = already_loaded_cpu_ops()
    if ops is None or not hasattr(ops, "dequantize_gguf_blocks"):
        return None
    for f in files:
        if not f.checked:
            check_blocks(f.data, f.qtype, f.name, f.path)
    orders = [None if f.order is None
              else torch.from_numpy(np.ascontiguousarray(f.order, dtype=np.int64))
              for f in files]
    values = ops.dequantize_gguf_blocks([np.ascontiguousarray(f.data) for f in files],
                                        [int(f.qtype) for f in files], orders)
    for f in files:
        f.release()
    return values


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
    # The fp32 (rows, cols) values made without the blocks (the loader's: the file's tensor
    # dequantized as --quantization none does it, no fused kernels needed); None: the
    # blocks' own (BlockWeights.dequantize), or the parts' for a fusion.
    values: Callable[[], torch.Tensor] | None = None
    # The raw blocks `make` unpacks, where they come straight from a file (the loader's):
    # a fusion of such parts of one type unpacks them together (LazyBlocks.fused).
    file: FileBlocks | None = None

    def load(self) -> BlockWeights:
        return self.make()

    def dequantized(self) -> torch.Tensor:
        """The fp32 (rows, cols) values: what kernels that do not run blocks take. Straight
        from the file's blocks by the fused kernels where it (or every part of a fusion)
        comes from a file, else `values`, else the blocks' own.
        NOTE: the same values every way (each reproduces gguf-py's dequantize, as the file's
        fp32 conversion does), but for a zero's sign (d (q - 8) is -0 where d u - 8 d is +0)."""
        files = self.files()
        values = dequantize_files(files) if files else None
        if values is not None:
            return values
        if self.values is not None:
            return self.values()
        if self.parts:
            return torch.cat([part.dequantized() for part in self.parts])
        return self.load().dequantize()

    def files(self) -> list[FileBlocks] | None:
        """The raw blocks of this weight's rows in turn, where they all come from a file
        (its own, or every part's of a fusion); None otherwise."""
        if self.file is not None:
            return [self.file]
        files = [part.file for part in self.parts]
        return files if files and all(f is not None for f in files) else None

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
        """The row-wise concatenation of `parts` (concat_rows), made when asked: parts of
        one GGUF type straight from a file unpacked together (unpack_files). NOTE: the
        3B's q+k and gate/up concatenated after unpacking cost ~1.8 s of its 14 s start
        (a copy of each, in fresh memory)."""
        types = tuple(dict.fromkeys(t for p in parts for t in p.types))
        rows = sum(p.shape[0] for p in parts)
        files = [p.file for p in parts]
        if all(f is not None for f in files) and len({f.qtype for f in files}) == 1:
            make = functools.partial(unpack_files, files)
        else:
            make = functools.partial(_concat_loaded, tuple(parts))
        return LazyBlocks(types, (rows, parts[0].shape[1]), make, tuple(parts))


def _concat_loaded(parts: tuple[LazyBlocks, ...]) -> BlockWeights:
    return concat_rows([part.load() for part in parts])


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
        return target.copy_(source.source.dequantized())


Q8_0_BLOCK = 32  # weights per Q8_0 block


def q8_0_blocks(weight: torch.Tensor) -> BlockWeights:
    """A float (rows, cols) weight quantized to Q8_0 (csrc/gguf_unpack.cpp's quantize_q8_0,
    rows in parallel: the raw blocks gguf-py's `quants.quantize` writes, bit for bit, as
    llama.cpp's quantize_row_q8_0_ref: d = amax / 127 per block of 32, kept as fp16; codes
    x / d rounded half away from zero), then unpacked as a Q8_0 file's are: the blocks of a
    Q8_0 GGUF written from the same weights. cols: a multiple of 32; a NaN or infinity is a
    ValueError."""
    from slotserve.model.cpu_ops import loaded_cpu_ops

    ops = loaded_cpu_ops()
    if ops is None:
        raise RuntimeError("Q8_0 blocks are made by the fused CPU kernels, not available here")
    try:
        raw = ops.quantize_q8_0(weight.detach())
    except RuntimeError as error:  # NOTE: the kernel's TORCH_CHECK, a c10::Error
        raise ValueError(f"quantization=q8_0: {str(error).splitlines()[0]}") from None
    name = "a weight quantized to Q8_0"
    return unpack_files([FileBlocks(raw.numpy(), Q.Q8_0, name, "quantization=q8_0",
                                    checked=True)])  # NOTE: its scales are finite fp16


def as_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A weight as quantization="q8_0" loads it (KernelSet.prepare_weight): a 2-D weight of
    whole blocks (a linear's, (out, in)) as Q8_0 blocks, made when its kernel is (LazyBlocks:
    one weight's fp32 values and blocks at a time: a GGUF weight is dequantized then too, so
    a tied table whose lookups use the head's blocks is never); anything else (norms, biases,
    a width that is no multiple of 32) as the set's float kernels take it (GGUF blocks
    dequantized)."""
    if weight.dim() != 2 or weight.shape[1] % Q8_0_BLOCK:
        return dequantized(weight)
    return GGUFBlockTensor(LazyBlocks((Q.Q8_0.name,), tuple(weight.shape),
                                      functools.partial(_q8_0_blocks_of, weight)))


def _q8_0_blocks_of(weight: torch.Tensor) -> BlockWeights:
    return q8_0_blocks(dequantized(weight))


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """A plain fp32 tensor: a GGUFBlockTensor's values, any other tensor as it is."""
    if not isinstance(tensor, GGUFBlockTensor):
        return tensor
    values = tensor.source.dequantized()
    return values.t() if tensor.transposed else values


# NOTE: a tied model's weights have no HEAD, whatever its file holds (the loaders drop it)
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def block_types(weights: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """The GGUF types of the block weights among `weights` that the linears run (empty: none
    is in blocks): every one but an embedding beside its own LM head (looked up a row at a
    time, never multiplied); a tied embedding (no `lm_head.weight`) is the head. Where the
    embedding is the only block weight, its types (the model keeps it in its blocks)."""
    linears = [name for name in weights if name != EMBEDDING or HEAD not in weights]
    return _types_of(weights, linears) or _types_of(weights, list(weights))


def _types_of(weights: dict[str, torch.Tensor], names: list[str]) -> tuple[str, ...]:
    found = (t for name in names if isinstance(weights[name], GGUFBlockTensor)
             for t in weights[name].source.types)
    return tuple(dict.fromkeys(sorted(found)))
