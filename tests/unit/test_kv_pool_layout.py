"""The KV pool's regions (a layer's K or V each) start at staggered offsets within a 2 MB
huge page, so a fresh pool's huge pages are faulted in one at a time, not every layer's at
the same block (`runner.model_runner.staggered_stride`)."""

from __future__ import annotations

import pytest
import torch

from slotserve.runner.model_runner import HUGE_PAGE_BYTES, PAGE_BYTES, staggered_stride
from tests.conftest import tiny_engine


@pytest.mark.parametrize("region,count", [(12 * HUGE_PAGE_BYTES, 60), (6144 * 4096, 60),
                                          (HUGE_PAGE_BYTES // 2, 4), (1000, 8),
                                          (3 * HUGE_PAGE_BYTES + 12345, 64), (5000, 1)])
def test_regions_start_at_distinct_offsets_within_a_huge_page(region, count):
    stride = staggered_stride(region, count)
    assert stride >= region and stride % PAGE_BYTES == 0
    assert stride - region < HUGE_PAGE_BYTES + PAGE_BYTES  # the padding is virtual, < 2 MB
    phases = {i * stride % HUGE_PAGE_BYTES for i in range(count)}
    assert len(phases) == min(count, HUGE_PAGE_BYTES // PAGE_BYTES)


def test_the_regions_of_a_12_huge_page_layer_no_longer_share_their_boundaries():
    # SmolLM2's default pool: 4096 blocks of 16 x 3 x 64 bf16 = 12 x 2 MB a region; packed
    # back to back every region crossed a boundary at the same block.
    region = 4096 * 16 * 3 * 64 * 2
    assert region % HUGE_PAGE_BYTES == 0
    stride = staggered_stride(region, 60)
    crossings = [(HUGE_PAGE_BYTES - i * stride % HUGE_PAGE_BYTES) % HUGE_PAGE_BYTES // 6144
                 for i in range(60)]  # the first block of each region on a new huge page
    assert max(crossings.count(c) for c in crossings) <= 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_each_layer_s_k_and_v_are_zeroed_contiguous_and_apart(tiny_llama, dtype):
    engine = tiny_engine(tiny_llama, num_blocks=40, kv_cache_dtype=dtype)
    caches = engine.runner.kv_caches
    regions = [cache for pair in caches for cache in pair]
    expected = torch.int8 if dtype == "int8" else getattr(torch, dtype)
    for region in regions:
        assert region.dtype == expected and region.is_contiguous()
        assert region.shape[:2] == (40, engine.config.cache.block_size)
        assert not region.any()
    spans = sorted((r.data_ptr(), r.data_ptr() + r.numel() * r.element_size())
                   for r in regions)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap
    caches[0][0].fill_(1)
    assert all(not r.any() for r in regions[1:])
