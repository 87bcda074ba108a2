"""chat_template_kwargs (vLLM's: Qwen3's `enable_thinking: false`) and --chat-template over
HTTP, on the tiny random Llama with a tiny tokenizer: the prompt the server builds is the
template's with those variables; bad values are 400s naming the field."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from slotserve.engine.async_engine import AsyncEngine
from slotserve.server.api import ServerLimits, build_app
from slotserve.server.protocol.requests import (
    MAX_CHAT_TEMPLATE_KWARGS_BYTES,
    MAX_CHAT_TEMPLATE_KWARGS_DEPTH,
)
from tests.unit.server_fixtures import text_engine, tiny_tokenizer
from tests.unit.test_chat_template_qwen3 import QWEN3_STYLE_TEMPLATE, qwen3_style_tokenizer

MESSAGES = [{"role": "user", "content": "hello world"}]


def served_app(engine, **limits):
    async_engine = AsyncEngine(engine)
    async_engine.start()
    client = TestClient(build_app(async_engine, "tiny", limits=ServerLimits(**limits)),
                        raise_server_exceptions=False)
    return client, async_engine


@pytest.fixture(scope="module")
def qwen3_client(tiny_llama):
    client, engine = served_app(text_engine(tiny_llama, tokenizer=qwen3_style_tokenizer()))
    with client:
        yield client
    engine.stop()


def chat(client, **body):
    return client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 1, "temperature": 0, **body})


def prompt_tokens(response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_enable_thinking_false_reaches_the_template(qwen3_client):
    tokenizer = qwen3_style_tokenizer()
    off = tokenizer.encode_chat(MESSAGES, enable_thinking=False)
    plain = tokenizer.encode_chat(MESSAGES)
    assert len(off) > len(plain)  # the empty <think></think> block
    assert prompt_tokens(chat(qwen3_client, chat_template_kwargs={
        "enable_thinking": False})) == len(off)
    for harmless in ({}, None, {"enable_thinking": True}):
        assert prompt_tokens(chat(qwen3_client, chat_template_kwargs=harmless)) == len(plain)


@pytest.mark.parametrize("value, message", [
    ([1, 2], "chat_template_kwargs"),  # not an object
    ("enable_thinking", "chat_template_kwargs"),
    ({"messages": []}, "set by the server"),
    ({"tools": []}, "set by the server"),
    ({"add_generation_prompt": False}, "set by the server"),
    ({"bad-name": 1}, "not a template variable name"),
    ({"1st": 1}, "not a template variable name"),
    ({"x" * 65: 1}, "not a template variable name"),
    ({"big": "x" * MAX_CHAT_TEMPLATE_KWARGS_BYTES}, "bytes of JSON"),
    ({"deep": [[[[[[[[[1]]]]]]]]]}, "nested more than"),
])
def test_bad_chat_template_kwargs_are_400_naming_the_field(qwen3_client, value, message):
    r = chat(qwen3_client, chat_template_kwargs=value)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template_kwargs" and message in error["message"]


def test_depth_bound_is_the_documented_one(qwen3_client):
    nested = 1
    for _ in range(MAX_CHAT_TEMPLATE_KWARGS_DEPTH - 1):
        nested = [nested]
    assert chat(qwen3_client, chat_template_kwargs={"x": nested}).status_code == 200
    assert chat(qwen3_client, chat_template_kwargs={"x": [nested]}).status_code == 400


def test_a_template_that_raises_on_a_variable_is_a_400(tiny_llama):
    """A template's raise_exception on a client's variable is the request's fault (400
    naming messages, with the template's words), not a 500."""
    template = ("{% if strict %}{{ raise_exception('strict mode is refused') }}{% endif %}"
                "{{ messages[0].content }}")
    engine = text_engine(tiny_llama, tokenizer=tiny_tokenizer(template=template))
    client, async_engine = served_app(engine)
    try:
        with client:
            assert chat(client, chat_template_kwargs={"strict": False}).status_code == 200
            r = chat(client, chat_template_kwargs={"strict": True})
        assert r.status_code == 400
        assert "strict mode is refused" in r.json()["error"]["message"]
    finally:
        async_engine.stop()


@pytest.fixture(scope="module")
def override_client(tiny_llama):
    """A model with no chat template, served with --chat-template (ServerLimits)."""
    engine = text_engine(tiny_llama, tokenizer=tiny_tokenizer(template=None))
    client, async_engine = served_app(engine, chat_template=QWEN3_STYLE_TEMPLATE)
    with client:
        yield client
    async_engine.stop()


def test_chat_template_flag_overrides_the_model(override_client, tiny_llama):
    tokenizer = tiny_tokenizer(template=None)
    expected = tokenizer.encode_chat(MESSAGES, chat_template=QWEN3_STYLE_TEMPLATE,
                                     enable_thinking=False)
    r = chat(override_client, chat_template_kwargs={"enable_thinking": False})
    assert prompt_tokens(r) == len(expected)
    r = override_client.post("/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200
    assert r.json()["tokens"] == tokenizer.encode_chat(MESSAGES,
                                                       chat_template=QWEN3_STYLE_TEMPLATE)


def test_without_any_template_chat_is_a_400(tiny_llama):
    engine = text_engine(tiny_llama, tokenizer=tiny_tokenizer(template=None))
    client, async_engine = served_app(engine)
    try:
        with client:
            r = chat(client)
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
    finally:
        async_engine.stop()
