"""Triton paged prefill attention: every prefill chunk of an iteration in one launch.

A chunk is n new tokens of one sequence at positions start_pos .. start_pos + n - 1; its K/V
are already written to the paged cache, which also holds the sequence's cached prefix
(chunked prefill, prefix-cache hits). Each query attends over the positions up to its own
(the causal mask offset by the prefix), within the layer's sliding window if it has one
(the query at i sees the key at j iff j <= i and i - j < window, as
attention/metadata.window_mask). The oracle is attention/torch_paged.py's prefill path
(`paged_attention` without ops: SDPA over the chunk's gathered blocks and its mask), which is
also the CUDA path's default (model/kernels.cuda_kernels: PREFILL_ATTENTION_ENV).

The kernel is flash attention over the block table: one program per (query tile, KV head),
its rows the tile's BLOCK_Q tokens x the GROUP query heads that share the KV head (GQA: head
h reads KV head h // GROUP, as HF), so a K/V tile is read once for the group. It walks the
keys BLOCK_N positions at a time from the first key the tile's first query sees to the tile's
last query, each key's block id read through the sequence's table, with an online softmax in
fp32. The tiles of all sequences form one flat grid (`PrefillBatch.tiles`, longest contexts
first), so a ragged batch of chunks is one launch with no empty programs.

Numerics: scores and the softmax in fp32; Q.K^T and P.V on the tensor cores in q's dtype
with fp32 accumulation (bf16/fp16: P rounded to q's dtype before P.V, as flash attention and
SDPA's CUDA kernels do; fp32: IEEE fp32 dots, no TF32). A cache of another dtype is converted
to q's, as torch_paged's gather does. The output is rounded once to q's dtype.
NOTE: Triton's interpreter multiplies bf16 dots' operands as their raw 16-bit integers, so
there (IEEE) the operands, already rounded to q's dtype, are widened exactly to fp32 and
multiplied in fp32: the same products, accumulated in fp32 as the tensor cores do.

NOTE: compiled, the key loop is a `for` over runtime bounds, which Triton software-pipelines
(the next steps' K/V loads in flight during this one's dots); in the interpreter it is a
`while` over the same steps (`PIPELINE`): the interpreter cannot run range() over tensor
bounds with numpy >= 2.4 (triton_ops' decode kernel loops a constant number of times
instead, which a prefill's context length cannot be).
"""

from __future__ import annotations

import dataclasses
import types
import weakref

import numpy as np
import torch
import triton
import triton.language as tl

from slotserve.gpu import triton_ops
from slotserve.gpu.triton_ops import _cast, _to_f32

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows of a program's query tile (tokens x the group's heads) and keys per loop step:
# Triton's flash-attention tutorial's Hopper tiles, which compile for sm_90 without register
# spills at head dims 64 and 128 (tests/gpu/test_triton_prefill_compile.py). NOTE: their
# speed is not yet measured (benchmarks/gpu_check.py times them and two others).
DEFAULT_BLOCK_M = 128
DEFAULT_BLOCK_N = 64
MIN_DOT = 16  # tl.dot's least K on a GPU (head dim, keys a step); tiles of 16+ rows


