"""Prefix caching over HTTP: the cache_salt field (completions and chat), POST
/reset_prefix_cache behind the admin key, the prefix-cache metrics and the usage's
prompt_tokens_details.cached_tokens."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from slotserve.engine.async_engine import AsyncEngine
from slotserve.server.api import build_app
from slotserve.server.auth import AccessPolicy, Tenant
from tests.unit.server_fixtures import started, text_engine

PROMPT = list(range(10, 50))  # two full blocks of 16 and a tail
ADMIN = "admin-secret"
KEYS = (("sk-alice", Tenant("alice")),)
GREEDY = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}


class SaltRecorder(AsyncEngine):
    """An AsyncEngine that remembers the cache_salt of each generation."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.salts: list = []

    def generate(self, request_id, prompt, params, *, cache_salt=None, **scheduling):
        self.salts.append(cache_salt)
        return super().generate(request_id, prompt, params, cache_salt=cache_salt,
                                **scheduling)


@pytest.fixture
def engine(tiny_llama):
    with started(SaltRecorder(text_engine(tiny_llama, num_blocks=64, max_num_seqs=4))) as engine:
        yield engine


def app_client(engine, **policy) -> TestClient:
    return TestClient(build_app(engine, "tiny", access=AccessPolicy(**policy)),
                      raise_server_exceptions=False)


def metrics(client, headers=None) -> dict[str, float]:
    text = client.get("/metrics", headers=headers or {}).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_cache_salt_reaches_the_engine_and_separates_prefixes(engine):
    with app_client(engine) as client:
        for salt in ("t1", "t2", "t1"):
            r = client.post("/v1/completions", json={"prompt": PROMPT, "cache_salt": salt,
                                                     **GREEDY})
            assert r.status_code == 200, r.text
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello world"}], "cache_salt": "t3",
            **GREEDY})
        assert r.status_code == 200, r.text
        m = metrics(client)
    assert engine.salts == ["t1", "t2", "t1", "t3"]
    assert m["slotserve:prefix_cache_hits_total"] == 32  # only the second "t1" hit
    assert m["slotserve:prefix_cache_queries_total"] >= 3 * len(PROMPT)
    assert 0 < m["slotserve:prefix_cache_hit_rate"] < 1


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
@pytest.mark.parametrize("salt", ["", 5, "x" * 257])
def test_a_bad_cache_salt_is_400(engine, path, body, salt):
    with app_client(engine) as client:
        r = client.post(path, json={**body, "cache_salt": salt, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"


def test_reset_prefix_cache_drops_the_cached_blocks(engine):
    with app_client(engine) as client:
        assert client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}).status_code == 200
        assert metrics(client)["slotserve:kv_blocks_cached_free"] == 2
        r = client.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"status": "ok", "blocks_dropped": 2}
        assert metrics(client)["slotserve:kv_blocks_cached_free"] == 0
        assert client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}).status_code == 200
        assert metrics(client)["slotserve:prefix_cache_hits_total"] == 0  # nothing to hit
        assert client.get("/reset_prefix_cache").status_code == 405


def test_reset_prefix_cache_is_an_admin_route(engine):
    with app_client(engine, api_keys=KEYS, admin_key=ADMIN) as client:
        for headers in ({}, {"Authorization": "Bearer sk-alice"}):
            assert client.post("/reset_prefix_cache", headers=headers).status_code == 401
        r = client.post("/reset_prefix_cache", headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200 and r.json()["blocks_dropped"] == 0
    with app_client(engine, api_keys=KEYS) as client:  # no admin key: admin routes are off
        r = client.post("/reset_prefix_cache", headers={"Authorization": "Bearer sk-alice"})
        assert r.status_code == 404


def test_reset_answers_503_when_the_engine_does_not_run(tiny_llama):
    engine = AsyncEngine(text_engine(tiny_llama, num_blocks=16))  # never started
    with app_client(engine) as client:
        r = client.post("/reset_prefix_cache")
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


def sse_events(text: str) -> list[dict]:
    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def cached_tokens(usage: dict) -> int:
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    return usage["prompt_tokens_details"]["cached_tokens"]


LONG_CHAT = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 4}]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": LONG_CHAT}),
])
def test_usage_counts_the_prompt_tokens_found_cached(engine, path, body):
    with app_client(engine) as client:
        first = client.post(path, json={**body, **GREEDY}).json()["usage"]
        second = client.post(path, json={**body, **GREEDY}).json()["usage"]
        streamed = sse_events(client.post(path, json={
            **body, **GREEDY, "stream": True,
            "stream_options": {"include_usage": True}}).text)[-1]["usage"]
    assert cached_tokens(first) == 0
    assert first["prompt_tokens"] >= 32  # two full blocks of 16 at least
    for usage in (second, streamed):
        cached = cached_tokens(usage)
        assert 0 < cached < usage["prompt_tokens"] and cached % 16 == 0


def test_chat_stream_with_continuous_usage(engine):
    body = {"messages": LONG_CHAT, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    with app_client(engine) as client:
        events = sse_events(client.post("/v1/chat/completions", json=body).text)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    so_far = [c["usage"]["completion_tokens"] for c in chunks]
    assert so_far[0] == 0  # the role chunk comes before any token
    assert so_far == sorted(so_far) and so_far[-1] == 3
    assert all(cached_tokens(c["usage"]) == 0 for c in events)
