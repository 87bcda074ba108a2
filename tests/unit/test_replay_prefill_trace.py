"""Replaying a trace keeps its prefix-cache hits (issue 35's prefill side of the replay).

A trace has no prompt token ids, only each request's `cached_tokens`; replayed as filler
prompts that share nothing, a burst of chat requests (one system prompt) recomputed every
prompt's shared prefix: W at 64 slots from a 16-slot trace predicted TTFT p50 at 1.5-1.7x
while the same replay from the workload's own prompts was within 5%. The cost model's prefill
side was not the cause (the calibration's prefill-only iterations of 16-64 prompts per
chunk are predicted within ~10%): the prompts rebuilt from `cached_tokens` are.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from slotserve.lab.replay import (
    LinearCost,
    ReplayRequest,
    ReplaySettings,
    UnitCost,
    replay,
    requests_from_trace,
)
from slotserve.lab.replay.inputs import shared_prefix_prompts

BLOCK = 16
# A CPU profile's shape (the replay-accuracy profile's coefficients, rounded).
COST = LinearCost(0.0145, {"prefill_tokens": 3.9e-4, "decode_seqs": 1.2e-5,
                           "attention_pairs": 7.6e-7, "sampled_rows": 4.8e-4})


def _burst(count: int, prefix: int = 32, seed: int = 0) -> list[ReplayRequest]:
    """count requests at t=0: one shared `prefix`-token system prompt, then their own."""
    system = tuple(range(100, 100 + prefix))
    requests = []
    for i in range(count):
        own = tuple(5000 + 100 * i + j for j in range(5 + (7 * i + seed) % 11))
        requests.append(ReplayRequest(f"r{i}", prefix + len(own), 4 + (5 * i) % 17, 0.0,
                                      system + own))
    return requests


def _settings(slots: int) -> ReplaySettings:
    return ReplaySettings(max_num_seqs=slots, max_num_batched_tokens=256, max_model_len=256,
                          block_size=BLOCK)


def _trace_of(requests, slots: int) -> dict:
    return json.loads(json.dumps(replay(requests, _settings(slots), UnitCost()).trace))


def _cached(result) -> dict[str, int]:
    return {r["id"]: r["cached_tokens"] for r in result.trace["requests"]}


def test_a_trace_replayed_at_more_slots_shares_what_the_prompts_share():
    requests = _burst(24)
    from_trace, info = requests_from_trace(_trace_of(requests, 4))
    assert info["cached_prompt_tokens"] > 0
    for cost in (UnitCost(), COST):
        truth = replay(requests, _settings(16), cost, check=True)
        predicted = replay(from_trace, _settings(16), cost, check=True)
        # The same hits, hence the same schedule and the same clock.
        assert _cached(predicted) == _cached(truth)
        assert [it["slots"] for it in predicted.trace["iterations"]] == \
            [it["slots"] for it in truth.trace["iterations"]]
        assert predicted.duration == pytest.approx(truth.duration)
        assert predicted.bench_result().ttft_ms.p50 == \
            pytest.approx(truth.bench_result().ttft_ms.p50)


def test_without_the_hits_the_burst_s_ttft_was_over_predicted():
    # What the replay of a trace did before: filler prompts sharing nothing.
    requests = _burst(64)
    from_trace, _ = requests_from_trace(_trace_of(requests, 16))
    unshared = [replace(r, prompt_token_ids=None) for r in from_trace]
    truth = replay(requests, _settings(64), COST).bench_result().ttft_ms.p50
    assert replay(from_trace, _settings(64), COST).bench_result().ttft_ms.p50 == \
        pytest.approx(truth, rel=0.01)
    assert replay(unshared, _settings(64), COST).bench_result().ttft_ms.p50 > 1.2 * truth


def test_the_earliest_request_of_a_tenant_computes_its_prefix():
    requests = [ReplayRequest(f"{t}{i}", 40, 2, 0.1 * i, tenant=t)
                for t in ("A", "B") for i in range(3)]
    cached = [0, 32, 16, 0, 0, 0]  # A's first computed it; B hit nothing
    rebuilt, warm = shared_prefix_prompts(requests, cached)
    assert warm == []  # NOTE: every hit is one an earlier request of the trace computed
    a0, a1, a2, b0, b1, b2 = (r.prompt_token_ids for r in rebuilt)
    assert a0[:32] == a1[:32] and a2[:16] == a0[:16] and a2[16] != a0[16]
    assert a1[32] != a0[32]  # nothing after the hit is shared
    assert len({b0[0], b1[0], b2[0]}) == 3 and b0[0] != a0[0]  # B shares nothing
    assert [len(ids) for ids in (a0, a1, a2, b0, b1, b2)] == [40] * 6


def test_a_trace_without_hits_replays_as_before():
    trace = {"requests": [{"id": "x", "arrival": 0.0, "prompt_tokens": 9, "output_tokens": 2,
                           "cached_tokens": 0},
                          {"id": "y", "arrival": 0.5, "prompt_tokens": 5, "output_tokens": 1}]}
    requests, info = requests_from_trace(trace)
    assert [r.prompt_token_ids for r in requests] == [None, None]
    assert info["cached_prompt_tokens"] == 0


@pytest.mark.parametrize("bad", [-16, 9, 12.5, "16", True])
def test_bad_cached_tokens_is_an_error_naming_it(bad):
    trace = {"requests": [{"id": "x", "arrival": 0.0, "prompt_tokens": 9, "output_tokens": 2,
                           "cached_tokens": bad}]}
    with pytest.raises(ValueError, match="request 0: cached_tokens"):
        requests_from_trace(trace)


def _hit_trace(records) -> dict:
    return {"requests": [{"id": rid, "arrival": arrival, "prompt_tokens": prompt,
                          "output_tokens": 3, "cached_tokens": hit, "tenant": tenant}
                         for rid, arrival, prompt, hit, tenant in records]}


def test_a_hit_no_request_of_the_trace_computed_was_cached_before_it_and_is_replayed():
    # A benchmark's later round: its one request found 48 of its 70 tokens cached by an
    # earlier round, before this trace began.
    requests, info = requests_from_trace(_hit_trace([("x", 0.0, 70, 48, "default")]))
    [(tenant, ids)] = info["trace_cached_prefixes"]
    assert tenant == "default" and len(ids) == 48
    assert tuple(requests[0].prompt_token_ids[:48]) == tuple(ids)
    warm = replay(requests, _settings(4), COST, cached_prefixes=info["trace_cached_prefixes"],
                  check=True)
    cold = replay(requests, _settings(4), COST, check=True)
    assert _cached(warm) == {"x": 48} and _cached(cold) == {"x": 0}
    assert warm.outcomes[0].ttft < cold.outcomes[0].ttft


def test_a_tenant_whose_first_request_hit_has_its_prefix_cached_and_no_source():
    requests, info = requests_from_trace(_hit_trace([
        ("a0", 0.0, 50, 32, "A"), ("a1", 0.1, 50, 0, "A"), ("a2", 0.2, 50, 16, "A"),
        ("b0", 0.0, 50, 0, "B"), ("b1", 0.1, 50, 32, "B")]))
    assert [(t, len(ids)) for t, ids in info["trace_cached_prefixes"]] == [("A", 32)]
    result = replay(requests, _settings(1), COST, check=True,
                    cached_prefixes=info["trace_cached_prefixes"])
    # A's hits came from before the trace (a1 computed something else); B's first request
    # computed the prefix B's second hit.
    assert _cached(result) == {"a0": 32, "a1": 0, "a2": 16, "b0": 0, "b1": 32}


def test_under_priority_the_first_request_served_computes_the_prefix():
    """A later arrival of higher priority is served first and computes the system prompt the
    earlier, lower-priority one then hits: the trace's order of service (`first_iteration`),
    not its arrivals, says who computed it (by arrival the earlier one's hit looked cached
    before the trace, and the replay found the prefix warm for both)."""
    system = tuple(range(100, 132))
    requests = [ReplayRequest("busy", 40, 6, 0.0, tuple(range(900, 940)), tenant="other"),
                ReplayRequest("low", 40, 2, 0.001, system + tuple(range(500, 508)),
                              priority=5, tenant="A"),
                ReplayRequest("high", 40, 2, 0.002, system + tuple(range(600, 608)),
                              priority=0, tenant="A")]
    settings = replace(_settings(1), scheduling_policy="priority")
    truth = replay(requests, settings, UnitCost(), check=True)
    assert _cached(truth) == {"busy": 0, "low": 32, "high": 0}
    trace = json.loads(json.dumps(truth.trace))
    from_trace, info = requests_from_trace(trace)
    assert info["trace_cached_prefixes"] == []
    predicted = replay(from_trace, settings, UnitCost(), check=True,
                       cached_prefixes=info["trace_cached_prefixes"])
    assert _cached(predicted) == _cached(truth)
    assert predicted.duration == pytest.approx(truth.duration)
    # Without the order of service (an older trace): arrival order, as before.
    for record in trace["requests"]:
        record.pop("first_iteration")
    _, by_arrival = requests_from_trace(trace)
    assert [(t, len(ids)) for t, ids in by_arrival["trace_cached_prefixes"]] == [("A", 32)]


def test_a_hit_in_a_tenant_s_first_iteration_was_cached_before_the_trace():
    """Blocks are cached after the forward that computed them: a request that hit in the
    same iteration as its tenant's first miss hit something from before the trace (the
    miss, though it arrived first, is not its source)."""
    trace = _hit_trace([("a0", 0.0, 50, 0, "A"), ("a1", 0.0, 50, 32, "A")])
    for record in trace["requests"]:
        record["first_iteration"] = 3
    requests, info = requests_from_trace(trace)
    assert [(t, len(ids)) for t, ids in info["trace_cached_prefixes"]] == [("A", 32)]
    result = replay(requests, _settings(2), COST, check=True,
                    cached_prefixes=info["trace_cached_prefixes"])
    assert _cached(result) == {"a0": 0, "a1": 32}


def test_a_trace_with_the_order_of_service_for_some_requests_only_uses_arrivals():
    """A record without first_iteration (an older trace, edited): arrival order for all, not
    the listed requests first and the others after every one of them."""
    trace = _hit_trace([("a0", 0.0, 50, 0, "A"), ("a1", 0.1, 50, 32, "A")])
    trace["requests"][1]["first_iteration"] = 0  # a0 has none
    _, info = requests_from_trace(trace)
    assert info["trace_cached_prefixes"] == []  # a0, the first to arrive, computed it


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_first_iteration_is_an_error_naming_it(bad):
    trace = _hit_trace([("x", 0.0, 50, 16, "A")])
    trace["requests"][0]["first_iteration"] = bad
    with pytest.raises(ValueError, match="request 0: first_iteration"):
        requests_from_trace(trace)


def test_a_cached_prefix_larger_than_the_pool_is_an_error_naming_it():
    requests = [ReplayRequest("x", 20, 2)]
    settings = replace(_settings(1), num_blocks=4)
    with pytest.raises(ValueError, match="cached_prefixes"):
        replay(requests, settings, COST, cached_prefixes=[("default", (7,) * 200)])


def test_an_engine_s_second_round_replays_with_the_hits_it_had(tiny_llama):
    """The benchmarks' rounds: the same prompts again on the same engine hit what the first
    round left cached; the second round's trace, replayed, hits the same (before, the
    replay computed those prompts in full, and a batch-1 cell's speculation ratio came out
    13-23% low)."""
    from slotserve.sampling import SamplingParams
    from tests.conftest import random_prompts, run_to_end, tiny_engine

    engine = tiny_engine(tiny_llama, max_num_seqs=4)
    prompts = random_prompts(3, min_len=40, max_len=70, seed=11)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    for round_ in range(2):
        engine.trace.clear()
        run_to_end(engine, [(f"r{round_}.{i}", prompt, params)
                            for i, prompt in enumerate(prompts)])
    trace = json.loads(json.dumps(engine.export_trace()))
    recorded = {r["id"]: r["cached_tokens"] for r in trace["requests"]}
    assert all(recorded.values()), recorded
    requests, info = requests_from_trace(trace)
    result = replay(requests, _settings(4), COST, check=True,
                    cached_prefixes=info["trace_cached_prefixes"])
    assert _cached(result) == recorded
