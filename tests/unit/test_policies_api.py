"""Scheduling policies over HTTP: the priority / SLO / user request fields reach the engine,
tenants come from the API key (else the bounded `user` field), keys-file weights reach the
scheduler config, slo_reject answers 503, and the per-tenant and goodput metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from slotserve.cli import build_parser
from slotserve.engine.async_engine import AsyncEngine
from slotserve.engine_args import engine_config_from_args
from slotserve.server.api import ServerLimits, build_app
from slotserve.server.auth import AccessPolicy, Tenant
from slotserve.server.startup import access_policy, server_limits, tenant_weights
from tests.unit.server_fixtures import text_engine

PROMPT = [5, 6, 7, 8]
SHORT = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
ADMIN = "admin-secret"
KEYS = (("sk-alice", Tenant("alice", 2.0)), ("sk-bob", Tenant("bob")))


class Recorder(AsyncEngine):
    """An AsyncEngine that remembers the scheduling keywords of each generation."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[dict] = []

    def generate(self, request_id, prompt, params, **kwargs):
        self.calls.append(kwargs)
        return super().generate(request_id, prompt, params, **kwargs)


def served(tiny_llama, **config) -> Recorder:
    config.setdefault("num_blocks", 64)
    engine = Recorder(text_engine(tiny_llama, **config))
    engine.start()
    return engine


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def metrics(client, headers=None) -> dict[str, float]:
    text = client.get("/metrics", headers=headers or {}).text
    result = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            result[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return result


# --------------------------------------------------------------------------- priority
async def _finish_order(engine: AsyncEngine) -> list[str]:
    """A long request holds the one slot; "low" (priority 5) then "high" (priority 1)
    queue behind it. Returns the order the three finish in."""
    app = build_app(engine, "tiny")
    transport = httpx.ASGITransport(app=app)
    order: list[str] = []

    async def post(name: str, priority: int, max_tokens: int) -> None:
        r = await client.post("/v1/completions", json={**SHORT, "max_tokens": max_tokens,
                                                       "priority": priority})
        assert r.status_code == 200, r.text
        order.append(name)

    async def until(condition) -> None:
        for _ in range(2000):
            if condition(engine.snapshot()):
                return
            await asyncio.sleep(0.005)
        raise AssertionError("the engine never got there")

    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        long = asyncio.create_task(post("long", -5, 300))
        await until(lambda s: s.num_running == 1)
        low = asyncio.create_task(post("low", 5, 2))
        await until(lambda s: s.num_waiting == 1)
        high = asyncio.create_task(post("high", 1, 2))
        await until(lambda s: s.num_waiting == 2)
        assert engine.snapshot().num_running == 1, "the long request ended too soon"
        await asyncio.gather(long, low, high)
    return order


@pytest.mark.parametrize("policy, expected", [
    ("fcfs", ["long", "low", "high"]),  # priority is carried but not read
    ("priority", ["long", "high", "low"]),  # the later, higher-priority request overtakes
])
def test_priority_field_reaches_the_scheduler(tiny_llama, policy, expected):
    engine = served(tiny_llama, max_num_seqs=1, scheduling_policy=policy)
    try:
        assert asyncio.run(_finish_order(engine)) == expected
    finally:
        engine.stop()
    assert [c["priority"] for c in engine.calls] == [-5, 5, 1]


# --------------------------------------------------------------------------- tenants
def test_tenant_is_the_api_keys_and_user_is_ignored_with_keys(tiny_llama):
    engine = served(tiny_llama, scheduling_policy="fair")
    app = build_app(engine, "tiny", access=AccessPolicy(api_keys=KEYS, admin_key=ADMIN))
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            for key, user in (("sk-alice", "mallory"), ("sk-bob", None)):
                r = client.post("/v1/completions", headers=bearer(key),
                                json={**SHORT, **({"user": user} if user else {})})
                assert r.status_code == 200, r.text
    finally:
        engine.stop()
    assert [c["tenant"] for c in engine.calls] == ["alice", "bob"]
    assert {t.name for t in engine.snapshot().tenants} == {"alice", "bob"}


def test_tenant_from_user_without_keys_is_bounded(tiny_llama):
    engine = served(tiny_llama)
    app = build_app(engine, "tiny", limits=ServerLimits(max_user_tenants=2))
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            for user in ("u1", None, "u2", "u3", "u1", ""):
                body = {**SHORT, **({"user": user} if user is not None else {})}
                r = client.post("/v1/chat/completions" if user == "u2" else "/v1/completions",
                                json=body if user != "u2" else {
                                    "messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 2, "user": user})
                assert r.status_code == 200, r.text
    finally:
        engine.stop()
    # u3 is past the bound of 2 names: it shares "other"; no / empty user: "default".
    assert [c["tenant"] for c in engine.calls] == ["u1", "default", "u2", "other", "u1",
                                                   "default"]


def test_user_field_ignored_when_bound_is_zero(tiny_llama):
    engine = served(tiny_llama)
    app = build_app(engine, "tiny", limits=ServerLimits(max_user_tenants=0))
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            assert client.post("/v1/completions", json={**SHORT, "user": "u1"}).status_code == 200
    finally:
        engine.stop()
    assert engine.calls[0]["tenant"] == "default"


def test_keys_file_weights_reach_the_scheduler_config(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-a alice 3\nsk-a2 alice 3\nsk-b bob\n# sk-c carol 9\n")
    args = build_parser().parse_args(["serve", "--api-keys-file", str(keys),
                                      "--scheduling-policy", "fair", "--max-user-tenants", "7"])
    weights = tenant_weights(access_policy(args))
    assert weights == (("alice", 3.0), ("bob", 1.0))
    config = engine_config_from_args(args, tenant_weights=weights)
    assert config.scheduler.tenant_weights == (("alice", 3.0), ("bob", 1.0))
    assert config.scheduler.scheduling_policy == "fair"
    assert server_limits(args).max_user_tenants == 7


def test_keys_file_with_conflicting_weights_is_refused(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-a alice 3\nsk-a2 alice 2\n")
    args = build_parser().parse_args(["serve", "--api-keys-file", str(keys)])
    with pytest.raises(ValueError, match="alice.*different weights"):
        tenant_weights(access_policy(args))


# --------------------------------------------------------------------------- slo_reject
async def _rejected_responses(engine: AsyncEngine) -> list[httpx.Response]:
    """A long request holds the one slot; two requests with a 1 ms TTFT SLO (one
    streaming) queue behind it and cannot meet it."""
    transport = httpx.ASGITransport(app=build_app(engine, "tiny"))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        long = asyncio.create_task(client.post("/v1/completions", json={
            **SHORT, "max_tokens": 200}))
        for _ in range(2000):
            if engine.snapshot().num_running == 1:
                break
            await asyncio.sleep(0.005)
        hopeless = [client.post("/v1/completions", json={**SHORT, "slo_ttft_ms": 1,
                                                         "stream": stream})
                    for stream in (False, True)]
        responses = await asyncio.gather(*hopeless)
        assert (await long).status_code == 200
    return responses


def test_slo_reject_answers_503(tiny_llama):
    engine = served(tiny_llama, max_num_seqs=1, scheduling_policy="deadline",
                    slo_reject=True)
    metrics_client = TestClient(build_app(engine, "tiny"))
    try:
        responses = asyncio.run(_rejected_responses(engine))
        m = metrics(metrics_client)
    finally:
        engine.stop()
    for r in responses:
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "slo_unattainable"
        assert "slo_ttft_ms" in error["message"] and r.headers["retry-after"] == "1"
    assert [c["slo_ttft_ms"] for c in engine.calls] == [None, 1, 1]
    assert m['slotserve:request_success_total{finished_reason="rejected"}'] == 2
    assert m['slotserve:request_slo_missed_total{tenant="default"}'] == 2
    assert m['slotserve:request_slo_met_total{tenant="default"}'] == 1  # the long one
    assert m["slotserve:slo_attainment"] == pytest.approx(1 / 3)


# --------------------------------------------------------------------------- metrics
def test_tenant_metrics_present_from_start_and_counting(tiny_llama):
    access = AccessPolicy(api_keys=KEYS, admin_key=ADMIN)
    # As `slotserve serve` does: the keys' weights, here with one tenant that has no key.
    engine = served(tiny_llama, scheduling_policy="fair",
                    tenant_weights=(*tenant_weights(access), ("carol", 4.0)))
    app = build_app(engine, "tiny", access=access)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            before = metrics(client, bearer(ADMIN))
            r = client.post("/v1/completions", headers=bearer("sk-alice"),
                            json={**SHORT, "max_tokens": 3, "slo_ttft_ms": 60_000,
                                  "slo_tpot_ms": 60_000})
            assert r.status_code == 200, r.text
            after = metrics(client, bearer(ADMIN))
            state = client.get("/debug/state", headers=bearer(ADMIN)).json()
    finally:
        engine.stop()
    assert before['slotserve:scheduling_policy_info{scheduling_policy="fair"}'] == 1
    assert before["slotserve:slo_attainment"] == 0
    for tenant in ("alice", "bob", "carol", "default"):  # keys, config, the default
        label = f'{{tenant="{tenant}"}}'
        for name in ("tenant_prompt_tokens_total", "tenant_generation_tokens_total",
                     "tenant_virtual_counter", "tenant_requests_active",
                     "tenant_time_to_first_token_seconds_count",
                     "tenant_request_queue_time_seconds_count", "request_slo_met_total",
                     "request_slo_missed_total"):
            assert before[f"slotserve:{name}{label}"] == 0, (name, tenant)
    alice = '{tenant="alice"}'
    assert after[f"slotserve:tenant_prompt_tokens_total{alice}"] == len(PROMPT)
    assert after[f"slotserve:tenant_generation_tokens_total{alice}"] == 3
    assert after[f"slotserve:tenant_virtual_counter{alice}"] > 0
    assert after[f"slotserve:tenant_time_to_first_token_seconds_count{alice}"] == 1
    assert after[f"slotserve:tenant_time_to_first_token_seconds_sum{alice}"] > 0
    assert after[f"slotserve:tenant_request_queue_time_seconds_count{alice}"] == 1
    assert after[f"slotserve:request_slo_met_total{alice}"] == 1
    assert after['slotserve:tenant_generation_tokens_total{tenant="bob"}'] == 0
    assert after["slotserve:slo_attainment"] == 1
    # The live view's tenant legend: the policy, and tenants by tokens served.
    assert state["scheduling_policy"] == "fair"
    assert state["tenants"] == [{"name": "alice", "weight": 2.0, "active": 0,
                                 "tokens_served": len(PROMPT) + 3}]


# --------------------------------------------------------------------------- bad values
@pytest.fixture(scope="module")
def client(tiny_llama):
    engine = served(tiny_llama)
    with TestClient(build_app(engine, "tiny"), raise_server_exceptions=False) as client:
        yield client
    engine.stop()


@pytest.mark.parametrize("field, value", [
    ("priority", "1"), ("priority", 1.5), ("priority", True), ("priority", None),
    ("priority", 2**40), ("slo_ttft_ms", -1), ("slo_ttft_ms", 0), ("slo_ttft_ms", "5"),
    ("slo_tpot_ms", -5), ("slo_tpot_ms", False), ("user", 5), ("user", "a\nb"),
    ("user", "x" * 300),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_scheduling_fields_are_400_naming_the_field(client, path, field, value):
    body = dict(SHORT) if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = client.post(path, json={**body, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_good_scheduling_fields_are_accepted(client):
    r = client.post("/v1/completions", json={**SHORT, "priority": -3, "slo_ttft_ms": 5000,
                                             "slo_tpot_ms": 2.5, "user": "someone"})
    assert r.status_code == 200, r.text
