"""The live view end to end: its routes over HTTP, then the page in headless Chromium.

A real uvicorn server on 127.0.0.1 (in a thread) serves `build_live_router` over an
AsyncEngine on a tiny random Llama (token-id prompts). A test-only endpoint starts
requests in the server's event loop, and a short sleep after each iteration (in the
engine thread) paces the engine so the page sees the batch while it runs, whatever the
CPU. The browser tests need Debian's chromium (/usr/bin/chromium) and the `playwright`
Python package (no `playwright install`); without them they skip. Screenshots go to
test-artifacts/.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from slotserve.engine.async_engine import AsyncEngine
from slotserve.engine.events import build_block_map
from slotserve.lab.simulate import summarize
from slotserve.obs.live_feed import LiveClient
from slotserve.percentile import percentile
from slotserve.sampling import SamplingParams
from slotserve.server.live import build_live_router, most_iterations, simulate_workload
from tests.conftest import random_prompts, tiny_engine, tiny_hf_model
from tests.e2e.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

NUM_SLOTS = 8
NUM_BLOCKS = 64
BLOCK_SIZE = 16
STEP_DELAY_S = 0.05  # engine-thread pause after each iteration: ~64 tokens take 3+ s
TIMEOUT_MS = 60_000


# --------------------------------------------------------------------------- the server
def build_test_app(async_engine: AsyncEngine) -> FastAPI:
    """The live router, the engine's trace (as the real app's /debug/trace), a test-only
    POST /test/generate that starts n requests in the background (their prompts start with
    the same `shared` tokens) and GET /test/busy: how many of them have not finished.

    NOTE: a started request reaches the engine only when its task first runs, after the POST
    has answered: the engine alone can look idle before its requests arrive."""
    app = FastAPI()
    app.include_router(build_live_router(async_engine, stats_interval_s=0.25))
    tasks: set[asyncio.Task] = set()

    @app.get("/debug/trace")
    async def trace() -> dict:
        return async_engine.export_trace()

    @app.get("/test/busy")
    async def busy() -> dict:
        return {"requests": len(tasks)}

    @app.post("/test/generate")
    async def generate(prefix: str, n: int = 8, max_tokens: int = 64, shared: int = 0) -> dict:
        prompts = random_prompts(n, min_len=8, max_len=30, seed=len(tasks))
        common = random_prompts(1, min_len=shared, max_len=shared, seed=99)[0] if shared else []
        for i, prompt in enumerate(prompts):
            prompt = common + prompt
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            task = asyncio.create_task(_run(async_engine, f"{prefix}-{i}", prompt, params))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return {"started": n}

    return app


async def _run(async_engine: AsyncEngine, request_id: str, prompt: list[int],
               params: SamplingParams) -> None:
    async for _ in async_engine.generate(request_id, prompt, params):
        pass


class ThreadServer:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve_slowed(engine, step_delay_s: float = STEP_DELAY_S):
    """A ThreadServer over `engine` whose engine thread pauses step_delay_s after each
    iteration (so a page sees the batch move); yields the server, stops both after."""
    async_engine = AsyncEngine(engine)
    async_engine.subscribe(lambda event: time.sleep(step_delay_s))
    server = ThreadServer(build_test_app(async_engine))
    async_engine.start()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        async_engine.stop()


@pytest.fixture(scope="module")
def live_server():
    yield from serve_slowed(tiny_engine(tiny_hf_model(), max_num_seqs=NUM_SLOTS,
                                        num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                        max_model_len=256))


def start_requests(server: ThreadServer, prefix: str, n: int = 8, max_tokens: int = 64,
                   shared: int = 0) -> None:
    r = httpx.post(f"{server.url}/test/generate",
                   params={"prefix": prefix, "n": n, "max_tokens": max_tokens, "shared": shared})
    assert r.status_code == 200, r.text


def wait_idle(server: ThreadServer, timeout: float = 60.0) -> dict:
    """The engine's state once every request /test/generate started has finished."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(f"{server.url}/debug/state").json()
        started = httpx.get(f"{server.url}/test/busy").json()["requests"]
        if started == 0 and state["running"] == 0 and state["waiting"] == 0:
            return state
        time.sleep(0.1)
    raise AssertionError(f"the engine is still busy after {timeout}s: {state}")


