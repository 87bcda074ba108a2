"""Reliability end to end: nothing is lost.

- a short soak (benchmarks/soak.py: 100 mixed requests, a tenth of the clients leave);
- memory pressure: a KV pool far smaller than the load, so requests are preempted and
  resumed; greedy outputs still equal the offline API's on a big pool;
- engine faults: an iteration that raises fails only its own requests (an error result
  offline, HTTP 500 / an error event through the server); the rest complete;
- limits: max_tokens cap (400), body size (413), requests at once (503), prompt length (400);
- graceful shutdown: SIGTERM / SIGINT drain (503 to new requests, running ones finish),
  then exit 0; a drain that times out aborts what is left with an error event.

One `slotserve serve` at a time (module fixtures, each stopped by its last test).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time

import httpx
import pytest
import uvicorn

from benchmarks import soak
from slotserve import SamplingParams
from slotserve.cli import build_parser
from slotserve.engine.async_engine import AsyncEngine
from slotserve.server.api import ServerLimits, build_app
from slotserve.server.startup import server_limits
from tests.conftest import tiny_engine, tiny_llm
from tests.e2e.conftest import MODEL_NAME, cli_flags, free_port, running_server

GREEDY_NO_EOS = {"temperature": 0.0, "ignore_eos": True}


def post(url: str, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL_NAME, **body}, timeout=120, **kwargs)


def assert_error(r: httpx.Response, status: int, **fields) -> dict:
    """An OpenAI error body with this status (and these fields)."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    for key, value in fields.items():
        assert error[key] == value, error
    return error


def sse_data(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# --------------------------------------------------------------------------- soak
def test_soak_with_disconnects_loses_nothing(server, offline_llm):
    report = soak.soak(server.url, requests=100, concurrency=16, disconnect=0.1, seed=3,
                       warmup=8, max_tokens=16, pid=server.proc.pid,
                       log_path=server.log_path, reference_llm=offline_llm)
    print(report.summary())
    assert not report.failures, report.summary()
    assert report.outcomes["completed"] >= 85
    assert report.outcomes.get("cancelled", 0) >= 3
    assert report.server_side.get("cancelled: aborted", 0) >= 1
    assert report.repeated_cases["greedy"] >= 5 and report.repeated_cases["seeded"] >= 3
    server.stop()  # one server at a time from here on
    assert server.proc.returncode == 0


# --------------------------------------------------------------------------- pressure
PRESSURE_BLOCKS = 24  # x 16 tokens: room for 3 of the 16 ~100-token sequences at once


@pytest.fixture(scope="module")
def pressured(tmp_path_factory):
    flags = cli_flags(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512,
                      num_blocks=PRESSURE_BLOCKS, block_size=16, seed=0)
    with running_server(tmp_path_factory.mktemp("pressure"), *flags, "--drain-timeout=1") as proc:
        yield proc


def pressure_prompts(count: int = 16) -> list[str]:
    words = "river stone light garden music paper window morning silver bridge".split()
    return [f"Story {i}: " + " ".join(words[(i + k) % len(words)] for k in range(70))
            for i in range(count)]


def test_memory_pressure_preempts_and_outputs_match(pressured, offline_llm):
    prompts, max_tokens = pressure_prompts(), 24  # 75 + 24 tokens: 7 blocks each

    async def one(client, i: int, prompt: str) -> str:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                **GREEDY_NO_EOS}
        if i % 2:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["usage"]["completion_tokens"] == max_tokens
            assert out["choices"][0]["finish_reason"] == "length"
            return out["choices"][0]["text"]
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = [json.loads(d) for d in sse_data([x async for x in r.aiter_lines()])
                      if d != "[DONE]"]
        assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
        return "".join(e["choices"][0]["text"] for e in events)

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=pressured.url, timeout=300) as client:
            return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))

    served = asyncio.run(run())
    m = pressured.metrics()
    assert m["slotserve:num_preemptions_total"] > 0, "the pool was not under pressure"
    assert m["slotserve:kv_blocks_free"] == m["slotserve:kv_blocks_total"] == PRESSURE_BLOCKS
    assert m.get('slotserve:request_success_total{finished_reason="error"}', 0) == 0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    offline = offline_llm.generate(prompts, params, use_tqdm=False)
    for text, out in zip(served, offline):
        ref = soak.reference_entry(offline_llm.tokenizer, out.outputs[0])
        assert text == ref["text"] or soak.near_tie(ref, text), (text, ref["text"])
    print(f"preemptions: {m['slotserve:num_preemptions_total']:.0f}, "
          f"exact: {sum(t == o.outputs[0].text for t, o in zip(served, offline))}/16")


def test_sigint_drain_timeout_aborts_with_an_error_event(pressured):
    """--drain-timeout=1: a request that needs longer is aborted; its client hears why."""
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 300,
            "stream": True, **GREEDY_NO_EOS}
    with httpx.stream("POST", pressured.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        pressured.proc.send_signal(signal.SIGINT)
        rest = sse_data(lines)
    assert json.loads(first[len("data: "):])["choices"]
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert pressured.proc.wait(30) == 0
    log = pressured.log()
    assert "SIGINT: draining 1 running requests" in log and "drain timed out" in log


# --------------------------------------------------------------------------- faults
class FaultOnce:
    """runner.execute that raises in one iteration, the first whose plan matches `when`, for
    every plan of it holding one of that plan's requests: the engine retries a failed
    iteration in smaller groups, so each of them must also fail on its own."""

    def __init__(self, execute, when) -> None:
        self.execute = execute
        self.when = when
        self.failed: list[str] | None = None  # the request ids of the failed iteration
        self.iteration: int | None = None

    def __call__(self, plan):
        if self.failed is None and self.when(plan):
            self.failed = [seq.request_id for seq in plan.seqs]
            self.iteration = plan.iteration
        if plan.iteration == self.iteration and any(
                seq.request_id in self.failed for seq in plan.seqs):
            raise RuntimeError("injected fault")
        return self.execute(plan)


def test_a_fault_fails_only_its_iteration_offline(tiny_llama, monkeypatch):
    llm = tiny_llm(tiny_llama, num_blocks=64, max_num_seqs=3)
    fault = FaultOnce(llm.engine.runner.execute, lambda plan: plan.iteration == 2)
    monkeypatch.setattr(llm.engine.runner, "execute", fault)
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    failed = [o for o in outs if o.outputs[0].finish_reason == "error"]
    assert len(fault.failed) == 3 and {o.request_id for o in failed} == set(fault.failed)
    assert all("injected fault" in o.error for o in failed)
    done = [o for o in outs if o not in failed]
    assert len(done) == 3 and all(len(o.outputs[0].token_ids) == 6 for o in done)
    llm.engine.check_integrity()
    assert llm.engine.kv.num_free_blocks == 64
    # The survivors' outputs are as if nothing had happened.
    monkeypatch.undo()
    again = llm.generate([prompts[int(o.request_id)] for o in done],
                         SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in done]


@contextlib.contextmanager
def inprocess_server(engine):
    """The app over `engine` in uvicorn on loopback, in a thread (so tests can reach into
    the engine); yields the base URL."""
    async_engine = AsyncEngine(engine)
    async_engine.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(async_engine, "tiny"), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "no server"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        async_engine.stop()


def test_a_fault_through_the_server_fails_only_its_requests(tiny_llama, monkeypatch):
    engine = tiny_engine(tiny_llama, num_blocks=64, max_num_seqs=4)
    fault = FaultOnce(engine.runner.execute,  # once all 4 requests are decoding
                      lambda plan: [s.kind for s in plan.seqs] == ["decode"] * 4)
    monkeypatch.setattr(engine.runner, "execute", fault)
    body = {"model": "tiny", "max_tokens": 200, **GREEDY_NO_EOS}

    async def one(client, i: int, stream: bool):
        payload = {**body, "prompt": [5 + i, 6, 7], "stream": stream}
        if not stream:
            return await client.post("/v1/completions", json=payload)
        async with client.stream("POST", "/v1/completions", json=payload) as r:
            return r.status_code, sse_data([x async for x in r.aiter_lines()])

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            first = await asyncio.gather(*(one(client, i, i % 2 == 0) for i in range(4)))
            later = await asyncio.gather(*(one(client, i, i % 2 == 0) for i in range(4, 6)))
            return first, later

    with inprocess_server(engine) as url:
        first, later = asyncio.run(run())
    assert fault.failed is not None and len(fault.failed) == 4
    for i, result in enumerate(first):
        if i % 2:  # not streaming: HTTP 500 with the error body
            assert_error(result, 500, type="server_error")
        else:  # streaming: 200, then an error event and [DONE]
            status, data = result
            assert status == 200 and data[-1] == "[DONE]", data[-3:]
            assert json.loads(data[-2])["error"]["type"] == "server_error"
    status, data = later[0]
    assert status == 200 and json.loads(data[-2])["choices"][0]["finish_reason"] == "length"
    assert later[1].status_code == 200 and later[1].json()["usage"]["completion_tokens"] == 200
    engine.check_integrity()
    assert engine.kv.num_free_blocks == 64
    assert engine.stats.finished_by_reason.get("error") == 4


# --------------------------------------------------------------------------- limits
CAP, BODY_BYTES, CONNECTIONS = 32, 2048, 3


def test_limit_and_drain_flags():
    args = build_parser().parse_args(["serve"])
    loopback = ("localhost", "127.0.0.1", "::1")  # the default bind answers these Hosts
    assert server_limits(args) == ServerLimits(max_tokens=None, max_body_bytes=1 << 20,
                                               max_connections=None, allowed_hosts=loopback)
    assert args.drain_timeout == 30
    args = build_parser().parse_args(["serve", "--max-tokens-cap", "64", "--max-body-bytes",
                                      "64K", "--max-connections", "8", "--drain-timeout", "5"])
    assert server_limits(args) == ServerLimits(64, 64 << 10, 8, allowed_hosts=loopback)
    assert args.drain_timeout == 5
    for flag in ("--max-tokens-cap", "--max-body-bytes", "--max-connections"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, "0"])


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    flags = cli_flags(max_num_seqs=4, num_blocks=64, max_model_len=128)
    with running_server(tmp_path_factory.mktemp("limits"), *flags,
                        f"--max-tokens-cap={CAP}", f"--max-body-bytes={BODY_BYTES}",
                        f"--max-connections={CONNECTIONS}", "--drain-timeout=60") as proc:
        yield proc


