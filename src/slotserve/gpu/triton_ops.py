"""Triton kernels of the GPU path: paged decode attention (flash-decoding), the K/V write,
RMSNorm (with the residual add), RoPE and SiLU-and-multiply.

Each takes and returns torch tensors with the shapes, dtypes and meaning of the plain-torch
op it replaces, which is also its test oracle:

| here | the torch op (CPU path) |
| --- | --- |
| `write_kv_` | attention/torch_paged.py `write_kv` |
| `paged_decode_attention` | torch_paged.py `decode_attention` over `DecodeGroup.windowed` |
| `rms_norm`, `add_rms_norm_` | model/layers.py `RMSNorm.forward` (after `x += delta`) |
| `rotary_` | layers.py `apply_rotary` with `RotaryEmbedding.tables(positions)`, in place |
| `silu_mul` | `F.silu(gate) * up` of `GatedMLP` |

The launchers' signatures are those of the fused CPU kernels' layer ops (model/cpu_ops.py:
`rms_norm`, `add_rms_norm_`, `silu_mul`, `rotary_(x, cos, sin)`, `write_kv_`,
`paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window)`), so a CUDA
KernelSet can hand this module to the model as its `ops` (issue 36, item 1; not done yet).

Prefill attention: torch_paged.py's `_prefill_attention` (SDPA over the chunk's gathered
blocks, with its causal / window mask) is device-neutral and the GPU path's default; the
Triton kernel is gpu/triton_prefill.py (all chunks in one launch; `triton_prefill.WITH_PREFILL`
is this module plus it, chosen by SLOTSERVE_PREFILL_ATTENTION=triton: model/kernels.py).

Numerics: every kernel computes in fp32 and rounds once to the output's dtype (fp32 or bf16).
NOTE: bf16 results are rounded by `_to_bf16` (integer round-to-nearest-even), not by
`x.to(tl.bfloat16)`: Triton's interpreter truncates that cast where the GPU rounds, and the
kernels must compute the same bits in both places (the K/V write equals torch's to the bit).

Devices: CUDA tensors when compiled; CPU tensors when Triton's interpreter runs the kernels
(TRITON_INTERPRET=1 set before this module is imported; `INTERPRETED`). The launchers check
shapes, dtypes and devices (a `ValueError` naming the argument) but never read a value back
from the device: block ids, slots and context lengths are trusted, as the CPU path's torch
ops trust them (`check_decode_inputs` checks them, at the cost of a sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
"""True when the kernels were decorated under TRITON_INTERPRET=1: they run on CPU tensors."""
# What KernelSet.describe_linears says of these kernels (the model's layer ops).
DESCRIPTION = "Triton kernels (norms, RoPE, SiLU, K/V writes, decode attention)"

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
DEFAULT_PARTITION_SIZE = 512
"""Context positions per split of the decode attention (vLLM's PARTITION_SIZE): a longer
context is split over several programs and their partial softmaxes reduced (flash-decoding)."""
# Cache blocks per step of the decode attention's loop. NOTE: 1 (16 positions a step) is what
# was measured on an H200 (benchmarks/GPU.md: too little work per step, 630-650 GB/s);
# benchmarks/gpu_check.py times 2 and 4 (8 spills registers), not yet run on a GPU.
DEFAULT_BLOCKS_PER_ITER = 1


# ---------------------------------------------------------------------------------------
# helpers (device functions)


@triton.jit
def _to_bf16(x):
    """fp32 -> bf16, rounded to nearest even as torch's .to(torch.bfloat16); NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_f32(x):
    """x (fp32 or bf16) widened to fp32, exactly. NOTE: bf16 by its bits (<< 16): Triton's
    interpreter widens subnormal bf16 values wrongly."""
    if x.dtype == tl.bfloat16:
        y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """fp32 x -> `dtype` (fp32 or bf16), rounded to nearest even."""
    if dtype == tl.bfloat16:
        y = _to_bf16(x)
    else:
        y = x.to(dtype)
    return y


# ---------------------------------------------------------------------------------------
# K/V write


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     NKV: tl.constexpr, HD: tl.constexpr,
                     NKV_P: tl.constexpr, HD_P: tl.constexpr):
    # one program per token: its (nkv, hd) K and V to flat slot `slot` of both caches
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)  # int64: slot * stride does not overflow
    heads = tl.arange(0, NKV_P)[:, None]
    dims = tl.arange(0, HD_P)[None, :]
    # NOTE: a negative slot is skipped (a padding row, e.g. of a CUDA graph's batch)
    mask = (heads < NKV) & (dims < HD) & (slot >= 0)
    dst = slot * stride_cs + heads * stride_ch + dims
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(k_cache_ptr + dst, _cast(_to_f32(k), k_cache_ptr.dtype.element_ty),
             mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + dst, _cast(_to_f32(v), v_cache_ptr.dtype.element_ty),
             mask=mask)