# --------------------------------------------------------------------------- routes over HTTP
def test_simulate_returns_the_seed_toy(live_server):
    traces = {p: httpx.get(f"{live_server.url}/debug/simulate", params={"policy": p}).json()
              for p in ("static", "continuous")}
    assert summarize(traces["static"])["iterations"] == 12
    assert summarize(traces["continuous"])["iterations"] == 8
    assert round(summarize(traces["static"])["utilisation"], 2) == 0.61
    assert round(summarize(traces["continuous"])["utilisation"], 2) == 0.92
    assert [r["output_tokens"] for r in traces["static"]["requests"]] == [2, 8, 3, 4, 3, 2]
    custom = httpx.get(f"{live_server.url}/debug/simulate",
                       params={"policy": "static", "lengths": "2,8,3,4,3,2", "slots": 3}).json()
    assert custom["iterations"] == traces["static"]["iterations"]
    arrivals = httpx.get(f"{live_server.url}/debug/simulate",
                         params={"lengths": "1,1", "arrivals": "0,5", "slots": 1}).json()
    assert len(arrivals["iterations"]) == 6  # idle iterations until the late arrival


@pytest.mark.parametrize("params, word", [
    ({"policy": "fifo"}, "policy"),
    ({"lengths": "2,x"}, "lengths"),
    ({"lengths": "2,0"}, "output_tokens"),
    ({"slots": 0}, "slots"),
    ({"lengths": "1,2", "arrivals": "0"}, "arrivals"),
    ({"lengths": "100000,100000", "slots": 64}, "too much work"),
    ({"lengths": ",".join(["90"] * 1000), "slots": 1}, "too much work"),
    ({"lengths": ",".join(["1"] * 1001)}, "at most 1000 requests"),
])
def test_simulate_rejects_bad_input(live_server, params, word):
    r = httpx.get(f"{live_server.url}/debug/simulate", params=params)
    assert r.status_code == 400
    assert word in r.text


def test_state_snapshot(live_server):
    state = httpx.get(f"{live_server.url}/debug/state").json()
    assert state["num_slots"] == NUM_SLOTS and state["kv_blocks_total"] == NUM_BLOCKS
    assert state["policy"] == "continuous" and state["block_size"] == BLOCK_SIZE
    for key in ("running", "waiting", "kv_blocks_used", "kv_blocks_free", "preemptions",
                "tokens_per_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "blocks",
                "kv_blocks_cached_free", "kv_blocks_shared", "prefix_cache_queries",
                "prefix_cache_hits", "prefix_cache_hit_rate"):
        assert key in state
    assert set(state["blocks"]) == {"owners", "runs", "shared", "cached_free"}
    assert state["enable_prefix_caching"] is True


def test_assets_and_unknown_asset(live_server):
    for path in ("/", "/dashboard"):
        r = httpx.get(live_server.url + path)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        assert "/dashboard/app.js" in r.text
    assert "javascript" in httpx.get(live_server.url + "/dashboard/app.js").headers["content-type"]
    assert httpx.get(live_server.url + "/dashboard/style.css").status_code == 200
    assert httpx.get(live_server.url + "/dashboard/..%2Flive.py").status_code == 404
    assert httpx.get(live_server.url + "/dashboard/index.js").status_code == 404


def read_events(lines, until, timeout: float = 30.0) -> list[tuple[str, object]]:
    """SSE events (name, data) from an iterator of lines until until(events) is true."""
    events, name, deadline = [], None, time.monotonic() + timeout
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
            if until(events):
                return events
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"stream ended or timed out; got {[n for n, _ in events]}")


