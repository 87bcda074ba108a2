"""benchmarks.soak's clients: each request sent, read (whole or streamed) and, for a
disconnecting client, abandoned at its moment; what each client saw (`Result`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field

import httpx

from benchmarks.soak_workload import Spec

REQUEST_TIMEOUT_S = 300.0


# --------------------------------------------------------------------------- clients
@dataclass
class Result:
    """What one client saw."""

    spec: Spec
    outcome: str = "pending"  # completed | cancelled | error
    status: int | None = None
    response_id: str | None = None  # the server's id (`cmpl-...`)
    echoed_id: str | None = None  # the response's X-Request-Id header
    texts: dict[int, str] = field(default_factory=lambda: defaultdict(str))
    finish: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    usage: dict | None = None
    error: str | None = None
    events: int = 0
    done_marker: bool = False  # streams: `data: [DONE]` came
    seconds: float = 0.0


async def run_workload(url: str, specs: list[Spec], concurrency: int,
                       progress: bool = False) -> list[Result]:
    """Send every spec from `concurrency` clients (each sends its next when one ends)."""
    queue: asyncio.Queue = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S,
                                 limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                results.append(await run_one(client, queue.get_nowait()))
                if progress and len(results) % 50 == 0:
                    print(f"  {len(results)}/{len(specs)} requests", flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.spec.index)


async def run_one(client: httpx.AsyncClient, spec: Spec) -> Result:
    """One request; the client leaves as its spec says."""
    result = Result(spec)
    sent = asyncio.Event()

    async def trace(event: str, info: dict) -> None:
        if event == "http11.send_request_body.complete":
            sent.set()

    start = time.monotonic()
    task = asyncio.ensure_future(exchange(client, spec, result, trace))
    leave = asyncio.ensure_future(leave_later(task, sent, spec.disconnect_after_s))
    try:
        await task
    except asyncio.CancelledError:
        result.outcome = "cancelled"
    except Exception as exc:  # every failure is a finding: reported, not raised
        result.outcome, result.error = "error", f"{type(exc).__name__}: {exc}"
    finally:
        leave.cancel()
    result.seconds = time.monotonic() - start
    return result


async def leave_later(task: asyncio.Task, sent: asyncio.Event, delay_s: float | None) -> None:
    """Cancel `task` (closing its connection) `delay_s` after the request went out.

    NOTE: counted from the sent body, so a cancelled request always reached the server:
    the server side must account for every one of them.
    """
    if delay_s is None:
        return
    await sent.wait()
    await asyncio.sleep(delay_s)
    task.cancel()


async def exchange(client: httpx.AsyncClient, spec: Spec, result: Result, trace) -> None:
    path = "/v1/completions" if spec.endpoint == "completions" else "/v1/chat/completions"
    headers = {"X-Request-Id": spec.request_id}
    extensions = {"trace": trace}
    if not spec.stream:
        response = await client.post(path, json=spec.body, headers=headers,
                                     extensions=extensions)
        result.echoed_id = response.headers.get("x-request-id")
        read_whole(response, spec, result)
        return
    async with client.stream("POST", path, json=spec.body, headers=headers,
                             extensions=extensions) as response:
        result.status = response.status_code
        result.echoed_id = response.headers.get("x-request-id")
        if response.status_code != 200:
            result.outcome, result.error = "error", (await response.aread()).decode()[:500]
            return
        if await read_events(response, spec, result):
            result.outcome = "cancelled"  # left after disconnect_after_events events
            return
    result.outcome = "completed"


def read_whole(response: httpx.Response, spec: Spec, result: Result) -> None:
    result.status = response.status_code
    if response.status_code != 200:
        result.outcome, result.error = "error", response.text[:500]
        return
    data = response.json()
    result.response_id, result.usage = data.get("id"), data.get("usage")
    for choice in data["choices"]:
        text = choice["text"] if spec.endpoint == "completions" else choice["message"]["content"]
        result.texts[choice["index"]] += text or ""
        result.finish[choice["index"]].append(choice["finish_reason"])
    result.outcome = "completed"


async def read_events(response: httpx.Response, spec: Spec, result: Result) -> bool:
    """Read the SSE events into `result`; True if the client left early (as planned)."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if result.events == spec.disconnect_after_events:
            return True
        result.events += 1
        payload = line[len("data: "):]
        if payload == "[DONE]":
            result.done_marker = True
            continue
        add_chunk(json.loads(payload), spec, result)
    return False


def add_chunk(data: dict, spec: Spec, result: Result) -> None:
    if "error" in data:
        result.error = json.dumps(data["error"])
        return
    result.response_id = data.get("id", result.response_id)
    if data.get("usage"):
        result.usage = data["usage"]
    for choice in data.get("choices", []):
        if spec.endpoint == "completions":
            text = choice.get("text") or ""
        else:
            text = (choice.get("delta") or {}).get("content") or ""
        result.texts[choice["index"]] += text
        if choice.get("finish_reason") is not None:
            result.finish[choice["index"]].append(choice["finish_reason"])
