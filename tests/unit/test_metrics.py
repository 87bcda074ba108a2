"""Prometheus metrics over a tiny engine driven step by step (no server, no threads)."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slotserve.obs.metrics import ServerMetrics, SlotWindow
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine


def samples(metrics: ServerMetrics) -> dict[str, float]:
    result = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            result[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return result


def run(engine, prompts, params, prefix: str = "r") -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.fixture
def engine(tiny_llama):
    return tiny_engine(tiny_llama, num_blocks=32, max_num_seqs=4)


def test_counters_histograms_and_gauges(engine):
    metrics = ServerMetrics(engine)
    seen = []
    engine.subscribe(seen.append)
    metrics.attach()
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    run(engine, [[5, 6, 7], [8, 9, 10, 11], [12, 13]], params)
    assert seen  # other subscribers still run
    m = samples(metrics)
    assert m["slotserve:time_to_first_token_seconds_count"] == 3
    assert m["slotserve:e2e_request_latency_seconds_count"] == 3
    assert m["slotserve:request_queue_time_seconds_count"] == 3
    assert m["slotserve:time_per_output_token_seconds_count"] == 3
    assert m["slotserve:inter_token_latency_seconds_count"] == 3 * 4
    assert m['slotserve:request_success_total{finished_reason="length"}'] == 3
    assert m["slotserve:prompt_tokens_total"] == 9
    assert m["slotserve:generation_tokens_total"] == 15
    assert m["slotserve:num_preemptions_total"] == 0
    # Idle again: gauges read the live engine.
    assert m["slotserve:num_requests_running"] == m["slotserve:num_requests_waiting"] == 0
    assert m["slotserve:kv_blocks_free"] == m["slotserve:kv_blocks_total"] == 32
    assert m["slotserve:kv_cache_usage_perc"] == 0
    # 3 requests in 4 slots for every iteration.
    assert m["slotserve:slot_utilisation"] == pytest.approx(3 / 4)


def test_every_finish_reason_is_counted_from_the_start(engine):
    m = samples(ServerMetrics(engine))
    reasons = {"stop", "length", "abort", "error", "rejected"}
    assert {f'slotserve:request_success_total{{finished_reason="{r}"}}' for r in reasons} <= {
        k for k, v in m.items() if k.startswith("slotserve:request_success_total") and v == 0}


def test_gauges_are_live(engine):
    metrics = ServerMetrics(engine)
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=50))
    engine.step()
    m = samples(metrics)
    assert m["slotserve:num_requests_running"] == 1
    used = 32 - m["slotserve:kv_blocks_free"]
    assert used >= 1 and m["slotserve:kv_cache_usage_perc"] == pytest.approx(used / 32)
    engine.abort_request("a")
    engine.step()
    m = samples(metrics)
    assert m["slotserve:kv_blocks_free"] == 32
    assert m['slotserve:request_success_total{finished_reason="abort"}'] == 1
    # Aborted requests are counted, but their latencies are not observed.
    assert m["slotserve:time_to_first_token_seconds_count"] == 0


def test_each_app_has_its_own_registry(engine):
    first, second = ServerMetrics(engine), ServerMetrics(engine)
    assert first.registry is not second.registry
    first.ttft.observe(0.5)
    assert samples(first)["slotserve:time_to_first_token_seconds_count"] == 1
    assert samples(second)["slotserve:time_to_first_token_seconds_count"] == 0


def test_slot_window():
    window = SlotWindow(num_slots=4, window_s=10)
    assert window.utilisation(now=0) == 0.0
    window.add(4, now=1)
    window.add(2, now=2)
    assert window.utilisation(now=5) == pytest.approx(6 / 8)
    assert window.utilisation(now=11.5) == pytest.approx(2 / 4)  # the first one left
    assert window.utilisation(now=30) == 0.0
    window.on_iteration({"slots": [None, {"request": "a", "kind": "decode", "tokens": 1},
                                   {"request": "c", "kind": "stalled", "tokens": 0},
                                   {"request": "b", "kind": "prefill", "tokens": 9}]})
    assert window.utilisation() == pytest.approx(2 / 4)  # the stalled slot is held, not busy


def test_prefix_cache_counters_and_hit_rate(tiny_llama):
    """Queries and hits in tokens, as vLLM counts them; the hit rate is hits / queries."""
    engine = tiny_engine(tiny_llama, num_blocks=32, max_num_seqs=4, block_size=4)
    metrics = ServerMetrics(engine)
    metrics.attach()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    shared = list(range(10, 22))  # three full blocks of 4
    run(engine, [shared + [30]], params, prefix="a")
    m = samples(metrics)
    assert m["slotserve:prefix_cache_queries_total"] == 13
    assert m["slotserve:prefix_cache_hits_total"] == 0
    assert m["slotserve:prefix_cache_hit_rate"] == 0
    run(engine, [shared + [31]], params, prefix="b")
    m = samples(metrics)
    assert m["slotserve:prefix_cache_queries_total"] == 26
    assert m["slotserve:prefix_cache_hits_total"] == 12
    assert m["slotserve:prefix_cache_hit_rate"] == pytest.approx(12 / 26)
    # Idle: the first request's cached blocks wait, free, for the next hit.
    assert m["slotserve:kv_blocks_cached_free"] >= 3
    assert m["slotserve:kv_blocks_shared"] == 0
    assert m["slotserve:kv_blocks_free"] == 32


def test_scheduling_series_exist_from_start_at_zero(engine):
    metrics = ServerMetrics(engine, tenants=["alice"])
    m = samples(metrics)
    assert m['slotserve:scheduling_policy_info{scheduling_policy="fcfs"}'] == 1
    assert m["slotserve:slo_attainment"] == 0
    for tenant in ("alice", "default"):
        label = f'{{tenant="{tenant}"}}'
        assert m[f"slotserve:tenant_generation_tokens_total{label}"] == 0
        assert m[f"slotserve:tenant_time_to_first_token_seconds_count{label}"] == 0
        assert m[f"slotserve:request_slo_met_total{label}"] == 0
        assert m[f"slotserve:request_slo_missed_total{label}"] == 0


def test_per_tenant_service_and_goodput(engine):
    metrics = ServerMetrics(engine)
    metrics.attach()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("met", [5, 6, 7], params, tenant="alice", slo_ttft_ms=60_000)
    # 1 ns, raised to the 1 ms floor (min_slo_ttft_ms); the wait before the first step
    # makes its TTFT longer than that (a tiny model's first step can take less), so it misses.
    engine.add_request("missed", [8, 9], params, tenant="bob", slo_ttft_ms=1e-6)
    engine.add_request("gone", [10, 11], params, tenant="bob")
    time.sleep(0.005)
    engine.step()
    engine.abort_request("gone")  # aborted: neither met nor missed
    while engine.has_unfinished_requests():
        engine.step()
    m = samples(metrics)
    alice, bob = '{tenant="alice"}', '{tenant="bob"}'
    assert m[f"slotserve:request_slo_met_total{alice}"] == 1
    assert m[f"slotserve:request_slo_missed_total{alice}"] == 0
    assert m[f"slotserve:request_slo_met_total{bob}"] == 0
    assert m[f"slotserve:request_slo_missed_total{bob}"] == 1
    assert m["slotserve:slo_attainment"] == pytest.approx(1 / 2)
    assert m[f"slotserve:tenant_prompt_tokens_total{alice}"] == 3
    assert m[f"slotserve:tenant_generation_tokens_total{alice}"] == 3
    assert m[f"slotserve:tenant_time_to_first_token_seconds_count{alice}"] == 1
    assert m[f"slotserve:tenant_time_to_first_token_seconds_count{bob}"] == 1  # not "gone"
    assert m[f"slotserve:tenant_request_queue_time_seconds_count{bob}"] == 1
    assert m[f"slotserve:tenant_requests_active{bob}"] == 0
    assert m['slotserve:tenant_generation_tokens_total{tenant="default"}'] == 0


def test_vllm_names_with_model_name_beside_ours(engine):
    """What vLLM dashboards read: the same families under `vllm:` with `model_name`."""
    metrics = ServerMetrics(engine, model_name="served-name")
    metrics.attach()
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    run(engine, [[5, 6, 7], [8, 9, 10, 11]], params)
    m = samples(metrics)
    label = '{model_name="served-name"}'
    assert m[f"vllm:num_requests_running{label}"] == 0
    assert m[f"vllm:num_requests_waiting{label}"] == 0
    assert m[f"vllm:kv_cache_usage_perc{label}"] == 0
    assert m[f"vllm:prompt_tokens_total{label}"] == m["slotserve:prompt_tokens_total"] == 7
    assert m[f"vllm:generation_tokens_total{label}"] == 10
    assert m[f"vllm:time_to_first_token_seconds_count{label}"] == 2
    assert m[f"vllm:inter_token_latency_seconds_count{label}"] == 2 * 4
    assert m[f"vllm:e2e_request_latency_seconds_count{label}"] == 2
    assert m[f"vllm:request_prompt_tokens_sum{label}"] == 7
    assert m[f"vllm:request_generation_tokens_sum{label}"] == 10
    assert m[f"vllm:prefix_cache_queries_total{label}"] >= 7
    assert m[f"vllm:prefix_cache_hits_total{label}"] >= 0
    success = 'vllm:request_success_total{finished_reason="length",model_name="served-name"}'
    assert m[success] == 2
    # Every token processed is in one iteration's count: the prompts and all but the
    # last token of each completion.
    assert m[f"vllm:iteration_tokens_total_sum{label}"] == 7 + 2 * 4
    assert m[f"vllm:iteration_tokens_total_count{label}"] == m[
        "slotserve:iteration_tokens_total_count"] > 0
    assert not any(k.startswith("vllm:slot_utilisation") for k in m)  # ours only


@pytest.mark.parametrize("names,present,absent", [("vllm", "vllm:", "slotserve:"),
                                                 ("slotserve", "slotserve:", "vllm:")])
def test_one_set_of_names(engine, names, present, absent):
    m = samples(ServerMetrics(engine, names=names))
    assert any(k.startswith(present) for k in m)
    assert not any(k.startswith(absent) for k in m)
    vllm_default = samples(ServerMetrics(engine))
    assert f'vllm:num_requests_running{{model_name="{engine.model_config.name}"}}' in (
        vllm_default)
    with pytest.raises(ValueError, match="names must be one of"):
        ServerMetrics(engine, names="prometheus")