def test_event_stream_carries_iterations_and_stats(live_server):
    feed_clients = lambda: httpx.get(f"{live_server.url}/debug/state").json()["clients"]
    with httpx.stream("GET", f"{live_server.url}/debug/events", timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        first = read_events(lines, lambda ev: len(ev) >= 1)
        assert first[0][0] == "hello" and first[0][1]["num_slots"] == NUM_SLOTS
        start_requests(live_server, "sse", n=3, max_tokens=8)
        events = read_events(lines, lambda ev: any(
            n == "iterations" and any(_ids(rec) & {"sse-0", "sse-1", "sse-2"} for rec in data)
            for n, data in ev) and any(n == "stats" for n, _ in ev))
        assert feed_clients() == 1
    records = [rec for name, data in events if name == "iterations" for rec in data]
    assert all(len(rec["slots"]) == NUM_SLOTS for rec in records)
    indices = [rec["index"] for rec in records]
    assert indices == sorted(indices) and len(set(indices)) == len(indices)
    wait_idle(live_server)
    deadline = time.monotonic() + 10
    while feed_clients() != 0 and time.monotonic() < deadline:  # the closed page is forgotten
        time.sleep(0.1)
    assert feed_clients() == 0
    state = httpx.get(f"{live_server.url}/debug/state").json()
    assert state["ttft_p50"] is not None and state["tpot_p99"] is not None


def _ids(record: dict) -> set[str]:
    return {cell["request"] for cell in record["slots"] if cell is not None}


# --------------------------------------------------------------------------- unit pieces
def test_client_queue_is_bounded_and_drops_the_oldest():
    loop = asyncio.new_event_loop()
    try:
        client = LiveClient(loop, maxlen=100)
        pusher = threading.Thread(target=lambda: [client.push({"index": i}) for i in range(5000)])
        pusher.start()
        pusher.join()
        loop.run_until_complete(asyncio.wait_for(client.wake.wait(), 5))
        records = client.drain()
    finally:
        loop.close()
    assert [r["index"] for r in records] == list(range(4900, 5000))
    assert client.dropped == 4900
    assert client.drain() == []


@pytest.mark.parametrize("seed", range(40))
def test_most_iterations_bounds_the_simulator(seed):
    import random

    rng = random.Random(seed)
    n, slots = rng.randint(1, 30), rng.randint(1, 6)
    lengths = [rng.randint(1, 12) for _ in range(n)]
    arrivals = [rng.choice([0, 0, rng.randint(0, 40)]) for _ in range(n)]
    prefill = rng.choice([0, 0, 2])
    for policy in ("static", "continuous"):
        trace = simulate_workload(policy, ",".join(map(str, lengths)), slots,
                                  ",".join(map(str, arrivals)), prefill)
        bound = most_iterations(policy, [x + prefill for x in lengths], arrivals, slots)
        assert len(trace["iterations"]) <= bound


def test_percentile_and_block_map():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == pytest.approx(99.01)

    blocks = build_block_map({"a": [0, 1, 2, 7], "b": [4, 3], "c": []}, []).to_json()
    assert {k: blocks[k] for k in ("owners", "runs")} == {
        "owners": ["a", "b"], "runs": [[0, 3, 0], [7, 1, 0], [3, 2, 1]]}


# --------------------------------------------------------------------------- the browser
@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM}: install Debian's browser (apt-get install -y chromium)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="no playwright: .venv/bin/pip install playwright")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A fresh page that records console errors and uncaught exceptions in `page.errors`."""
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = context.new_page()
    page.errors = []
    page.on("console", lambda msg: page.errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: page.errors.append(f"pageerror: {exc}"))
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    context.close()


def open_dashboard(page, server: ThreadServer, path: str = "/") -> None:
    page.goto(server.url + path)
    page.wait_for_selector('body[data-connected="true"]')
    # NOTE: the event stream opens before its "hello" arrives (the config; a loaded CI
    # host once ran a test's script in between)
    page.wait_for_function("() => live.config !== null")
    page.wait_for_selector('#replay-static[data-iterations="12"]')


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path


def test_page_loads_without_errors(page, live_server):
    open_dashboard(page, live_server)
    assert page.title() == "slotserve · live"
    assert page.locator("#config").inner_text().count("slots") == 1
    page.wait_for_function("() => document.querySelector('#stat-running').textContent !== '—'")
    assert page.locator("#block-map").get_attribute("data-total") == str(NUM_BLOCKS)
    open_dashboard(page, live_server, "/dashboard")
    assert page.errors == []


