"""AsyncEngine's waiting bound: one source of truth, the engine's SchedulerConfig; it counts
sequences (n per request)."""

from __future__ import annotations

import asyncio
import time

import pytest

from slotserve.engine.async_engine import AsyncEngine, QueueFullError
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine


async def first_output(engine: AsyncEngine):
    async for output in engine.generate("r", [5, 6, 7], SamplingParams(max_tokens=1)):
        return output


def test_the_waiting_bound_comes_from_the_scheduler_config(tiny_llama):
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16, max_waiting=0))
    assert engine.max_waiting == 0
    with pytest.raises(QueueFullError):  # refused before the (unstarted) engine thread
        asyncio.run(first_output(engine))


def test_an_explicit_bound_is_the_async_engines_own(tiny_llama):
    """The bound is AsyncEngine's field: the scheduler's config (which it never reads for
    the bound) is left alone."""
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16), max_waiting=2)
    assert engine.max_waiting == 2
    assert engine.engine.scheduler_config.max_waiting is None
    engine.max_waiting = None
    assert engine.max_waiting is None


async def admit(engine: AsyncEngine, request_id: str, n: int) -> None:
    """Open a stream on an engine whose thread is not running: it stays queued (returns)
    or is refused (raises)."""
    outputs = engine.generate(request_id, [5, 6, 7], SamplingParams(n=n, max_tokens=1))
    first = asyncio.ensure_future(anext(outputs))
    await asyncio.sleep(0.01)
    if first.done():
        first.result()  # the refusal
        raise AssertionError("an output without an engine thread")
    first.cancel()  # the consumer leaves; its sequences stay queued as a command


def test_the_bound_counts_sequences_not_requests(tiny_llama):
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16, max_waiting=4))

    async def scenario():
        await admit(engine, "three", n=3)
        with pytest.raises(QueueFullError, match="waiting queue is full"):
            await admit(engine, "two", n=2)  # 3 + 2 > 4
        await admit(engine, "one", n=1)  # 3 + 1 == 4
        with pytest.raises(QueueFullError):
            await admit(engine, "another", n=1)

    asyncio.run(scenario())


def test_n_beyond_the_bound_can_never_be_admitted(tiny_llama):
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16, max_waiting=4))
    with pytest.raises(ValueError, match="n=5"):
        asyncio.run(admit(engine, "five", n=5))
    asyncio.run(admit(engine, "four", n=4))  # exactly the bound: queued


def test_waiting_completions_in_the_scheduler_count_too(tiny_llama):
    """Once the engine thread has moved a request's completions to the scheduler's waiting
    queue, each of them still counts."""
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16, max_num_seqs=1,
                                     max_waiting=3))
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def scenario():
        running = engine.generate("running", [5, 6, 7], long)
        await asyncio.wait_for(anext(running), 60)  # it holds the only slot
        waiting = engine.generate("waiting", [5, 6, 7], SamplingParams(n=3, max_tokens=1))
        first = asyncio.ensure_future(anext(waiting))
        deadline = time.monotonic() + 60
        while engine.engine.scheduler.num_waiting < 3:  # the engine thread saw it
            assert time.monotonic() < deadline and not first.done()
            await asyncio.sleep(0.01)
        with pytest.raises(QueueFullError, match="waiting queue is full"):
            await admit(engine, "refused", n=1)
        first.cancel()
        await running.aclose()

    engine.start()
    try:
        asyncio.run(scenario())
    finally:
        engine.stop()
