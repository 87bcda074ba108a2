"""The live view: a web page that shows the batch at work, and the data it reads.

`build_live_router(async_engine)` returns an APIRouter with

- GET `/` and `/dashboard`: the page (`server/dashboard/`: plain HTML, JS and CSS, no build
  step, nothing fetched from outside the server);
- GET `/dashboard/{app.js,style.css}`: its assets;
- GET `/debug/events`: a server-sent event stream: `hello` (the state and the recent
  iterations), then `iterations` (a list of iteration records of the engine's trace, format
  in `slotserve.lab.simulate`) as they run and `stats` every `stats_interval_s`;
- GET `/debug/state`: the same state as JSON (slots, KV pool, policy, stats, block map);
- GET `/debug/simulate?policy=static|continuous&lengths=2,8,3,4,3,2&slots=3`: the
  simulator's trace of a workload (default: the seed's toy), for the page's replay.

Data flow: the engine thread calls `LiveFeed.on_iteration` after every iteration (a trace
listener); each connected page has a bounded queue that drops its oldest records when the
page lags, so a slow or stalled client costs the engine nothing and memory stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, StreamingResponse

from slotserve.lab.simulate import POLICIES, SEED_TOY, SimRequest, simulate

DASHBOARD_DIR = Path(__file__).parent / "dashboard"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
NO_CACHE = {"Cache-Control": "no-cache"}

# Finish reasons whose latencies count (aborted / failed requests would skew them).
OBSERVED_REASONS = ("stop", "length")

# Bounds of /debug/simulate, on the most iterations the workload could take (it runs in a
# worker thread; each bound is about a second of simulation and a few MB of JSON at most).
MAX_SIM_REQUESTS = 1000
MAX_SIM_SLOTS = 1024
MAX_SIM_ITERATIONS = 100_000
MAX_SIM_CELLS = 1_000_000  # iterations x slots
MAX_SIM_QUEUE_WORK = 20_000_000  # iterations x requests (the waiting-queue count)


def build_live_router(async_engine, *, stats_interval_s: float = 1.0,
                      client_queue: int = 2048, backfill: int = 600) -> APIRouter:
    """The live view's routes over `async_engine` (it starts following the engine now).

    client_queue: iteration records kept per page before the oldest are dropped.
    backfill: recent iterations a page gets when it connects.
    """
    feed = LiveFeed(async_engine, client_queue=client_queue)
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
        return feed.state()

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
        yield sse("hello", feed.hello(backfill))
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
                yield sse("stats", feed.stats(dropped=client.dropped))
                next_stats = loop.time() + stats_interval_s
    finally:
        feed.disconnect(client)


def sse(event: str, data) -> str:
    """One server-sent event (the JSON is one line, so one data: field)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


