"""Paged attention with tanh soft-capped scores (Gemma 2), in plain torch.

scores = cap * tanh(q.k * scale / cap), then the causal (and sliding-window) mask, softmax in
fp32, as HF's Gemma 2 eager attention computes it. The fused kernels and
attention/torch_paged.py's SDPA calls have no soft-cap, so a soft-capped layer runs this.
It reads the same metadata as attention/torch_paged.py: a prefill's KeyView (its blocks from
the window's first on, its mask) and a decode group cut to its window.
"""

from __future__ import annotations

import torch

from slotserve.attention.metadata import AttentionMetadata
from slotserve.attention.torch_paged import gather_kv  # an int8 cache: dequantized


def softcapped_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               meta: AttentionMetadata, scale: float, softcap: float,
                               window: int | None = None) -> torch.Tensor:
    """q: (T, nh, hd) -> (T, nh, hd); the new tokens' K/V must already be in the cache."""
    out = torch.empty_like(q)
    for seq in meta.prefills:
        rows = slice(seq.query_start, seq.query_start + seq.num_queries)
        keys = seq.keys(window)
        length = seq.context_len - keys.key_start
        k = gather_kv(k_cache, keys.block_table, q.dtype)[:length]  # (L, nkv, hd)
        v = gather_kv(v_cache, keys.block_table, q.dtype)[:length]
        out[rows] = _attend(q[rows][None], k[None], v[None], keys.mask[None], scale,
                            softcap)[0]
    for group in meta.decode_groups:
        group = _with_mask(group, meta.block_size).windowed(window, meta.block_size)
        k = gather_kv(k_cache, group.block_tables, q.dtype)  # (D, Lmax, nkv, hd)
        v = gather_kv(v_cache, group.block_tables, q.dtype)
        out[group.rows] = _attend(q[group.rows][:, None], k, v, group.mask[:, None], scale,
                                  softcap)[:, 0]
    return out


def _attend(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """q (B, n, nh, hd), k/v (B, L, nkv, hd), mask (B, n, L) -> (B, n, nh, hd)."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)  # head h reads KV head h // group, as HF
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # (B, nh, n, L)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def _with_mask(group, block_size: int):
    """The group with its gather mask (the fused kernels' groups come without one)."""
    if group.mask is not None:
        return group
    width = group.block_tables.shape[1] * block_size
    mask = (torch.arange(width, device=group.context_lens.device)[None, :]
            < group.context_lens[:, None])
    return type(group)(group.rows, group.block_tables, group.context_lens, mask)
