"""AsyncEngine's waiting bound: one source of truth, the engine's SchedulerConfig."""

from __future__ import annotations

import asyncio

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


def test_an_explicit_bound_is_written_to_the_config(tiny_llama):
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16), max_waiting=2)
    assert engine.engine.scheduler_config.max_waiting == engine.max_waiting == 2
    engine.max_waiting = None
    assert engine.engine.scheduler_config.max_waiting is None