# --------------------------------------------------------------------------- the feed
class LiveClient:
    """One page's bounded queue of iteration records.

    NOTE: `push` runs in the engine thread, everything else in the event loop. The deque is
    thread-safe for append / popleft and its maxlen drops the oldest record when the page
    lags; at most one wake-up is in flight on the loop, so a stalled loop piles up nothing.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, maxlen: int) -> None:
        self.loop = loop
        self.records: deque[dict] = deque(maxlen=maxlen)
        self.wake = asyncio.Event()
        self.dropped = 0
        self._wake_pending = False

    def push(self, record: dict) -> None:
        if len(self.records) == self.records.maxlen:
            self.dropped += 1
        self.records.append(record)
        if not self._wake_pending:
            self._wake_pending = True
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._wake_pending = False
        self.wake.set()

    def drain(self) -> list[dict]:
        out = []
        while self.records:
            out.append(self.records.popleft())
        return out


class LiveFeed:
    """Follows one AsyncEngine: fans iteration records out to pages, keeps recent latencies.

    window_s: TTFT / TPOT percentiles cover the completions finished in this window.
    """

    def __init__(self, async_engine, client_queue: int = 2048, window_s: float = 60.0,
                 max_latencies: int = 4096) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.client_queue = client_queue
        self.window_s = window_s
        self._clients: list[LiveClient] = []
        self._lock = threading.Lock()  # guards _clients and _latencies across the threads
        self._latencies: deque[tuple[float, float | None, float | None]] = deque(
            maxlen=max_latencies)  # (finish time, ttft, tpot)
        self._tokens: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens generated)
        self._attached = False

    # ------------------------------------------------------------------ engine side
    def attach(self) -> None:
        """Follow the trace (iterations) and the finished outputs (latencies)."""
        self.engine.trace.add_listener(self.on_iteration)
        self.async_engine.add_step_listener(self.on_step)
        self._attached = True

    def close(self) -> None:
        """Stop following the engine."""
        if not self._attached:
            return
        self.engine.trace.remove_listener(self.on_iteration)
        self.async_engine.remove_step_listener(self.on_step)
        self._attached = False

    def on_iteration(self, record: dict) -> None:
        """Trace listener (engine thread): hand the record to every page."""
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            try:
                client.push(record)
            except RuntimeError:  # its event loop is closed: the page is gone
                self.disconnect(client)

    def on_step(self, outputs: list) -> None:
        """Step listener (engine thread): keep the latencies of finished completions."""
        now = time.monotonic()
        finished = [(now, c.metrics.ttft, c.metrics.tpot) for out in outputs
                    for c in out.outputs
                    if c.finish_reason in OBSERVED_REASONS and c.metrics is not None]
        if finished:
            with self._lock:
                self._latencies.extend(finished)

    # ------------------------------------------------------------------ pages
    def connect(self, loop: asyncio.AbstractEventLoop) -> LiveClient:
        client = LiveClient(loop, self.client_queue)
        with self._lock:
            self._clients.append(client)
        return client

    def disconnect(self, client: LiveClient) -> None:
        with self._lock:
            if client in self._clients:
                self._clients.remove(client)

    @property
    def num_clients(self) -> int:
        with self._lock:
            return len(self._clients)

    def hello(self, backfill: int) -> dict:
        """The first event of a stream: the state and the last `backfill` iterations."""
        iterations = self.engine.trace.export()["iterations"]
        return {**self.state(), "iterations": iterations[-backfill:] if backfill else []}

    # ------------------------------------------------------------------ snapshots
    def config(self) -> dict:
        engine, sched = self.engine, self.engine.scheduler.config
        return {"model": engine.model_config.name, "policy": sched.policy,
                "num_slots": sched.max_num_seqs, "kv_blocks_total": engine.kv.num_blocks,
                "block_size": engine.kv.block_size,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_model_len": sched.max_model_len, "window_s": self.window_s}

    def state(self) -> dict:
        """Config, stats and the block map: GET /debug/state."""
        return {**self.config(), **self.stats()}

    def stats(self, dropped: int = 0, now: float | None = None) -> dict:
        """Counters and recent latencies. Read from the server thread while the engine runs.

        NOTE: each engine value is one attribute or len() read, so a snapshot may mix two
        iterations but never sees a torn value (as the Prometheus collector).
        """
        now = time.monotonic() if now is None else now
        engine, sched, kv = self.engine, self.engine.scheduler, self.engine.kv
        ttft, tpot = self._recent_latencies(now)
        return {
            "time": time.time(), "iteration": sched.iteration,
            "running": sched.num_running, "waiting": sched.num_waiting,
            "kv_blocks_used": kv.num_blocks - kv.num_free_blocks,
            "kv_blocks_free": kv.num_free_blocks, "preemptions": sched.num_preemptions,
            "generation_tokens": engine.stats.generation_tokens,
            "tokens_per_s": self._tokens_per_s(now, engine.stats.generation_tokens),
            "finished_in_window": len(ttft),
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
            "blocks": block_map(kv), "dropped": dropped, "clients": self.num_clients,
        }

    def _recent_latencies(self, now: float) -> tuple[list[float], list[float]]:
        horizon = now - self.window_s
        with self._lock:
            recent = [(a, b) for t, a, b in self._latencies if t >= horizon]
        return ([a for a, _ in recent if a is not None],
                [b for _, b in recent if b is not None])

    def _tokens_per_s(self, now: float, total: int, span_s: float = 5.0) -> float:
        """Output tokens per second over the last ~span_s seconds of stats snapshots."""
        samples = self._tokens
        if not samples or now - samples[-1][0] >= 0.2:
            samples.append((now, total))
        while len(samples) > 2 and now - samples[1][0] >= span_s:
            samples.popleft()
        t0, n0 = samples[0]
        return (total - n0) / (now - t0) if now - t0 >= 0.5 else 0.0


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def block_map(kv, max_runs: int = 20_000) -> dict:
    """Which request holds which KV block, as runs: {"owners": [ids], "runs": [[first
    block, count, owner index], ...]} (free blocks are in no run). Runs are None when there
    would be more than max_runs (the page then shows counts only).

    NOTE: read while the engine thread runs: list() of the dict and of each table are single
    C calls under the GIL, so each table is whole; tables may come from two iterations.
    """
    try:
        tables = list(kv.block_tables.items())
        owners, runs = [], []
        for request_id, table in tables:
            blocks = sorted(list(table))
            if not blocks:
                continue
            owner = len(owners)
            owners.append(request_id)
            runs.extend([first, count, owner] for first, count in _runs(blocks))
            if len(runs) > max_runs:
                return {"owners": [], "runs": None}
    except RuntimeError:  # a table changed size mid-copy: skip this snapshot's map
        return {"owners": [], "runs": None}
    return {"owners": owners, "runs": runs}


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block ids as (first, count) runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for block in blocks:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs
