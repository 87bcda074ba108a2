"""Faster kernels for the model's Linear layers, swapped in as the weights are loaded.

Which one a model runs is its KernelSet's choice (model/kernels.py).

The plain `x @ weight` of `layers.Linear` is the reference. A kernel here takes the layer's
(in, out) weight once, keeps its own copy in the layout its library wants, and the layer
then calls it instead (the original weight is released: one copy in memory, not two).

- PanelLinear: fp32, the fused CPU kernel `panel_linear` (csrc/panel_linear.cpp) over the
  weights kept in panels of 32 output columns; the default where the kernels are built with
  AVX-512 or AVX2 + FMA (the avx2 CPU class: smaller tiles, the same sums). Same math as
  the reference (fp32 accumulate), and a row's result does not depend on how many rows are
  multiplied with it. Up to 1.6x MKL's packed GEMM on the decode
  step's matmuls at 1-16 rows, level to 15% behind at 32-512 rows (benchmarks/PERF.md).
- MKLPackedLinear: fp32, MKL's packed GEMM (`cblas_sgemm_pack` / `cblas_sgemm_compute`,
  reached through `torch.ops.mkl`, the op torch's own inductor uses for frozen CPU linears).
  Same math as the reference (fp32 accumulate), a different blocking: 1.2-1.6x faster on
  the decode step's skinny matmuls here (benchmarks/PERF.md).
- Bf16PanelLinear: `quantization="bf16"`, and "auto" (the default) on the avx2 and AVX-512
  CPU classes (model/kernels.py). The weights rounded to bfloat16 once and kept in bf16 panels
  (csrc/bf16_panels.cpp, `panel_linear_bf16`): half the fp32 panels' bytes, widened to fp32 in
  registers, fp32 activations and accumulation; equal to the last bit to the fp32 panels
  over the rounded weights (the avx2 and avx512 classes). From 8 rows on, where AMX is usable, x is
  rounded to bf16 too and multiplied on AMX tiles (fp32 sums: the amx class); without AMX
  but with AVX512_BF16, x rounded to bf16 and vdpbf16ps at every size (the avx512bf16
  class). Without the fused kernels vectorised (or with kernels="reference", or on the
  generic class) Bf16RoundedLinear: the fp32 math over the rounded weights.
- Int8WeightOnlyLinear: opt-in `quantization="int8"`. Weights int8 per output channel
  (symmetric), activations int16 through the fused CPU kernel (bfloat16 through torch's
  kernel with kernels="reference"). 4x fewer weight bytes per decode step; held to a
  quality bar (greedy agreement with fp32, `benchmarks/int8_quality.py`).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch
from torch import nn

from slotserve.model.cpu_ops import on_cpu_fp32

# NOTE: MKL's packed layout depends on the batch size it was packed for; packed for 64
# rows it ran every batch from 1 to 256 at least as fast as the plain matmul here.
MKL_PACK_ROWS = 64
PANEL_WIDTH = 32  # outputs per weight panel (csrc/panels.h)
# NOTE: torch's CPU int8 weight-only kernel (the reference int8 path) is vectorised for
# bfloat16 activations; with fp32 ones it ran 20-70x slower here.
INT8_ACTIVATION_DTYPE = torch.bfloat16
# NOTE: ...and it crashes the process (torch 2.13) unless in_features is a multiple of 64.
TORCH_INT8_WIDTH_MULTIPLE = 64


def panel_kernel_available(ops) -> bool:
    """Whether `ops` runs panel_linear vectorised (built with AVX-512, or AVX2 + FMA);
    without, its plain-loop fallback is correct but slower than MKL's GEMM."""
    return ops is not None and ops.panel_linear_vectorised()


