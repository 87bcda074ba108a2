"""The live view's routes: a web page that shows the batch at work, and its data.

`build_live_router(engine)` (an AsyncEngine, or anything with the engine's read side:
`snapshot()`, `subscribe()`, `export_trace()`) returns an APIRouter with

- GET `/` and `/dashboard`: the page (`server/dashboard/`: plain HTML, JS and CSS, no build
  step, nothing fetched from outside the server);
- GET `/dashboard/{app.js,style.css}`: its assets;
- GET `/debug/events`: a server-sent event stream: `hello` (the state and the recent
  iterations), then `iterations` (a list of iteration records of the engine's trace, format
  in `slotserve.lab.simulate`) as they run and `stats` every `stats_interval_s`;
- GET `/debug/state`: the same state as JSON (slots, KV pool, policy, stats, prefix cache,
  block map with shared and cached-free blocks);
- GET `/debug/simulate?policy=static|continuous&lengths=2,8,3,4,3,2&slots=3`: the
  simulator's trace of a workload (default: the seed's toy), for the page's replay.

The data (`LiveFeed`: the iteration fan-out, recent latencies, the state) lives in
`slotserve.obs.live_feed`; this module holds routes only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, StreamingResponse

from slotserve.lab.simulate import POLICIES, SEED_TOY, SimRequest, simulate
from slotserve.obs.live_feed import LiveFeed

DASHBOARD_DIR = Path(__file__).parent / "dashboard"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
NO_CACHE = {"Cache-Control": "no-cache"}

# Bounds of /debug/simulate, on the most iterations the workload could take (it runs in a
# worker thread; each bound is about a second of simulation and a few MB of JSON at most).
MAX_SIM_REQUESTS = 1000
MAX_SIM_SLOTS = 1024
MAX_SIM_ITERATIONS = 100_000
MAX_SIM_CELLS = 1_000_000  # iterations x slots
MAX_SIM_QUEUE_WORK = 20_000_000  # iterations x requests (the waiting-queue count)


def build_live_router(engine, *, stats_interval_s: float = 1.0,
                      client_queue: int = 2048, backfill: int = 600) -> APIRouter:
    """The live view's routes over `engine` (it starts following the engine now).

    client_queue: iteration records kept per page before the oldest are dropped.
    backfill: recent iterations a page gets when it connects.
    """
    feed = LiveFeed(engine, client_queue=client_queue)
    feed.attach()
    router = APIRouter()
    router.live_feed = feed  # for tests and for `close()`
    _add_page_routes(router)
    _add_data_routes(router, feed, stats_interval_s, backfill)
    return router


# --------------------------------------------------------------------------- routes
def _add_page_routes(router: APIRouter) -> None:
    @router.get("/", include_in_schema=False)
    @router.get("/dashboard", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(DASHBOARD_DIR / "index.html", media_type="text/html",
                            headers=NO_CACHE)

    @router.get("/dashboard/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        if name not in ASSETS:  # NOTE: a fixed list: no path ever reaches the filesystem
            raise HTTPException(404, f"no dashboard asset {name!r}")
        return FileResponse(DASHBOARD_DIR / name, media_type=ASSETS[name], headers=NO_CACHE)


def _add_data_routes(router: APIRouter, feed: LiveFeed, stats_interval_s: float,
                     backfill: int) -> None:
    @router.get("/debug/state")
    async def state() -> dict:
        return await asyncio.to_thread(feed.state)  # NOTE: waits for the engine's state lock

    @router.get("/debug/events")
    async def events(request: Request) -> StreamingResponse:
        stream = event_stream(feed, request, stats_interval_s, backfill)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={**NO_CACHE, "X-Accel-Buffering": "no"})

    @router.get("/debug/simulate")
    async def simulated(policy: str = "continuous", lengths: str | None = None,
                        slots: int = 3, arrivals: str | None = None,
                        prefill: int = 0) -> dict:
        try:
            return await asyncio.to_thread(simulate_workload, policy, lengths, slots, arrivals,
                                           prefill)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc


def simulate_workload(policy: str, lengths: str | None, slots: int, arrivals: str | None,
                      prefill: int = 0) -> dict:
    """The simulator's trace of a workload given as comma-separated numbers.

    lengths: output tokens of each request (default: the seed's toy, R1..R6);
    arrivals: the arrival iteration of each request (default: all at 0).
    ValueError naming the parameter on bad input.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not 1 <= slots <= MAX_SIM_SLOTS:
        raise ValueError(f"slots must be in [1, {MAX_SIM_SLOTS}], got {slots}")
    outs = _int_list("lengths", lengths) if lengths is not None else [
        r.output_tokens for r in SEED_TOY]
    starts = _int_list("arrivals", arrivals) if arrivals is not None else [0] * len(outs)
    if len(starts) != len(outs):
        raise ValueError(f"arrivals has {len(starts)} values, lengths has {len(outs)}")
    if len(outs) > MAX_SIM_REQUESTS:
        raise ValueError(f"lengths: at most {MAX_SIM_REQUESTS} requests, got {len(outs)}")
    most = most_iterations(policy, [n + max(prefill, 0) for n in outs], starts, slots)
    if (most > MAX_SIM_ITERATIONS or most * slots > MAX_SIM_CELLS
            or most * len(outs) > MAX_SIM_QUEUE_WORK):
        raise ValueError(f"lengths: too much work to simulate here (up to {most} iterations "
                         f"of {slots} slots and {len(outs)} requests)")
    requests = [SimRequest(f"R{i}", n, a) for i, (n, a) in enumerate(zip(outs, starts), 1)]
    return simulate(requests, slots, policy, prefill)


def most_iterations(policy: str, work: list[int], arrivals: list[int], slots: int) -> int:
    """An upper bound on the iterations the simulator takes; work: iterations per request.

    NOTE: any policy: each iteration waits for an arrival or advances some request, so
    last arrival + total work. Continuous: once the last request arrived, a request waits
    only while every slot is busy, so the last to start does by last arrival + total work /
    slots, and ends one request's work later. Static: batches that start before the last
    arrival run one after another and end by last arrival + the longest work; after it, the
    rest go in full batches of `slots`, each at most the longest work.
    """
    last, longest, total = max(arrivals), max(work), sum(work)
    if policy == "continuous":
        bound = last + -(-total // slots) + longest
    else:
        bound = last + longest * (1 + -(-len(work) // slots))
    return min(bound, last + total)


def _int_list(name: str, text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{name} must not be empty")
    return values


async def event_stream(feed: LiveFeed, request: Request, stats_interval_s: float,
                       backfill: int) -> AsyncIterator[str]:
    """The SSE stream of one page: hello, then iterations as they run and stats on a timer."""
    loop = asyncio.get_running_loop()
    client = feed.connect(loop)
    try:
        yield sse("hello", await asyncio.to_thread(feed.hello, backfill))
        next_stats = loop.time() + stats_interval_s
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(client.wake.wait(), max(0.0, next_stats - loop.time()))
            client.wake.clear()
            records = client.drain()
            if records:
                yield sse("iterations", records)
                await asyncio.sleep(0.05)  # batch fast engines: at most ~20 messages a second
            if loop.time() >= next_stats:
                if await request.is_disconnected():
                    return
                yield sse("stats", await asyncio.to_thread(feed.stats, client.dropped))
                next_stats = loop.time() + stats_interval_s
    finally:
        feed.disconnect(client)


def sse(event: str, data) -> str:
    """One server-sent event (the JSON is one line, so one data: field)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
