"""Overload: a server with one slot and a waiting bound of 2 answers the excess with 429.

Its own server (the main one is stopped by then: one server at a time), which is also
shut down here to check the graceful exit and the --trace file.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, cli_flags, running_server

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("overload")
    flags = cli_flags(max_num_seqs=1, max_waiting=2, num_blocks=64, max_model_len=256)
    with running_server(folder, *flags, f"--trace={folder / 'trace.json'}") as proc:
        yield proc


def test_excess_requests_get_429_and_admitted_ones_complete(small_server):
    async def one(client, i: int):
        return await client.completions.create(
            model=MODEL_NAME, prompt=f"Story number {i}:", max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"ignore_eos": True})

    async def burst():
        async with small_server.async_client(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(10)),
                                        return_exceptions=True)

    results = asyncio.run(burst())
    rejected = [r for r in results if isinstance(r, openai.RateLimitError)]
    admitted = [r for r in results if not isinstance(r, Exception)]
    assert len(rejected) + len(admitted) == len(results), results
    assert rejected and len(admitted) >= 2
    for exc in rejected:
        assert exc.status_code == 429
        assert int(exc.response.headers["retry-after"]) >= 1
        error = exc.response.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    for out in admitted:
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == MAX_TOKENS


def test_serves_normally_after_the_burst(small_server):
    out = small_server.client().completions.create(model=MODEL_NAME, prompt="Hello",
                                                   max_tokens=2)
    assert out.usage.completion_tokens >= 1
    m = small_server.metrics()
    assert m["slotserve:kv_blocks_free"] == m["slotserve:kv_blocks_total"] == 64


def test_graceful_shutdown_writes_the_trace(small_server):
    small_server.stop()
    assert small_server.proc.returncode == 0, small_server.log()[-2000:]
    trace_path = small_server.log_path.parent / "trace.json"
    trace = json.loads(trace_path.read_text())
    assert trace["num_slots"] == 1 and trace["iterations"]
    assert "trace written to" in small_server.log()