def write_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V (T, nkv, hd) at their flat cache slots (T,) int64, in the
    cache's dtype (fp32 or bf16, rounded to nearest even as torch_paged.write_kv).

    Caches: (num_blocks, block_size, nkv, hd), contiguous. k, v may be views into a wider
    row (their last dimension contiguous). A slot < 0 is skipped (a padding row).
    """
    _check_cache_pair(k_cache, v_cache)
    for name, x in (("k", k), ("v", v)):
        _check(x.dim() == 3 and x.shape[1:] == k_cache.shape[2:],
               f"{name} must be (T, {k_cache.shape[2]}, {k_cache.shape[3]}), got "
               f"{tuple(x.shape)}")
        _check(x.shape[0] == slot_mapping.shape[0], f"{name} and slot_mapping differ in T")
        _check(x.stride(2) == 1, f"{name}'s last dimension must be contiguous")
        _check_dtype(name, x)
    _check(slot_mapping.dim() == 1 and slot_mapping.dtype == torch.int64,
           "slot_mapping must be (T,) int64")
    _check_devices(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1),
        k_cache.stride(2), NKV=num_kv_heads, HD=head_dim,
        NKV_P=triton.next_power_of_2(num_kv_heads), HD_P=triton.next_power_of_2(head_dim))


# ---------------------------------------------------------------------------------------
# paged decode attention (flash-decoding)


@triton.jit
def _decode_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr,
        scale, window,
        stride_qs, stride_qh, stride_cb, stride_cp, stride_ch, stride_ts,
        stride_os, stride_oh, stride_osplit, stride_ls, stride_lh,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, PARTITION_BLOCKS: tl.constexpr,
        WINDOWED: tl.constexpr, SPLIT: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr):
    """One program: one sequence, one KV head (its GROUP query heads as rows), one split
    (PARTITION_BLOCKS cache blocks from the first block the query reads), BLOCKS_PER_ITER
    blocks a loop step (BLOCKS_PER_ITER x BLOCK_P positions). SPLIT: write the split's
    normalised output and log-sum-exp for _decode_reduce_kernel; else the output."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + seq)
    first_pos = context_len * 0  # an int64 zero
    if WINDOWED:
        first_pos = tl.maximum(context_len - window, 0)
    # NOTE: blocks before first_pos // BLOCK_SIZE and after the context's last are never read
    # (their table entries may be anything: given back, padding)
    first_block = first_pos // BLOCK_SIZE
    end_block = (context_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    block_lo = first_block + split * PARTITION_BLOCKS
    block_hi = tl.minimum(block_lo + PARTITION_BLOCKS, end_block)

    rows = tl.arange(0, GROUP_P)  # query heads kv_head * GROUP + rows (HF's GQA grouping)
    dims = tl.arange(0, HD_P)
    offs = tl.arange(0, BLOCKS_PER_ITER * BLOCK_P)  # a step's positions: block offs // BLOCK_P
    sub = offs // BLOCK_P
    within = offs % BLOCK_P
    row_ok = rows < GROUP
    dim_ok = dims < HD
    q = tl.load(q_ptr + seq * stride_qs + (kv_head * GROUP + rows)[:, None] * stride_qh
                + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = _to_f32(q) * scale  # (GROUP_P, HD_P)

    m = tl.full([GROUP_P], float("-inf"), tl.float32)  # running max of each row's scores
    denom = tl.zeros([GROUP_P], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([GROUP_P, HD_P], tl.float32)  # running sum of exp(score - m) * v
    # NOTE: a constant trip count, each block past the split's end skipped: Triton's
    # interpreter cannot loop over range(tensor, tensor) with numpy >= 2.4
    for i in range(0, PARTITION_BLOCKS, BLOCKS_PER_ITER):
        first = block_lo + i  # the step's first block
        if first < block_hi:
            block = first + sub  # (N,) each position's block
            in_split = block < block_hi
            if BLOCKS_PER_ITER == 1:
                block_id = tl.load(tables_ptr + seq * stride_ts + first)
            else:  # NOTE: table entries past the split's last block are not read
                block_id = tl.load(tables_ptr + seq * stride_ts + block, mask=in_split, other=0)
            pos = block * BLOCK_SIZE + within
            # NOTE: positions outside [first_pos, context_len) are not loaded (other=0) as well
            # as masked: they may hold NaN (stale or another layer's window), and 0 * NaN = NaN
            valid = (in_split & (within < BLOCK_SIZE) & (pos >= first_pos)
                     & (pos < context_len))
            kv_row = block_id * stride_cb + within * stride_cp + kv_head * stride_ch  # (N,)
            kv_off = kv_row[:, None] + dims[None, :]
            kv_mask = valid[:, None] & dim_ok[None, :]
            k = _to_f32(tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0))
            # NOTE: one block a step: a broadcast product (what was measured); more: fp32
            # dots (the broadcast's (GROUP_P, N, HD_P) product would spill registers)
            if BLOCKS_PER_ITER == 1:
                scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (GROUP_P, N)
            else:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            scores = tl.where(valid[None, :], scores, float("-inf"))
            # the step's first block holds a valid position: m_new is finite
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            v = _to_f32(tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0))
            if BLOCKS_PER_ITER == 1:
                pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # (GROUP_P, HD_P)
            else:
                pv = tl.dot(p, v, input_precision="ieee")
            acc = acc * alpha[:, None] + pv
            denom = denom * alpha + tl.sum(p, axis=1)
            m = m_new

    heads = kv_head * GROUP + rows
    out_mask = row_ok[:, None] & dim_ok[None, :]
    out_off = seq * stride_os + heads[:, None] * stride_oh + dims[None, :]
    if SPLIT:
        # an empty split (a context shorter than the longest): output 0, log-sum-exp -inf
        has = denom > 0
        part = acc / tl.where(has, denom, 1.0)[:, None]
        tl.store(out_ptr + out_off + split * stride_osplit, part, mask=out_mask)
        lse = tl.where(has, m + tl.log(tl.where(has, denom, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=row_ok)
    else:
        out = acc / denom[:, None]
        tl.store(out_ptr + out_off, _cast(out, out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(part_ptr, lse_ptr, out_ptr, num_splits,
                          stride_ps, stride_ph, stride_psplit, stride_ls, stride_lh,
                          stride_os, stride_oh,
                          HD: tl.constexpr, HD_P: tl.constexpr, SPLITS_P: tl.constexpr):
    """One program per (sequence, query head): the splits' outputs weighted by their share
    of the softmax, exp(lse_s - max) / sum of them."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)
    dims = tl.arange(0, HD_P)
    split_ok = splits < num_splits
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + splits, mask=split_ok,
                  other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))  # split 0 is never empty: the max is finite
    parts = tl.load(part_ptr + seq * stride_ps + head * stride_ph
                    + splits[:, None] * stride_psplit + dims[None, :],
                    mask=split_ok[:, None] & (dims < HD)[None, :], other=0.0)
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims,
             _cast(out, out_ptr.dtype.element_ty), mask=dims < HD)


# The decode attention's split count when none is asked for (auto_partition_size): enough
# splits for about TARGET_PROGRAMS programs per launch, none under MIN_PARTITION_BLOCKS
# blocks, at most MAX_SPLITS. NOTE: measured on an H200 (benchmarks/GPU.md): one split per
# KV head at batch 1 (8 programs looping over every block, latency-bound) took 78 us a layer
# at a context of ~300 positions, 39% of an 8B model's decode forward.
TARGET_PROGRAMS = 1024
# NOTE: the interpreter runs a launch's programs one after another on the CPU: at 1024 the
# engine's interpreted tests took 3x as long; at this many a small batch still splits.
INTERPRETED_TARGET_PROGRAMS = 16
MIN_PARTITION_BLOCKS = 4
MAX_SPLITS = 64


def auto_partition_size(num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int,
                        window: int | None, target_programs: int = TARGET_PROGRAMS) -> int:
    """Positions per split of a decode launch of num_seqs x num_kv_heads programs per split
    (about target_programs in all); a power of two of blocks, so few kernel variants are
    compiled. NOTE: known on the host from shapes alone: a CUDA graph keeps its grid."""
    blocks_read = _blocks_read(max_blocks, block_size, window)
    wanted = -(-target_programs // max(1, num_seqs * num_kv_heads))
    splits = max(1, min(wanted, MAX_SPLITS, -(-blocks_read // MIN_PARTITION_BLOCKS)))
    return triton.next_power_of_2(-(-blocks_read // splits)) * block_size


def _blocks_read(max_blocks: int, block_size: int, window: int | None) -> int:
    """The most blocks one sequence reads: its whole table, or its window's blocks."""
    if window:
        return min(max_blocks, -(-window // block_size) + 1)
    return max_blocks


def num_decode_splits(max_blocks: int, block_size: int, window: int | None,
                      partition_size: int = DEFAULT_PARTITION_SIZE) -> tuple[int, int]:
    """(splits, blocks per split) for block tables `max_blocks` wide: the most blocks one
    sequence reads (its whole table, or its window's blocks) cut into partitions of
    partition_size positions (whole blocks, at least one). Known on the host, no sync: a
    CUDA graph captured at one table width keeps its grid.

    NOTE: one split covers the blocks read rounded up to a power of two, not a whole
    partition: the kernel loops over a split's blocks a constant number of times (a
    compile-time constant: a few variants, not one per table width).
    """
    blocks_read = _blocks_read(max_blocks, block_size, window)
    partition_blocks = max(1, partition_size // block_size)
    splits = max(1, -(-blocks_read // partition_blocks))
    if splits == 1:
        partition_blocks = min(partition_blocks, triton.next_power_of_2(max(1, blocks_read)))
    return splits, partition_blocks


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int | None = None,
                           partition_size: int | None = None,
                           num_warps: int = 4,
                           blocks_per_iter: int = DEFAULT_BLOCKS_PER_ITER) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context (the token's own K/V
    already written), as torch_paged.decode_attention.

    q: (D, nh, hd) (rows may be views into a wider row); caches (num_blocks, block_size, nkv,
    hd) contiguous, fp32 or bf16; block_tables (D, maxb) int64; context_lens (D,) int64, each
    >= 1 and <= maxb * block_size; window: the layer's sliding window (the query at position
    L-1 reads positions L-window .. L-1; the blocks before them are not read), None or 0 for
    all -> (D, nh, hd) in q's dtype. GQA: head h reads KV head h // (nh / nkv), as HF.
    A context longer than partition_size positions (None: auto_partition_size's) is split
    over programs (flash-decoding) and the partial softmaxes are reduced by a second kernel.
    blocks_per_iter: cache blocks per step of a program's loop (a power of two; at most the
    split's blocks rounded up to one).
    """
    _check_cache_pair(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    _check(q.dim() == 3 and q.shape[2] == head_dim,
           f"q must be (D, nh, {head_dim}), got {tuple(q.shape)}")
    num_seqs, num_heads, _ = q.shape
    _check(num_heads % num_kv_heads == 0,
           f"q's {num_heads} heads are not a multiple of the cache's {num_kv_heads} KV heads")
    _check(q.stride(2) == 1, "q's last dimension must be contiguous")
    _check_dtype("q", q)
    _check(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
           and block_tables.dtype == torch.int64, f"block_tables must be ({num_seqs}, maxb) int64")
    _check(block_tables.stride(1) == 1, "block_tables' rows must be contiguous")
    _check(context_lens.shape == (num_seqs,) and context_lens.dtype == torch.int64,
           f"context_lens must be ({num_seqs},) int64")
    _check(window is None or window >= 0, f"window must be >= 0 or None, got {window}")
    if partition_size is None:
        target = INTERPRETED_TARGET_PROGRAMS if INTERPRETED else TARGET_PROGRAMS
        partition_size = auto_partition_size(q.shape[0], k_cache.shape[2],
                                             block_tables.shape[1], k_cache.shape[1], window,
                                             target)
    _check(partition_size >= 1, f"partition_size must be >= 1, got {partition_size}")
    _check(blocks_per_iter >= 1 and blocks_per_iter & (blocks_per_iter - 1) == 0,
           f"blocks_per_iter must be a power of two >= 1, got {blocks_per_iter}")
    _check_devices(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                   context_lens=context_lens)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    splits, partition_blocks = num_decode_splits(block_tables.shape[1], block_size, window,
                                                 partition_size)
    if splits > 1:
        dest = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32,
                           device=q.device)
        lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        dest_strides = (dest.stride(0), dest.stride(1), dest.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    else:
        dest, lse = out, out  # lse unused
        dest_strides, lse_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    head_dim_p = triton.next_power_of_2(head_dim)
    blocks_per_iter = min(blocks_per_iter, triton.next_power_of_2(partition_blocks))
    block_p = triton.next_power_of_2(block_size)
    if blocks_per_iter > 1:  # tl.dot's least K (head dim; positions a step): 16
        head_dim_p = max(head_dim_p, 16)
        blocks_per_iter = max(blocks_per_iter, 16 // block_p)  # past a split's end: masked
    _decode_attention_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, dest, lse, scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), *dest_strides, *lse_strides,
        GROUP=group, GROUP_P=triton.next_power_of_2(group), HD=head_dim, HD_P=head_dim_p,
        BLOCK_SIZE=block_size, BLOCK_P=block_p,
        PARTITION_BLOCKS=partition_blocks, WINDOWED=bool(window), SPLIT=splits > 1,
        BLOCKS_PER_ITER=blocks_per_iter, num_warps=num_warps)
    if splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            dest, lse, out, splits, *dest_strides, *lse_strides, out.stride(0), out.stride(1),
            HD=head_dim, HD_P=head_dim_p, SPLITS_P=triton.next_power_of_2(splits))
    return out


def check_decode_inputs(k_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, window: int | None = None) -> None:
    """What paged_decode_attention trusts, checked (a sync on CUDA: for tests and debugging):
    each context length in 1 .. table width * block_size, and every block id a sequence reads
    (from its window's first block to its last) within the cache."""
    num_blocks, block_size = k_cache.shape[:2]
    lens = context_lens.cpu()
    tables = block_tables.cpu()
    capacity = tables.shape[1] * block_size
    bad = ((lens < 1) | (lens > capacity)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"context_lens[{i}] = {int(lens[i])} is outside 1..{capacity} "
                         f"(the block table's {tables.shape[1]} blocks of {block_size})")
    for i in range(len(lens)):
        length = int(lens[i])
        first = max(0, length - window) // block_size if window else 0
        ids = tables[i, first:-(-length // block_size)]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise ValueError(f"block_tables[{i}] reads a block id outside 0..{num_blocks - 1}")


# ---------------------------------------------------------------------------------------
# RMSNorm


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, out_ptr, eps,
                     stride_x, stride_delta, stride_out,
                     H: tl.constexpr, H_P: tl.constexpr, ADD: tl.constexpr):
    """One program per row. ADD: x += delta first (x rounded to its dtype, as torch's add_),
    then the norm of the sum. bf16: (weight * round(x * rsqrt(mean(x^2) + eps))), rounded,
    as RMSNorm.forward; fp32: x * rsqrt(...) * weight, as F.rms_norm."""
    row = tl.program_id(0)
    cols = tl.arange(0, H_P)
    mask = cols < H
    dtype = x_ptr.dtype.element_ty
    x = _to_f32(tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0))
    if ADD:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        summed = _cast(x + _to_f32(delta), dtype)
        tl.store(x_ptr + row * stride_x + cols, summed, mask=mask)
        x = _to_f32(summed)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = x * inv_rms
    if dtype == tl.bfloat16:
        normed = _to_f32(_cast(normed, dtype))
    weight = _to_f32(tl.load(weight_ptr + cols, mask=mask, other=0.0))
    tl.store(out_ptr + row * stride_out + cols, _cast(normed * weight, dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row: x (T, H) fp32 or bf16, weight (H,) -> (T, H) in x's dtype."""
    return _launch_rms_norm(x, None, weight, eps)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """x += delta (in place: the residual stream), then return rms_norm(x) in one pass."""
    _check(delta.shape == x.shape and delta.dtype == x.dtype,
           f"delta must have x's shape {tuple(x.shape)} and dtype {x.dtype}")
    _check(delta.stride(-1) == 1, "delta's rows must be contiguous")
    _check_devices(x=x, delta=delta)
    return _launch_rms_norm(x, delta, weight, eps)


def _launch_rms_norm(x, delta, weight, eps):
    _check(x.dim() == 2, f"x must be (T, H), got {tuple(x.shape)}")
    _check(x.stride(1) == 1, "x's rows must be contiguous")
    _check_dtype("x", x)
    _check(weight.shape == (x.shape[1],), f"weight must be ({x.shape[1]},)")
    _check_devices(x=x, weight=weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    hidden = x.shape[1]
    _rms_norm_kernel[(x.shape[0],)](
        x, x if delta is None else delta, weight.contiguous(), out, eps, x.stride(0),
        0 if delta is None else delta.stride(0), out.stride(0), H=hidden,
        H_P=triton.next_power_of_2(hidden), ADD=delta is not None,
        num_warps=_row_warps(hidden))
    return out


# ---------------------------------------------------------------------------------------
# RoPE


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, positions_ptr,
                   stride_xt, stride_xh, stride_cos, stride_sin,
                   NH: tl.constexpr, HALF: tl.constexpr,
                   NH_P: tl.constexpr, HALF_P: tl.constexpr, BY_TOKEN: tl.constexpr):
    """One program per token: all its heads rotated by its position's angles, in place
    (rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)). BY_TOKEN: the tables
    hold one row per token (already looked up), else row positions[token]."""
    token = tl.program_id(0)
    if BY_TOKEN:
        position = token
    else:
        position = tl.load(positions_ptr + token)
    heads = tl.arange(0, NH_P)[:, None]
    cols = tl.arange(0, HALF_P)[None, :]
    col_ok = cols < HALF
    mask = (heads < NH) & col_ok
    cos = tl.load(cos_ptr + position * stride_cos + cols, mask=col_ok, other=0.0)
    sin = tl.load(sin_ptr + position * stride_sin + cols, mask=col_ok, other=0.0)
    cos, sin = _to_f32(cos), _to_f32(sin)
    first = x_ptr + token * stride_xt + heads * stride_xh + cols
    x1 = _to_f32(tl.load(first, mask=mask, other=0.0))
    x2 = _to_f32(tl.load(first + HALF, mask=mask, other=0.0))
    dtype = x_ptr.dtype.element_ty
    tl.store(first, _cast(x1 * cos - x2 * sin, dtype), mask=mask)
    tl.store(first + HALF, _cast(x2 * cos + x1 * sin, dtype), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x (T, n, hd) in place; returns x. x may be a view into a wider row (the q and
    k heads of a qkv row, rotated in one call).

    With positions (T,) int64: cos and sin are RotaryEmbedding's (max_positions, hd/2)
    tables, looked up here. Without: they are the tokens' own rows, (T, 1, hd/2) as
    RotaryEmbedding.tables returns them (the fused CPU kernel's `rotary_(x, cos, sin)`).
    """
    _check(x.dim() == 3 and x.shape[2] % 2 == 0, f"x must be (T, n, even hd), got "
                                                  f"{tuple(x.shape)}")
    half = x.shape[2] // 2
    if positions is None:
        _check(cos.numel() == sin.numel() == x.shape[0] * half,
               f"cos and sin must hold {x.shape[0]} rows of {half} without positions")
        cos, sin = cos.reshape(x.shape[0], half), sin.reshape(x.shape[0], half)
    _check(x.stride(2) == 1, "x's last dimension must be contiguous")
    _check_dtype("x", x)
    for name, table in (("cos", cos), ("sin", sin)):
        _check(table.dim() == 2 and table.shape[1] == half and table.stride(1) == 1,
               f"{name} must be (max_positions, {half}) with contiguous rows")
    if positions is not None:
        _check(positions.shape == (x.shape[0],) and positions.dtype == torch.int64,
               f"positions must be ({x.shape[0]},) int64")
        _check_devices(x=x, cos=cos, sin=sin, positions=positions)
    else:
        _check_devices(x=x, cos=cos, sin=sin)
    if x.shape[0] == 0:
        return x
    _rotary_kernel[(x.shape[0],)](
        x, cos, sin, cos if positions is None else positions, x.stride(0), x.stride(1),
        cos.stride(0), sin.stride(0), NH=x.shape[1], HALF=half,
        NH_P=triton.next_power_of_2(x.shape[1]), HALF_P=triton.next_power_of_2(half),
        BY_TOKEN=positions is None)
    return x


# ---------------------------------------------------------------------------------------
# SiLU and multiply

SILU_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out,
                     I: tl.constexpr, BLOCK: tl.constexpr):  # noqa: E741
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + I + cols, mask=mask, other=0.0)
    gate, up = _to_f32(gate), _to_f32(up)
    # NOTE: gate / (1 + exp(-gate)): exp overflows to inf for gate < -88, giving -0, as torch
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, _cast(out, out_ptr.dtype.element_ty),
             mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) [gate | up] -> (T, I) silu(gate) * up, in gate_up's dtype."""
    _check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
           f"gate_up must be (T, 2I), got {tuple(gate_up.shape)}")
    _check(gate_up.stride(1) == 1, "gate_up's rows must be contiguous")
    _check_dtype("gate_up", gate_up)
    _check_devices(gate_up=gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or inter == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), I=inter, BLOCK=block)
    return out


# ---------------------------------------------------------------------------------------
# argument checks (host side, no sync)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_dtype(name: str, x: torch.Tensor) -> None:
    _check(x.dtype in SUPPORTED_DTYPES, f"{name} must be float32 or bfloat16, got {x.dtype}")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor,
                      dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    _check(k_cache.dim() == 4, "k_cache must be (num_blocks, block_size, nkv, hd), got "
                               f"{tuple(k_cache.shape)}")
    _check(v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
           and v_cache.stride() == k_cache.stride(),
           "v_cache must have k_cache's shape, dtype and strides")
    _check(k_cache.is_contiguous(), "the caches must be contiguous")
    _check(k_cache.dtype in dtypes, f"k_cache must be one of "
           f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)}, got {k_cache.dtype}")


def _check_devices(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        _check(device == first, f"{name} is on {device}, {first_name} on {first}")
    if INTERPRETED:
        _check(first.type == "cpu", f"the interpreted kernels take CPU tensors, got {first}")
    else:
        _check(first.type == "cuda", f"the Triton kernels take CUDA tensors, got {first} "
               "(on a CPU, set TRITON_INTERPRET=1 before importing slotserve.gpu.triton_ops)")


def _row_warps(width: int) -> int:
    """Warps for one program over a row of `width` elements."""
    return 4 if width <= 2048 else 8 if width <= 8192 else 16
