"""The engine's read side: snapshot(), subscribe(), the trace's cached tokens, the prefix
cache reset and cache_salt through AsyncEngine."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from slotserve.engine.async_engine import AsyncEngine
from slotserve.engine.events import EngineSnapshot, IterationEvent, build_block_map
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine
from tests.unit.server_fixtures import started

BLOCK = 4
SHARED = list(range(10, 22))  # three full blocks of BLOCK tokens
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama):
    return tiny_engine(tiny_llama, num_blocks=32, max_num_seqs=4, block_size=BLOCK)


def drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()


def used_blocks(snap: EngineSnapshot) -> set[int]:
    return {b for first, count, _ in snap.block_map.runs for b in range(first, first + count)}


def test_snapshot_is_frozen_and_counts_the_engine(engine):
    snap = engine.snapshot()
    assert (snap.num_slots, snap.kv_blocks_total, snap.block_size) == (4, 32, BLOCK)
    assert snap.num_running == snap.num_waiting == 0 and snap.block_map is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.num_running = 3
    engine.add_request("a", SHARED + [30], SamplingParams(max_tokens=8))
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=8))
    assert engine.snapshot().num_waiting == 2
    engine.step()
    snap = engine.snapshot(include_blocks=True)
    assert snap.num_running == 2 and snap.iteration == 1 and snap.iterations == 1
    assert [(s.slot, s.request_id) for s in snap.slots] == [(0, "a"), (1, "b")]
    assert snap.slots[0].num_computed_tokens == 13 and snap.slots[0].num_output_tokens == 1
    assert snap.kv_blocks_used == 4 + 1 == len(used_blocks(snap))
    assert snap.block_map.owners == ("a", "b") and snap.block_map.shared == ()
    assert snap.prompt_tokens == 16 and snap.generation_tokens == 2


def test_block_map_shows_shared_and_cached_free_blocks(engine):
    engine.add_request("first", SHARED + [30], GREEDY)
    drain(engine)
    idle = engine.snapshot(include_blocks=True)
    assert idle.kv_blocks_cached_free == 3 and idle.kv_blocks_free == 32
    assert sum(c for _, c in idle.block_map.cached_free) == 3 and idle.block_map.runs == ()
    # Two requests behind the same prefix share its three cached blocks.
    engine.add_request("x", SHARED + [31], SamplingParams(max_tokens=8))
    engine.add_request("y", SHARED + [32], SamplingParams(max_tokens=8))
    engine.step()
    snap = engine.snapshot(include_blocks=True)
    shared = {b for first, count in snap.block_map.shared for b in range(first, first + count)}
    assert snap.kv_blocks_shared == len(shared) == 3
    assert shared <= used_blocks(snap)
    assert snap.kv_blocks_cached_free == 0 and snap.prefix_cache_hits == 24
    assert snap.prefix_cache_hit_rate == pytest.approx(24 / (13 * 3))
    assert [s.num_cached_tokens for s in snap.slots] == [12, 12]


def test_build_block_map_runs_and_bound():
    bm = build_block_map({"a": [0, 1, 2, 7], "b": [4, 3, 0], "c": []}, cached_free=[9, 10])
    assert bm.owners == ("a", "b")
    assert bm.runs == ((0, 3, 0), (7, 1, 0), (0, 1, 1), (3, 2, 1))
    assert bm.shared == ((0, 1),) and bm.cached_free == ((9, 2),)
    assert bm.to_json()["runs"] == [[0, 3, 0], [7, 1, 0], [0, 1, 1], [3, 2, 1]]
    big = build_block_map({"a": list(range(0, 100, 2))}, [], max_runs=10)
    assert big.truncated and big.to_json()["runs"] is None


def test_subscribers_get_one_event_per_iteration(engine):
    events: list[IterationEvent] = []
    engine.subscribe(events.append)
    engine.add_request("first", SHARED + [30], GREEDY)
    drain(engine)
    engine.add_request("again", SHARED + [31], GREEDY)
    drain(engine)
    assert [e.index for e in events] == list(range(len(events)))
    finished = [f for e in events for f in e.finished]
    assert [(f.request_id, f.finish_reason, f.num_cached_tokens) for f in finished] == [
        ("first", "length", 0), ("again", "length", 12)]
    assert all(f.metrics is not None and f.metrics.ttft is not None for f in finished)
    assert events[-1].observed() == events[-1].finished
    engine.unsubscribe(events.append)
    before = len(events)
    engine.add_request("late", [5, 6], GREEDY)
    drain(engine)
    assert len(events) == before


def test_an_abort_is_in_the_next_event_but_not_observed(engine):
    events: list[IterationEvent] = []
    engine.subscribe(events.append)
    engine.add_request("gone", [5, 6, 7], SamplingParams(max_tokens=50))
    engine.add_request("stays", [8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.abort_request("gone")
    drain(engine)
    finished = {f.request_id: f.finish_reason for e in events for f in e.finished}
    assert finished == {"gone": "abort", "stays": "length"}
    assert {f.request_id for e in events for f in e.observed()} == {"stays"}


def test_trace_records_the_prefill_the_cache_skipped(engine):
    engine.add_request("first", SHARED + [30], GREEDY)
    drain(engine)
    engine.add_request("again", SHARED + [31], GREEDY)
    drain(engine)
    requests = {r["id"]: r for r in engine.export_trace()["requests"]}
    assert requests["first"]["cached_tokens"] == 0
    assert requests["again"]["cached_tokens"] == 12


def test_reset_prefix_cache_drops_the_cached_free_blocks(engine):
    engine.add_request("first", SHARED + [30], GREEDY)
    drain(engine)
    assert engine.snapshot().kv_blocks_cached_free == 3
    assert engine.reset_prefix_cache() == 3
    engine.check_integrity()
    snap = engine.snapshot()
    assert snap.kv_blocks_cached_free == snap.kv_blocks_cached == 0
    engine.add_request("again", SHARED + [31], GREEDY)
    drain(engine)
    assert engine.snapshot().prefix_cache_hits == 0
    assert engine.reset_prefix_cache() == 3  # "again" cached its own blocks


def test_snapshots_from_another_thread_are_whole(engine):
    """Snapshots taken while the engine steps are consistent: the blocks the tables hold are
    the used blocks, and cached free blocks are none of them."""
    stop, problems, seen = threading.Event(), [], []

    def watch() -> None:
        while not stop.is_set():
            snap = engine.snapshot(include_blocks=True)
            seen.append(snap.num_running)
            used = used_blocks(snap)
            cached_free = {b for first, count in snap.block_map.cached_free
                           for b in range(first, first + count)}
            if len(used) != snap.kv_blocks_used or used & cached_free:
                problems.append(snap)
            if len(cached_free) != snap.kv_blocks_cached_free:
                problems.append(snap)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(12):
            engine.add_request(f"r{i}", SHARED[: 4 + i % 8] + [40 + i],
                               SamplingParams(max_tokens=4 + i % 3, ignore_eos=True))
            if i % 3 == 2:
                engine.step()
        drain(engine)
    finally:
        stop.set()
        watcher.join()
    assert not problems and seen


# --------------------------------------------------------------------------- AsyncEngine
async def generate(served: AsyncEngine, request_id: str, prompt, salt=None):
    final = None
    async for out in served.generate(request_id, prompt, GREEDY, cache_salt=salt):
        final = out
    return final


@pytest.fixture
def served(engine):
    with started(AsyncEngine(engine)) as served:
        yield served


def test_cache_salt_keeps_prefixes_apart(served):
    async def scenario() -> list[int]:
        hits = []
        for request_id, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1"),
                                 ("d", None)):
            await asyncio.wait_for(generate(served, request_id, SHARED + [30], salt), 30)
            hits.append(served.snapshot().prefix_cache_hits)
        return hits

    hits = asyncio.run(scenario())
    assert hits == [0, 0, 12, 12]  # only the same salt hits; no salt is its own namespace


def test_a_bad_cache_salt_is_a_value_error(served):
    with pytest.raises(ValueError, match="cache_salt"):
        asyncio.run(generate(served, "bad", [5, 6], salt=""))


def test_reset_through_the_async_engine(served):
    async def scenario() -> int:
        await asyncio.wait_for(generate(served, "a", SHARED + [30]), 30)
        return await asyncio.wait_for(served.reset_prefix_cache(), 30)

    assert asyncio.run(scenario()) == 3
    assert served.snapshot().kv_blocks_cached_free == 0


def test_reset_needs_a_running_engine(engine):
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(AsyncEngine(engine).reset_prefix_cache())


def test_the_start_up_line_reads_the_snapshot(tiny_llama, caplog):
    """`slotserve serve`'s start-up lines come from the snapshot alone: the same figures the
    engine's parts give."""
    import logging

    from slotserve.runner.model_runner import kv_block_bytes
    from slotserve.server.startup import log_startup

    engine = tiny_engine(tiny_llama, scheduling_policy="fair", slo_ttft_ms=500.0,
                         tenant_weights=(("a", 2.0),))
    snap = engine.snapshot()
    block_bytes = kv_block_bytes(engine.model_config, engine.kv.block_size, engine.runner.dtype)
    assert snap.kv_block_bytes == block_bytes > 0
    assert snap.kv_pool_bytes == engine.kv.num_blocks * block_bytes
    assert snap.kernels == engine.runner.kernels.describe() and snap.kernels
    assert snap.dtype == str(engine.runner.dtype).removeprefix("torch.")
    assert (snap.device, snap.num_parameters) == (engine.config.device,
                                                  engine.model_config.num_parameters)
    assert (snap.slo_ttft_ms, snap.slo_tpot_ms, snap.slo_reject) == (500.0, None, False)
    with caplog.at_level(logging.INFO, logger="slotserve.server"):
        log_startup(snap, "tiny", "http://127.0.0.1:8000/v1")
    text = caplog.text
    assert f"on {snap.device} ({snap.dtype}), {snap.kernels}" in text
    assert (f"KV pool: {snap.kv_blocks_total} blocks x {snap.block_size} tokens = "
            f"{snap.kv_blocks_total * snap.block_size} tokens") in text
    assert "scheduling policy fair; SLOs: TTFT 500.0 ms, TPOT None ms; 1 tenants weighted" in text
    assert "serving tiny at http://127.0.0.1:8000/v1" in text


def test_shutdown_writes_the_exported_trace(tiny_llama, tmp_path):
    import json

    from slotserve.server.startup import shutdown

    engine = tiny_engine(tiny_llama)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    path = tmp_path / "trace.json"
    shutdown(async_engine, str(path))
    assert json.loads(path.read_text()) == engine.export_trace()
    assert engine.export_trace()["iterations"]
