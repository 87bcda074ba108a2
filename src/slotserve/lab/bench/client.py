"""The HTTP client of `OpenAITarget`: one streaming request, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from slotserve.lab.bench.stats import RequestRecord
from slotserve.lab.workload import BenchRequest


async def first_model(client) -> str:
    """The first model the server lists, or "default" if it lists none."""
    try:
        response = await client.get("/v1/models")
        data = response.json().get("data") or []
        return data[0]["id"] if data else "default"
    except Exception:
        return "default"


async def stream_request(client, path: str, payload: dict,
                         request: BenchRequest) -> RequestRecord:
    """Send one streaming request; time each chunk that carries text.

    A server may stream no text at all (a model without a tokenizer): then every chunk with
    a choice counts, so TTFT is when the first one came.
    """
    times = _ChunkTimes()
    start = time.perf_counter()
    async with client.stream("POST", path, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")[:200]
            return RequestRecord(request.id, ok=False, error=f"HTTP {response.status_code}: {body}")
        async with aclosing(sse_json(response)) as chunks:  # NOTE: closed on an early return
            async for chunk in chunks:
                if chunk.get("error"):
                    return RequestRecord(request.id, ok=False, error=str(chunk["error"])[:200])
                times.add(chunk, time.perf_counter())
    record = _client_record(request, start, time.perf_counter(), times.token_times(), times.usage)
    record.text = "".join(times.answer)
    return record


async def sse_json(response) -> AsyncIterator[dict]:
    """The JSON of each server-sent-events `data:` line of an httpx streaming response.

    Other lines (blank separators, `event:`, comments) and `data: [DONE]` are skipped.
    NOTE: every event of an OpenAI-style stream is one `data:` line of JSON, so a line
    reader is the whole parser here.
    """
    async for line in response.aiter_lines():
        chunk = _sse_data(line)
        if chunk is not None:
            yield chunk


def _sse_data(line: str) -> dict | None:
    """The JSON of one server-sent-events `data:` line; None for others and [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return None if data in ("", "[DONE]") else json.loads(data)


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
