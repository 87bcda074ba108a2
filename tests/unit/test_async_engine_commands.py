"""AsyncEngine's commands to its engine thread are small frozen dataclasses (AddRequest,
AbortRequest, CallInEngine) applied with one `match` (issue 33), not tuples whose slots mean
different things per kind."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import time

import pytest

from slotserve.core.scheduling_fields import SchedulingFields
from slotserve.engine.async_engine import (
    AbortRequest,
    AddRequest,
    AsyncEngine,
    CallInEngine,
)
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def queued(engine: AsyncEngine) -> list:
    """Take every command queued (the engine thread is not running)."""
    commands = []
    while True:
        try:
            commands.append(engine._commands.get_nowait())
        except queue.Empty:
            return commands


def test_a_request_and_its_abort_are_typed_commands(tiny_llama):
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16))

    async def leave_before_the_first_output() -> None:
        outputs = engine.generate("r1", [5, 6, 7], PARAMS, cache_salt="salt", priority=2,
                                  tenant="acme", slo_ttft_ms=500.0)
        first = asyncio.ensure_future(anext(outputs))
        await asyncio.sleep(0.01)  # no engine thread: it stays queued
        first.cancel()  # the consumer leaves: the stream aborts its request
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(leave_before_the_first_output())
    add, abort = queued(engine)
    assert isinstance(add, AddRequest) and abort == AbortRequest("r1")
    assert (add.request_id, add.prompt_text, add.prompt_ids, add.matchers) == (
        "r1", None, [5, 6, 7], None)
    assert add.params is PARAMS
    assert add.scheduling == SchedulingFields(priority=2, tenant="acme", slo_ttft_ms=500.0,
                                              cache_salt="salt")
    with pytest.raises(dataclasses.FrozenInstanceError):
        add.request_id = "other"  # type: ignore[misc]
    assert (str(add), str(abort)) == ("add r1", "abort r1")


def test_the_engine_thread_applies_each_command_and_survives_a_foreign_one(tiny_llama):
    """A request runs, a prefix-cache reset is a CallInEngine whose result comes back, and
    something that is no command costs nothing but a log line."""
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16))
    engine.start()
    try:
        engine._commands.put(("add", "r0", None, None))  # the old tuple form: refused
        engine._wakeup.set()

        async def run() -> tuple[list[int], int]:
            tokens = [out.token_ids async for out in engine.generate("r1", [5, 6, 7], PARAMS)]
            freed = await asyncio.wait_for(engine.reset_prefix_cache(), 30)
            return tokens[-1], freed

        tokens, freed = asyncio.run(run())
        assert len(tokens) == 3 and isinstance(freed, int)
        assert engine.healthy and not engine.engine.has_request("r0")
    finally:
        engine.stop()


def test_a_call_settles_its_future_with_the_functions_exception():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def boom() -> None:
            raise LookupError("nothing to reset")

        with pytest.raises(LookupError):
            AsyncEngine._call(CallInEngine(boom, done, loop))
        with pytest.raises(LookupError, match="nothing to reset"):
            await asyncio.wait_for(done, 5)

    asyncio.run(scenario())


def test_a_request_arrives_when_the_server_takes_it_not_when_the_engine_applies_it(tiny_llama):
    """A request queued through a long iteration has waited since the server took it: its
    arrival (TTFT's start in the trace and the metrics) is stamped then, as vLLM's."""
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16))
    before = time.monotonic()

    async def queue_then_apply_later() -> tuple[float, float]:
        outputs = engine.generate("r1", [5, 6, 7], PARAMS)
        first = asyncio.ensure_future(anext(outputs))
        await asyncio.sleep(0.01)  # no engine thread: it stays queued
        (add,) = queued(engine)
        time.sleep(0.05)  # the engine's thread is busy with an iteration meanwhile
        applied = time.monotonic()
        engine._add(add)  # what the engine's thread does next
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        return add.arrival, applied

    arrival, applied = asyncio.run(queue_then_apply_later())
    assert before <= arrival <= applied - 0.05
    assert engine.engine._sequences["r1"].request.times.arrival == arrival
