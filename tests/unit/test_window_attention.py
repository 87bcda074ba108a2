"""Sliding-window attention: the fused decode kernel and the torch paths against dense
attention with HF's window mask (key j visible from query i iff j <= i and i - j < window),
around block and window boundaries; and no path reads a block before its window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slotserve.attention.metadata import build_metadata, window_mask
from slotserve.attention.torch_paged import paged_attention, write_kv
from slotserve.core.outputs import ScheduledSeq
from slotserve.layer_windows import (
    gguf_layer_windows,
    hf_layer_windows,
    layer_window,
    uniform_window,
)
from slotserve.sampling import SamplingParams

BLOCK_SIZE = 16
NUM_BLOCKS = 64
POISON_BLOCK = 10**6  # a table entry no path may read (a block given back)


def dense_window_attention(q, k, v, start_pos: int, scale: float,
                           window: int | None) -> torch.Tensor:
    """q: (n, nh, hd) at positions start_pos.., k/v: (L, nkv, hd) -> (n, nh, hd), in fp64."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    behind = (torch.arange(start_pos, start_pos + q.shape[0])[:, None]
              - torch.arange(k.shape[0])[None, :])
    visible = (behind >= 0) & (behind < (window or k.shape[0] + 1))
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


class Cache:
    """A KV pool of NUM_BLOCKS scattered blocks and the sequences stored in it."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.free = torch.randperm(NUM_BLOCKS, generator=self.gen).tolist()
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def sequence(self, length: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """A block table holding `length` random K/V rows, and those rows as stored."""
        table = [self.free.pop() for _ in range(-(-length // BLOCK_SIZE))]
        k = torch.randn(length, self.num_kv_heads, self.head_dim, generator=self.gen)
        v = torch.randn(length, self.num_kv_heads, self.head_dim, generator=self.gen)
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                              for p in range(length)])
        write_kv(self.k, self.v, k, v, slots)
        return table, k.to(self.k.dtype).float(), v.to(self.v.dtype).float()

    def poison_before(self, table: list[int], first_position: int) -> list[int]:
        """NaN in every block wholly before `first_position`; the table with those entries
        replaced by an id outside the pool (as a manager that gave them back might leave)."""
        before = first_position // BLOCK_SIZE
        for block in table[:before]:
            self.k[block] = float("nan")
            self.v[block] = float("nan")
        return [POISON_BLOCK] * before + table[before:]


# contexts around block ends (16, 32, 48) and windows around them, smaller and larger
CONTEXTS = [1, 2, 15, 16, 17, 23, 24, 25, 31, 32, 33, 47, 48, 49, 80, 97]
WINDOWS = [None, 1, 7, 16, 17, 24, 33, 200]


def decode_seqs(tables, lengths):
    return [ScheduledSeq(f"r{i}", [0], length - 1, table, True, SamplingParams(), 0, "decode")
            for i, (table, length) in enumerate(zip(tables, lengths))]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 24], ids=["avx512-path", "generic-path"])
@pytest.mark.parametrize("path", ["torch", "fused"])
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_window_matches_dense(window, path, head_dim, kv_dtype, request):
    """Every context length of CONTEXTS in one batch; the blocks before each window hold NaN
    and the table names a block outside the pool there: neither path reads them."""
    ops = request.getfixturevalue("cpu_ops") if path == "fused" else None
    num_heads, num_kv_heads, scale = 6, 2, head_dim ** -0.5
    cache = Cache(num_kv_heads, head_dim, kv_dtype, seed=head_dim)
    stored = [cache.sequence(length) for length in CONTEXTS]
    q = torch.randn(len(CONTEXTS), num_heads, head_dim, generator=cache.gen)
    tables = [table if window is None else cache.poison_before(table, max(0, length - window))
              for (table, _, _), length in zip(stored, CONTEXTS)]
    meta = build_metadata(decode_seqs(tables, CONTEXTS), BLOCK_SIZE, torch.device("cpu"),
                          group_decodes=ops is None)
    out = paged_attention(q, cache.k, cache.v, meta, scale, ops, window)
    for i, (length, (_, k, v)) in enumerate(zip(CONTEXTS, stored)):
        want = dense_window_attention(q[i:i + 1], k, v, length - 1, scale, window)
        torch.testing.assert_close(out[i:i + 1], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 16, 24])
def test_fused_decode_is_batch_invariant_with_a_window(cpu_ops, window):
    """A sequence's output is the same bits alone and in a batch of others."""
    cache = Cache(2, 64, torch.float32, seed=7)
    stored = [cache.sequence(length) for length in CONTEXTS]
    q = torch.randn(len(CONTEXTS), 4, 64, generator=cache.gen)
    tables = torch.zeros(len(CONTEXTS), 7, dtype=torch.int64)
    for row, (table, _, _) in enumerate(stored):
        tables[row, :len(table)] = torch.tensor(table)
    lens = torch.tensor(CONTEXTS)
    batch = cpu_ops.paged_decode_attention(q, cache.k, cache.v, tables, lens, 0.125, window)
    for row in range(len(CONTEXTS)):
        alone = cpu_ops.paged_decode_attention(q[row:row + 1], cache.k, cache.v,
                                               tables[row:row + 1], lens[row:row + 1], 0.125,
                                               window)
        assert torch.equal(alone, batch[row:row + 1])


