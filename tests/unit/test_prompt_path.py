"""The server's prompt path: one chat path with the offline LLM.chat (BOS exactly once),
prompts checked cheaply and tokenized off the event loop, stop-string bounds."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from slotserve import SamplingParams
from slotserve.engine.async_engine import AsyncEngine
from slotserve.engine.llm import LLM
from slotserve.server.api import ServerLimits, build_app
from tests.support.launch import free_port
from tests.unit.server_fixtures import app_client, text_engine, tiny_tokenizer

MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello world, name three colours"}]


class RecordingEngine(AsyncEngine):
    """An AsyncEngine that remembers the prompts the server hands it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list = []

    def generate(self, request_id, prompt, params, **kwargs):
        self.prompts.append(prompt)
        return super().generate(request_id, prompt, params, **kwargs)


@pytest.fixture(scope="module")
def served(tiny_llama):
    engine = RecordingEngine(text_engine(tiny_llama, num_blocks=64, max_num_seqs=4))
    with app_client(engine, limits=ServerLimits(max_body_bytes=8 << 20)) as client:
        yield client, engine


def test_encode_chat_writes_bos_once():
    tok = tiny_tokenizer(add_bos_token=True)
    assert tok.encode("hi")[0] == tok.bos_token_id  # the tokenizer adds BOS to plain text
    ids = tok.encode_chat(MESSAGES)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids == tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)


def test_server_chat_and_offline_chat_run_the_same_prompt(served, tiny_llama):
    client, engine = served
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    server_ids = engine.prompts[-1]
    offline = LLM(engine=text_engine(tiny_llama, num_blocks=64)).chat(
        MESSAGES, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert server_ids == offline.prompt_token_ids
    bos = engine.engine.tokenizer.bos_token_id
    assert server_ids.count(bos) == 1
    assert r.json()["usage"]["prompt_tokens"] == len(server_ids)
    assert r.json()["choices"][0]["message"]["content"] == offline.outputs[0].text


def test_text_prompt_reaches_the_engine_as_ids(served):
    client, engine = served
    r = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 2})
    assert r.status_code == 200
    assert engine.prompts[-1] == engine.engine.tokenizer.encode("hello world")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x" * (1 << 20)}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (1 << 20)}]},
     "messages"),
])
def test_oversized_text_is_refused_without_tokenizing(served, monkeypatch, path, body, param):
    client, engine = served
    tokenizer = engine.engine.tokenizer
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(1) or [1])
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "context_length_exceeded"
    assert "tokens" in error["message"] and not calls


def test_the_size_check_is_sound(served):
    """Text under the byte bound is tokenized; the token count decides."""
    client, engine = served
    server = client.app.state.server
    assert server.max_prompt_bytes >= server.max_prompt_tokens  # a token is >= 1 byte
    text = "hello world " * 400  # ~800 tokens: over the 511 a prompt may have here
    assert len(text) < server.max_prompt_bytes
    r = client.post("/v1/completions", json={"prompt": text})
    assert r.status_code == 400 and "has " in r.json()["error"]["message"]
    fits = "hello " * 100
    r = client.post("/v1/completions", json={"prompt": fits, "max_tokens": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stop,ok", [
    (["a"] * 64, True), (["a"] * 65, False), ("s" * 512, True), ("s" * 513, False),
    (["ok", "s" * 513], False),
])
def test_stop_bounds(served, stop, ok):
    client, _ = served
    r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1, "stop": stop})
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "stop" and error["type"] == "invalid_request_error"
        assert "--max-stop" in error["message"]


def test_stop_bounds_can_be_lifted(tiny_llama):
    engine = AsyncEngine(text_engine(tiny_llama, num_blocks=16))
    engine.start()
    try:
        limits = ServerLimits(max_stop_strings=None, max_stop_chars=None)
        with TestClient(build_app(engine, "tiny", limits=limits)) as client:
            r = client.post("/v1/completions", json={"prompt": [5], "max_tokens": 1,
                                                     "stop": ["a" * 600] * 100})
            assert r.status_code == 200, r.text
    finally:
        engine.stop()


# ------------------------------------------------------------------ the event loop stays free
class ThreadedServer:
    """uvicorn in a thread on a free loopback port (real sockets, so chunks arrive as sent)."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


STEP_S = 0.1


def _slow_steps(runner, monkeypatch) -> None:
    execute = runner.execute

    def slow_execute(*args, **kwargs):
        time.sleep(STEP_S)
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", slow_execute)


def _stream_gaps(url: str) -> list[float]:
    """Seconds between the chunks of one streamed completion."""
    body = {"prompt": [5, 6, 7], "max_tokens": 16, "ignore_eos": True, "stream": True,
            "logprobs": 1}  # NOTE: a chunk every token (text may wait for a whole character)
    arrivals = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


# A client in its own process (as real clients are): posts 1 MiB prompts until killed.
SENDER = """
import sys, httpx
body = ('{"prompt": "' + "hello world the quick brown fox " * 32768 + '"}').encode()
with httpx.Client(timeout=60) as client:
    while True:
        r = client.post(sys.argv[1] + "/v1/completions", content=body,
                        headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
"""


def _oversized_senders(url: str, count: int = 3) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SENDER, url]) for _ in range(count)]


@pytest.mark.parametrize("size_check", [True, False], ids=["size-check", "tokenized"])
def test_oversized_prompts_do_not_stall_a_stream(tiny_llama, monkeypatch, size_check):
    """A stream's longest gap between chunks, with three clients sending 1 MiB prompts all
    the while, against the same stream alone. Without the size check the prompts are
    tokenized (in the server's threads); either way the event loop keeps streaming.

    NOTE: each step takes STEP_S longer (as a larger model's would), so the gaps measure
    the event loop, not the noise of a busy 2-core machine: tokenizing one of these
    prompts on the loop takes several steps' time."""
    engine = AsyncEngine(text_engine(tiny_llama, num_blocks=64, max_num_seqs=4))
    _slow_steps(engine.engine.runner, monkeypatch)
    engine.start()
    app = build_app(engine, "tiny", limits=ServerLimits(max_body_bytes=8 << 20))
    if not size_check:
        app.state.server.max_prompt_bytes = None
    try:
        with ThreadedServer(app) as url:
            _stream_gaps(url)  # warm up
            alone = max(_stream_gaps(url))
            senders = _oversized_senders(url)
            try:
                time.sleep(1.0)  # the senders are started and busy
                assert all(sender.poll() is None for sender in senders)
                crowded = max(_stream_gaps(url))
                assert all(sender.poll() is None for sender in senders)  # they kept sending
            finally:
                for sender in senders:
                    sender.kill()
                    sender.wait(10)
    finally:
        engine.stop()
    assert crowded < 4 * alone, (crowded, alone)
