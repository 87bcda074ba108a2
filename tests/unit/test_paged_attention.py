"""Paged attention (the torch path) equals dense causal attention over each sequence alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slotserve.attention.metadata import (
    GROUP_LENGTH_RATIO,
    GROUP_MIN_SAVED_BLOCKS,
    build_metadata,
    group_by_length,
)
from slotserve.attention.torch_paged import paged_attention, write_kv
from slotserve.core.outputs import ROW_CHUNK_TOKENS, ScheduledSeq
from slotserve.sampling import SamplingParams

BLOCK_SIZE = 4


def dense_attention(q, k, v, start_pos: int, scale: float) -> torch.Tensor:
    """q: (n, nh, hd) at positions start_pos.., k/v: (L, nkv, hd) -> (n, nh, hd), explicitly."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (L, nh, hd): head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(start_pos, start_pos + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16],
                         ids=["fp32-cache", "bf16-cache"])
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused-cpu-ops"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("long_chunk", [False, True], ids=["short-chunks", "a-long-chunk"])
def test_mixed_batch_matches_dense_per_sequence(num_heads, num_kv_heads, long_chunk, fused,
                                                kv_dtype, request):
    """A bf16 cache: dense attention over the K/V rounded to bf16 (as they are stored)."""
    ops = request.getfixturevalue("cpu_ops") if fused else None
    gen = torch.Generator().manual_seed(num_heads)
    head_dim, scale = 8, 8 ** -0.5
    # (cached tokens, new tokens): decodes, a fresh prefill, a chunk after a cached prefix,
    # and one long decode, so that the decodes are attended in groups of similar length;
    # a chunk longer than ROW_CHUNK_TOKENS keeps the fused path off the decode rows
    shapes = [(9, 1), (0, 7), (3, 1), (5, 6), (12, 1), (1, 1), (290, 1)]
    shapes += [(2, ROW_CHUNK_TOKENS + 8)] if long_chunk else []
    num_blocks = 120
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, out of order
    seqs, full_k, full_v = [], [], []
    for i, (cached, new) in enumerate(shapes):
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        seqs.append(ScheduledSeq(f"r{i}", [0] * new, cached, table, True,
                                 SamplingParams(), 0, "decode" if new == 1 else "prefill"))
        full_k.append(torch.randn(total, num_kv_heads, head_dim, generator=gen))
        full_v.append(torch.randn(total, num_kv_heads, head_dim, generator=gen))
        # the cached prefix is already in the cache; the new tokens are written below
        for pos in range(cached):
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            k_cache[block, offset], v_cache[block, offset] = full_k[i][pos], full_v[i][pos]
    meta = build_metadata(seqs, BLOCK_SIZE, torch.device("cpu"), group_decodes=not fused,
                          short_chunks_as_rows=fused)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes)])
    write_kv(k_cache, v_cache, new_k, new_v, meta.slot_mapping, ops)
    q = torch.randn(new_k.shape[0], num_heads, head_dim, generator=gen)

    out = paged_attention(q, k_cache, v_cache, meta, scale, ops)

    row = 0
    for i, (cached, new) in enumerate(shapes):
        stored_k, stored_v = (full[i].to(kv_dtype).float() for full in (full_k, full_v))
        expected = dense_attention(q[row:row + new], stored_k, stored_v, cached, scale)
        torch.testing.assert_close(out[row:row + new], expected, atol=1e-5, rtol=1e-4)
        row += new
    if fused and not long_chunk:  # every token a row of one group (`runs_as_rows`)
        assert meta.decode_only and meta.num_decodes == sum(new for _, new in shapes)
        return
    assert meta.num_decodes == 5 and len(meta.prefills) == 2 + long_chunk
    # torch: the 73-block table alone, the short ones together; fused: no padding, one group
    assert len(meta.decode_groups) == (1 if fused else 2)


@pytest.mark.parametrize("lens", [[], [3], [5, 5, 5], [1, 2, 3, 90, 100, 45, 44, 20, 7],
                                  list(range(1, 200, 7))])
def test_group_by_length_partitions_and_bounds_padding(lens):
    table_lens = np.array(lens, dtype=np.int64)
    groups = group_by_length(table_lens)
    members = np.concatenate(groups) if groups else np.array([], dtype=np.int64)
    assert sorted(members.tolist()) == list(range(len(lens)))  # each sequence exactly once
    for group in groups:
        assert (np.diff(group) > 0).all()  # rows stay in batch order
        sizes = table_lens[group]
        padding = int((sizes.max() - sizes).sum())
        # either similar lengths, or the last group taking the rest since it pads little
        assert sizes.max() <= GROUP_LENGTH_RATIO * sizes.min() or (
            group is groups[-1] and padding < GROUP_MIN_SAVED_BLOCKS)