def test_fused_decode_checks_only_the_windows_blocks(cpu_ops):
    """A block id outside the pool is refused where it is read, allowed before the window."""
    cache = Cache(2, 64, torch.float32, seed=3)
    q = torch.randn(1, 2, 64)
    tables = torch.tensor([[POISON_BLOCK, 5, 6]])
    lens = torch.tensor([40])
    cpu_ops.paged_decode_attention(q, cache.k, cache.v, tables, lens, 0.125, 24)  # 16..39
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_ops.paged_decode_attention(q, cache.k, cache.v, tables, lens, 0.125, 25)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_ops.paged_decode_attention(q, cache.k, cache.v, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        cpu_ops.paged_decode_attention(q, cache.k, cache.v, tables, lens, 0.125, -1)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cached,new", [(0, 80), (0, 17), (40, 40), (16, 8), (47, 1),
                                        (20, 1), (63, 30)])
def test_prefill_window_matches_dense(cached, new, window):
    """Prefills, chunks after a cached prefix and decodes ((47, 1), (20, 1)) beside another
    prefill; the blocks before the first query's window poisoned."""
    head_dim, scale = 32, 32 ** -0.5
    cache = Cache(2, head_dim, torch.float32, seed=cached + new)
    table, k, v = cache.sequence(cached + new)
    other_table, other_k, other_v = cache.sequence(9)
    if window is not None:
        table = cache.poison_before(table, max(0, cached - window + 1))
    q = torch.randn(new + 4, 4, head_dim, generator=cache.gen)
    seqs = [ScheduledSeq("a", [0] * new, cached, table, True, SamplingParams(), 0, "prefill"),
            ScheduledSeq("b", [0] * 4, 5, other_table, True, SamplingParams(), 0, "prefill")]
    meta = build_metadata(seqs, BLOCK_SIZE, torch.device("cpu"))
    out = paged_attention(q, cache.k, cache.v, meta, scale, None, window)
    torch.testing.assert_close(out[:new], dense_window_attention(q[:new], k, v, cached, scale,
                                                                 window), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out[new:], dense_window_attention(q[new:], other_k, other_v, 5,
                                                                 scale, window),
                               atol=2e-5, rtol=1e-4)


def test_window_views_are_built_once_per_iteration():
    cache = Cache(1, 8, torch.float32, seed=0)
    tables = [cache.sequence(n)[0] for n in (40, 70)]
    meta = build_metadata(decode_seqs(tables, [40, 70]), BLOCK_SIZE, torch.device("cpu"))
    group = meta.decode_groups[0]
    assert group.windowed(24, BLOCK_SIZE) is group.windowed(24, BLOCK_SIZE)
    assert group.windowed(None, BLOCK_SIZE) is group
    view = group.windowed(24, BLOCK_SIZE)
    # 40: positions 16..39 in blocks 1, 2 (padded with its own last); 70: 46..69 in 2, 3, 4
    assert view.block_tables.tolist() == [[tables[0][1], tables[0][2], tables[0][2]],
                                          [tables[1][2], tables[1][3], tables[1][4]]]
    assert view.mask.sum(1).tolist() == [24, 24]
    prefill = build_metadata([ScheduledSeq("p", [0] * 30, 50, tables[1], True,
                                           SamplingParams(), 0, "prefill")],
                             BLOCK_SIZE, torch.device("cpu")).prefills[0]
    keys = prefill.keys(24)
    assert keys is prefill.keys(24) and keys.key_start == 16  # query 50 reads from 27
    assert keys.mask.shape == (30, 80 - 16)


