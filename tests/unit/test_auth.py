"""Access: API keys (tenants), the admin key, admin routes off, server-owned request ids,
/health when the engine is unhealthy; with the official `openai` client where it fits."""

from __future__ import annotations

import base64
import logging
import re

import openai
import pytest
from fastapi.testclient import TestClient

from slotserve.cli import main
from slotserve.engine.async_engine import AsyncEngine
from slotserve.server.api import build_app
from slotserve.server.auth import AccessPolicy, Tenant, load_api_keys_file
from tests.conftest import tiny_engine
from tests.unit.server_fixtures import started

PROMPT = [5, 6, 7, 8]
KEYS = (("sk-alice", Tenant("alice", 2.0)), ("sk-bob", Tenant("bob")))
ADMIN = "admin-secret"
ADMIN_PATHS = ("/metrics", "/debug/trace", "/", "/dashboard")


@pytest.fixture
def engine(tiny_llama):
    """NOTE: one per test: an app's shutdown stops its engine accepting requests."""
    with started(AsyncEngine(tiny_engine(tiny_llama, num_blocks=64, max_num_seqs=4))) as engine:
        yield engine


def app_client(engine, **policy) -> TestClient:
    return TestClient(build_app(engine, "tiny", access=AccessPolicy(**policy)),
                      raise_server_exceptions=False)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def basic(password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"me:{password}".encode()).decode()}


def complete(client, headers=None, **extra):
    return client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **extra},
                       headers=headers or {})


# ------------------------------------------------------------------ the keys file
def test_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# key tenant weight\n\nsk-a alice 2\n  sk-b bob\nsk-c carol 0.5  \n")
    assert load_api_keys_file(path) == [("sk-a", Tenant("alice", 2.0)),
                                        ("sk-b", Tenant("bob", 1.0)),
                                        ("sk-c", Tenant("carol", 0.5))]


@pytest.mark.parametrize("line,message", [
    ("sk-a", "expected 'KEY TENANT [WEIGHT]', got 1 fields"),
    ("sk-a alice 1 extra", "expected 'KEY TENANT [WEIGHT]', got 4 fields"),
    ("sk-a alice heavy", "the weight must be a number"),
    ("sk-a alice -1", "the weight must be a positive number"),
    ("sk-a alice nan", "the weight must be a positive number"),
])
def test_keys_file_errors_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "keys"
    path.write_text(f"# comment\nsk-ok ok\n{line}\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: {message}")):
        load_api_keys_file(path)


