"""AsyncEngine.launch freezes the start-up heap for the garbage collector (freeze_heap's
NOTE: a collection of the oldest generation then scans only what serving allocated)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from slotserve.engine.async_engine import AsyncEngine, freeze_heap
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine


@pytest.fixture
def unfrozen():
    """Each test starts and ends with nothing frozen (the rest of the session unchanged)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class Node:
    """An object in a reference cycle (only a collection frees it)."""

    def __init__(self) -> None:
        self.me = self


def test_freeze_heap_collects_cycles_before_it_freezes(unfrozen):
    node = Node()
    gone = weakref.ref(node)
    del node
    freeze_heap()
    assert gc.get_freeze_count() > 0
    assert gone() is None  # collected, not frozen for good


def test_a_cycle_frozen_once_is_collected_by_the_next_freeze(unfrozen):
    """A benchmark building engine after engine: what one call froze and the process let
    go since is collected by the next call, not held for good."""
    node = Node()
    gone = weakref.ref(node)
    freeze_heap()
    del node
    gc.collect()
    assert gone() is not None  # frozen: out of the collector's sight
    freeze_heap()
    assert gone() is None
    assert gc.get_freeze_count() > 0


def test_launch_freezes_what_start_up_built_and_then_serves(tiny_llama, unfrozen):
    async_engine = AsyncEngine.launch(lambda: tiny_engine(tiny_llama, num_blocks=16))
    try:
        assert gc.get_freeze_count() > 0
        engine = async_engine.engine
        assert gc.is_tracked(engine)
        assert not any(o is engine for o in gc.get_objects())  # frozen: out of its sight

        async def tokens() -> list[int]:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            outputs = [out async for out in async_engine.generate("r", [5, 6, 7], params)]
            return list(outputs[-1].outputs[0].token_ids)

        assert len(asyncio.run(tokens())) == 4
        gc.collect()  # a full collection while serving harms nothing frozen
        assert async_engine.healthy
    finally:
        async_engine.stop()
