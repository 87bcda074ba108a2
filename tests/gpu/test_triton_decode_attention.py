"""The Triton paged decode attention equals the torch path's (attention/torch_paged.py).

The oracle is `decode_attention` in fp32 over `DecodeGroup.windowed` (the torch path's own
windowed view). The kernel gets a poisoned copy of the cache and tables: every position it
must not read is NaN, every table entry it must not read an out-of-pool id, so a read
outside a sequence's window or context shows up as NaN or a fault.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from slotserve.attention.metadata import DecodeGroup  # noqa: E402
from slotserve.attention.torch_paged import decode_attention  # noqa: E402
from slotserve.gpu import triton_ops as ops  # noqa: E402

FP32_TOL = dict(atol=1e-5, rtol=1e-4)  # as the fused CPU kernel's tests
OUT_OF_POOL = 10**9


def make_case(device, *, lens, block_size=16, num_kv_heads=2, group=3, head_dim=32,
              q_dtype=torch.float32, kv_dtype=torch.float32, seed=0):
    """Random caches, tables (disjoint blocks per sequence) and q as the model passes it (a
    view into a wider row)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int64)
    max_blocks = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    v_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * max_blocks]
    tables = tables.view(len(lens), max_blocks)
    width = (num_kv_heads * group + 3) * head_dim
    qkv = torch.randn(len(lens), width, generator=gen).to(q_dtype)
    q = qkv[:, :num_kv_heads * group * head_dim].view(len(lens), num_kv_heads * group,
                                                        head_dim)
    to = lambda t: t.to(device)
    return to(q), to(k_cache), to(v_cache), to(tables), to(lens)


def reference(q, k_cache, v_cache, tables, lens, scale, window=None):
    """torch_paged's decode attention in fp32, with the torch path's windowed view."""
    block_size = k_cache.shape[1]
    mask = torch.arange(tables.shape[1] * block_size, device=q.device)[None] < lens[:, None]
    rows = torch.arange(len(lens), device=q.device)
    view = DecodeGroup(rows, tables, lens, mask).windowed(window, block_size)
    return decode_attention(q.float(), k_cache, v_cache, view.block_tables, view.mask, scale)


def poisoned(k_cache, v_cache, tables, lens, window=None):
    """Copies where nothing the kernel may not read is usable: unread positions of read
    blocks NaN; unread table entries out of the pool (odd columns) or NaN blocks (even)."""
    k_cache, v_cache, tables = k_cache.clone(), v_cache.clone(), tables.clone()
    block_size = k_cache.shape[1]
    for i, length in enumerate(lens.tolist()):
        first = max(0, length - window) if window else 0
        for col in range(tables.shape[1]):
            positions = torch.arange(col * block_size, (col + 1) * block_size)
            unread = (positions < first) | (positions >= length)
            block = int(tables[i, col])
            k_cache[block, unread.to(k_cache.device)] = float("nan")
            v_cache[block, unread.to(v_cache.device)] = float("nan")
            if bool(unread.all()) and col % 2:
                tables[i, col] = OUT_OF_POOL
    return k_cache, v_cache, tables


def check(q, k_cache, v_cache, tables, lens, *, window=None, partition_size=512):
    scale = q.shape[-1] ** -0.5
    expected = reference(q, k_cache, v_cache, tables, lens, scale, window)
    got = ops.paged_decode_attention(q, *poisoned(k_cache, v_cache, tables, lens, window),
                                     lens, scale, window=window,
                                     partition_size=partition_size)
    assert got.dtype == q.dtype and got.shape == q.shape
    if q.dtype == torch.float32:
        torch.testing.assert_close(got, expected, **FP32_TOL)
    else:  # one rounding of the fp32 result (assert_close's bf16 tolerance)
        torch.testing.assert_close(got, expected.to(q.dtype))


DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
          (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("q_dtype,kv_dtype", DTYPES, ids=["fp32", "fp32-bf16cache", "bf16"])
@pytest.mark.parametrize("partition_size", [512, 32], ids=["one-split", "2-block-splits"])
def test_decode_attention_equals_torch_reference(device, q_dtype, kv_dtype, partition_size):
    # lengths around block ends; 100 positions are 4 splits of 2 blocks
    case = make_case(device, lens=[100, 1, 16, 17, 33], q_dtype=q_dtype, kv_dtype=kv_dtype)
    check(*case, partition_size=partition_size)


@pytest.mark.parametrize("shape", [
    dict(head_dim=80, block_size=12, group=1, num_kv_heads=4),  # padded dims, no GQA
    dict(head_dim=64, block_size=32, group=8, num_kv_heads=1),  # 8 query heads per KV head
    dict(head_dim=16, block_size=1, group=2, num_kv_heads=2),   # one position per block
], ids=["hd80-bs12", "hd64-bs32-g8", "bs1"])
def test_decode_attention_odd_shapes(device, shape):
    case = make_case(device, lens=[45, 7, 64], seed=1, **shape)
    check(*case, partition_size=2 * shape["block_size"])


def test_a_long_context_split_many_ways_equals_one_split(device):
    case = make_case(device, lens=[600, 3], num_kv_heads=1, group=4, seed=2)
    check(*case, partition_size=64)  # 10 splits
    check(*case, partition_size=16)  # 38 splits of one block


@pytest.mark.parametrize("window", [1, 5, 16, 24, 40, 1000])
@pytest.mark.parametrize("partition_size", [512, 32], ids=["one-split", "2-block-splits"])
def test_decode_attention_with_a_sliding_window(device, window, partition_size):
    """The last `window` positions only; the blocks before them are never read (NaN or out
    of the pool in the kernel's copy)."""
    case = make_case(device, lens=[1, 5, 16, 17, 24, 25, 40, 41, 100], seed=window)
    check(*case, window=window, partition_size=partition_size)


def test_decode_attention_with_a_window_in_bf16(device):
    case = make_case(device, lens=[3, 24, 57, 100], q_dtype=torch.bfloat16,
                     kv_dtype=torch.bfloat16, seed=3)
    check(*case, window=24, partition_size=32)


def test_number_of_splits_comes_from_the_table_width_and_the_window():
    assert ops.num_decode_splits(7, 16, None, 512) == (1, 8)  # 7 blocks: a loop of 8
    assert ops.num_decode_splits(40, 16, None, 1024) == (1, 64)
    assert ops.num_decode_splits(100, 16, None, 10**9) == (1, 128)
    assert ops.num_decode_splits(7, 16, None, 32) == (4, 2)
    assert ops.num_decode_splits(100, 16, None, 512) == (4, 32)
    # a window of 24 reads at most 3 blocks of 16 (24 positions not aligned to a block)
    assert ops.num_decode_splits(100, 16, 24, 16) == (3, 1)
    assert ops.num_decode_splits(2, 16, 1000, 16) == (2, 1)  # never more than the table
    assert ops.num_decode_splits(2, 16, 1000, 512) == (1, 2)
    assert ops.num_decode_splits(7, 64, None, 32) == (7, 1)  # a partition is whole blocks


def test_an_empty_batch(device):
    q, k_cache, v_cache, tables, lens = make_case(device, lens=[5])
    out = ops.paged_decode_attention(q[:0], k_cache, v_cache, tables[:0], lens[:0], 1.0)
    assert out.shape == (0, *q.shape[1:])


def test_decode_attention_rejects_bad_arguments(device):
    q, k_cache, v_cache, tables, lens = make_case(device, lens=[5, 9])
    call = ops.paged_decode_attention
    with pytest.raises(ValueError, match="q must be"):
        call(q[..., :16], k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        call(q[:, :5], k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="v_cache must have"):
        call(q, k_cache, v_cache.bfloat16(), tables, lens, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        call(q.double(), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables must be"):
        call(q, k_cache, v_cache, tables.int(), lens, 1.0)
    with pytest.raises(ValueError, match="context_lens must be"):
        call(q, k_cache, v_cache, tables, lens[:1], 1.0)
    with pytest.raises(ValueError, match="window must be"):
        call(q, k_cache, v_cache, tables, lens, 1.0, window=-1)
    elsewhere = torch.device("meta")
    with pytest.raises(ValueError, match="context_lens is on meta"):
        call(q, k_cache, v_cache, tables, lens.to(elsewhere), 1.0)


def test_check_decode_inputs_finds_what_the_kernel_trusts(device):
    q, k_cache, v_cache, tables, lens = make_case(device, lens=[20, 9])
    ops.check_decode_inputs(k_cache, tables, lens)
    with pytest.raises(ValueError, match=r"context_lens\[1\] = 0"):
        ops.check_decode_inputs(k_cache, tables, torch.tensor([20, 0], device=device))
    with pytest.raises(ValueError, match=r"context_lens\[0\] = 33 is outside 1..32"):
        ops.check_decode_inputs(k_cache, tables, torch.tensor([33, 9], device=device))
    bad = tables.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[0\] reads a block id outside"):
        ops.check_decode_inputs(k_cache, bad, lens)
    bad[0, 0], bad[0, 1] = -1, tables[0, 1]  # before a window of 4: never read
    ops.check_decode_inputs(k_cache, bad, lens, window=4)


def test_the_fused_cpu_kernels_call_form(device):
    """paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window) with window 0
    for none, as attention/torch_paged.py calls its layer ops."""
    q, k_cache, v_cache, tables, lens = make_case(device, lens=[30, 4], seed=4)
    full = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 0)
    assert torch.equal(full, ops.paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                        0.25))
    windowed = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 8)
    torch.testing.assert_close(windowed, reference(q, k_cache, v_cache, tables, lens, 0.25, 8),
                               **FP32_TOL)


def test_auto_partition_size_spreads_a_small_batch_over_splits():
    # batch 1, 8 KV heads, 25 blocks: 7 splits of 4 blocks (not 8 programs looping 32 times)
    assert ops.auto_partition_size(1, 8, 25, 16, None) == 64
    assert ops.num_decode_splits(25, 16, None, 64) == (7, 4)
    assert ops.auto_partition_size(64, 8, 25, 16, None) == 16 * 16  # 2 splits
    assert ops.auto_partition_size(256, 8, 25, 16, None) == 32 * 16  # enough programs: one
    assert ops.auto_partition_size(1, 8, 2048, 16, None) == 32 * 16  # at most 64 splits
    assert ops.auto_partition_size(1, 8, 2, 16, None) == 2 * 16  # never under the table
    assert ops.auto_partition_size(1, 8, 2048, 16, 4096) == 8 * 16  # 257 blocks read


@pytest.mark.parametrize("q_dtype,kv_dtype", DTYPES[::2], ids=["fp32", "bf16"])
def test_decode_attention_with_its_own_splits_equals_torch_reference(device, q_dtype,
                                                                     kv_dtype):
    case = make_case(device, lens=[100, 1, 16, 17, 33], q_dtype=q_dtype, kv_dtype=kv_dtype)
    check(*case, partition_size=None)
    check(*case, window=24, partition_size=None)