# JS: how many requests with this id prefix the live legend lists, and the utilisation.
LEGEND = """prefix => [...document.querySelectorAll('#live-legend li[data-request]')]
    .filter(li => li.dataset.request.startsWith(prefix)).length"""
UTILISATION = "() => Number(document.querySelector('#live-util-text').dataset.utilisation)"
RUNNING = "() => Number(document.querySelector('#stat-running').dataset.value)"
# Pixels of the block map that are neither free (grey, or pale green: free but cached) nor
# background (a used block).
USED_PIXELS = """() => {
    const c = document.querySelector('#block-map');
    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    let used = 0;
    for (let i = 0; i < d.length; i += 4) {
        const grey = d[i] === 230 && d[i + 1] === 230 && d[i + 2] === 230;
        const cached = d[i] === 183 && d[i + 1] === 223 && d[i + 2] === 197;
        if (d[i + 3] === 255 && !grey && !cached) used++;
    }
    return used;
}"""
# Pixels of one exact colour in the block map.
COLOR_PIXELS = """([r, g, b]) => {
    const c = document.querySelector('#block-map');
    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    let n = 0;
    for (let i = 0; i < d.length; i += 4) {
        if (d[i] === r && d[i + 1] === g && d[i + 2] === b && d[i + 3] === 255) n++;
    }
    return n;
}"""
CACHED_FREE_RGB = [183, 223, 197]
SHARED_MARK_RGB = [16, 24, 40]


def test_live_strip_shows_the_running_batch(page, live_server):
    wait_idle(live_server)
    open_dashboard(page, live_server)
    start_requests(live_server, "live", n=8, max_tokens=64)
    page.wait_for_function(f"() => ({LEGEND})('live-') === 8 && ({UTILISATION})() > 0 "
                           f"&& ({RUNNING})() > 0")
    running = httpx.get(f"{live_server.url}/debug/state").json()["running"]
    assert running > 0, "the requests finished before the page showed them"
    assert page.evaluate(USED_PIXELS) > 0
    screenshot(page, "dashboard-live.png")

    wait_idle(live_server)
    page.wait_for_selector('#block-map[data-used="0"]')
    page.wait_for_function(f"() => ({RUNNING})() === 0")
    assert page.evaluate(USED_PIXELS) == 0
    assert page.locator("#stat-kv-free").get_attribute("data-value") == str(NUM_BLOCKS)
    assert page.evaluate(LEGEND, "live-") == 8  # still in the strip after they finished
    # Their full prompt blocks stay cached, free: pale green, not grey.
    assert int(page.locator("#block-map").get_attribute("data-cached-free")) > 0
    assert page.evaluate(COLOR_PIXELS, CACHED_FREE_RGB) > 0
    page.wait_for_function("() => document.querySelector('[data-key=ttft_p50]').textContent "
                           "!== '—'")
    screenshot(page, "dashboard-after.png")
    assert page.errors == []


def test_block_map_shows_shared_prefix_blocks(page, live_server):
    """Requests behind one 40-token prefix share its two full blocks while they run (a dark
    centre on the owner's color); the hit rate shows."""
    wait_idle(live_server)
    open_dashboard(page, live_server)
    start_requests(live_server, "shared", n=4, max_tokens=48, shared=40)
    page.wait_for_function("() => Number(document.querySelector('#block-map')"
                           ".dataset.shared) > 0")
    assert page.evaluate(COLOR_PIXELS, SHARED_MARK_RGB) > 0
    screenshot(page, "dashboard-shared-blocks.png")
    state = wait_idle(live_server)
    assert state["prefix_cache_hits"] >= 3 * 32 and state["kv_blocks_shared"] == 0
    page.wait_for_function("() => document.querySelector('#block-map').dataset.shared === '0'")
    assert page.evaluate(COLOR_PIXELS, SHARED_MARK_RGB) == 0
    assert page.locator("#stat-prefix-hit").text_content().endswith("%")
    assert page.errors == []


