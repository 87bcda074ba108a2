"""A replica set's snapshot: the replicas' EngineSnapshots as one engine's
(`ReplicaFront.snapshot`), or the set idle when no replica is up."""

from __future__ import annotations

import dataclasses
from collections import Counter

from slotserve.engine.events import EngineSnapshot, TenantView

# EngineSnapshot fields summed over the replicas (the others, config, from the first).
SUMMED_FIELDS = (
    "num_slots", "kv_blocks_total", "iteration", "num_running", "num_waiting",
    "num_preemptions", "kv_blocks_free", "kv_blocks_cached", "kv_blocks_cached_free",
    "kv_blocks_shared", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_evictions",
    "iterations", "prompt_tokens", "generation_tokens", "busy_seconds")
TENANT_SUMMED = ("virtual_counter", "prompt_tokens", "output_tokens", "active")


def sum_snapshots(snaps: list[EngineSnapshot]) -> EngineSnapshot:
    """Several replicas' snapshots as one (see ReplicaFront.snapshot)."""
    first = snaps[0]
    sums = {name: sum(getattr(s, name) for s in snaps) for name in SUMMED_FIELDS}
    slots, offset = [], 0
    for snap in snaps:
        slots.extend(dataclasses.replace(v, slot=offset + v.slot) for v in snap.slots)
        offset += snap.num_slots
    finished = Counter()
    for snap in snaps:
        finished.update(dict(snap.finished_by_reason))
    return dataclasses.replace(
        first, **sums, slots=tuple(slots), block_map=None,
        finished_by_reason=tuple(sorted(finished.items())),
        tenants=_sum_tenants([t for s in snaps for t in s.tenants]))


def _sum_tenants(views: list[TenantView]) -> tuple[TenantView, ...]:
    """One view per tenant name: its service summed over the replicas (weight: the first)."""
    by_name: dict[str, TenantView] = {}
    for view in views:
        seen = by_name.get(view.name)
        by_name[view.name] = view if seen is None else dataclasses.replace(
            seen, **{f: getattr(seen, f) + getattr(view, f) for f in TENANT_SUMMED})
    return tuple(by_name[name] for name in sorted(by_name))


def idle_snapshot(snap: EngineSnapshot) -> EngineSnapshot:
    """snap's configuration with its pool all free and every count zero."""
    kept = ("num_slots", "kv_blocks_total", "kv_blocks_free")
    zeros = {name: 0 for name in SUMMED_FIELDS if name not in kept}
    return dataclasses.replace(snap, **zeros, kv_blocks_free=snap.kv_blocks_total, slots=(),
                               block_map=None, finished_by_reason=(), tenants=())
