"""AsyncEngine's first iteration after idle waits for the requests the server is preparing
(`incoming`), so a burst runs as one; a request arriving alone does not wait."""

from __future__ import annotations

import asyncio
import time

import pytest

from slotserve.engine import async_engine as ae
from slotserve.engine.async_engine import AsyncEngine
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine
from tests.unit.server_fixtures import app_client, started

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


async def run_to_end(engine: AsyncEngine, request_id: str, prompt: list[int]) -> None:
    async for _ in engine.generate(request_id, prompt, PARAMS):
        pass


def first_iterations(engine: AsyncEngine) -> dict[str, int]:
    """Each request's first scheduled iteration, from the engine's trace."""
    return {r["id"]: r["first_iteration"] for r in engine.export_trace()["requests"]}


def test_a_request_prepared_while_another_arrives_joins_its_first_iteration(tiny_llama,
                                                                          monkeypatch):
    """B is announced (incoming) before A arrives and added 0.2 s later: the engine, idle
    until A, waits for it, so both prompts start in the same iteration (without the wait,
    A ran alone for several iterations before B came)."""
    monkeypatch.setattr(ae, "BURST_MAX_S", 5.0)  # the wait's bound: the next test
    with started(AsyncEngine(tiny_engine(tiny_llama, num_blocks=64, max_num_seqs=4))) as engine:
        async def scenario():
            with engine.incoming():
                first = asyncio.ensure_future(run_to_end(engine, "a", [5, 6, 7, 8]))
                await asyncio.sleep(0.2)
            await asyncio.gather(first, run_to_end(engine, "b", [9, 10, 11]))

        asyncio.run(scenario())
        firsts = first_iterations(engine)
    assert firsts["a"] == firsts["b"]


def test_a_lone_request_does_not_wait(tiny_llama, monkeypatch):
    """Nothing incoming, nothing else queued: the settling returns at once (the quiet wait
    is made long here, so a wait would show)."""
    monkeypatch.setattr(ae, "BURST_QUIET_S", 2.0)
    monkeypatch.setattr(ae, "BURST_POLL_S", 2.0)
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16))  # its thread not started
    start = time.monotonic()
    engine._settle_arrivals()
    assert time.monotonic() - start < 1.0


def test_the_wait_is_bounded_when_an_announced_request_never_comes(tiny_llama, monkeypatch):
    monkeypatch.setattr(ae, "BURST_MAX_S", 0.3)
    with started(AsyncEngine(tiny_engine(tiny_llama, num_blocks=64, max_num_seqs=4))) as engine:
        async def scenario():
            with engine.incoming():  # a request announced and never added
                start = time.monotonic()
                await asyncio.wait_for(run_to_end(engine, "a", [5, 6, 7]), timeout=30)
                return time.monotonic() - start

        elapsed = asyncio.run(scenario())
    assert 0.25 <= elapsed < 30


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "not-the-model", "prompt": [5, 6, 7]}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi"}),  # no tokenizer: 400
    ("/v1/chat/completions", {"model": "not-the-model",
                              "messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_refused_request_is_no_longer_incoming(tiny_llama, path, body):
    """A request the server refuses while preparing it (4xx) leaves the count: a leak would
    make every later burst's first iteration wait BURST_MAX_S."""
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=64, max_num_seqs=4))
    with app_client(engine) as client:
        answer = client.post(path, json=body)
        assert 400 <= answer.status_code < 500, answer.text
        assert engine._incoming == 0
        ok = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7],
                                                  "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert engine._incoming == 0
