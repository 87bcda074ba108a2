"""The chaos benchmark's attacks as a hostile client: headers, keys, raw bytes, streams left
mid-way and slow-loris uploads (benchmarks/chaos.py)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from benchmarks.chaos_kit import (
    AUTH,
    REQUEST_TIMEOUT_S,
    VICTIM_KEY,
    Context,
    Outcome,
    error_note,
    post,
    small,
)
from slotserve.lab.bench.server import HOST


async def foreign_host(ctx: Context) -> Outcome:
    """A Host header naming another site (DNS rebinding from a web page)."""
    headers = {**AUTH, "X-Request-Id": ctx.next_id("host"), "Host": "evil.example"}
    r = await post(ctx, "host", small(), headers=headers)
    return Outcome(r.status_code, error_note(r))


async def reused_request_id(ctx: Context) -> Outcome:
    """A victim's live X-Request-Id: the server's ids are its own, so both run."""
    headers = {**AUTH, "X-Request-Id": ctx.live_victim_id}
    r = await post(ctx, "reused", small(temperature=0.0), headers=headers)
    echoed = r.headers.get("x-request-id")
    return Outcome(r.status_code, f"echoed {echoed!r}", echoed == ctx.live_victim_id)


async def malformed_json(ctx: Context) -> Outcome:
    r = await post(ctx, "malformed", content=b'{"model": "x", "prompt": "Hi", "max_tokens": ')
    return Outcome(r.status_code, error_note(r))


async def missing_key(ctx: Context) -> Outcome:
    r = await post(ctx, "nokey", small(), headers={})
    return Outcome(r.status_code, error_note(r))


async def wrong_key(ctx: Context) -> Outcome:
    r = await post(ctx, "wrongkey", small(), headers={"Authorization": "Bearer not-a-key"})
    return Outcome(r.status_code, error_note(r))


async def metrics_without_admin(ctx: Context) -> Outcome:
    async with httpx.AsyncClient(base_url=ctx.url, timeout=REQUEST_TIMEOUT_S) as client:
        r = await client.get("/metrics", headers=AUTH)
    return Outcome(r.status_code, error_note(r))


async def disconnect_mid_stream(ctx: Context) -> Outcome:
    """A long stream, left after two events (the server must abort it)."""
    request_id = ctx.next_id("leave")
    headers = {**AUTH, "X-Request-Id": request_id}
    body = small(max_tokens=200, ignore_eos=True, stream=True)
    async with httpx.AsyncClient(base_url=ctx.url, timeout=REQUEST_TIMEOUT_S) as client:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break
    return Outcome(r.status_code, f"left after {events} events: {request_id}")


async def disconnect_before_first_token(ctx: Context) -> Outcome:
    """A request abandoned 20 ms after it was sent (before or at its first token)."""
    task = asyncio.ensure_future(post(ctx, "gone", small(max_tokens=200, ignore_eos=True)))
    await asyncio.sleep(0.02)
    task.cancel()
    try:
        r = await task
    except asyncio.CancelledError:
        return Outcome(None, "abandoned")
    return Outcome(r.status_code, "answered before the client left")


async def slow_loris(url: str, key: str | None, until,
                     max_s: float) -> Outcome:
    """A valid request whose body comes 8 bytes every 0.2 s, abandoned when `until` is set
    (or after max_s). Without a key the server must refuse it at once: 401."""
    port = int(url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection(HOST, port)
    body = json.dumps(small(prompt="slow " * 2000)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n"
            + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n")
    writer.write(head.encode())
    sent, deadline = 0, time.monotonic() + max_s
    try:
        while not until.is_set() and time.monotonic() < deadline and sent < len(body) - 8:
            writer.write(body[sent:sent + 8])
            sent += 8
            await writer.drain()
            try:  # an answer (a refusal) ends the attack
                line = await asyncio.wait_for(reader.readline(), 0.2)
            except asyncio.TimeoutError:
                continue
            return Outcome(int(line.split()[1]) if line else None,
                           f"answered after {sent} body bytes")
        return Outcome(None, f"abandoned after {sent} of {len(body)} body bytes, no answer")
    except (ConnectionError, OSError) as exc:
        return Outcome(None, f"connection closed by the server after {sent} bytes: {exc}")
    finally:
        writer.transport.abort()  # a RST, not a polite close: the client just vanishes


SLOW_LORIS = {"slow-loris upload (abandoned)": (VICTIM_KEY, frozenset({None, 408})),
              "slow-loris upload without a key": (None, frozenset({401}))}
