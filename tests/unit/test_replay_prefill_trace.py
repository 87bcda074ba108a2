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
    rebuilt = shared_prefix_prompts(requests, cached)
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
