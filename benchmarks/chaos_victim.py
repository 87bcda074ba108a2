"""The chaos benchmark's victim: distinct greedy streams, each checked whole, with its TPOT
(benchmarks/chaos.py)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.chaos_kit import REQUEST_TIMEOUT_S, VICTIM_KEY
from benchmarks.soak import MODEL, WORDS


@dataclass
class VictimResult:
    """One victim stream: its text, token count, chunk times, and what went wrong."""

    index: int
    request_id: str
    text: str = ""
    tokens: int = 0
    tpot_s: float | None = None
    errors: list[str] = field(default_factory=list)


def victim_bodies(count: int, max_tokens: int) -> list[dict]:
    """`count` distinct greedy prompts (12-30 words), each `max_tokens` tokens."""
    bodies = []
    for i in range(count):
        words = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12 + (i * 5) % 19))
        bodies.append({"model": MODEL, "prompt": f"Story {i}: {words}", "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    return bodies


async def run_victim(url: str, bodies: list[dict], tag: str) -> list[VictimResult]:
    """Every body at once, streaming; TPOT = (last token chunk - first) / (tokens - 1)."""
    headers = {"Authorization": f"Bearer {VICTIM_KEY}"}
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, headers=headers,
                                 limits=limits) as client:
        return await asyncio.gather(*(victim_stream(client, i, body, f"victim-{tag}-{i}")
                                      for i, body in enumerate(bodies)))


async def victim_stream(client: httpx.AsyncClient, index: int, body: dict,
                        request_id: str) -> VictimResult:
    result = VictimResult(index, request_id)
    times, done, finish = [], False, None
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"X-Request-Id": request_id}) as r:
            if r.status_code != 200:
                result.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                return result
            if r.headers.get("x-request-id") != request_id:
                result.errors.append(f"X-Request-Id echoed {r.headers.get('x-request-id')!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    result.errors.append(f"error event: {event['error']}")
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        result.text += choice["text"]
                        times.append(time.monotonic())
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        result.errors.append(f"{type(exc).__name__}: {exc}")
        return result
    if not done:
        result.errors.append("no [DONE]")
    if finish != "length" or result.tokens != body["max_tokens"]:
        result.errors.append(f"finish {finish!r} after {result.tokens} tokens")
    if len(times) >= 2 and result.tokens >= 2:
        result.tpot_s = (times[-1] - times[0]) / (result.tokens - 1)
    return result
