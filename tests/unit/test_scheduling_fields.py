"""SchedulingFields: one frozen value that checks priority, tenant, SLOs and cache salt
once, and travels as is from the server through AsyncEngine to LLMEngine.add_request."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from slotserve.config import MAX_SLO_MS
from slotserve.core.scheduling_fields import (
    SchedulingFieldError,
    SchedulingFields,
    given_or_loose,
)
from slotserve.engine.async_engine import AsyncEngine
from slotserve.request import Request
from slotserve.sampling import SamplingParams
from slotserve.server.endpoints import scheduling_fields
from slotserve.server.protocol import APIError, CompletionRequest
from tests.conftest import tiny_engine

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(("field", "value"), [
    ("priority", 1.5), ("priority", True), ("priority", "1"),
    ("tenant", ""), ("tenant", None),
    ("slo_ttft_ms", 0), ("slo_ttft_ms", -1.0), ("slo_ttft_ms", float("nan")),
    ("slo_ttft_ms", float("inf")), ("slo_tpot_ms", MAX_SLO_MS + 1), ("slo_tpot_ms", "5"),
    ("cache_salt", ""), ("cache_salt", 7),
])
def test_a_bad_field_is_a_value_error_naming_it(field, value):
    with pytest.raises(SchedulingFieldError, match=field) as caught:
        SchedulingFields(**{field: value})
    assert caught.value.field == field and isinstance(caught.value, ValueError)


def test_it_is_frozen_and_replace_checks_again():
    fields = SchedulingFields(priority=3, tenant="acme", slo_ttft_ms=MAX_SLO_MS,
                              cache_salt="s")
    with pytest.raises(dataclasses.FrozenInstanceError):
        fields.priority = 4  # type: ignore[misc]
    with pytest.raises(SchedulingFieldError, match="tenant"):
        dataclasses.replace(fields, tenant="")


def test_it_sets_and_reads_a_request():
    fields = SchedulingFields(priority=-2, tenant="t", slo_ttft_ms=100.0, slo_tpot_ms=20.0,
                              cache_salt="x")
    request = Request("r", [1, 2], PARAMS)
    fields.apply_to(request)
    assert SchedulingFields.of(request) == fields
    request.tenant = ""
    with pytest.raises(ValueError, match="tenant"):
        SchedulingFields.of(request)


def test_given_or_loose_refuses_both():
    given = SchedulingFields(tenant="a")
    assert given_or_loose(given, SchedulingFields()) is given
    assert given_or_loose(None, SchedulingFields(priority=1)) == SchedulingFields(priority=1)
    with pytest.raises(ValueError, match="not both"):
        given_or_loose(given, SchedulingFields(priority=1))


def test_the_server_builds_them_from_the_body_and_a_bad_one_is_a_400_naming_it():
    body = CompletionRequest(model="m", prompt="hi", priority=5, slo_tpot_ms=40.0,
                             cache_salt="k")
    assert scheduling_fields(body, "acme") == SchedulingFields(5, "acme", None, 40.0, "k")
    with pytest.raises(APIError) as caught:
        scheduling_fields(body, "")
    assert (caught.value.status, caught.value.param) == (400, "tenant")


def test_the_engine_path_carries_one_value_to_every_completion(tiny_llama):
    """AsyncEngine.generate(scheduling=...) -> its AddRequest -> LLMEngine.add_request:
    each completion's Request holds exactly those fields."""
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16))
    fields = SchedulingFields(priority=1, tenant="acme", slo_ttft_ms=60_000.0,
                              slo_tpot_ms=30_000.0, cache_salt="salt")
    seen = []
    add = engine.engine.scheduler.add_request

    def record(request):
        seen.append(SchedulingFields.of(request))
        add(request)

    async def run() -> None:
        params = dataclasses.replace(PARAMS, n=2)
        async for _ in engine.generate("r1", [5, 6, 7], params, scheduling=fields):
            pass

    engine.engine.scheduler.add_request = record
    engine.start()
    try:
        asyncio.run(run())
    finally:
        engine.stop()
    assert seen == [fields, fields]


def test_generate_refuses_a_bad_field_before_queueing_and_both_forms(tiny_llama):
    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16))

    async def first(**fields):
        return await anext(engine.generate("r", [5, 6], PARAMS, **fields))

    with pytest.raises(ValueError, match="slo_ttft_ms"):
        asyncio.run(first(slo_ttft_ms=-1))
    with pytest.raises(ValueError, match="not both"):
        asyncio.run(first(scheduling=SchedulingFields(), priority=2))
    assert engine._commands.empty()


def test_llm_engine_add_request_takes_them_or_the_loose_keywords(tiny_llama):
    llm = tiny_engine(tiny_llama, num_blocks=16)
    llm.add_request("a", [5, 6], PARAMS, scheduling=SchedulingFields(tenant="x", priority=4))
    llm.add_request("b", [5, 6], PARAMS, tenant="y", cache_salt="s")
    requests = llm.scheduler.requests
    assert [(r.tenant, r.priority, r.cache_salt) for r in requests.values()] == [
        ("x", 4, None), ("y", 0, "s")]
    with pytest.raises(ValueError, match="cache_salt"):
        llm.add_request("c", [5, 6], PARAMS, cache_salt="")


def test_keywords_rebuild_the_same_fields():
    """The server -> EngineClient boundary stays keywords (ReplicaFront forwards them)."""
    fields = SchedulingFields(priority=7, tenant="t", slo_tpot_ms=5.0, cache_salt="c")
    assert set(fields.keywords()) == {"priority", "tenant", "slo_ttft_ms", "slo_tpot_ms",
                                      "cache_salt"}
    assert SchedulingFields(**fields.keywords()) == fields
