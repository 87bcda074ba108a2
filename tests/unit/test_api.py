"""The FastAPI app over a real AsyncEngine on a tiny random model (token-id prompts only:
it has no tokenizer). The embedded model and the openai client: tests/e2e."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from slotserve.engine.async_engine import AsyncEngine
from slotserve.server.api import build_app
from slotserve.server.generation import ClientGone, unless_disconnected
from tests.conftest import tiny_engine
from tests.unit.server_fixtures import app_client

PROMPT = [5, 6, 7, 8]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def served(tiny_llama):
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=64, max_num_seqs=4))
    with app_client(engine, aliases=("tiny-alias",)) as client:
        yield client, engine


@pytest.fixture
def client(served):
    return served[0]


def post(client, path: str, **body):
    return client.post(path, json={"model": "tiny", **body})


def sse_events(text: str) -> list:
    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion(client):
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=5, temperature=0,
             ignore_eos=True)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_alias_and_no_model_are_accepted(client):
    for body in ({"model": "tiny-alias"}, {}):
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, **body})
        assert r.status_code == 200


def test_completion_logprobs(client):
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=3, temperature=0,
             logprobs=2, ignore_eos=True)
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    for logprob, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert max(top.values()) == pytest.approx(logprob) and len(top) == 2


def test_n_choices(client):
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=3, n=3, seed=1,
             ignore_eos=True)
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 9 and body["usage"]["prompt_tokens"] == 4


def test_stream_with_usage(client):
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=4, n=2, stream=True,
             ignore_eos=True, logprobs=1, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert all(c["usage"] is None for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes.count("length") == 2
    tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks)
    assert tokens == 8


def test_stream_with_continuous_usage(client):
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=4, n=2, stream=True,
             ignore_eos=True, stream_options={"include_usage": True,
                                              "continuous_usage_stats": True})
    *chunks, last = sse_events(r.text)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    usages = [c["usage"] for c in chunks]
    assert all(u["prompt_tokens"] == 4 and u["total_tokens"] == 4 + u["completion_tokens"]
               and u["prompt_tokens_details"] == {"cached_tokens": 0} for u in usages)
    so_far = [u["completion_tokens"] for u in usages]
    assert so_far == sorted(so_far) and 1 <= so_far[0] and so_far[-1] == 8
    # without include_usage the option asks for nothing
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=2, stream=True,
             stream_options={"continuous_usage_stats": True})
    assert all("usage" not in e for e in sse_events(r.text))


def test_unknown_fields_are_served_and_logged(client, monkeypatch, caplog):
    from slotserve.server.protocol import IgnoredFields, request_model

    monkeypatch.setattr(request_model, "IGNORED_FIELDS", IgnoredFields())
    caplog.set_level("WARNING", logger="slotserve.server")
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=1, use_beam_search=False)
    assert r.status_code == 200, r.text
    assert ("The following fields were present in the request but ignored: "
            "{'use_beam_search'}") in caplog.messages


def test_stream_without_usage(client):
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=2, stream=True)
    events = sse_events(r.text)
    assert events and all("usage" not in e for e in events)


def test_models_health_metrics_trace(client):
    # NOTE: a request of its own, so the trace has iterations when this test runs alone
    assert post(client, "/v1/completions", prompt=PROMPT, max_tokens=2).status_code == 200
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert client.get("/v1/models/tiny-alias").json()["id"] == "tiny"
    assert client.get("/v1/models/other").json()["error"]["code"] == "model_not_found"
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "slotserve:kv_blocks_total 64.0" in metrics.text
    assert "slotserve:time_to_first_token_seconds_count" in metrics.text
    trace = client.get("/debug/trace").json()
    assert trace["kv_blocks_total"] == 64 and trace["iterations"]


@pytest.mark.parametrize("path,content,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'{"prompt": [1], "max_tokens": "5"}', 400, "max_tokens"),
    ("/v1/completions", b'{"max_tokens": 5}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [1], "model": "gpt-4"}', 404, "model"),
    ("/v1/completions", b'{"prompt": [1], "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": [1], "top_p": 2}', 400, "top_p"),
    ("/v1/completions", b'{"prompt": []}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [99999]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [1], "stop": [1]}', 400, "stop"),
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}', 400,
     "messages"),  # this model has no tokenizer: no chat template
    ("/v1/chat/completions", b'{"messages": [{"role": "bot", "content": "hi"}]}', 400,
     "messages.0.role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', 400, "messages.0"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": '
     b'"image_url", "image_url": {"url": "x"}}]}]}', 400, "messages.0.content"),
])
def test_bad_input(client, path, content, status, param):
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize("message,words", [
    ({"role": "user"}, "a user message needs content"),
    ({"role": "tool", "tool_call_id": "x"}, "a tool message needs content"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "'image_url' are not supported: this server reads text parts only"),
])
def test_chat_messages_name_what_is_missing_or_unsupported(client, message, words):
    r = post(client, "/v1/chat/completions", messages=[message])
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_prompt_too_long(client):
    r = post(client, "/v1/completions", prompt=[5] * 2000)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "tokens" in r.json()["error"]["message"]


def test_unknown_route_has_the_error_shape(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_queue_full_is_429_with_retry_after(served):
    client, engine = served
    engine.max_waiting = 0
    try:
        r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=2)
    finally:
        engine.max_waiting = None
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert post(client, "/v1/completions", prompt=PROMPT, max_tokens=2).status_code == 200


def test_unexpected_error_is_500_and_the_server_goes_on(client):
    server = client.app.state.server
    server.models = lambda: 1 / 0
    try:
        r = client.get("/v1/models")
    finally:
        del server.models
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert client.get("/v1/models").status_code == 200


def test_engine_failure_is_500(served, monkeypatch):
    client, engine = served

    def boom(plan):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.engine.runner, "execute", boom)
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=2)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    assert post(client, "/v1/completions", prompt=PROMPT, max_tokens=2).status_code == 200
    engine.engine.check_integrity()


def test_shutting_down_is_503(tiny_llama):
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16))
    engine.start()
    try:
        with TestClient(build_app(engine, "tiny")) as client:
            engine.stop_accepting()
            r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=2)
            assert r.status_code == 503
            assert r.json()["error"]["type"] == "service_unavailable"
    finally:
        engine.stop()


class FakeRequest:
    """receive() answers http.disconnect after `after` seconds."""

    def __init__(self, after: float) -> None:
        self.after = after

    async def receive(self) -> dict:
        await asyncio.sleep(self.after)
        return {"type": "http.disconnect"}


def test_disconnect_cancels_the_work():
    cancelled = asyncio.Event()

    async def work():
        try:
            await asyncio.sleep(10)
        finally:
            cancelled.set()

    async def main():
        with pytest.raises(ClientGone):
            await unless_disconnected(FakeRequest(0.01), work())
        assert cancelled.is_set()
        assert await unless_disconnected(FakeRequest(10), asyncio.sleep(0, "done")) == "done"

    asyncio.run(main())


@pytest.mark.parametrize("content,headers,expected", [
    (b"", JSON, "the request needs a JSON body"),
    (b'{"prompt": [1]}', {"content-type": "text/plain"}, "must be a JSON object"),
    (b'{"prompt": [1], "stop": 5}', JSON, "stop: Input should be a valid string"),
    (b'{"prompt": [1], "stop": 5, "n": "2"}', JSON, "(and 1 more invalid field)"),
])
def test_validation_messages(client, content, headers, expected):
    r = client.post("/v1/completions", content=content, headers=headers)
    assert r.status_code == 400
    assert expected in r.json()["error"]["message"]
