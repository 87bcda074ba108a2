"""Building an `EngineSnapshot` from the engine's parts (the read side's one reader).

NOTE: called by `LLMEngine.snapshot()` under the engine's state lock, so the scheduler, the
KV manager and the stats are read between two mutations, never halfway through one.
"""

from __future__ import annotations

from collections import Counter

from slotserve.engine.events import EngineSnapshot, SlotView, TenantView, build_block_map
from slotserve.runner.model_runner import kv_block_bytes


def build_snapshot(engine, include_blocks: bool = False) -> EngineSnapshot:
    """The EngineSnapshot of an LLMEngine (its lock held by the caller)."""
    sched, kv, stats = engine.scheduler, engine.kv, engine.stats
    config = sched.config
    pool = kv.pool
    holders = Counter(block for table in kv.block_tables.values() for block in table)
    slots = tuple(sorted((SlotView(
        slot=r.slot, request_id=r.request_id, num_prompt_tokens=r.num_prompt_tokens,
        num_computed_tokens=r.num_computed_tokens, num_output_tokens=len(r.output_token_ids),
        num_cached_tokens=r.num_cached_tokens) for r in sched.running if r.slot is not None),
        key=lambda view: view.slot))
    block_map = None
    if include_blocks:
        block_map = build_block_map(kv.block_tables, pool.cached_free_blocks())
    return EngineSnapshot(
        model=engine.model_config.name, policy=config.policy, num_slots=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len, max_total_tokens=sched.max_total_tokens,
        block_size=kv.block_size, kv_blocks_total=kv.num_blocks,
        enable_prefix_caching=kv.enable_prefix_caching,
        iteration=sched.iteration, num_running=sched.num_running,
        num_waiting=sched.num_waiting, num_preemptions=sched.num_preemptions, slots=slots,
        kv_blocks_free=kv.num_free_blocks, kv_blocks_cached=pool.num_cached,
        kv_blocks_cached_free=pool.num_cached_free,
        kv_blocks_shared=sum(1 for n in holders.values() if n > 1),
        prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
        prefix_cache_evictions=pool.num_evictions,
        iterations=stats.iterations, prompt_tokens=stats.prompt_tokens,
        generation_tokens=stats.generation_tokens, busy_seconds=stats.busy_seconds,
        finished_by_reason=tuple(sorted(stats.finished_by_reason.items())),
        block_map=block_map, scheduling_policy=str(sched.scheduling_policy),
        tenants=_tenants(sched.policy_state()),
        configured_tenants=tuple(name for name, _ in config.tenant_weights),
        slo_ttft_ms=config.slo_ttft_ms, slo_tpot_ms=config.slo_tpot_ms,
        slo_reject=config.slo_reject, **_placement(engine))


def _placement(engine) -> dict:
    """The model's size, device, dtype, kernels and KV block bytes (the start-up line's)."""
    runner = engine.runner
    return dict(num_parameters=engine.model_config.num_parameters, device=engine.config.device,
                dtype=str(runner.dtype).removeprefix("torch."),
                kernels=runner.kernels.describe(),
                kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
                kv_block_bytes=kv_block_bytes(engine.model_config, engine.kv.block_size,
                                              runner.kv_cache_dtype))


def _tenants(state: dict) -> tuple[TenantView, ...]:
    """The policy state's tenants (by name) as frozen views."""
    return tuple(TenantView(
        name=name, weight=t["weight"], virtual_counter=t["virtual_counter"],
        prompt_tokens=t["prompt_tokens"], output_tokens=t["output_tokens"], active=t["active"])
        for name, t in sorted(state.get("tenants", {}).items()))
