"""kv_cache_dtype="int8": the setting, its refusals and the pool's sizing (no model built)."""

from __future__ import annotations

import pytest
import torch

from slotserve.attention import kv_int8
from slotserve.config import CacheConfig, ModelConfig, SchedulerConfig, engine_config
from slotserve.engine.sizing import resolve_num_blocks
from slotserve.model.kernels import KernelSet, resolve_kv_cache_dtype
from slotserve.runner.model_runner import kv_block_bytes

# SmolLM2-135M's attention shape (30 layers, 3 KV heads of 64)
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64)


def test_int8_is_accepted_and_resolves_to_torch_int8():
    assert engine_config(kv_cache_dtype="int8").cache.kv_cache_dtype == "int8"
    for weights in ("fp32", "bf16", "int8", "gguf"):
        kernels = KernelSet(weights=weights)
        assert resolve_kv_cache_dtype("int8", kernels, torch.float32) == torch.int8
        assert resolve_kv_cache_dtype("auto", kernels, torch.float32) != torch.int8  # opt-in


@pytest.mark.parametrize("bad", ["fp8", "INT8", "int4", "q8_0", ""])
def test_a_bad_value_is_a_value_error_naming_kv_cache_dtype(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine_config(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype(bad, KernelSet(), torch.float32)


def test_int8_is_refused_off_the_cpu():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' runs on the CPU only"):
        engine_config(device="cuda", kv_cache_dtype="int8")
    assert engine_config(device="cuda", kv_cache_dtype="bfloat16").device == "cuda"


def test_the_flag_parses_and_its_help_says_what_int8_is():
    from slotserve.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    serve = parser._subparsers._group_actions[0].choices["serve"]
    action = next(a for a in serve._actions if "--kv-cache-dtype" in a.option_strings)
    assert "int8" in action.choices and "per 32 elements" in action.help


@pytest.mark.parametrize("head_dim", [8, 40, 64, 96, 128, 256])
def test_a_head_row_is_its_codes_and_a_scale_per_32(head_dim):
    scales = -(-head_dim // 32)
    assert kv_int8.row_bytes(head_dim) == head_dim + 4 * scales
    assert kv_int8.head_dim_of(kv_int8.row_bytes(head_dim)) == head_dim


def test_quantize_is_symmetric_per_run_and_dequantize_inverts_it_within_half_a_scale():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0, 0.5, 127.0 * 3] + [0.0] * 4])  # hd 40
    rows = kv_int8.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (1, 40 + 8)
    scales = rows[:, 40:].contiguous().view(torch.float32)
    assert scales.tolist() == [[0.0, 3.0]]  # a zero run: scale 0; the other: amax / 127
    assert rows[0, 32:36].tolist() == [0, -1, 0, 127]  # 1/3 and 0.5/3 round to 0, -2/3 to -1
    back = kv_int8.dequantize(rows)
    assert back[0, 32:36].tolist() == [0.0, -3.0, 0.0, 381.0]
    assert ((back - x).abs() <= 1.5).all()


def test_block_bytes_count_the_scales_and_the_pool_nearly_doubles_against_bf16():
    int8 = kv_block_bytes(SMOLLM2, 16, torch.int8)
    assert int8 == 2 * 30 * 3 * (64 + 8) * 16  # K and V, every layer, codes + 2 scales
    assert kv_block_bytes(SMOLLM2, 16, torch.bfloat16) == 2 * 30 * 3 * 64 * 2 * 16
    memory = CacheConfig(memory_bytes=1 << 30)
    sched = SchedulerConfig()
    blocks = {dtype: resolve_num_blocks(memory, SMOLLM2, sched, "cpu", dtype)
              for dtype in (torch.bfloat16, torch.int8)}
    assert blocks[torch.int8] == (1 << 30) // int8
    assert 1.75 <= blocks[torch.int8] / blocks[torch.bfloat16] <= 2.0  # 128 / 72 bytes a row
