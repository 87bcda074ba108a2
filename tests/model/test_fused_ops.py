"""The fused CPU kernels (csrc/fused_ops.cpp, paged_attention.cpp) equal the torch ops they replace.

Paged decode attention and the K/V write are also checked against dense attention in
tests/unit/test_paged_attention.py; whole models against HF in test_vs_hf.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slotserve.attention.torch_paged import decode_attention
from slotserve.model.layers import apply_rotary
from tests.conftest import tiny_engine, tiny_hf_model


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_equals_torch(cpu_ops, rows):
    x, weight = torch.randn(rows, 96) * 3, torch.randn(96)
    expected = F.rms_norm(x, (96,), weight, 1e-5)
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5), expected)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_add_rms_norm_adds_in_place_and_equals_add_then_norm_to_the_bit(cpu_ops, rows):
    x, delta, weight = torch.randn(rows, 96) * 3, torch.randn(rows, 96), torch.randn(96)
    summed = x + delta
    y = cpu_ops.add_rms_norm_(x, delta, weight, 1e-5)
    assert torch.equal(x, summed)  # x now holds the sum
    assert torch.equal(y, cpu_ops.rms_norm(summed, weight, 1e-5))
    torch.testing.assert_close(y, F.rms_norm(summed, (96,), weight, 1e-5))
    with pytest.raises(RuntimeError, match="delta of x's shape"):
        cpu_ops.add_rms_norm_(x, delta[:, :48], weight, 1e-5)


@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("inter", [64, 13])  # 13: a row's last vector part-filled
def test_silu_mul_equals_torch_over_the_whole_range(cpu_ops, rows, inter):
    gate_up = torch.randn(rows, 2 * inter) * 20  # large |gate|: exp under- and overflow paths
    gate_up[0, :4] = torch.tensor([-200.0, -88.0, 88.0, 200.0])
    gate_up[-1, inter - 1] = float("nan")  # in the last, part-filled vector
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), F.silu(gate) * up,
                               rtol=1e-5, atol=1e-6, equal_nan=True)


def test_rotary_in_place_rotates_only_the_view(cpu_ops):
    tokens, heads, head_dim = 5, 6, 16
    qkv = torch.randn(tokens, heads * head_dim + 32)  # a view of the first columns is rotated
    angles = torch.rand(tokens, 1, head_dim // 2) * 6.3
    rope = angles.cos(), angles.sin()
    view = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    expected, untouched = apply_rotary(view, rope), qkv[:, heads * head_dim:].clone()

    cpu_ops.rotary_(view, *rope)

    torch.testing.assert_close(view, expected)
    assert torch.equal(qkv[:, heads * head_dim:], untouched)


KV_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["fp32-cache", "bf16-cache"])
@pytest.mark.parametrize("seqs,max_len", [(1, 9), (1, 600), (7, 300)])
def test_decode_attention_equals_torch_reference(cpu_ops, seqs, max_len, kv_dtype):
    # (1, 9) runs on the calling thread, (7, 300) on the pool (SERIAL_POSITIONS in the .cpp),
    # one task per sequence over whole cached rows (the 1-sequence cases: one per KV head)
    gen = torch.Generator().manual_seed(seqs)
    block_size, num_blocks, num_kv_heads, group, head_dim = 16, 300, 2, 3, 32
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    lens = torch.randint(1, max_len + 1, (seqs,), generator=gen)
    lens[0] = max_len
    max_blocks = -(-max_len // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:seqs * max_blocks].view(seqs, max_blocks)
    # q as the model passes it: a view into a wider (qkv-like) row
    qkv = torch.randn(seqs, (num_kv_heads * group + 5) * head_dim, generator=gen)
    q = qkv[:, :num_kv_heads * group * head_dim].view(seqs, num_kv_heads * group, head_dim)
    mask = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]

    got = cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2)

    expected = decode_attention(q, k_cache, v_cache, tables, mask, 0.2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("head_dim,group,num_kv_heads,block_size,seqs", [
    (64, 3, 3, 16, 1),    # SmolLM2-135M's shape, one sequence (one task per KV head)
    (64, 3, 3, 16, 9),    # ... many sequences (a task per sequence, whole rows)
    (64, 5, 2, 16, 6),    # 5 query heads per KV head: register chunks of 4 + 1 (AVX2: 1s)
    (64, 7, 2, 16, 3),    # 7 (Qwen2.5-0.5B's): chunks of 4 + 3 (AVX2: 1s)
    (64, 1, 4, 8, 5),     # no GQA; blocks of 8 (no prefetch of the next block)
    (128, 3, 2, 16, 6),   # head_dim 128: chunks of 2 + 1
    (128, 4, 1, 32, 2),   # blocks of 32
])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["fp32-cache", "bf16-cache"])
def test_decode_attention_register_path_equals_torch(cpu_ops, head_dim, group, num_kv_heads,
                                                     block_size, seqs, kv_dtype):
    """The torch reference reads the same cached values (a bf16 cache widened exactly), so
    a bf16 cache is held to fp32's tolerance too."""
    # head_dim 64 and 128 take the AVX-512 path where the CPU has it, else the AVX2 one
    gen = torch.Generator().manual_seed(head_dim + group + seqs)
    num_blocks, max_len = 200, 150
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    lens = torch.randint(1, max_len + 1, (seqs,), generator=gen)
    lens[0] = max_len  # ends inside a block for every block size here
    max_blocks = -(-max_len // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:seqs * max_blocks].view(seqs, max_blocks)
    q = torch.randn(seqs, num_kv_heads * group, head_dim, generator=gen)
    mask = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]

    got = cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)

    expected = decode_attention(q, k_cache, v_cache, tables, mask, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [64, 32])  # the register path; the generic one
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["fp32-cache", "bf16-cache"])
def test_decode_attention_of_a_sequence_does_not_depend_on_its_batch(cpu_ops, head_dim,
                                                                     kv_dtype):
    """A sequence's output alone (a task per KV head; on the calling thread when its context
    is short) and among 9 others (a task per sequence, whole cached rows): the same bits.
    NOTE: splitting a sequence's positions over threads must keep this (fixed chunks)."""
    gen = torch.Generator().manual_seed(head_dim)
    block_size, num_blocks, num_kv_heads, group, seqs = 16, 400, 3, 3, 10
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    lens = torch.tensor([1, 31, 32, 33, 47, 64, 65, 200, 333, 600])
    max_blocks = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:seqs * max_blocks].view(seqs, max_blocks)
    q = torch.randn(seqs, num_kv_heads * group, head_dim, generator=gen)

    batch = cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)

    for i in range(seqs):
        # the one sequence's table cut to its own blocks: a short one runs serially
        table = tables[i:i + 1, :-(-int(lens[i]) // block_size)]
        alone = cpu_ops.paged_decode_attention(q[i:i + 1], k_cache, v_cache, table,
                                               lens[i:i + 1], 0.125)
        assert torch.equal(alone[0], batch[i]), f"sequence of {int(lens[i])} positions"
    mask = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]
    expected = decode_attention(q, k_cache, v_cache, tables, mask, 0.125)
    torch.testing.assert_close(batch, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [0, 700], ids=["full", "window"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["fp32-cache", "bf16-cache"])
def test_decode_attention_of_long_contexts_equals_torch_alone_or_batched(cpu_ops, head_dim,
                                                                         kv_dtype, window):
    """Contexts past 512 read positions (which the register kernels cut into runs of 512 and
    merges): against the torch reference, and each sequence alone the same bits as in its
    batch. Lengths around the cuts: 512 (one run), 513, 1024, 1025, 1300; a window of 700
    cuts 700 positions into 512 + 188 wherever the context is longer."""
    gen = torch.Generator().manual_seed(head_dim + window)
    block_size, num_kv_heads, group = 16, 3, 3
    lens = torch.tensor([1300, 512, 513, 1024, 1025, 40])
    seqs, max_blocks = len(lens), -(-1300 // block_size)
    num_blocks = seqs * max_blocks + 5
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:seqs * max_blocks].view(seqs, max_blocks)
    q = torch.randn(seqs, num_kv_heads * group, head_dim, generator=gen)
    scale = head_dim ** -0.5

    batch = cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window)

    pos = torch.arange(max_blocks * block_size)[None, :]
    mask = pos < lens[:, None]
    if window:
        mask &= pos >= lens[:, None] - window
    expected = decode_attention(q, k_cache, v_cache, tables, mask, scale)
    torch.testing.assert_close(batch, expected, atol=1e-5, rtol=1e-4)
    for i in range(seqs):
        alone = cpu_ops.paged_decode_attention(q[i:i + 1], k_cache, v_cache, tables[i:i + 1],
                                               lens[i:i + 1], scale, window)
        assert torch.equal(alone[0], batch[i]), f"sequence of {int(lens[i])} positions"


def test_write_kv_into_a_bf16_cache_rounds_as_torch_does(cpu_ops):
    """The fused store and torch's index_copy_ of .to(bfloat16) (round to nearest even) give
    the same bits; k and v as the model passes them (views into a wider row)."""
    from slotserve.attention.torch_paged import write_kv

    gen = torch.Generator().manual_seed(3)
    tokens, nkv, hd = 7, 3, 64
    qkv = torch.randn(tokens, (4 + 2 * nkv) * hd, generator=gen) * 5
    k = qkv[:, 4 * hd:(4 + nkv) * hd].view(tokens, nkv, hd)
    v = qkv[:, (4 + nkv) * hd:].view(tokens, nkv, hd)
    slots = torch.tensor([5, 0, 17, 9, 30, 2, 11])
    fused = [torch.zeros(8, 4, nkv, hd, dtype=torch.bfloat16) for _ in range(2)]
    reference = [c.clone() for c in fused]

    cpu_ops.write_kv_(*fused, k, v, slots)
    write_kv(*reference, k, v, slots)

    assert torch.equal(fused[0], reference[0]) and torch.equal(fused[1], reference[1])
    assert torch.equal(fused[0].view(-1, nkv, hd)[slots], k.to(torch.bfloat16))
    assert torch.count_nonzero(fused[1].view(-1, nkv, hd)[slots] - v.to(torch.bfloat16)) == 0


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 100, 49_155])
def test_argmax_rows_equals_numpy_on_ties_nans_and_infinities(cpu_ops, vocab):
    """The sampler's greedy pick: the first maximum, or the first NaN (numpy's rule)."""
    logits = torch.randn(70, vocab, generator=torch.Generator().manual_seed(vocab))
    nan, inf = float("nan"), float("inf")
    logits[1] = 0.5  # all tied: the first
    logits[2, -1] = nan
    logits[3, vocab // 2], logits[3, -1] = nan, nan
    logits[4] = -inf
    logits[5, vocab // 3], logits[5, -1] = inf, inf
    logits[6] = torch.randint(0, 3, (vocab,), generator=torch.Generator().manual_seed(1))
    logits[7], logits[7, -1] = -0.0, 0.0  # equal: the first
    logits[8, 0] = nan
    expected = torch.from_numpy(logits.numpy().argmax(axis=-1))
    assert torch.equal(cpu_ops.argmax_rows(logits), expected)
    assert torch.equal(cpu_ops.argmax_rows(logits[:1]), expected[:1])  # one row, one thread
    with pytest.raises(RuntimeError, match="logits must be"):
        cpu_ops.argmax_rows(logits[0])


def test_kernels_reject_bad_input(cpu_ops):
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    k_cache = torch.zeros(4, 2, 1, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_ops.write_kv_(k_cache, k_cache.clone(), torch.ones(1, 1, 8), torch.ones(1, 1, 8),
                          torch.tensor([8]))
    with pytest.raises(RuntimeError, match="context length"):
        cpu_ops.paged_decode_attention(torch.randn(1, 1, 8), k_cache, k_cache,
                                       torch.tensor([[0, 1]]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_ops.paged_decode_attention(torch.randn(1, 1, 8), k_cache, k_cache,
                                       torch.tensor([[0, 4]]), torch.tensor([3]), 1.0)
    wide = k_cache.double()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_ops.write_kv_(wide, wide.clone(), torch.ones(1, 1, 8), torch.ones(1, 1, 8),
                          torch.tensor([0]))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):  # k and v caches differ
        cpu_ops.paged_decode_attention(torch.randn(1, 1, 8), k_cache, k_cache.bfloat16(),
                                       torch.tensor([[0, 1]]), torch.tensor([3]), 1.0)


def test_engine_uses_the_kernels_by_default_and_not_for_the_reference(cpu_ops):
    hf = tiny_hf_model()
    fused, reference = tiny_engine(hf), tiny_engine(hf, kernels="reference")
    assert fused.runner.fused_cpu_ops and "fused CPU ops" in fused.runner.linear_kernel
    assert not reference.runner.fused_cpu_ops
    assert fused.runner.model.layers[0].mlp.ops is cpu_ops


def test_switched_off_by_environment(monkeypatch):
    from slotserve.model import cpu_ops as module

    monkeypatch.setenv(module.ENV_SWITCH, "0")
    module.load_cpu_ops.cache_clear()
    try:
        engine = tiny_engine(tiny_hf_model())
        assert not engine.runner.fused_cpu_ops
        assert engine.runner.model.layers[0].mlp.ops is None
    finally:
        module.load_cpu_ops.cache_clear()
