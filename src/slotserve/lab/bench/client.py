"""The HTTP client of `OpenAITarget`: one streaming request, timed chunk by chunk.

NOTE: aiohttp (its HTTP parser is C) on uvloop where installed, as vLLM's benchmark client:
the client shares the machine with the server it measures, and every token it parses takes
CPU from the server's compute threads. On the 2-core machine of benchmarks/PERF.md it used
0.26-0.30 ms of CPU per streamed token where httpx used 0.57-0.65, and the batch-1 TPOT it
measured was 3% lower (8 rounds each, alternated, one server).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import aclosing
from typing import Any

from slotserve.lab.bench.stats import RequestRecord
from slotserve.lab.workload import BenchRequest


def run_client(main: Coroutine) -> Any:
    """Run the client's coroutine to its end on a fresh event loop (uvloop's if installed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def open_session(base: str, headers: dict, timeout: float):
    """An aiohttp session on the server root `base`.

    NOTE: no connection limit: a pool cap would queue requests on our side and inflate
    TTFT with the client's wait instead of the server's. `timeout` bounds connecting and
    each wait for data (as httpx's timeout did), not a whole stream.
    """
    import aiohttp

    return aiohttp.ClientSession(
        base_url=base + "/", headers=headers, connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout))


async def first_model(session) -> str:
    """The first model the server lists, or "default" if it lists none."""
    try:
        async with session.get("v1/models") as response:
            data = (await response.json()).get("data") or []
        return data[0]["id"] if data else "default"
    except Exception:
        return "default"


async def stream_request(session, path: str, payload: dict,
                         request: BenchRequest) -> RequestRecord:
    """Send one streaming request; time each chunk that carries text.

    A server may stream no text at all (a model without a tokenizer): then every chunk with
    a choice counts, so TTFT is when the first one came.
    """
    times = _ChunkTimes()
    start = time.perf_counter()
    async with session.post(path.lstrip("/"), json=payload) as response:
        if response.status != 200:
            body = (await response.read()).decode(errors="replace")[:200]
            return RequestRecord(request.id, ok=False, error=f"HTTP {response.status}: {body}")
        async with aclosing(sse_json(response)) as chunks:  # NOTE: closed on an early return
            async for chunk in chunks:
                if chunk.get("error"):
                    return RequestRecord(request.id, ok=False, error=str(chunk["error"])[:200])
                times.add(chunk, time.perf_counter())
    record = _client_record(request, start, time.perf_counter(), times.token_times(), times.usage)
    record.text = "".join(times.answer)
    return record


async def sse_json(response) -> AsyncIterator[dict]:
    """The JSON of each server-sent-events `data:` line of an aiohttp streaming response.

    Other lines (blank separators, `event:`, comments) and `data: [DONE]` are skipped.
    NOTE: every event of an OpenAI-style stream is one `data:` line of JSON, so a line
    reader is the whole parser here. Lines are split here, not by aiohttp's readline, which
    refuses lines over its buffer's limit (a chunk with many logprobs can be longer).
    """
    pending = b""
    async for data in response.content.iter_any():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            chunk = _sse_data(line)
            if chunk is not None:
                yield chunk
    chunk = _sse_data(pending)
    if chunk is not None:
        yield chunk


def _sse_data(line: bytes) -> dict | None:
    """The JSON of one server-sent-events `data:` line; None for others and [DONE]."""
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    return None if data in (b"", b"[DONE]") else json.loads(data)


class _ChunkTimes:
    """Arrival times of a stream's chunks: those with a choice, those with text; its usage."""

    def __init__(self) -> None:
        self.text: list[float] = []
        self.choices: list[float] = []
        self.usage: dict = {}
        self.answer: list[str] = []

    def add(self, chunk: dict, now: float) -> None:
        if chunk.get("choices"):
            self.choices.append(now)
        text = _chunk_text(chunk)
        if text:
            self.text.append(now)
            self.answer.append(text)
        self.usage = chunk.get("usage") or self.usage

    def token_times(self) -> list[float]:
        """Text chunk times, or every choice's when no chunk carried text."""
        return self.text or self.choices


def _chunk_text(chunk: dict) -> str:
    """The text a completions or chat chunk carries ("" for role-only or usage chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _client_record(request: BenchRequest, start: float, end: float, times: list[float],
                   usage: dict) -> RequestRecord:
    """Latencies from chunk times; token counts from usage when the server sent it.

    TPOT = (end of stream - first token) / (output tokens - 1), as vLLM's benchmark.
    """
    output_tokens = usage.get("completion_tokens") or len(times)
    prompt_tokens = usage.get("prompt_tokens") or (
        len(request.prompt) if isinstance(request.prompt, list) else 0)
    if not times:
        return RequestRecord(request.id, ok=False, prompt_tokens=prompt_tokens,
                             error="the stream carried no choices")
    ttft, e2e = times[0] - start, end - start
    tpot = (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    itls = [b - a for a, b in zip(times, times[1:])]
    return RequestRecord(request.id, True, prompt_tokens, output_tokens, ttft, tpot, e2e, itls)
