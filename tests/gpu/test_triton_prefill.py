"""The Triton paged prefill attention equals the torch path's (attention/torch_paged.py).

The oracle is `paged_attention` without ops (SDPA over each chunk's gathered blocks and its
causal / window mask) in fp32, over a metadata built by `build_metadata`. The kernel gets a
poisoned copy of the cache and tables: every position it must not read (past a chunk's
context, before its first query's window) is NaN, and every table entry of a block it must
not read is an out-of-pool id or a NaN block, so a stray read shows up as NaN or a fault.
Tiles are tiny (16 rows, 16 keys) so several tiles and key steps run in the interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from slotserve.attention.metadata import build_metadata  # noqa: E402
from slotserve.attention.torch_paged import paged_attention  # noqa: E402
from slotserve.config import SlotKind  # noqa: E402
from slotserve.core.outputs import ScheduledSeq  # noqa: E402
from slotserve.gpu import triton_ops  # noqa: E402
from slotserve.gpu import triton_prefill as tp  # noqa: E402
from slotserve.sampling import SamplingParams  # noqa: E402

FP32_TOL = dict(atol=1e-5, rtol=1e-4)  # as the fused CPU kernel's and the decode kernel's
# bf16 / fp16: P is rounded to q's dtype before P.V (as flash attention and SDPA's CUDA
# kernels do), an error of about 2^-9 (bf16) or 2^-12 (fp16) of |v| on top of the output's
# rounding; the values here are N(0, 1)
LOW_TOL = {torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
           torch.float16: dict(atol=2e-3, rtol=2e-3)}
OUT_OF_POOL = 10**9
PARAMS = SamplingParams(temperature=0.0)


def prefill(i: int, start: int, count: int, table: list[int], sample: bool = True):
    return ScheduledSeq(f"r{i}", list(range(count)), start, table, sample, PARAMS, 0,
                        SlotKind.PREFILL)


def decode(i: int, start: int, table: list[int]):
    return ScheduledSeq(f"d{i}", [1], start, table, True, PARAMS, 0, SlotKind.DECODE)


def make_case(device, chunks, *, block_size=8, num_kv_heads=2, group=3, head_dim=16,
              q_dtype=torch.float32, kv_dtype=torch.float32, seed=0, decodes=()):
    """Random caches, q as the model passes it (a view into a wider row) and the plan:
    chunks (start_pos, num_new) as prefills, then decodes (context lengths), each sequence
    on blocks of its own in a random order."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [start + count for start, count in chunks] + list(decodes)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 3
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [blocks[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(lengths))]
    seqs = [prefill(i, start, count, tables[i]) for i, (start, count) in enumerate(chunks)]
    seqs += [decode(i, n - 1, tables[len(chunks) + i]) for i, n in enumerate(decodes)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(kv_dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(kv_dtype).to(device)
    num_tokens = sum(s.num_tokens for s in seqs)
    width = (num_kv_heads * group + 3) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(q_dtype).to(device)
    q = qkv[:, :num_kv_heads * group * head_dim].view(num_tokens, num_kv_heads * group,
                                                      head_dim)
    return q, k_cache, v_cache, seqs


def poisoned(k_cache, v_cache, seqs, window=None):
    """Copies of the caches and plan where what the kernel must not read is unusable."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    out = []
    for seq in seqs:
        first = max(0, seq.start_pos - window + 1) if window else 0
        table = list(seq.block_table)
        for col, block in enumerate(seq.block_table):
            positions = torch.arange(col * block_size, (col + 1) * block_size)
            unread = ((positions < first) | (positions >= seq.context_len)).to(k_cache.device)
            k_cache[block, unread] = float("nan")
            v_cache[block, unread] = float("nan")
            if bool(unread.all()) and col % 2:
                table[col] = OUT_OF_POOL
        out.append(ScheduledSeq(seq.request_id, seq.token_ids, seq.start_pos, table,
                                seq.sample, seq.sampling_params, 0, seq.kind))
    return k_cache, v_cache, out


def check(q, k_cache, v_cache, seqs, *, window=None, block_m=16, block_n=16):
    device = q.device
    block_size = k_cache.shape[1]
    scale = q.shape[-1] ** -0.5
    meta = build_metadata(seqs, block_size, device)
    expected = paged_attention(q.float(), k_cache, v_cache, meta, scale, window=window)
    k_bad, v_bad, bad_seqs = poisoned(k_cache, v_cache, seqs, window)
    bad_meta = build_metadata(bad_seqs, block_size, device)
    block_q = tp.tokens_per_tile(q.shape[1] // k_cache.shape[2], block_m)
    batch = tp.metadata_batch(bad_meta, block_q, device)
    out = torch.full_like(q, 7.0)
    got = tp.paged_prefill_attention(q, k_bad, v_bad, batch, scale, window=window, out=out,
                                     block_n=block_n)
    assert got is out and got.dtype == q.dtype
    rows = torch.cat([torch.arange(p.query_start, p.query_start + p.num_queries)
                      for p in meta.prefills])
    untouched = torch.ones(q.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert bool((got[untouched.to(device)] == 7.0).all())  # decode rows are not written
    rows = rows.to(device)
    if q.dtype == torch.float32:
        torch.testing.assert_close(got[rows], expected[rows], **FP32_TOL)
    else:
        torch.testing.assert_close(got[rows].float(), expected[rows], **LOW_TOL[q.dtype])


DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
          (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]
DTYPE_IDS = ["fp32", "fp32-bf16cache", "bf16", "fp16"]


@pytest.mark.parametrize("q_dtype,kv_dtype", DTYPES, ids=DTYPE_IDS)
def test_ragged_chunks_after_cached_prefixes_equal_torch(device, q_dtype, kv_dtype):
    # a whole prompt over 2 tiles of 5 tokens (16 rows / 4 padded heads: 4 tokens a tile),
    # a chunk after a 13-position prefix (chunked prefill or a prefix-cache hit), a chunk
    # starting at a block end, a one-token chunk that samples nothing
    chunks = [(0, 9), (13, 6), (16, 3), (21, 1)]
    check(*make_case(device, chunks, q_dtype=q_dtype, kv_dtype=kv_dtype))


@pytest.mark.parametrize("window", [1, 4, 8, 11, 40])
def test_prefill_with_a_sliding_window(device, window):
    """Blocks before the first query's window are never read (NaN or out of the pool in
    the kernel's copy); a window longer than the context is the full causal mask."""
    chunks = [(0, 10), (19, 7), (30, 1), (5, 4)]
    check(*make_case(device, chunks, seed=window), window=window)


def test_a_windowed_bf16_prefill(device):
    chunks = [(0, 12), (17, 9)]
    case = make_case(device, chunks, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, seed=5)
    check(*case, window=6)


@pytest.mark.parametrize("shape", [
    dict(head_dim=24, block_size=12, group=1, num_kv_heads=3),  # padded dims, no GQA
    dict(head_dim=16, block_size=4, group=8, num_kv_heads=1),  # 8 heads a KV head: 2 tokens
    dict(head_dim=16, block_size=1, group=2, num_kv_heads=2),  # one position per block
    dict(head_dim=16, block_size=8, group=32, num_kv_heads=1),  # a tile: 1 token x 32 heads
], ids=["hd24-bs12", "g8", "bs1", "g32"])
def test_prefill_odd_shapes(device, shape):
    check(*make_case(device, [(0, 5), (9, 4)], seed=1, **shape))


def test_longer_keys_than_a_step_and_bigger_tiles(device):
    """A chunk of 20 after 50 cached positions: key steps of 16 and 32, tiles of 4 and 8
    tokens."""
    case = make_case(device, [(50, 20), (0, 3)], num_kv_heads=1, group=4, seed=2)
    check(*case, block_m=16, block_n=16)
    check(*case, block_m=32, block_n=32)
    check(*case, window=17, block_m=32, block_n=16)


def test_paged_attention_with_the_prefill_kernel_in_its_ops(device):
    """paged_attention's ops with `prefill_attention` (WITH_PREFILL): prefills in one
    launch, decodes through the Triton decode kernel, beside each other in one iteration."""
    q, k_cache, v_cache, seqs = make_case(device, [(0, 7), (10, 5)], decodes=(12, 3, 30),
                                          seed=3)
    meta = build_metadata(seqs, k_cache.shape[1], device, group_decodes=False)  # the kernels'
    assert len(meta.prefills) == 2 and meta.num_decodes == 3
    torch_meta = build_metadata(seqs, k_cache.shape[1], device)
    for window in (None, 4):
        got = paged_attention(q, k_cache, v_cache, meta, 0.25, ops=tp.WITH_PREFILL,
                              window=window)
        expected = paged_attention(q, k_cache, v_cache, torch_meta, 0.25, window=window)
        torch.testing.assert_close(got, expected, **FP32_TOL)


def test_with_prefill_is_triton_ops_plus_the_prefill():
    assert tp.WITH_PREFILL.rms_norm is triton_ops.rms_norm
    assert tp.WITH_PREFILL.paged_decode_attention is triton_ops.paged_decode_attention
    assert tp.WITH_PREFILL.prefill_attention is tp.prefill_attention
    assert "prefill attention" in tp.WITH_PREFILL.DESCRIPTION
    assert not hasattr(triton_ops, "prefill_attention")  # the default: SDPA for prefills


def test_the_batch_is_built_once_per_metadata(device):
    q, k_cache, v_cache, seqs = make_case(device, [(0, 5), (3, 9)])
    meta = build_metadata(seqs, k_cache.shape[1], device)
    batch = tp.metadata_batch(meta, 4, device)
    assert tp.metadata_batch(meta, 4, device) is batch
    assert tp.metadata_batch(meta, 2, device) is not batch
    again = build_metadata(seqs, k_cache.shape[1], device)
    assert tp.metadata_batch(again, 2, device) is not batch


def test_tiles_cover_every_query_once_longest_context_first():
    batch = tp.prefill_batch([0, 9, 10], [9, 1, 6], [0, 40, 3], [[0, 1], [2, 3, 4, 5], [6]],
                             4, torch.device("cpu"))
    assert batch.seqs.tolist() == [[0, 9, 0], [9, 1, 40], [10, 6, 3]]
    tiles = [tuple(t) for t in batch.tiles.tolist()]
    assert sorted(tiles) == [(0, 0), (0, 4), (0, 8), (1, 0), (2, 0), (2, 4)]
    # by the keys their last query sees (41, 9, 9, 8, 7, 4), ties in chunk order
    assert tiles == [(1, 0), (0, 8), (2, 4), (0, 4), (2, 0), (0, 0)]
    assert batch.block_tables.tolist() == [[0, 1, 0, 0], [2, 3, 4, 5], [6, 0, 0, 0]]


def test_an_empty_batch_writes_nothing(device):
    q, k_cache, v_cache, _ = make_case(device, [(0, 3)])
    batch = tp.prefill_batch([], [], [], [], 4, device)
    out = torch.zeros_like(q)
    assert tp.paged_prefill_attention(q, k_cache, v_cache, batch, 1.0, out=out) is out
    assert bool((out == 0).all())


def test_prefill_attention_rejects_bad_arguments(device):
    q, k_cache, v_cache, seqs = make_case(device, [(0, 5), (2, 3)])
    batch = tp.prefill_batch([0, 5], [5, 3], [0, 2], [s.block_table for s in seqs], 4, device)
    call = tp.paged_prefill_attention
    with pytest.raises(ValueError, match="q must be"):
        call(q[..., :8], k_cache, v_cache, batch, 1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        call(q[:, :5], k_cache, v_cache, batch, 1.0)
    with pytest.raises(ValueError, match="v_cache must have"):
        call(q, k_cache, v_cache.bfloat16(), batch, 1.0)
    with pytest.raises(ValueError, match="k_cache must be one of"):
        call(q, k_cache.double(), v_cache.double(), batch, 1.0)
    with pytest.raises(ValueError, match="q must be float32, bfloat16 or float16"):
        call(q.double(), k_cache, v_cache, batch, 1.0)
    with pytest.raises(ValueError, match="out must be"):
        call(q, k_cache, v_cache, batch, 1.0, out=torch.empty_like(q).bfloat16())
    with pytest.raises(ValueError, match="window must be"):
        call(q, k_cache, v_cache, batch, 1.0, window=-1)
    with pytest.raises(ValueError, match="block_n must be"):
        call(q, k_cache, v_cache, batch, 1.0, block_n=24)
    if triton_ops.INTERPRETED:
        with pytest.raises(ValueError, match="pipeline=True: Triton's interpreter"):
            call(q, k_cache, v_cache, batch, 1.0, pipeline=True)
    with pytest.raises(ValueError, match="block_m must be"):
        tp.tokens_per_tile(4, 8)
    with pytest.raises(ValueError, match="num_queries >= 1"):
        tp.prefill_batch([0], [0], [0], [[0]], 4, device)
    with pytest.raises(ValueError, match="one entry per chunk"):
        tp.prefill_batch([0, 1], [1], [0], [[0]], 4, device)
    with pytest.raises(ValueError, match="block_tables is on meta"):
        call(q, k_cache, v_cache, tp.PrefillBatch(batch.block_tables.to("meta"), batch.seqs,
                                                  batch.tiles, 4), 1.0)


def test_the_pipelined_loop_equals_the_while_loop(device):
    """Compiled, the key loop is a software-pipelined `for`; the interpreter runs the `while`
    (the tests above): on a GPU both give the same bits."""
    if triton_ops.INTERPRETED:
        pytest.skip("the interpreter runs the while loop only")
    q, k_cache, v_cache, seqs = make_case(device, [(0, 40), (50, 30)], q_dtype=torch.bfloat16,
                                          kv_dtype=torch.bfloat16)
    meta = build_metadata(seqs, k_cache.shape[1], device)
    batch = tp.metadata_batch(meta, tp.tokens_per_tile(3, 16), device)
    runs = [tp.paged_prefill_attention(q, k_cache, v_cache, batch, 0.25, window=window,
                                       block_n=16, pipeline=pipeline)
            for window in (None, 20) for pipeline in (True, False)]
    rows = torch.cat([torch.arange(0, 40), torch.arange(40, 70)]).to(device)
    assert torch.equal(runs[0][rows], runs[1][rows]) and torch.equal(runs[2][rows],
                                                                      runs[3][rows])
