"""A prompt list larger than its tenant's waiting bound can never be queued whole: a 400 naming
`prompt` before anything is queued, not a 429 it could never get past (issue 33).

One real server (`--max-waiting-per-tenant 4`, two API keys: `small` of weight 1, bound 4;
`big` of weight 2, bound 8), and EngineClient.queue_bound of both implementations without a
server: AsyncEngine's (the server's and the tenant's bounds, the smaller) and the replicas'
front's (one replica's bound times the replicas: a list's prompts are routed one by one).
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import tiny_engine
from tests.e2e.conftest import ENGINE_FLAGS, MODEL_NAME, running_server
from tests.support.launch import cli_flags, scrape_metrics

PER_TENANT = 4
SMALL_KEY, BIG_KEY = "small-key-0123", "big-key-4567"  # weights 1 and 2: bounds 4 and 8
ADMIN_KEY = "admin-key-89ab"  # /metrics
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("queue-bound")
    keys = folder / "keys.txt"
    keys.write_text(f"{SMALL_KEY} small\n{BIG_KEY} big 2\n")
    flags = [*cli_flags(**ENGINE_FLAGS), f"--api-keys-file={keys}", f"--admin-key={ADMIN_KEY}",
             f"--max-waiting-per-tenant={PER_TENANT}"]
    with running_server(folder, *flags) as proc:
        yield proc


def complete(server, key: str, prompts: int, n: int = 1) -> httpx.Response:
    prompt = PROMPT if prompts == 1 else [f"{PROMPT} {i}" for i in range(prompts)]
    body = {"model": MODEL_NAME, "prompt": prompt, "n": n, "max_tokens": 1,
            "temperature": 0}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def assert_never_queueable(response: httpx.Response) -> None:
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "prompt" and "can never be queued" in error["message"]
    assert "--max-waiting-per-tenant" in error["message"]


def test_a_list_past_the_tenants_bound_is_a_400_before_anything_is_queued(server):
    assert_never_queueable(complete(server, SMALL_KEY, PER_TENANT + 1))
    assert_never_queueable(complete(server, SMALL_KEY, 2, n=3))  # 6 sequences
    metrics = scrape_metrics(server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert metrics["slotserve:num_requests_waiting"] == 0
    assert metrics["slotserve:num_requests_running"] == 0
    ok = complete(server, SMALL_KEY, PER_TENANT)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == PER_TENANT


def test_the_bound_is_the_tenants_own(server):
    """`big` (weight 2) may queue 8: its list of 5 is served, its list of 9 refused."""
    ok = complete(server, BIG_KEY, PER_TENANT + 1)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == PER_TENANT + 1
    assert_never_queueable(complete(server, BIG_KEY, 2 * PER_TENANT + 1))


def test_one_prompt_with_too_many_completions_stays_the_engines_400(server):
    response = complete(server, SMALL_KEY, 1, n=PER_TENANT + 1)
    assert response.status_code == 400
    assert "n=5 completions can never be queued" in response.json()["error"]["message"]


# ------------------------------------------------------------------ without a server
def test_async_engine_queue_bound_is_the_smaller_bound(tiny_llama):
    from slotserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16, max_waiting=6,
                                     max_waiting_per_tenant=2, tenant_weights={"big": 4}))
    assert engine.queue_bound("default") == 2
    assert engine.queue_bound("big") == 6  # its own 8, the server's 6
    engine.max_waiting = 0  # refuses everything for now (429), bounds nothing for ever
    assert engine.queue_bound("big") == 8
    unbounded = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16, max_waiting_per_tenant=None))
    assert unbounded.queue_bound("default") is None


def test_the_replicas_front_bounds_a_list_by_every_replica(tiny_llama):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from slotserve.config import SchedulerConfig
    from slotserve.scaleout.front import ReplicaFront
    from slotserve.scaleout.router import Router

    engine = tiny_engine(tiny_llama, num_blocks=16)
    describe = {"model_config": engine.model_config, "tokenizer": engine.tokenizer,
                "snapshot": engine.snapshot(), "max_waiting": 6,
                "scheduler_config": SchedulerConfig(max_waiting_per_tenant=2,
                                                    tenant_weights={"big": 4})}
    names = ["r0", "r1", "r2"]
    front = ReplicaFront(dict.fromkeys(names), describe, Router(names, 16, "round_robin"))
    assert front.queue_bound("default") == 2 * 3 and front.queue_bound("big") == 6 * 3
    unknown = {k: v for k, v in describe.items() if k not in ("max_waiting", "scheduler_config")}
    assert ReplicaFront(dict.fromkeys(names), unknown,
                        Router(names, 16, "round_robin")).queue_bound("default") is None