def test_prompt_over_the_model_length_is_400(limited):
    r = post(limited.url, "/v1/completions", {"prompt": "word " * 200, "max_tokens": 2})
    assert "128 tokens" in assert_error(r, 400, param="prompt")["message"]


def test_max_tokens_over_the_cap_is_400(limited):
    r = post(limited.url, "/v1/completions", {"prompt": "Hi", "max_tokens": CAP + 1})
    error = assert_error(r, 400, param="max_tokens", code="max_tokens_exceeded")
    assert f"at most {CAP}" in error["message"]
    messages = [{"role": "user", "content": "Hi"}]
    r = post(limited.url, "/v1/chat/completions",
             {"messages": messages, "max_completion_tokens": CAP + 1})
    assert_error(r, 400, param="max_completion_tokens")
    r = post(limited.url, "/v1/completions", {"prompt": "Hi", "max_tokens": CAP,
                                              "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == CAP
    # Without max_tokens, chat's default (1024) is lowered to the cap, not refused.
    r = post(limited.url, "/v1/chat/completions", {"messages": messages, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == CAP


def test_body_over_the_limit_is_413(limited):
    r = post(limited.url, "/v1/completions", {"prompt": "x" * BODY_BYTES, "max_tokens": 1})
    assert str(BODY_BYTES) in assert_error(r, 413, code="request_too_large")["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(8):
            yield b" " * 512
        yield json.dumps({"prompt": "Hi"}).encode()

    r = httpx.post(limited.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert_error(r, 413)
    # NOTE: padded with a field the server ignores (`user` is now read: at most 256 chars)
    under = {"prompt": "Hi", "max_tokens": 1, "x_padding": "x" * (BODY_BYTES - 200)}
    assert post(limited.url, "/v1/completions", under).status_code == 200


def test_requests_over_the_connection_limit_get_503(limited):
    body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": CAP, "stream": True,
            **GREEDY_NO_EOS}
    with contextlib.ExitStack() as stack:
        for _ in range(CONNECTIONS):  # hold every allowed request open
            r = stack.enter_context(httpx.stream("POST", limited.url + "/v1/completions",
                                                 json=body, timeout=60))
            assert r.status_code == 200
        error = assert_error(post(limited.url, "/v1/completions", {"prompt": "Hi"}), 503,
                             code="too_many_connections")
        assert "--max-connections" in error["message"]
        assert httpx.get(limited.url + "/health").status_code == 200  # exempt
        assert httpx.get(limited.url + "/metrics").status_code == 200
    deadline = time.monotonic() + 30
    while (r := post(limited.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
           ).status_code == 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert r.status_code == 200


def test_sigterm_drains_running_requests_then_exits_0(limited):
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": CAP,
            "stream": True, **GREEDY_NO_EOS}
    with httpx.stream("POST", limited.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        limited.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(limited.url + "/health").status_code == 200:  # the drain started
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = post(limited.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert_error(refused, 503, type="service_unavailable")
        rest = sse_data(lines)
    events = [json.loads(d) for d in [first[len("data: "):], *rest[:-1]]]
    assert rest[-1] == "[DONE]" and "error" not in events[-1]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert len("".join(e["choices"][0]["text"] for e in events)) > 0
    assert limited.proc.wait(30) == 0
    log = limited.log()
    assert "SIGTERM: draining 1 running requests" in log and "drained" in log
    with pytest.raises(httpx.ConnectError):  # after the drain, the listener is closed
        httpx.get(limited.url + "/health")