class PanelLinear:
    """y = x @ W (+ b) through the fused kernel `panel_linear`; W given (in, out), fp32 or
    bf16 / fp16 (widened exactly as it is packed)."""

    TAKES_16_BIT = True  # NOTE: LinearKernelSwap hands it a 16-bit weight as stored

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops,
                 panels_out: torch.Tensor | None = None) -> None:
        self.out_features = weight.shape[1]
        self.panels = ops.pack_panels(weight.detach().t(), panels_out)  # (P, in, 32)
        self.bias = None if bias is None else bias.detach()
        self.ops = ops

    @staticmethod
    def panels_layout(in_features: int, out_features: int) -> tuple[tuple, torch.dtype]:
        """The panels' shape and dtype for these features (pack_panels checks its `out`)."""
        return (-(-out_features // PANEL_WIDTH), in_features, PANEL_WIDTH), torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        y = self.ops.panel_linear(x, self.panels, self.out_features)
        return y if self.bias is None else y.add_(self.bias)

    def cpp_weights(self, ops):
        """The same call for the C++ DecodeStack of `ops` (model/cpu_ops.py)."""
        return ops.linear_weights("panel", self.panels, None, self.bias, self.out_features)


def bf16_round(weight: torch.Tensor) -> torch.Tensor:
    """The fp32 values of `weight` rounded to bfloat16 (round to nearest even)."""
    return weight.detach().float().bfloat16().float()


# NOTE: from 8 rows on, AMX's tile multiply (x rounded to bf16) runs the model's matmuls
# faster than widening the weights (which is compute-bound there): 16 layers of the 1B
# model's linears at 8 / 12 / 16 rows 75.7 / 76.6 / 75.0 ms against 80.3 / 111.1 / 131.3,
# SmolLM2's 30 layers 10.3 / 10.6 / 11.1 against 11.1 / 13.2 / 16.8 (this AMX Xeon,
# interleaved, 2026-12-05); below 8 AMX's 16-row tile is mostly padding and loses (4 rows:
# 78.3 against 63.3, 9.9 against 8.8). From 16 rows: 1.7-3.5x (benchmarks/PERF.md).
BF16_AMX_MIN_ROWS = 8
# NOTE: without AMX (the avx512bf16 CPU class: AMD Zen 4/5), x rounded to bf16 and
# vdpbf16ps ran one forward's linears x0.94-1.08 widening's speed at 1-4 rows (both at the
# memory's pace), x1.0-1.4 at 8 and x1.4-1.9 from 16 rows (widening is compute-bound there:
# Zen 4's 512-bit FMAs run on 256-bit units), on SmolLM2-135M's and Qwen2.5-0.5B's shapes
# (benchmarks/cpu_classes.py, results/cpu-classes-zen4.{json,txt}): vdpbf16ps at every
# size, which also keeps a row's result independent of its batch at every size.
BF16_DOT_MIN_ROWS = 1


class Bf16PanelLinear:
    """y = x @ bf16(W) (+ b) through the fused kernels over bf16 panels; W given (in, out).

    The weights are stored in bfloat16 (half the bytes a decode step reads; W may come fp32,
    bf16 or fp16: rounded as its fp32 widening is); y, the bias and the sums stay fp32.
    Modes (by the number of rows of a call):
    - default: x stays fp32, the weights are widened in registers (`panel_linear_bf16`):
      equal to the fp32 panels over bf16(W), batch invariant to the last bit;
    - amx_min_rows=N (> 0): calls of N rows or more (prefill chunks, large decode batches)
      round x to bf16 and run on AMX (`panel_linear_bf16_amx`) where the OS allows it;
    - dot_min_rows=N (> 0): calls of N rows or more round x to bf16 and run AVX512_BF16's
      vdpbf16ps (`panel_linear_bf16(..., bf16_activations=True)`): the CPUs without AMX
      (model/kernels.py's avx512bf16 class); N=1: at every size.
      NOTE: with a threshold a row's result depends on whether its batch reached N rows
      (bf16 activations above, fp32 below); within one mode it does not.
    bf16_activations=True is dot_min_rows=1 (the older spelling).
    """

    TAKES_16_BIT = True  # NOTE: LinearKernelSwap hands it a 16-bit weight as stored

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops,
                 bf16_activations: bool = False, amx_min_rows: int = 0,
                 dot_min_rows: int = 0, panels_out: torch.Tensor | None = None) -> None:
        if bf16_activations:
            dot_min_rows = dot_min_rows or 1
        if amx_min_rows < 0 or dot_min_rows < 0 or (amx_min_rows and dot_min_rows):
            raise ValueError(f"amx_min_rows ({amx_min_rows}) and dot_min_rows "
                             f"({dot_min_rows}): at most one, and not negative")
        self.out_features = weight.shape[1]
        self.panels = ops.pack_panels_bf16(weight.detach().t(), panels_out)
        self.bias = None if bias is None else bias.detach()
        self.amx_min_rows = amx_min_rows
        self.dot_min_rows = dot_min_rows
        self.ops = ops

    @staticmethod
    def panels_layout(in_features: int, out_features: int) -> tuple[tuple, torch.dtype]:
        """The panels' shape and dtype for these features (pack_panels_bf16 checks its
        `out`): input pairs padded to whole AMX tiles of 16 pairs (csrc/panels.h)."""
        pairs = (-(-in_features // 2) + 15) // 16 * 16
        return (-(-out_features // PANEL_WIDTH), pairs, 2 * PANEL_WIDTH), torch.bfloat16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        rows = x.shape[0]
        if 0 < self.amx_min_rows <= rows and self.ops.amx_bf16_usable():
            y = self.ops.panel_linear_bf16_amx(x, self.panels, self.out_features)
        else:
            y = self.ops.panel_linear_bf16(x, self.panels, self.out_features,
                                           0 < self.dot_min_rows <= rows)
        return y if self.bias is None else y.add_(self.bias)

    def cpp_weights(self, ops):
        """The same call for the C++ DecodeStack of `ops` (model/cpu_ops.py)."""
        if self.dot_min_rows:  # NOTE: the stack's panel_bf16_dot: dot from this many rows
            return ops.linear_weights("panel_bf16_dot", self.panels, None, self.bias,
                                      self.out_features, self.dot_min_rows)
        return ops.linear_weights("panel_bf16", self.panels, None, self.bias, self.out_features,
                                  self.amx_min_rows)


# The kernels whose weights are panels (`.panels`), placed in one arena once all are made.
PANEL_KERNELS = (PanelLinear, Bf16PanelLinear)


class Bf16RoundedLinear:
    """The reference of quantization="bf16": plain torch over the bf16-rounded weights,
    held in fp32 (no bytes saved: the math of Bf16PanelLinear, not its speed)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = bf16_round(weight).contiguous()  # (in, out)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)

    def cpp_weights(self, ops):
        """The same call for the C++ DecodeStack of `ops` (model/cpu_ops.py)."""
        return ops.linear_weights("plain", self.weight, None, self.bias)


def bf16_panel_kernel_available(ops) -> bool:
    """Whether `ops` runs panel_linear_bf16 (fp32 activations) vectorised (AVX-512, or
    AVX2 + FMA)."""
    return ops is not None and ops.panel_bf16_vectorised()[0]


def mkl_packed_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class MKLPackedLinear:
    """y = x @ W (+ b) through MKL's packed GEMM; W given (in, out), fp32 on the CPU."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        weight_out_in = weight.detach().t().contiguous()  # (out, in): the op's convention
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight_out_in, MKL_PACK_ROWS)
        # NOTE: the op also takes the unpacked weight, read only for its shape unless the
        # batch differs from the one passed next to it, which we never let happen (we pass
        # x's own row count). A zero-stride view of the right shape costs no memory.
        self.shape_only = torch.empty((), dtype=weight.dtype).expand(weight_out_in.shape)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.shape_only, self.bias,
                                         x.shape[0])

    def cpp_weights(self, ops):
        """The same call for the C++ DecodeStack of `ops` (model/cpu_ops.py)."""
        return ops.linear_weights("mkl", self.packed, self.shape_only, self.bias)


class Int8WeightOnlyLinear:
    """y ~= x @ W (+ b) with W int8 per output channel (symmetric).

    With `ops` (the fused CPU kernels, model/cpu_ops.py) each token's activations are
    quantized to int16 (one scale per token) and multiplied in integers by AVX-512's 16-bit
    dot product; without, torch's `_weight_int8pack_mm` takes them in bfloat16. Either way
    a decode step reads 1 byte per weight instead of 4. NOTE: the weights are int8, the
    activations keep 16 bits: quantizing them to int8 too (fbgemm's dynamic linear, per
    tensor or per row, even with SmoothQuant scaling) agreed with fp32 on only 55-91% of
    greedy tokens here (benchmarks/PERF.md).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops=None) -> None:
        if ops is None and weight.shape[0] % TORCH_INT8_WIDTH_MULTIPLE:
            raise ValueError(f"int8 without the fused CPU kernels needs in_features a "
                             f"multiple of {TORCH_INT8_WIDTH_MULTIPLE}, got {weight.shape[0]}")
        weight_out_in = weight.detach().float().t().contiguous()  # (out, in)
        amax = weight_out_in.abs().amax(dim=1).clamp(min=1e-12)  # (out,)
        # NOTE: torch's kernel takes its scales in the activations' dtype; quantize with that
        # rounded scale, nudged up by 2^-7 first so that |w| / scale <= 127 still holds.
        self.scales = (amax / 127.0 * (1 + 2 ** -7)).to(INT8_ACTIVATION_DTYPE)
        self.scales_fp32 = self.scales.float()  # the same values, for the fused kernel
        self.qweight = torch.round(weight_out_in / self.scales_fp32[:, None]).clamp(
            -127, 127).to(torch.int8)  # (out, in)
        self.bias = None if bias is None else bias.detach()
        self.ops = ops

    def dequantized(self) -> torch.Tensor:
        """The (in, out) fp32 weight this kernel multiplies by (for tests)."""
        return (self.qweight.float() * self.scales_fp32[:, None]).t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        if self.ops is not None:
            y = self.ops.int8_linear(x, self.qweight, self.scales_fp32)
        else:
            y = torch._weight_int8pack_mm(x.to(INT8_ACTIVATION_DTYPE), self.qweight,
                                          self.scales).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def cpp_weights(self, ops):
        """The fused kernel's call for the C++ DecodeStack of `ops` (model/cpu_ops.py)."""
        if self.ops is None:
            raise ValueError("the C++ decode stack runs int8 only through the fused kernel")
        return ops.linear_weights("int8", self.qweight, self.scales_fp32, self.bias)


# NOTE: the block kernel's activations are int8 per block, as llama.cpp's, except in a model
# whose block weights are all Q8_0 (a Q8_0 file, quantization=q8_0): 16 bits there, twice
# the integer multiplies. SmolLM2-135M-Instruct's llama-quantize Q8_0 file served in its
# blocks (32 chat prompts x 64 tokens, teacher-forced greedy agreement, Ice Lake Xeon):
# with the file dequantized to fp32 99.61% (int8 activations: 97.90%), with the original
# fp32 model 98.39% (97.17%): Q8_0's own rounding is as fine as int8 activations', which
# doubled its error. Its Q4_K_M file, the activations rounded as the kernel rounds them (in
# torch): 90.53% with int8 and 90.58% with 16 bits against the original (4- and 6-bit
# weights' error is all there is to see, Q8_0 head or not). Through the engine 16 bits cost
# nothing at batch 1 (the weights' stream) and x0.66 at 64 rows (the multiplies): paid
# only where they buy something (benchmarks/QUANT.md).
WIDE_ACTIVATION_TYPES = frozenset({"Q8_0"})


def activation_bits_for(gguf_types: tuple[str, ...]) -> int:
    """The block kernel's activation bits in a model whose block weights are of GGUF
    `gguf_types` (KernelSet.gguf_types): 16 where every one is Q8_0, else 8."""
    return 16 if gguf_types and set(gguf_types) <= WIDE_ACTIVATION_TYPES else 8


class GGUFBlockLinear:
    """y ~= x @ W (+ b) with W kept in a GGUF file's own blocks (loader/gguf_blocks.py).

    The blocks (4-, 6- or 8-bit unsigned codes, or IQ4_NL's 4-bit indices that the kernel looks
    up as codes; a scale and min per block of 16 or 32: fp16 where they are fp16 values, as
    GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL ones, the K-quants' as int8 factors of an fp16
    scale per super-block (`ops.pack_factored_scales`; Q3_K's and Q6_K's one factor for the
    scale and the min), else fp32) are packed into
    panels of 16 output rows (`ops.pack_quant_blocks`); each call quantizes
    x per row and block to `activation_bits` (8, or 16 for 8-bit codes: activation_bits_for)
    and sums the products in integers (AVX512-VNNI's vpdpbusd, or on the avx2 CPU class
    vpmaddwd over the codes widened to int16: the same exact sums, csrc/quant_blocks.cpp),
    the block scales and mins in fp32. A row's result does not depend on its batch, nor on
    the path. The decode stack runs the same kernel (its `gguf_blocks`
    kind).
    """

    def __init__(self, blocks, bias: torch.Tensor | None, ops, activation_bits: int = 8) -> None:
        self.out_features = blocks.shape[0]
        self.block_len, self.types = blocks.block_len, blocks.types
        self.bits = blocks.kernel_bits  # 4, 6, 8 or IQ4_NL's indices (csrc/ops.h)
        if activation_bits not in (8, 16) or (activation_bits == 16 and self.bits != 8):
            raise ValueError(f"activation_bits must be 8, or 16 for 8-bit codes; got "
                             f"{activation_bits!r} for codes of format {self.bits}")
        self.activation_bits = activation_bits
        self.codes, self.scales_mins = ops.pack_quant_blocks(blocks.stored_codes(), blocks.scales,
                                                             blocks.mins, self.bits)
        factors = blocks.factors
        if factors is not None and factors.packable:  # NOTE: the same d and m, bit for bit
            self.scales_mins = ops.pack_factored_scales(
                factors.scale_factors, None if factors.shared else factors.min_factors,
                factors.supers)
        self.bias = None if bias is None else bias.detach()
        self.ops = ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        # NOTE: by keyword: a build from before activation_bits refuses it (positionally it
        # would be that build's force_plain)
        y = self.ops.quant_block_linear(x, self.codes, self.scales_mins, self.out_features,
                                        self.block_len, self.bits,
                                        activation_bits=self.activation_bits)
        return y if self.bias is None else y.add_(self.bias)

    def cpp_weights(self, ops):
        """The same call for the C++ DecodeStack of `ops` (model/cpu_ops.py)."""
        return ops.linear_weights("gguf_blocks", self.codes, self.scales_mins, self.bias,
                                  self.out_features, block_len=self.block_len, bits=self.bits,
                                  activation_bits=self.activation_bits)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # (n,) -> (n, in)
        """Rows `ids` of W (out, in) in fp32, each BlockWeights.dequantize's values to the bit:
        an embedding lookup in the blocks (BlockEmbedding)."""
        return self.ops.quant_block_rows(self.codes, self.scales_mins, self.out_features,
                                         self.block_len, self.bits, ids)


class SegmentedLinear:
    """y = [x @ W_1 | x @ W_2 | ...]: one linear layer (a fused q/k/v) whose row segments
    keep their own GGUF formats (`LazyBlocks.segments`), so a Q4_K q and k beside a Q6_K v
    are read at 4 bits, not widened to v's 6-bit blocks of 16 (concat_rows). Each segment is
    a GGUFBlockLinear with its rows' bias; the decode stack runs them in turn (its
    `segments` kind: a row's outputs written in place, no copy at batch 1)."""

    def __init__(self, segments: list[GGUFBlockLinear]) -> None:
        self.segments = segments
        self.out_features = sum(s.out_features for s in segments)
        self.types = tuple(dict.fromkeys(t for s in segments for t in s.types))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        return torch.cat([segment(x) for segment in self.segments], dim=1)

    def cpp_weights(self, ops):
        """The same call for the C++ DecodeStack of `ops` (model/cpu_ops.py)."""
        return ops.segmented_linear_weights([s.cpp_weights(ops) for s in self.segments])


def gguf_block_linear(lazy, bias: torch.Tensor | None, ops, activation_bits: int = 8):
    """The kernel of a weight in GGUF blocks (`lazy`: a LazyBlocks): a GGUFBlockLinear, or a
    SegmentedLinear where a fusion's parts differ in type. NOTE: each segment is made,
    packed, then dropped: one segment's converted blocks at a time."""
    segments = lazy.segments()
    if len(segments) == 1:
        return GGUFBlockLinear(lazy.load(), bias, ops, activation_bits)
    kernels, first = [], 0
    for segment in segments:
        rows = segment.shape[0]
        part_bias = None if bias is None else bias[first:first + rows]
        kernels.append(GGUFBlockLinear(segment.load(), part_bias, ops, activation_bits))
        first += rows
    return SegmentedLinear(kernels)


class BlockEmbedding(nn.Module):
    """A token embedding looked up in GGUF blocks: (T,) ids -> (T, H) fp32.

    `kernel` is a GGUFBlockLinear over the (V, H) table: the tied LM head's own (the table
    then costs no memory of its own) or one for the table alone. A row is what the fp32
    table would hold (BlockWeights.dequantize), so the model computes as with that table,
    which is never made. `placeholder`: a (V, H) fp32 tensor never written or read (so
    never resident), the table argument of DecodeStack.set_lookup_tables; the stack then
    takes the blocks (set_block_embedding).
    """

    def __init__(self, kernel: GGUFBlockLinear, placeholder: torch.Tensor) -> None:
        super().__init__()
        self.kernel, self.placeholder = kernel, placeholder

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, H)
        return self.kernel.rows(ids)

    def set_in_stack(self, stack) -> None:
        """Give the decode stack `stack` these blocks to look its tokens up in."""
        k = self.kernel
        stack.set_block_embedding(k.codes, k.scales_mins, block_len=k.block_len, bits=k.bits)


def gguf_block_kernel_available(ops) -> bool:
    """Whether `ops` has the GGUF block kernel vectorised (AVX512-VNNI, or AVX2: the build's
    path is `ops.quant_blocks_isa()`)."""
    return ops is not None and hasattr(ops, "quant_block_linear") and ops.quant_blocks_vectorised()


def held_bytes(kernel) -> int:
    """Bytes of the tensors a linear kernel holds (its weights in their layout, scales,
    bias): what one call reads, whatever its batch.

    NOTE: a tensor's own elements, not its storage's: the panels are views of one arena
    (place_panels_in_one_arena); a zero-stride view (MKLPackedLinear's `shape_only`) holds
    nothing. A SegmentedLinear holds its segments'.
    """
    if isinstance(kernel, SegmentedLinear):
        return sum(held_bytes(segment) for segment in kernel.segments)
    return sum(value.numel() * value.element_size() for value in vars(kernel).values()
               if isinstance(value, torch.Tensor)
               and (value.numel() <= 1 or 0 not in value.stride()))


def decode_step_weight_bytes(model: nn.Module) -> int:
    """The bytes of linear weights (with their scales and biases) a decode step reads: every
    Linear of `model` once, as its kernel holds them (the layer's own weight without one).
    NOTE: the embedding table is not counted (a step reads one row of it per sequence)."""
    from slotserve.model.layers import Linear

    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            total += (held_bytes(module.kernel) if module.kernel is not None else
                      sum(p.numel() * p.element_size() for p in module.parameters()))
    return total


class LinearKernelSwap:
    """Gives the Linears of `model` the linear kernels of `kernel_set` (model/kernels.py) one
    at a time, as the loading sets each one's weights (`swap`), then the rest and the panels'
    arena (`finish`). The Linear named `lm_head` takes the set's head_factory() (int8 leaves
    it in bf16).

    NOTE: a swapped Linear releases its fp32 parameter, so a loading that swaps each Linear
    as soon as its weights are in holds one fp32 linear at a time, not the whole model in
    fp32 beside its packed kernels.
    """

    def __init__(self, model: nn.Module, kernel_set) -> None:
        self.model = model
        self.factory, self.head_factory = kernel_set.linear_factory(), kernel_set.head_factory()
        if self.factory is not None and not on_cpu_fp32(model):
            raise ValueError(f"the {kernel_set.linear!r} linear kernel needs the model on the "
                             "CPU in float32")
        self.arena_parts = self._plan_arena()

    def _factory_of(self, name: str):
        return self.head_factory if name == "lm_head" and self.head_factory else self.factory

    def _plan_arena(self) -> dict[str, torch.Tensor]:
        """Linear name -> its panels' part of the arena, for the Linears whose kernel is
        known to keep panels: packed there, not packed and then copied (finish)."""
        from slotserve.model.layers import Linear

        if self.factory is None:
            return {}
        layouts = {}
        for name, module in self.model.named_modules():  # in the order a forward reads them
            kind = getattr(self._factory_of(name), "func", None)  # a functools.partial's
            if isinstance(module, Linear) and kind in PANEL_KERNELS:
                layouts[name] = kind.panels_layout(module.in_features, module.out_features)
        return carve_arena(layouts)

    def takes(self, weight: torch.Tensor) -> bool:
        """Whether a Linear's (in, out) `weight` can go to its kernel as it is (`swap`'s
        `weight`), never copied into the layer's fp32 parameter: a kernel will take it, and
        it is a plain tensor on the CPU (a GGUF block weight attaches its blocks through the
        parameter)."""
        return (self.factory is not None and type(weight) is torch.Tensor
                and weight.device.type == "cpu" and weight.is_floating_point())

    def swap(self, name: str, module, weight: torch.Tensor | None = None) -> None:
        """Linear `module` (named `name` in the model), its weights set, runs its kernel;
        `weight`: its (in, out) weight where it is not in the parameter (`takes`)."""
        if self.factory is None:
            return
        make, part = self._factory_of(name), self.arena_parts.get(name)
        if weight is None:
            weight = module.weight
        elif not (weight.dtype in (torch.bfloat16, torch.float16)
                  and getattr(getattr(make, "func", make), "TAKES_16_BIT", False)):
            weight = weight.float()  # NOTE: a panel kernel widens a 16-bit weight as it packs
        module.use_kernel(make(weight, module.bias) if part is None
                          else make(weight, module.bias, panels_out=part))

    def finish(self) -> None:
        """Swap every Linear not swapped yet; the panels into one arena, in forward order."""
        from slotserve.model.layers import Linear

        linears = [(name, module) for name, module in self.model.named_modules()
                   if isinstance(module, Linear)]  # in the order a forward reads them
        for name, module in linears:
            if module.kernel is None:
                self.swap(name, module)
        place_panels_in_one_arena([module.kernel for name, module in linears
                                   if isinstance(module.kernel, PANEL_KERNELS)
                                   and name not in self.arena_parts])  # (GGUF: unplanned)


def place_panels_in_one_arena(kernels: list) -> None:
    """Move the weight panels of `kernels` (listed in the order a forward reads them) into
    one tensor per dtype, each kernel keeping a view of its part; the math is unchanged.
    (A model's loading packs straight into such an arena where it knows the kernels ahead:
    LinearKernelSwap; this moves the rest, the panels of a GGUF's plain tensors.)

    NOTE: a matmul streams its weights faster from one allocation than from many. Measured
    here at batch 1 (bf16 weights, 1 thread per core, 5 interleaved runs): a decode step of
    SmolLM2-135M 12.1-13.7 ms (median 13.4) with each linear's panels in their own
    allocation, 11.4-13.2 (median 12.5) in one arena; 30 gate_up matmuls over views of one
    tensor 4.4-4.6 ms against 5.3-5.6 over 30 tensors of the same bytes (one matmul of them
    all: 3.8-4.1).
    """
    parts = carve_arena({i: (k.panels.shape, k.panels.dtype) for i, k in enumerate(kernels)})
    for i, kernel in enumerate(kernels):
        parts[i].copy_(kernel.panels)
        kernel.panels = parts[i]
    return_freed_memory()


def carve_arena(layouts: dict) -> dict:
    """key -> (shape, dtype) to key -> a view of that shape in one new tensor per dtype, the
    views in the order of `layouts`, untouched (no memory until written)."""
    by_dtype: dict[torch.dtype, list] = {}
    for key, (shape, dtype) in layouts.items():
        by_dtype.setdefault(dtype, []).append((key, shape))
    parts = {}
    for dtype, group in by_dtype.items():
        sizes = [torch.Size(shape).numel() for _, shape in group]
        arena, offset = torch.empty(sum(sizes), dtype=dtype), 0
        for (key, shape), size in zip(group, sizes):  # NOTE: whole panel rows (128 B or more)
            parts[key] = arena[offset:offset + size].view(shape)
            offset += size
    return parts


def return_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing).

    NOTE: the panels moved into the arena were freed into glibc's heap, which keeps them:
    the server's resident memory stayed ~100 MB higher without this; after a GGUF's blocks
    were converted and packed (LLMEngine.from_config), ~0.9 GiB higher on a 1B Q4_K_M.
    """
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
