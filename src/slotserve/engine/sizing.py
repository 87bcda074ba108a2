"""Engine sizing from the config: the KV pool's block count, the scheduler's fit, torch threads."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from slotserve.config import CacheConfig, ModelConfig, SchedulerConfig
from slotserve.runner.model_runner import kv_block_bytes


def eos_ids(model_config: ModelConfig, tokenizer) -> tuple[int, ...]:
    """The model's EOS token ids and the tokenizer's, sorted."""
    ids = set(model_config.eos_token_ids)
    if tokenizer is not None:
        ids.update(tokenizer.eos_token_ids)
    return tuple(sorted(ids))


def fit_scheduler_config(sched: SchedulerConfig, model: ModelConfig) -> SchedulerConfig:
    """Cap max_model_len at the model's positions (the RoPE table is that long)."""
    if sched.max_model_len > model.max_position_embeddings:
        return replace(sched, max_model_len=model.max_position_embeddings)
    return sched


def resolve_num_blocks(cache: CacheConfig, model: ModelConfig, sched: SchedulerConfig,
                       device: str, kv_dtype: torch.dtype) -> int:
    """Pool size: num_blocks, else memory_bytes, else a share of free memory (in blocks of
    kv_dtype elements).

    The default never exceeds what max_num_seqs full-length sequences could use.
    """
    if cache.num_blocks is not None:
        return cache.num_blocks
    block_bytes = kv_block_bytes(model, cache.block_size, kv_dtype)
    useful = sched.max_num_seqs * -(-sched.max_model_len // cache.block_size)
    if cache.memory_bytes is not None:
        return max(1, cache.memory_bytes // block_bytes)
    return max(1, min(useful, int(0.25 * available_memory(device)) // block_bytes))


def available_memory(device: str) -> int:
    """Free bytes on the device (CUDA) or available system memory (CPU)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def set_torch_threads() -> None:
    """One torch thread per core we may run on (the CPUs here have no SMT)."""
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
