"""The Triton prefill attention compiles for the H200 (sm_90) on a machine without a GPU, at
the variants its launcher makes for Llama-3's head shapes, specialised as the runtime does
(tests/gpu/sm90_compile.py): on Hopper's tensor cores, its key loop software-pipelined, and
no register spills at the default tiles."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.gpu.sm90_compile import compile_for_sm90, tensor  # noqa: E402


def variant(name: str, *, dtype: str = "bfloat16", head_dim: int = 128,
            windowed: bool = False, block_m: int = 128, block_n: int = 64,
            pipeline: bool = True) -> dict:
    """The launch of 32 query heads over 8 KV heads of `head_dim` (a group of 4)."""
    x = tensor(2, 4096, dtype=dtype)
    cache = tensor(4, 16, 8, head_dim, dtype=dtype)
    ints = tensor(2, 4, dtype="int64")
    return dict(
        name=name, num_warps=8 if block_m >= 128 else 4,
        args=dict(q_ptr=x, k_cache_ptr=cache, v_cache_ptr=cache, tables_ptr=ints,
                  seqs_ptr=ints, tiles_ptr=ints, out_ptr=x, scale=0.1, window=4096,
                  stride_qt=6144, stride_qh=head_dim, stride_ot=4096, stride_oh=head_dim,
                  stride_cb=16 * 8 * head_dim, stride_cp=8 * head_dim, stride_ch=head_dim,
                  stride_ts=64),
        constexprs=dict(GROUP=4, GROUP_P=4, HD=head_dim, HD_P=head_dim, BLOCK_SIZE=16,
                        BLOCK_Q=block_m // 4, BLOCK_N=block_n, WINDOWED=windowed,
                        IEEE=dtype == "float32", PIPELINE=pipeline))


DEFAULTS = [variant("bf16-hd128"), variant("bf16-hd128-window", windowed=True),
            variant("bf16-hd64", head_dim=64), variant("fp16-hd128", dtype="float16")]
OTHERS = [variant("fp32-hd64", dtype="float32", head_dim=64),
          variant("bf16-hd128-m64-n32", block_m=64, block_n=32),
          variant("bf16-hd128-while", pipeline=False)]


@pytest.mark.slow  # ~20 s: 7 variants through LLVM and ptxas
def test_the_prefill_kernel_compiles_for_sm90_without_a_gpu():
    from slotserve.gpu import triton_prefill

    assert triton_prefill.DEFAULT_BLOCK_M == 128 and triton_prefill.DEFAULT_BLOCK_N == 64
    compiled = compile_for_sm90("slotserve.gpu.triton_prefill", "_prefill_attention_kernel",
                                DEFAULTS + OTHERS)
    assert set(compiled) == {v["name"] for v in DEFAULTS + OTHERS}
    assert all(c["registers"] for c in compiled.values()), compiled  # ptxas -v was read
    for v in DEFAULTS:
        c = compiled[v["name"]]
        assert c["wgmma"] and c["spill_bytes"] == 0, c
        assert c["async_copies"] > 0, c  # K/V loads pipelined across key steps
    assert compiled["bf16-hd128-while"]["async_copies"] == 0  # the interpreter's loop
