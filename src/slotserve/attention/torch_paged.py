"""Paged attention in plain torch: the CPU path and the oracle for faster kernels.

The cache of one layer is two tensors (num_blocks, block_size, nkv, hd); a sequence's
context is the concatenation of its blocks, in block-table order. An int8 cache's last
axis is a stored head row instead (attention/kv_int8.py: hd codes, then their scales):
written quantized, gathered dequantized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slotserve.attention import kv_int8
from slotserve.attention.metadata import AttentionMetadata, DecodeGroup, KeyView


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, ops=None) -> None:
    """Store the new tokens' K/V (T, nkv, hd) at their flat cache slots (T,), in the cache's
    dtype (a bf16 cache holds them rounded to bf16, an int8 cache kv_int8's rows).

    ops: the fused CPU kernels (model/cpu_ops.py) do it in one call, or None for torch's.
    """
    if ops is not None:
        return ops.write_kv_(k_cache, v_cache, k, v, slot_mapping)
    if k_cache.dtype == torch.int8:
        nkv, width = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, nkv, width).index_copy_(0, slot_mapping, kv_int8.quantize(k))
        v_cache.view(-1, nkv, width).index_copy_(0, slot_mapping, kv_int8.quantize(v))
        return None
    nkv, hd = k.shape[1], k.shape[2]
    # NOTE: .to rounds to nearest even, as the fused kernel stores a bf16 cache
    k_cache.view(-1, nkv, hd).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, nkv, hd).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, ops=None,
                    window: int | None = None) -> torch.Tensor:
    """Attention of every new token over its own sequence's cached context.

    q: (T, nh, hd) -> out (T, nh, hd). NOTE: the new tokens' K/V must already be written.
    ops: the fused CPU kernels (model/cpu_ops.py) for the decodes, or None for torch's;
    ops with `prefill_attention` (gpu/triton_prefill.py) run the prefills too.
    window: the layer's sliding window (a query at position i reads positions i - window + 1
    .. i only; the blocks before them are not read), None for full causal attention.
    """
    groups = meta.decode_groups
    if meta.decode_only:
        return _decode_group_attention(q, k_cache, v_cache, groups[0], meta.block_size,
                                       scale, ops, window)
    out = torch.empty_like(q)
    # NOTE: ops with a prefill kernel (gpu/triton_prefill.WITH_PREFILL) attend every prefill
    # in one call; the others (the fused CPU kernels, triton_ops) leave prefills to SDPA
    prefill_kernel = getattr(ops, "prefill_attention", None)
    if prefill_kernel is not None:
        prefill_kernel(q, k_cache, v_cache, meta, scale, window, out)
    else:
        for seq in meta.prefills:
            rows = slice(seq.query_start, seq.query_start + seq.num_queries)
            out[rows] = _prefill_attention(q[rows], k_cache, v_cache, seq.keys(window),
                                           seq.context_len, scale)
    for group in groups:
        out[group.rows] = _decode_group_attention(q[group.rows], k_cache, v_cache, group,
                                                  meta.block_size, scale, ops, window)
    return out


def _decode_group_attention(q, k_cache, v_cache, group: DecodeGroup, block_size: int,
                            scale: float, ops, window: int | None):
    if ops is not None:
        return ops.paged_decode_attention(q, k_cache, v_cache, group.block_tables,
                                          group.context_lens, scale, window or 0)
    group = group.windowed(window, block_size)
    return decode_attention(q, k_cache, v_cache, group.block_tables, group.mask, scale)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """(nblocks_total, bs, nkv, hd)[table] -> (..., L, nkv, hd) with L = table.shape[-1] * bs,
    as `dtype` (the queries': a bf16 cache widens exactly, an int8 cache's rows are
    dequantized: code x scale in fp32, as the fused decode kernel reads them).

    NOTE: index_select over the flattened table, not `cache[table]`: on CPU the generic
    advanced-indexing kernel copies the same bytes 3-4x slower (benchmarks/PERF.md).
    """
    blocks = cache.index_select(0, block_table.reshape(-1))  # (n, bs, nkv, hd | row)
    blocks = blocks.view(*block_table.shape[:-1], -1, *cache.shape[2:])
    if cache.dtype == torch.int8:
        return kv_int8.dequantize(blocks, dtype)
    return blocks.to(dtype)


def _prefill_attention(q, k_cache, v_cache, keys: KeyView, context_len: int,
                       scale: float) -> torch.Tensor:
    # q: (n, nh, hd); keys at positions key_start..L-1 (L = context_len), their blocks only.
    length = context_len - keys.key_start
    k = gather_kv(k_cache, keys.block_table, q.dtype)[:length]  # (length, nkv, hd)
    v = gather_kv(v_cache, keys.block_table, q.dtype)[:length]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # (nh|nkv, n|length, hd)
        attn_mask=keys.mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # (n, nh, hd)


def decode_attention(q, k_cache, v_cache, block_tables: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The torch reference: one query per sequence, at position context_len - 1.

    q: (D, nh, hd); block_tables: (D, maxb) padded; mask: (D, maxb * bs), True where a
    gathered position is part of the context -> (D, nh, hd).
    NOTE: GQA is folded into the query axis: the g = nh / nkv heads that share a KV head
    become g query rows of one (D, nkv) attention, so K/V are never repeated per head.
    Heads are grouped as HF does (head h reads KV head h // g).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = gather_kv(k_cache, block_tables, q.dtype)  # (D, Lmax, nkv, hd)
    v = gather_kv(v_cache, block_tables, q.dtype)
    max_len = k.shape[1]
    out = F.scaled_dot_product_attention(
        q.reshape(num_seqs, num_kv_heads, group, head_dim),  # (D, nkv, g, hd)
        k.transpose(1, 2), v.transpose(1, 2),  # (D, nkv, Lmax, hd)
        attn_mask=mask[:, None, None, :].expand(num_seqs, 1, group, max_len), scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)