def replay_state(page) -> dict:
    return page.evaluate("""() => Object.fromEntries(['static', 'continuous'].map(p => {
        const pane = document.querySelector('#replay-' + p);
        return [p, {iterations: Number(pane.dataset.iterations), step: Number(pane.dataset.step),
                    utilisation: Number(pane.dataset.utilisation),
                    waiting: [...pane.querySelectorAll('.chip:not(.done)')].map(c => c.textContent),
                    done: [...pane.querySelectorAll('.chip.done')].map(c => c.textContent)}];
    }))""")


def test_replay_of_the_seed_toy(page, live_server):
    open_dashboard(page, live_server)
    state = replay_state(page)
    assert state["static"]["iterations"] == 12 and state["continuous"]["iterations"] == 8
    assert round(state["static"]["utilisation"], 2) == 0.61
    assert round(state["continuous"]["utilisation"], 2) == 0.92
    assert state["static"]["step"] == 12 and state["continuous"]["step"] == 8
    screenshot(page, "dashboard-replay.png")

    page.keyboard.press("Home")
    state = replay_state(page)
    assert state["static"]["step"] == 0 and state["continuous"]["step"] == 0
    assert state["static"]["waiting"] == ["R1", "R2", "R3", "R4", "R5", "R6"]
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    state = replay_state(page)
    assert state["static"]["step"] == 3 and state["continuous"]["step"] == 3
    # The seed: static keeps R4-R6 waiting although R1 and R3 are done; continuous has
    # let R4 in as soon as R1 left.
    assert state["static"]["waiting"] == ["R4", "R5", "R6"]
    assert state["static"]["done"] == ["R1", "R3"]
    assert state["continuous"]["waiting"] == ["R5", "R6"]
    page.locator("#replay").screenshot(path=str(ARTIFACTS / "dashboard-replay-step3.png"))
    page.keyboard.press("ArrowLeft")
    assert replay_state(page)["static"]["step"] == 2
    page.click("#rp-next")
    page.click("#rp-next")
    assert replay_state(page)["static"]["step"] == 4
    page.keyboard.press("End")
    state = replay_state(page)
    assert state["static"]["step"] == 12 and state["continuous"]["step"] == 8
    assert page.locator("#replay-step").get_attribute("data-step") == "12"

    page.fill("#rp-lengths", "4,4,4,4")
    page.fill("#rp-slots", "2")
    page.click("#rp-form button[type=submit]")
    page.wait_for_selector('#replay-static[data-iterations="8"]')
    assert replay_state(page)["continuous"]["iterations"] == 8  # equal lengths: no difference
    assert page.errors == []


def test_replay_of_the_servers_trace(page, live_server):
    start_requests(live_server, "trace", n=4, max_tokens=6)
    wait_idle(live_server)
    open_dashboard(page, live_server)
    page.click("#rp-server")
    page.wait_for_function("() => document.querySelector('#replay-continuous .source')"
                           ".textContent.includes('server')")
    state = replay_state(page)
    assert state["continuous"]["iterations"] > 0 and state["static"]["iterations"] > 0
    assert "error" not in page.locator("#replay-note").get_attribute("class")
    assert page.errors == []


def test_page_buffers_stay_bounded(page, live_server):
    """Feed the page 3000 iterations of 3000 different requests: it keeps the last 600
    columns, a legend of at most 41 entries, and redraws."""
    open_dashboard(page, live_server)
    kept = page.evaluate("""() => {
        const slots = live.config.num_slots;
        const base = live.lastIndex + 1;
        const records = Array.from({length: 3000}, (_, i) => ({index: base + i, start: 0, end: 0,
            slots: Array.from({length: slots}, (_, s) => s ? null :
                {request: 'fake-' + i, kind: 'decode', tokens: 1}),
            num_waiting: 0, kv_blocks_used: 0, preempted: []}));
        appendIterations(records);
        return live.columns.length;
    }""")
    assert kept == 600
    page.wait_for_function("() => document.querySelector('#live-legend').children.length > 1")
    assert page.locator("#live-legend li").count() <= 41
    assert page.errors == []


