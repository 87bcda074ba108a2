"""AsyncEngine.launch: the engine is built in the engine thread (the only thread that runs
torch's parallel ops: see launch's NOTE), which then serves requests."""

from __future__ import annotations

import asyncio
import threading

import pytest

from slotserve.engine.async_engine import AsyncEngine
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine


async def generate_all(engine: AsyncEngine, request_id: str) -> list[int]:
    tokens: list[int] = []
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    async for out in engine.generate(request_id, [5, 6, 7], params):
        tokens = list(out.outputs[0].token_ids)
    return tokens


def test_launch_builds_the_engine_in_the_thread_that_runs_it(tiny_llama):
    builders: list[int] = []
    steppers: set[int] = set()

    def build():
        builders.append(threading.get_ident())
        engine = tiny_engine(tiny_llama, num_blocks=16)
        step = engine.step
        engine.step = lambda: steppers.add(threading.get_ident()) or step()
        return engine

    async_engine = AsyncEngine.launch(build)
    try:
        async_engine.start()  # NOTE: a no-op after launch (a thread starts only once)
        assert len(asyncio.run(generate_all(async_engine, "r"))) == 4
        assert builders == [async_engine._thread.ident] != [threading.get_ident()]
        assert steppers == {async_engine._thread.ident}
    finally:
        async_engine.stop()
    assert not async_engine._thread.is_alive()


def test_launch_raises_what_building_raised():
    def build():
        raise ValueError("max_num_seqs must be >= 1")

    with pytest.raises(ValueError, match="max_num_seqs"):
        AsyncEngine.launch(build)


def test_launch_passes_the_waiting_bound_on(tiny_llama):
    async_engine = AsyncEngine.launch(lambda: tiny_engine(tiny_llama, num_blocks=16),
                                      max_waiting=3)
    try:
        assert async_engine.max_waiting == 3
        assert async_engine.healthy
    finally:
        async_engine.stop()
