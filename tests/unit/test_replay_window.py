"""The replay frees the blocks before a request's sliding window, as the engine does.

A model with one window on every layer (Mistral-style) frees each request's blocks that no
query can read (core/kv_manager.py); the engine's trace records the window and the replay
builds its KV manager with it, so a replay of such a model holds the blocks the engine held.
"""

from __future__ import annotations

import argparse

from slotserve.commands.replay import settings_from_args
from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.engine.trace import trace_settings
from slotserve.lab.replay import ReplayRequest, ReplaySettings, UnitCost, replay

# 12 blocks of 16 tokens: 192 positions in the pool.
POOL = dict(max_num_seqs=2, num_blocks=12, block_size=16, max_model_len=1024,
            max_num_batched_tokens=64, enable_prefix_caching=False)


def _replay(requests, window):
    return replay(requests, ReplaySettings(**POOL, sliding_window=window), UnitCost(),
                  check=True)


def test_a_request_longer_than_the_pool_runs_within_its_window():
    """300 positions in a 192-position pool: refused without a window, run with one of 32
    (the engine does the same: tests/model/test_window_block_freeing.py)."""
    long = [ReplayRequest("long", 200, 100)]
    without = _replay(long, None).outcomes[0]
    assert without.error is not None and without.finished is None
    within = _replay(long, 32).outcomes[0]
    assert within.error is None and within.finished is not None


def test_two_requests_share_a_pool_neither_window_fits_alone_without_preempting():
    """Two 100 + 60 requests (10 blocks each) in 12 blocks: without a window the second
    preempts or waits; with a window of 32 each holds at most 4 blocks, so both decode
    together and the run takes fewer iterations."""
    requests = [ReplayRequest("a", 100, 60), ReplayRequest("b", 100, 60)]
    without, within = _replay(requests, None), _replay(requests, 32)
    assert all(o.error is None for o in without.outcomes + within.outcomes)
    assert within.preemptions == 0
    assert within.iterations < without.iterations


def test_the_trace_records_the_window_and_the_replay_reads_it():
    sched, cache = SchedulerConfig(), CacheConfig()
    assert "sliding_window" not in trace_settings(sched, cache)
    recorded = trace_settings(sched, cache, sliding_window=4096)
    assert recorded["sliding_window"] == 4096
    flags = {name: None for name in ("max_num_seqs", "max_num_batched_tokens",
                                     "max_prefill_tokens_while_decoding", "num_blocks",
                                     "block_size", "max_model_len", "enable_prefix_caching",
                                     "scheduling_policy", "slo_ttft_ms", "slo_tpot_ms",
                                     "slo_reject", "speculative_config", "batching")}
    settings = settings_from_args(argparse.Namespace(**flags), {"trace_settings": recorded})
    assert settings.sliding_window == 4096
    assert settings_from_args(argparse.Namespace(**flags), {}).sliding_window is None