# --------------------------------------------------------------------------- replicas
REPLICAS = ("replica-0", "replica-1")
REPLICA_SLOTS = 4


@pytest.fixture(scope="module")
def replica_live_server():
    """The live view over a replica set's ingress (a real ReplicaFront polling every 0.2 s)
    whose two replicas are paced engines in this process (tests.support.replicas: no Ray);
    POST /test/generate?replica=NAME starts requests on one replica."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from contextlib import asynccontextmanager

    from tests.support.replicas import InProcessReplica, in_process_front

    replicas = {}
    for seed, name in enumerate(REPLICAS):
        engine = tiny_engine(tiny_hf_model(), max_num_seqs=REPLICA_SLOTS, num_blocks=NUM_BLOCKS,
                             block_size=BLOCK_SIZE, max_model_len=256, seed=seed)
        replicas[name] = InProcessReplica(AsyncEngine(engine))
        replicas[name].async_engine.subscribe(lambda event: time.sleep(STEP_DELAY_S))
    front = in_process_front(replicas, BLOCK_SIZE)
    front.poll_interval_s = 0.2

    @asynccontextmanager
    async def polling(app):
        front.start()
        yield
        await front.stop()

    app = FastAPI(lifespan=polling)
    app.include_router(build_live_router(front, stats_interval_s=0.25))
    tasks: set[asyncio.Task] = set()

    @app.post("/test/generate")
    async def generate(replica: str, prefix: str, n: int = 3, max_tokens: int = 40) -> dict:
        engine = replicas[replica].async_engine
        for i, prompt in enumerate(random_prompts(n, min_len=8, max_len=30, seed=n)):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            task = asyncio.create_task(_run(engine, f"{prefix}-{i}", prompt, params))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return {"started": n}

    server = ThreadServer(app)
    for replica in replicas.values():
        replica.async_engine.start()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        for replica in replicas.values():
            replica.async_engine.stop()


# JS: each replica strip's label, iterations drawn and requests in view.
REPLICA_STRIPS = """() => [...document.querySelectorAll('#live .replica-strip')].map(node => ({
    name: node.dataset.replica, label: node.querySelector('.replica-label').textContent,
    iterations: Number(node.dataset.iterations || 0),
    requests: (node.dataset.requests || '').split(' ').filter(Boolean),
    painted: (() => { const c = node.querySelector('canvas.strip');
                      return c.width > 0 && c.getBoundingClientRect().height > 0; })()}))"""


def test_live_view_of_replicas_draws_a_labelled_strip_per_replica(page, replica_live_server):
    """With a replica set behind the server, the page swaps its one strip for one strip per
    replica, labelled, each with the requests that replica ran."""
    page.goto(replica_live_server.url + "/")
    page.wait_for_selector('body[data-connected="true"]')
    for name in REPLICAS:
        r = httpx.post(f"{replica_live_server.url}/test/generate",
                       params={"replica": name, "prefix": f"{name}-req"})
        assert r.status_code == 200, r.text
    page.wait_for_function(f"() => ({REPLICA_STRIPS})().length === 2 && ({REPLICA_STRIPS})()"
                           ".every(s => s.requests.length === 3)")
    strips = page.evaluate(REPLICA_STRIPS)
    assert [s["name"] for s in strips] == list(REPLICAS)
    for strip in strips:
        assert strip["label"] == f"{strip['name']} · {REPLICA_SLOTS} slots · up"
        assert sorted(strip["requests"]) == [f"{strip['name']}-req-{i}" for i in range(3)]
        assert strip["iterations"] > 0 and strip["painted"]
    assert not page.locator("#live-strip").is_visible()  # the single strip gives way
    assert page.evaluate(LEGEND, "replica-") == 6
    assert float(page.locator("#live-util-text").get_attribute("data-utilisation")) > 0
    screenshot(page, "dashboard-replicas.png")
    page.wait_for_function("() => document.querySelector('[data-key=ttft_p50]').textContent "
                           "!== '—'")  # the replicas' finished requests reach the latencies
    assert page.errors == []