@triton.jit
def _attend_step(q, m, denom, acc, start, key_hi, k_cache_ptr, v_cache_ptr, table_ptr,
                 head_offset, stride_cb, stride_cp, dims, dim_ok, row_ok, query_pos, scale,
                 window, dtype: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 WINDOWED: tl.constexpr, IEEE: tl.constexpr):
    """One step of the online softmax: the keys at positions start .. start + BLOCK_N - 1
    (those < key_hi) read through the sequence's table -> the new (m, denom, acc)."""
    pos = start + tl.arange(0, BLOCK_N)
    # NOTE: positions outside [key_lo, key_hi) are neither loaded (other=0) nor their table
    # entries read: they may be NaN, given back, or past the table's end
    pos_ok = pos < key_hi
    block_id = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    kv_off = block_id * stride_cb + (pos % BLOCK_SIZE) * stride_cp + head_offset
    kv_mask = pos_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if k.dtype != dtype:  # (BLOCK_N, HD_P) in q's dtype, as torch's gather
        k = _cast(_to_f32(k), dtype)
    if IEEE:
        scores = tl.dot(q, tl.trans(_to_f32(k)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = scores * scale  # (M, BLOCK_N) fp32
    seen = row_ok[:, None] & pos_ok[None, :] & (pos[None, :] <= query_pos[:, None])
    if WINDOWED:
        seen = seen & (query_pos[:, None] - pos[None, :] < window)
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    # NOTE: a row that has seen no key yet (a window's first tile, a padding row) keeps
    # m = -inf: subtract 0 there, not -inf (exp(-inf - -inf) would be NaN)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if v.dtype != dtype:
        v = _cast(_to_f32(v), dtype)
    # P in q's dtype, rounded to nearest even as flash attention's (on a GPU by the native
    # conversion; the interpreter's truncates, so there by _cast)
    if dtype == tl.float32:
        pv = tl.dot(p, _to_f32(v), input_precision="ieee")
    elif IEEE:
        pv = tl.dot(_to_f32(_cast(p, dtype)), _to_f32(v), input_precision="ieee")
    else:
        pv = tl.dot(p.to(dtype), v)
    return m_new, denom * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _prefill_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seqs_ptr, tiles_ptr, out_ptr,
        scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cp, stride_ch,
        stride_ts,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        WINDOWED: tl.constexpr, IEEE: tl.constexpr, PIPELINE: tl.constexpr):
    """One program: query tile `tile` (its sequence and first query from tiles_ptr), one KV
    head. seqs_ptr holds (query_start, num_queries, start_pos) per sequence."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles_ptr + 2 * tile)
    first_query = tl.load(tiles_ptr + 2 * tile + 1)  # index within the chunk
    query_start = tl.load(seqs_ptr + 3 * seq)  # row of the chunk's first token in q
    num_queries = tl.load(seqs_ptr + 3 * seq + 1)
    start_pos = tl.load(seqs_ptr + 3 * seq + 2)

    rows = tl.arange(0, BLOCK_Q * GROUP_P)  # row r: token r // GROUP_P, head r % GROUP_P
    token = first_query + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (token < num_queries) & (rows % GROUP_P < GROUP)
    query_pos = start_pos + token
    dims = tl.arange(0, HD_P)
    dim_ok = dims < HD
    q = tl.load(q_ptr + (query_start + token)[:, None] * stride_qt
                + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (M, HD_P)
    dtype = q.dtype
    if IEEE:
        q = _to_f32(q)

    # the keys some row of the tile sees: [key_lo, key_hi)
    key_hi = start_pos + tl.minimum(first_query + BLOCK_Q, num_queries)
    key_lo = key_hi * 0  # an int64 zero
    if WINDOWED:
        key_lo = tl.maximum(start_pos + first_query - window + 1, 0)

    m = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)  # running max of each row
    denom = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HD_P], tl.float32)  # running sum of exp(...) * v
    # NOTE: on a GPU a for loop over runtime bounds (software-pipelined, num_stages); in
    # the interpreter a while loop (see the module's NOTE); the same step either way
    if PIPELINE:
        for start in range(key_lo, key_hi, BLOCK_N):
            m, denom, acc = _attend_step(
                q, m, denom, acc, start, key_hi, k_cache_ptr, v_cache_ptr,
                tables_ptr + seq * stride_ts, kv_head * stride_ch, stride_cb, stride_cp,
                dims, dim_ok, row_ok, query_pos, scale, window, dtype, BLOCK_SIZE, BLOCK_N,
                WINDOWED, IEEE)
    else:
        start = key_lo
        while start < key_hi:
            m, denom, acc = _attend_step(
                q, m, denom, acc, start, key_hi, k_cache_ptr, v_cache_ptr,
                tables_ptr + seq * stride_ts, kv_head * stride_ch, stride_cb, stride_cp,
                dims, dim_ok, row_ok, query_pos, scale, window, dtype, BLOCK_SIZE, BLOCK_N,
                WINDOWED, IEEE)
            start += BLOCK_N

    # every real row saw at least its own position: denom > 0; padding rows are not stored
    out = acc / tl.where(row_ok, denom, 1.0)[:, None]
    tl.store(out_ptr + (query_start + token)[:, None] * stride_ot + head[:, None] * stride_oh
             + dims[None, :], _cast(out, out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """The prefill chunks of one iteration as the kernel reads them, on the device.

    block_tables: (P, maxb) int64, each sequence's table (padded with block 0, never read);
    seqs: (P, 3) int64 (query_start, num_queries, start_pos); tiles: (num_tiles, 2) int64
    (sequence, first query of the tile), the longest contexts first; block_q: tokens per tile.
    """

    block_tables: torch.Tensor
    seqs: torch.Tensor
    tiles: torch.Tensor
    block_q: int

    @property
    def num_seqs(self) -> int:
        return self.seqs.shape[0]


def tokens_per_tile(group: int, block_m: int = DEFAULT_BLOCK_M) -> int:
    """A tile's tokens: block_m rows (a power of two >= 16: fewer would idle the tensor
    cores) over the group's heads (padded to a power of two); at least one token."""
    _check(block_m >= MIN_DOT and block_m & (block_m - 1) == 0,
           f"block_m must be a power of two >= {MIN_DOT}, got {block_m}")
    return max(1, block_m // triton.next_power_of_2(group))


def prefill_batch(query_starts, num_queries, start_positions, block_tables, block_q: int,
                  device: torch.device) -> PrefillBatch:
    """The device arrays of P chunks: per chunk its first row in q, its number of new tokens
    (>= 1), its first position, its block table (a list of ints or an int64 tensor, covering
    start_pos + num_queries positions); block_q tokens per query tile. NOTE: one host-to-device
    copy for the integers, the tables padded on their device."""
    starts = np.asarray(query_starts, dtype=np.int64)
    counts = np.asarray(num_queries, dtype=np.int64)
    positions = np.asarray(start_positions, dtype=np.int64)
    if not (len(starts) == len(counts) == len(positions) == len(block_tables)):
        raise ValueError("query_starts, num_queries, start_positions and block_tables must "
                         "have one entry per chunk")
    if (counts < 1).any() or (positions < 0).any() or (starts < 0).any():
        raise ValueError("every chunk needs num_queries >= 1, start_pos >= 0, query_start >= 0")
    if block_q < 1:
        raise ValueError(f"block_q must be >= 1, got {block_q}")
    tiles_per_seq = -(-counts // block_q)
    owner = np.repeat(np.arange(len(counts)), tiles_per_seq)  # (num_tiles,) each tile's chunk
    first = np.arange(len(owner)) - np.repeat(np.cumsum(tiles_per_seq) - tiles_per_seq,
                                              tiles_per_seq)  # tile index within its chunk
    first_query = first * block_q
    # NOTE: the most keys first (a tile's work grows with its last query's position), so the
    # longest programs start first and the short ones fill the gaps
    order = np.argsort(-(positions[owner] + np.minimum(first_query + block_q, counts[owner])),
                       kind="stable")
    tiles = np.stack([owner[order], first_query[order]], axis=1)
    packed = torch.from_numpy(np.concatenate([np.stack([starts, counts, positions], axis=1)
                                              .reshape(-1), tiles.reshape(-1)]))
    packed = packed.to(device)
    tables = [torch.as_tensor(t, dtype=torch.int64).to(device) for t in block_tables]
    tables = (torch.nn.utils.rnn.pad_sequence(tables, batch_first=True) if tables
              else torch.zeros(0, 1, dtype=torch.int64, device=device))
    return PrefillBatch(tables, packed[:3 * len(starts)].view(-1, 3),
                        packed[3 * len(starts):].view(-1, 2), block_q)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            batch: PrefillBatch, scale: float, window: int | None = None,
                            out: torch.Tensor | None = None, block_n: int = DEFAULT_BLOCK_N,
                            num_warps: int | None = None, num_stages: int | None = None,
                            pipeline: bool | None = None) -> torch.Tensor:
    """Causal attention of each chunk's new tokens over its paged context.

    q: (T, nh, hd) (rows may be views into a wider row), the chunks' rows as batch.seqs
    says; caches (num_blocks, block_size, nkv, hd) contiguous, fp32, bf16 or fp16, the chunks'
    K/V already written; window: the layer's sliding window, None or 0 for none. Writes the
    chunks' rows of `out` (T, nh, hd) in q's dtype (a new tensor when None; its other rows are
    left as they are) and returns it. batch.block_q must be tokens_per_tile(nh // nkv, m) for
    some m: the tile's rows are block_q x the group's heads padded to a power of two.
    block_n: keys per loop step (a power of two >= 16); num_warps: None for 8 at tiles
    of 128 rows or more, else 4; pipeline: the key loop a `for` (software-pipelined over
    num_stages) or a `while`; None: `for` when compiled, `while` in the interpreter (which
    cannot run the `for`).
    """
    triton_ops._check_cache_pair(k_cache, v_cache, SUPPORTED_DTYPES)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    _check(q.dim() == 3 and q.shape[2] == head_dim,
           f"q must be (T, nh, {head_dim}), got {tuple(q.shape)}")
    num_heads = q.shape[1]
    _check(num_heads % num_kv_heads == 0,
           f"q's {num_heads} heads are not a multiple of the cache's {num_kv_heads} KV heads")
    _check(q.stride(2) == 1, "q's last dimension must be contiguous")
    _check(q.dtype in SUPPORTED_DTYPES, f"q must be float32, bfloat16 or float16, got "
                                        f"{q.dtype}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _check(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1,
           f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dimension")
    _check(window is None or window >= 0, f"window must be >= 0 or None, got {window}")
    _check(not (pipeline and triton_ops.INTERPRETED),
           "pipeline=True: Triton's interpreter cannot run the pipelined loop")
    tables = batch.block_tables
    _check(tables.dim() == 2 and tables.dtype == torch.int64 and tables.stride(1) == 1,
           "batch.block_tables must be (P, maxb) int64 with contiguous rows")
    _check(block_n >= MIN_DOT and block_n & (block_n - 1) == 0,
           f"block_n must be a power of two >= {MIN_DOT}, got {block_n}")
    triton_ops._check_devices(q=q, k_cache=k_cache, v_cache=v_cache, out=out,
                              block_tables=tables, seqs=batch.seqs, tiles=batch.tiles)
    num_tiles = batch.tiles.shape[0]
    if num_tiles == 0:
        return out
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    rows = batch.block_q * group_p
    extra = {}
    if num_stages is not None:
        extra["num_stages"] = num_stages
    _prefill_attention_kernel[(num_tiles, num_kv_heads)](
        q, k_cache, v_cache, tables, batch.seqs, batch.tiles, out, scale, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        GROUP=group, GROUP_P=group_p, HD=head_dim,
        HD_P=max(MIN_DOT, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_Q=batch.block_q, BLOCK_N=block_n, WINDOWED=bool(window),
        IEEE=q.dtype == torch.float32 or triton_ops.INTERPRETED,
        PIPELINE=not triton_ops.INTERPRETED if pipeline is None else pipeline,
        num_warps=num_warps or (8 if rows >= 128 else 4), **extra)
    return out


# ---------------------------------------------------------------------------------------
# the model's call: every prefill of an iteration's AttentionMetadata


# NOTE: the batch of the last metadata seen, built by the first layer that asks and reused by
# the others (a weak reference: a new iteration's metadata is a new object, and a dead one
# never matches).
_last_batch: tuple = (lambda: None, 0, None)


def metadata_batch(meta, block_q: int, device: torch.device) -> PrefillBatch:
    """The PrefillBatch of an AttentionMetadata's prefills (attention/metadata.py), built
    once per iteration."""
    global _last_batch
    ref, cached_block_q, batch = _last_batch
    if ref() is meta and cached_block_q == block_q:
        return batch
    prefills = meta.prefills
    batch = prefill_batch([p.query_start for p in prefills], [p.num_queries for p in prefills],
                          [p.start_pos for p in prefills], [p.block_table for p in prefills],
                          block_q, device)
    _last_batch = (weakref.ref(meta), block_q, batch)
    return batch


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                      scale: float, window: int | None, out: torch.Tensor,
                      block_m: int = DEFAULT_BLOCK_M) -> None:
    """The prefill rows of `out` (T, nh, hd) for every prefill of `meta` in one launch: what
    attention/torch_paged.paged_attention calls where its ops have this function (see
    WITH_PREFILL)."""
    if not meta.prefills:
        return
    block_q = tokens_per_tile(q.shape[1] // k_cache.shape[2], block_m)
    paged_prefill_attention(q, k_cache, v_cache, metadata_batch(meta, block_q, q.device),
                            scale, window, out)


def _with_prefill(ops: types.ModuleType) -> types.SimpleNamespace:
    """triton_ops' layer ops plus `prefill_attention`: what a KernelSet hands the model for
    Triton prefill attention (model/kernels.cuda_kernels)."""
    names = {name: getattr(ops, name) for name in dir(ops) if not name.startswith("__")}
    names.update(prefill_attention=prefill_attention,
                 DESCRIPTION="Triton kernels (norms, RoPE, SiLU, K/V writes, decode and "
                             "prefill attention)")
    return types.SimpleNamespace(**names)


WITH_PREFILL = _with_prefill(triton_ops)
"""triton_ops with the prefill attention too (KernelSet(ops=WITH_PREFILL, ...))."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
