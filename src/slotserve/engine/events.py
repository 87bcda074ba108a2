"""What the engine publishes to the layers above it (obs/, server/): plain frozen data.

- `EngineSnapshot` (`LLMEngine.snapshot()`): counts, slots, block usage, prefix-cache
  counters, config and (on request) the block map, all read at one moment;
- `IterationEvent` (`LLMEngine.subscribe(callback)`): after every iteration, its trace
  record and the completions that finished.

NOTE: this module imports nothing from the engine's internals (core/, runner/, model/):
obs/ and server/ may import it (and engine/outputs.py) and nothing else of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.engine.outputs import RequestMetrics
from slotserve.request import RequestStatus

# Finish reasons whose latencies are observed (aborted / failed ones would skew them).
OBSERVED_REASONS = ("stop", "length")
# Every finish reason a completion can have ("stop", "length", "abort", "error", "rejected").
FINISH_REASONS = tuple(status.value for status in RequestStatus if status.finished)


@dataclass(frozen=True)
class SlotView:
    """The request running in one slot."""

    slot: int
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens its first prefill found in the prefix cache


@dataclass(frozen=True)
class TenantView:
    """One tenant's service so far (the scheduling policy's counters, core/queue_policy.py)."""

    name: str
    weight: float
    virtual_counter: float  # VTC's weighted cost of the service it got (`fair` orders by it)
    prompt_tokens: int  # prompt tokens processed (prefix-cache hits are not)
    output_tokens: int  # tokens generated
    active: int  # its requests in the scheduler (waiting or running)


@dataclass(frozen=True)
class BlockMap:
    """Where the KV blocks are, as runs of consecutive block ids.

    owners: request ids; runs: (first block, count, owner index) of the blocks each holds
    (a shared block appears in each holder's runs); shared: (first, count) of blocks held
    by more than one request; cached_free: (first, count) of free blocks that still hold
    cached K/V (hittable until evicted). Free blocks in no run are plain free blocks.
    truncated: the map had more than its bound of runs; then every tuple is empty.
    """

    owners: tuple[str, ...] = ()
    runs: tuple[tuple[int, int, int], ...] = ()
    shared: tuple[tuple[int, int], ...] = ()
    cached_free: tuple[tuple[int, int], ...] = ()
    truncated: bool = False

    def to_json(self) -> dict:
        """The live view's format: lists, and runs None when truncated."""
        if self.truncated:
            return {"owners": [], "runs": None, "shared": None, "cached_free": None}
        return {"owners": list(self.owners), "runs": [list(r) for r in self.runs],
                "shared": [list(r) for r in self.shared],
                "cached_free": [list(r) for r in self.cached_free]}


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine at one moment (between two mutations, never halfway through one)."""

    # config
    model: str
    policy: str
    num_slots: int
    max_num_batched_tokens: int
    max_model_len: int
    max_total_tokens: int  # longest sequence: the model length or the whole pool
    block_size: int
    kv_blocks_total: int
    enable_prefix_caching: bool
    # counts
    iteration: int  # iterations planned so far
    num_running: int
    num_waiting: int
    num_preemptions: int
    slots: tuple[SlotView, ...]  # the running requests, by slot
    # KV blocks
    kv_blocks_free: int  # plain free + cached free (the cached ones are evicted on demand)
    kv_blocks_cached: int  # blocks registered in the prefix cache (held or free)
    kv_blocks_cached_free: int
    kv_blocks_shared: int  # held by more than one request
    prefix_cache_queries: int  # tokens looked up (a request's length at each admission)
    prefix_cache_hits: int  # of those, tokens found cached
    prefix_cache_evictions: int
    # totals
    iterations: int  # iterations run
    prompt_tokens: int
    generation_tokens: int
    busy_seconds: float
    finished_by_reason: tuple[tuple[str, int], ...]
    block_map: BlockMap | None = None  # only when asked for (it costs a pass over the tables)
    # scheduling policy (--scheduling-policy) and the tenants it has seen, by name
    scheduling_policy: str = "fcfs"
    tenants: tuple[TenantView, ...] = ()
    configured_tenants: tuple[str, ...] = ()  # named in SchedulerConfig.tenant_weights
    slo_ttft_ms: float | None = None  # the scheduler's SLO targets (None: none)
    slo_tpot_ms: float | None = None
    slo_reject: bool = False  # requests whose SLO is unattainable are rejected
    # the model and where it runs (the start-up line)
    num_parameters: int = 0
    device: str = ""
    dtype: str = ""  # the activations' ("float32", "bfloat16", ...)
    kernels: str = ""  # the KernelSet's describe()
    kv_cache_dtype: str = ""  # the KV cache's elements ("float32", "bfloat16", "int8")
    kv_block_bytes: int = 0  # one block's K and V over every layer

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_blocks_total * self.kv_block_bytes

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def kv_usage(self) -> float:
        """Fraction of blocks in use (cached free blocks count as free)."""
        return self.kv_blocks_used / self.kv_blocks_total

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries in tokens since start; 0.0 before any query."""
        return (self.prefix_cache_hits / self.prefix_cache_queries
                if self.prefix_cache_queries else 0.0)


@dataclass(frozen=True)
class FinishedCompletion:
    """A completion that finished in an iteration."""

    request_id: str  # the completion's own id (`<request>#<index>` when n > 1)
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics | None
    tenant: str = "default"
    # Goodput: finished normally (stop / length) within both SLOs (`Request.met_slo`).
    met_slo: bool = False


@dataclass(frozen=True)
class IterationEvent:
    """One iteration: its trace record (format in `slotserve.lab.simulate`) and the
    completions that finished since the previous event (with this iteration, or aborted or
    failed between two iterations: see finish_reason).

    NOTE: every subscriber gets the same record dict (the trace keeps it too): read it,
    never change it.
    """

    record: dict
    finished: tuple[FinishedCompletion, ...]

    @property
    def index(self) -> int:
        return self.record["index"]

    def observed(self) -> tuple[FinishedCompletion, ...]:
        """The finished completions whose latencies count (OBSERVED_REASONS)."""
        return tuple(f for f in self.finished if f.finish_reason in OBSERVED_REASONS)


def build_block_map(tables: dict[str, list[int]], cached_free: list[int],
                    max_runs: int = 20_000) -> BlockMap:
    """The BlockMap of these block tables (request id -> block ids) and cached free blocks.

    Truncated (empty) when it would hold more than max_runs runs (the page then shows
    counts only).
    """
    owners: list[str] = []
    runs: list[tuple[int, int, int]] = []
    holders: dict[int, int] = {}
    for request_id, table in tables.items():
        if not table:
            continue
        owner = len(owners)
        owners.append(request_id)
        runs.extend((first, count, owner) for first, count in block_runs(sorted(table)))
        for block in table:
            holders[block] = holders.get(block, 0) + 1
        if len(runs) > max_runs:
            return BlockMap(truncated=True)
    shared = block_runs(sorted(b for b, n in holders.items() if n > 1))
    free = block_runs(sorted(cached_free))
    if len(runs) + len(shared) + len(free) > max_runs:
        return BlockMap(truncated=True)
    return BlockMap(tuple(owners), tuple(runs), tuple(shared), tuple(free))


def block_runs(blocks: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted block ids as (first, count) runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for block in blocks:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return tuple(runs)