def test_window_mask_is_hf_sliding_window_causal():
    from transformers.masking_utils import sliding_window_causal_mask_function

    hf = sliding_window_causal_mask_function(5)
    as_tensor = torch.tensor
    want = np.array([[bool(hf(as_tensor(0), as_tensor(0), as_tensor(i), as_tensor(j)))
                      for j in range(12)] for i in range(12)])
    assert want.sum() == 5 * 12 - 10  # the window is not empty or everything
    assert (window_mask(np.arange(12), np.arange(12), 5) == want).all()


def test_hf_config_windows():
    base = dict(num_hidden_layers=4)
    assert hf_layer_windows({**base, "model_type": "mistral", "sliding_window": 24}) == (24,) * 4
    assert hf_layer_windows({**base, "model_type": "mistral"}) == (4096,) * 4  # HF's default
    assert hf_layer_windows({**base, "model_type": "mistral", "sliding_window": None}) == ()
    assert hf_layer_windows({**base, "model_type": "llama", "sliding_window": 24}) == ()
    qwen = {**base, "model_type": "qwen2", "sliding_window": 24, "max_window_layers": 1}
    assert hf_layer_windows(qwen) == ()  # use_sliding_window defaults to False
    assert hf_layer_windows({**qwen, "use_sliding_window": True}) == (None, 24, 24, 24)
    assert hf_layer_windows({**qwen, "use_sliding_window": True, "layer_types": [
        "sliding_attention", "full_attention"] * 2}) == (24, None, 24, None)
    gemma3 = {"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 8}
    assert hf_layer_windows(gemma3) == (8, 8, 8, 8, 8, None, 8)
    assert hf_layer_windows({**gemma3, "sliding_window_pattern": 2})[:3] == (8, None, 8)
    gemma2 = {"model_type": "gemma2", "num_hidden_layers": 3, "sliding_window": 8}
    assert hf_layer_windows(gemma2) == (8, None, 8)
    assert layer_window((), 3) is None and layer_window((None, 24), 1) == 24
    assert uniform_window((24, 24)) == 24 and uniform_window((None, 24)) is None
    assert uniform_window(()) is None


@pytest.mark.parametrize("cfg,key", [
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
    ({"model_type": "mistral", "sliding_window": "24"}, "sliding_window"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["sliding_attention"]}, "layer_types"),
    ({"model_type": "qwen2", "layer_types": ["sliding_attention"] * 4}, "sliding_window"),
    ({"model_type": "gemma2", "layer_types": ["chunked_attention"] * 4}, "chunked_attention"),
    ({"model_type": "falcon", "sliding_window": 8}, "sliding_window"),
])
def test_bad_hf_windows_are_refused_naming_the_key(cfg, key):
    with pytest.raises(ValueError, match=key):
        hf_layer_windows({"num_hidden_layers": 4, **cfg})


def test_gguf_windows():
    meta = {"gemma3.attention.sliding_window": 512}
    assert gguf_layer_windows(meta, "gemma3", 7) == (512,) * 5 + (None, 512)
    assert gguf_layer_windows({"gemma2.attention.sliding_window": 8}, "gemma2", 3) == (
        8, None, 8)
    both = {**meta, "gemma3.attention.sliding_window_pattern": [True, False]}
    assert gguf_layer_windows(both, "gemma3", 2) == (512, None)
    assert gguf_layer_windows({"llama.attention.sliding_window": 8}, "llama", 2) == ()
    with pytest.raises(ValueError, match="gemma3.attention.sliding_window"):
        gguf_layer_windows({}, "gemma3", 2)
    with pytest.raises(ValueError, match="phi3.attention.sliding_window"):
        gguf_layer_windows({"phi3.attention.sliding_window": 8}, "phi3", 2)


def test_windows_survive_the_converted_model_cache():
    """The on-disk cache stores the config as JSON (lists): it comes back as the same tuple."""
    import dataclasses
    import json

    from slotserve.config import ModelConfig
    from slotserve.loader.cache import _config_from_json

    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                      sliding_windows=(None, 24))
    assert _config_from_json(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    old_entry = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "sliding_windows"}
    assert _config_from_json(old_entry).sliding_windows == ()
