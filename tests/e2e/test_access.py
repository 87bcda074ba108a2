"""Issue 14 end to end: a real server with API keys (tenants) and an admin key, the official
`openai` client; client request ids, stop bounds and oversized prompts on it."""

from __future__ import annotations

import asyncio
import base64

import httpx
import openai
import pytest

from tests.e2e.conftest import ENGINE_FLAGS, MODEL_NAME, running_server
from tests.support.launch import cli_flags

ADMIN = "adm-e2e-secret"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keyed")
    keys = folder / "keys.txt"
    keys.write_text("# key tenant weight\nsk-alice alice 2\nsk-bob bob\n")
    with running_server(folder, *cli_flags(**ENGINE_FLAGS), "--api-keys-file", str(keys),
                        "--admin-key", ADMIN) as proc:
        yield proc


def client(server, key: str, cls=openai.OpenAI):
    return cls(base_url=server.base_url, api_key=key, max_retries=0)


def test_keys_decide_who_may_generate(keyed):
    out = client(keyed, "sk-alice").chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0)
    assert out.choices[0].message.content
    for key in ("sk-nobody", ADMIN + "x"):
        with pytest.raises(openai.AuthenticationError):
            client(keyed, key).models.list()
    r = httpx.post(keyed.base_url + "/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(keyed.url + "/health").json() == {"status": "ok"}


def test_admin_routes_need_the_admin_key(keyed):
    for path in ("/metrics", "/debug/trace", "/"):
        assert httpx.get(keyed.url + path).status_code == 401, path
        alice = {"Authorization": "Bearer sk-alice"}
        assert httpx.get(keyed.url + path, headers=alice).status_code == 401, path
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert httpx.get(keyed.url + path, headers=admin, timeout=30).status_code == 200
    basic = base64.b64encode(f"ops:{ADMIN}".encode()).decode()
    r = httpx.get(keyed.url + "/metrics", headers={"Authorization": f"Basic {basic}"})
    assert r.status_code == 200 and "slotserve:" in r.text


def test_clients_may_reuse_request_ids(keyed):
    async def run():
        async with client(keyed, "sk-alice", openai.AsyncOpenAI) as alice, \
                client(keyed, "sk-bob", openai.AsyncOpenAI) as bob:
            calls = [c.completions.with_raw_response.create(
                model=MODEL_NAME, prompt="Once upon a time", max_tokens=8,
                extra_headers={"X-Request-Id": "same-id"}, extra_body={"ignore_eos": True})
                for c in (alice, bob, alice)]
            return await asyncio.gather(*calls)

    raws = asyncio.run(run())
    assert all(raw.headers["x-request-id"] == "same-id" for raw in raws)
    ids = {raw.parse().id for raw in raws}
    assert len(ids) == 3 and not any("same-id" in i for i in ids)
    log = keyed.log()
    assert " [tenant alice, X-Request-Id same-id]: " in log
    assert " [tenant bob, X-Request-Id same-id]: " in log
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert "same-id" not in httpx.get(keyed.url + "/debug/trace", headers=admin, timeout=30).text


def test_stop_bounds(keyed):
    bob = client(keyed, "sk-bob")
    with pytest.raises(openai.BadRequestError) as info:
        bob.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2,
                               stop=[f"s{i}" for i in range(65)])
    assert info.value.param == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        bob.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, stop="x" * 513)
    assert info.value.param == "stop"


def test_oversized_prompt_is_refused_untokenized(keyed):
    """900 kB of text: far more than 512 tokens can hold; the size check refuses it (its
    message counts bytes; the token count's would count tokens)."""
    bob = client(keyed, "sk-bob")
    with pytest.raises(openai.BadRequestError) as info:
        bob.completions.create(model=MODEL_NAME, prompt="hello world " * 75_000, max_tokens=1)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert "bytes of text" in info.value.message
    assert bob.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1).choices


def test_logs_say_who_may_connect(keyed):
    log = keyed.log()
    assert "access: /v1 needs an API key (2 keys, tenants: alice, bob)" in log
    assert "admin routes (/, /debug, /metrics) need --admin-key" in log
    assert "no --api-key" not in log
