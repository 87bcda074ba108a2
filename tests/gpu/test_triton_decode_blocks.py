"""The Triton decode attention with several cache blocks per loop step (blocks_per_iter)
equals the torch path's, on the poisoned caches and tables of test_triton_decode_attention
(a read outside a sequence's window, context or split shows up as NaN, a fault or a
position counted twice)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from slotserve.gpu import triton_ops as ops  # noqa: E402
from tests.gpu.sm90_compile import compile_for_sm90, tensor  # noqa: E402
from tests.gpu.test_triton_decode_attention import (  # noqa: E402
    FP32_TOL,
    make_case,
    poisoned,
    reference,
)


def check(q, k_cache, v_cache, tables, lens, *, blocks_per_iter, window=None,
          partition_size=512):
    scale = q.shape[-1] ** -0.5
    expected = reference(q, k_cache, v_cache, tables, lens, scale, window)
    got = ops.paged_decode_attention(q, *poisoned(k_cache, v_cache, tables, lens, window),
                                     lens, scale, window=window,
                                     partition_size=partition_size,
                                     blocks_per_iter=blocks_per_iter)
    if q.dtype == torch.float32:
        torch.testing.assert_close(got, expected, **FP32_TOL)
    else:  # one rounding of the fp32 result
        torch.testing.assert_close(got, expected.to(q.dtype))


@pytest.mark.parametrize("blocks_per_iter", [2, 4, 8])
@pytest.mark.parametrize("partition_size", [512, 64, 48, None],
                         ids=["one-split", "4-block-splits", "3-block-splits", "auto"])
def test_several_blocks_a_step_equal_torch(device, blocks_per_iter, partition_size):
    # 100 positions: 7 blocks; splits of 3 blocks end inside a step of 2 or 4 blocks
    case = make_case(device, lens=[100, 1, 16, 17, 33, 64])
    check(*case, blocks_per_iter=blocks_per_iter, partition_size=partition_size)


@pytest.mark.parametrize("window", [1, 5, 24, 40])
@pytest.mark.parametrize("partition_size", [512, 32], ids=["one-split", "2-block-splits"])
def test_several_blocks_a_step_with_a_window(device, window, partition_size):
    case = make_case(device, lens=[1, 5, 16, 17, 24, 25, 40, 41, 100], seed=window)
    check(*case, blocks_per_iter=4, window=window, partition_size=partition_size)


def test_several_blocks_a_step_in_bf16(device):
    case = make_case(device, lens=[3, 24, 57, 100], q_dtype=torch.bfloat16,
                     kv_dtype=torch.bfloat16, seed=3)
    check(*case, blocks_per_iter=4)
    check(*case, blocks_per_iter=2, window=24, partition_size=32)


@pytest.mark.parametrize("shape", [
    dict(head_dim=80, block_size=12, group=1, num_kv_heads=4),  # padded positions a block
    dict(head_dim=16, block_size=1, group=2, num_kv_heads=2),   # one position per block
], ids=["hd80-bs12", "bs1"])
def test_several_blocks_a_step_odd_shapes(device, shape):
    case = make_case(device, lens=[45, 7, 64], seed=1, **shape)
    check(*case, blocks_per_iter=4, partition_size=3 * shape["block_size"])
    check(*case, blocks_per_iter=8)


def test_blocks_per_iter_must_be_a_power_of_two(device):
    q, k_cache, v_cache, tables, lens = make_case(device, lens=[5])
    with pytest.raises(ValueError, match="blocks_per_iter must be a power of two"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0, blocks_per_iter=3)
    with pytest.raises(ValueError, match="blocks_per_iter must be a power of two"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0, blocks_per_iter=0)


def decode_variant(blocks: int, warps: int, split: bool) -> dict:
    """A launch at Llama-3-8B's shape (bf16, head dim 128, 4 query heads a KV head)."""
    x = tensor(2, 4096)
    cache = tensor(4, 16, 8, 128)
    table = tensor(2, 4, dtype="int64")
    return dict(
        name=f"b{blocks}-w{warps}{'-split' if split else ''}", num_warps=warps,
        args=dict(q_ptr=x, k_cache_ptr=cache, v_cache_ptr=cache, tables_ptr=table,
                  lens_ptr=table, out_ptr=tensor(2, 4096, dtype="float32") if split else x,
                  lse_ptr=tensor(2, 4096, dtype="float32"), scale=0.1, window=4096,
                  stride_qs=6144, stride_qh=128, stride_cb=16384, stride_cp=1024,
                  stride_ch=128, stride_ts=64, stride_os=4096, stride_oh=128,
                  stride_osplit=128, stride_ls=256, stride_lh=8),
        constexprs=dict(GROUP=4, GROUP_P=4, HD=128, HD_P=128, BLOCK_SIZE=16, BLOCK_P=16,
                        PARTITION_BLOCKS=32, WINDOWED=False, SPLIT=split,
                        BLOCKS_PER_ITER=blocks))


@pytest.mark.slow  # ~10 s through LLVM and ptxas
def test_several_blocks_a_step_compile_for_sm90_without_spills():
    """The variants gpu_check times (2 and 4 blocks a step, 8 warps) spill no registers,
    specialised as the runtime does (8 blocks would spill)."""
    variants = [decode_variant(blocks, 8, split) for blocks in (2, 4)
                for split in (False, True)]
    compiled = compile_for_sm90("slotserve.gpu.triton_ops", "_decode_attention_kernel",
                                variants)
    assert set(compiled) == {v["name"] for v in variants}
    assert all(c["registers"] and c["spill_bytes"] == 0 for c in compiled.values()), compiled