def test_duplicate_key_is_an_error(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-a alice\nsk-a bob\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: this key is listed twice")):
        load_api_keys_file(path)


def test_serve_stops_at_a_bad_keys_file(tmp_path, capsys):
    path = tmp_path / "keys"
    path.write_text("sk-a\n")
    assert main(["serve", "--api-keys-file", str(path)]) == 2  # before any model loads
    assert f"{path}:1:" in capsys.readouterr().err


def test_policy_matches_keys():
    policy = AccessPolicy(api_keys=KEYS, admin_key=ADMIN)
    assert policy.tenant_for("sk-alice") == Tenant("alice", 2.0)
    assert policy.tenant_for("sk-bob").name == "bob"
    assert policy.tenant_for(ADMIN).name == "admin"
    for wrong in ("sk-alic", "sk-alice ", "", None, "SK-ALICE"):
        assert policy.tenant_for(wrong) is None
    assert policy.is_admin(ADMIN) and not policy.is_admin("sk-alice")
    with pytest.raises(ValueError):
        AccessPolicy(api_keys=(("has space", Tenant()),))


# ------------------------------------------------------------------ over HTTP
def test_no_keys_everything_is_open(engine):
    with app_client(engine) as client:
        assert complete(client).status_code == 200
        for path in ADMIN_PATHS:
            assert client.get(path).status_code == 200, path


def test_v1_needs_a_key(engine):
    with app_client(engine, api_keys=KEYS, admin_key=ADMIN) as client:
        for headers in (None, bearer("sk-wrong"), basic("sk-alice"), {"Authorization": "x"}):
            r = complete(client, headers)
            assert r.status_code == 401, headers
            error = r.json()["error"]
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
            assert client.get("/v1/models", headers=headers).status_code == 401
        assert complete(client, bearer("sk-alice")).status_code == 200
        assert complete(client, bearer("sk-bob")).status_code == 200
        assert client.get("/v1/models", headers=bearer("sk-bob")).status_code == 200
        assert client.get("/health").json() == {"status": "ok"}  # always open


def test_admin_routes_need_the_admin_key(engine):
    with app_client(engine, api_keys=KEYS, admin_key=ADMIN) as client:
        for path in ADMIN_PATHS:
            for headers in (None, bearer("sk-alice"), basic("sk-alice")):
                r = client.get(path, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["message"], (path, headers)
            assert r.headers["www-authenticate"].startswith("Basic")  # a browser asks
            assert client.get(path, headers=bearer(ADMIN)).status_code == 200, path
            assert client.get(path, headers=basic(ADMIN)).status_code == 200, path


def test_admin_key_alone_guards_only_the_admin_routes(engine):
    with app_client(engine, admin_key=ADMIN) as client:
        assert complete(client).status_code == 200
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=bearer(ADMIN)).status_code == 200


@pytest.mark.parametrize("policy", [dict(api_keys=KEYS),
                                    dict(admin_routes=False),
                                    dict(api_keys=KEYS, admin_key=ADMIN, admin_routes=False)])
def test_admin_routes_off(engine, policy):
    with app_client(engine, **policy) as client:
        for path in ADMIN_PATHS:
            r = client.get(path, headers=bearer(ADMIN))
            assert r.status_code == 404 and r.json()["error"]["message"], path
        assert client.get("/health").status_code == 200


def test_openai_client(engine):
    with app_client(engine, api_keys=KEYS) as http:
        good = openai.OpenAI(base_url="http://test/v1", api_key="sk-bob", http_client=http,
                             max_retries=0)
        out = good.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert out.usage.completion_tokens == 2
        bad = openai.OpenAI(base_url="http://test/v1", api_key="sk-nobody", http_client=http,
                            max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_the_tenant_is_known_to_the_generation(engine, caplog):
    with app_client(engine, api_keys=KEYS) as client, caplog.at_level(logging.INFO,
                                                                       "slotserve.server"):
        assert complete(client, bearer("sk-alice")).status_code == 200
    finished = [r.getMessage() for r in caplog.records if "finished" in r.getMessage()]
    assert finished and re.match(r"finished cmpl-[0-9a-f]{32} \[tenant alice\]: ",
                                 finished[-1])


# ------------------------------------------------------------------ request ids
def test_client_request_ids_are_echoed_not_used(engine, caplog):
    with app_client(engine) as client, caplog.at_level(logging.INFO, "slotserve.server"):
        # the same client id twice, at once (streams open) and again: all served
        streams = [client.stream("POST", "/v1/completions", headers={"X-Request-Id": "mine"},
                                 json={"prompt": PROMPT, "max_tokens": 8, "stream": True})
                   for _ in range(2)]
        responses = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in responses] == [200, 200]
            assert all(r.headers["x-request-id"] == "mine" for r in responses)
            bodies = [r.read().decode() for r in responses]
        finally:
            for s in streams:
                s.__exit__(None, None, None)
        ids = {re.search(r'"id": "([^"]+)"', b).group(1) for b in bodies}
        assert len(ids) == 2 and all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids)
        r = complete(client, {"X-Request-Id": "mine"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "mine"
        assert "mine" not in r.json()["id"]
        assert "mine" not in client.get("/debug/trace").text
        unsafe = complete(client, {"X-Request-Id": "bad id\t"})
        assert unsafe.status_code == 200 and "x-request-id" not in unsafe.headers
    assert any(re.match(r"finished cmpl-\w+ \[tenant default, X-Request-Id mine\]: ",
                        r.getMessage()) for r in caplog.records)


# ------------------------------------------------------------------ /health
def test_health_is_503_when_the_engine_is_unhealthy(engine, monkeypatch):
    with app_client(engine, api_keys=KEYS) as client:
        assert client.get("/health").status_code == 200
        # NOTE: raising=False: AsyncEngine.healthy may not exist yet (another change adds it)
        monkeypatch.setattr(AsyncEngine, "healthy", property(lambda self: False),
                            raising=False)
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        monkeypatch.undo()
        assert client.get("/health").status_code == 200
