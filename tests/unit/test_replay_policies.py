"""Replay with scheduling policies: the scheduler reads the virtual clock, requests keep
their tenant, priority and SLOs from the trace, and a replay takes every setting from the
trace unless a flag overrides it."""

from __future__ import annotations

import json

import pytest

from slotserve.cli import main
from slotserve.lab.replay import (
    ReplayRequest,
    ReplaySettings,
    UnitCost,
    replay,
    requests_from_trace,
)
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine

# A start far beyond any wall clock's: time.monotonic() (seconds since boot) never gets here.
LATE = 1e12


def _deadline_outcomes(start: float, slo_ttft_ms: float) -> dict[str, str | None]:
    # 1 slot, unit cost (1 s per iteration): a runs t=start..start+3, b from start+3, ...
    requests = [ReplayRequest(name, 4, 3, start) for name in "abcd"]
    settings = ReplaySettings(max_num_seqs=1, max_num_batched_tokens=16,
                              scheduling_policy="deadline", slo_ttft_ms=slo_ttft_ms,
                              slo_reject=True)
    result = replay(requests, settings, UnitCost(), check=True)
    return {o.id: o.finish_reason for o in result.outcomes}


@pytest.mark.parametrize("start", [0.0, LATE])
def test_deadline_replay_judges_slack_on_the_virtual_clock(start):
    # Slack = arrival + SLO - now - estimated prefill: all in simulated seconds, so a run's
    # decisions do not depend on when its virtual time starts. (On the wall clock, `now`
    # would be seconds since boot: every request of the run at 0 would look long overdue,
    # and none of the run at LATE could ever be late.)
    assert _deadline_outcomes(start, 100_000) == dict.fromkeys("abcd", "length")
    # 4.5 s: once a has finished (t=3), b's slack (4.5 - 3 - 4 s learnt for 4 tokens at
    # 1 s a token) is negative: b, c and d are rejected, a is served.
    assert _deadline_outcomes(start, 4500) == {"a": "length", "b": "rejected",
                                               "c": "rejected", "d": "rejected"}


def test_a_rejected_request_is_a_failed_outcome_without_tokens():
    settings = ReplaySettings(max_num_seqs=1, scheduling_policy="deadline", slo_ttft_ms=4500,
                              slo_reject=True)
    result = replay([ReplayRequest(n, 4, 3) for n in "ab"], settings, UnitCost())
    b = {o.id: o for o in result.outcomes}["b"]
    assert b.token_times == [] and b.error.startswith("slo:") and b.ttft is None
    report = result.bench_result()
    assert (report.completed, report.failed) == (1, 1)


def test_tenant_and_priority_are_carried_into_the_scheduler():
    requests = [ReplayRequest("a1", 4, 3, tenant="A"), ReplayRequest("a2", 4, 3, tenant="A"),
                ReplayRequest("a3", 4, 3, tenant="A"), ReplayRequest("b1", 4, 3, tenant="B",
                                                                       priority=-1)]

    def first_token_order(policy: str) -> list[str]:
        result = replay(requests, ReplaySettings(max_num_seqs=1, scheduling_policy=policy),
                        UnitCost(), check=True)
        return [o.id for o in sorted(result.outcomes, key=lambda o: o.token_times[0])]

    assert first_token_order("fcfs") == ["a1", "a2", "a3", "b1"]
    assert first_token_order("priority") == ["b1", "a1", "a2", "a3"]
    assert first_token_order("fair") == ["a1", "b1", "a2", "a3"]  # B's turn after A's first
    with pytest.raises(ValueError, match="tenant"):
        ReplayRequest("x", 4, 3, tenant="")
    with pytest.raises(ValueError, match="slo_ttft_ms"):
        ReplayRequest("x", 4, 3, slo_ttft_ms=-1)


def test_an_engine_trace_keeps_the_policy_fields_and_settings(tiny_llama):
    engine = tiny_engine(tiny_llama, kernels="reference", max_num_seqs=2,
                         max_num_batched_tokens=48, scheduling_policy="priority",
                         slo_ttft_ms=900)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("x", [5, 6, 7], params, tenant="T", priority=3, slo_tpot_ms=50)
    engine.add_request("y", [5, 6, 8, 9], params)
    while engine.has_unfinished_requests():
        engine.step()
    trace = json.loads(json.dumps(engine.trace.export()))
    requests, info = requests_from_trace(trace)
    x, y = sorted(requests, key=lambda r: r.id)
    assert (x.tenant, x.priority, x.slo_ttft_ms, x.slo_tpot_ms) == ("T", 3, 900, 50)
    assert (y.tenant, y.priority, y.slo_ttft_ms, y.slo_tpot_ms) == ("default", 0, 900, None)
    assert info["trace_settings"]["scheduling_policy"] == "priority"
    assert info["trace_settings"]["max_num_batched_tokens"] == 48


def _write_trace(path, requests: list[dict], **header) -> None:
    records = [{"arrival": 0.0, "prompt_tokens": 4, "output_tokens": 3, **r} for r in requests]
    path.write_text(json.dumps({"version": 1, "source": "engine", "policy": "continuous",
                                "num_slots": 4, "kv_blocks_total": 10, "requests": records,
                                "iterations": [], **header}))


def _replayed_config(tmp_path, trace, *flags) -> dict:
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--clock", "iterations", "--out", str(out), *flags]) == 0
    (row,) = json.loads(out.read_text())["results"]
    return row["config"]


def test_cli_takes_every_setting_from_the_trace_unless_a_flag_overrides_it(tmp_path):
    trace = tmp_path / "t.json"
    _write_trace(trace, [{"id": "a"}, {"id": "b"}],
                 settings={"max_num_batched_tokens": 64, "max_model_len": 256,
                           "scheduling_policy": "fair", "slo_ttft_ms": 500.0,
                           "enable_prefix_caching": False})
    config = _replayed_config(tmp_path, trace)
    assert (config["max_num_seqs"], config["num_blocks"]) == (4, 10)
    assert (config["max_num_batched_tokens"], config["max_model_len"]) == (64, 256)
    assert (config["scheduling_policy"], config["slo_ttft_ms"]) == ("fair", 500.0)
    assert config["enable_prefix_caching"] is False
    # --max-num-seqs changes the slots, not the recorded KV pool (it was the default).
    config = _replayed_config(tmp_path, trace, "--max-num-seqs", "8")
    assert (config["max_num_seqs"], config["num_blocks"]) == (8, 10)
    config = _replayed_config(tmp_path, trace, "--num-blocks", "20", "--max-num-batched-tokens",
                              "32", "--scheduling-policy", "fcfs", "--slo-ttft-ms", "700",
                              "--enable-prefix-caching")
    assert (config["num_blocks"], config["max_num_batched_tokens"]) == (20, 32)
    assert (config["scheduling_policy"], config["slo_ttft_ms"]) == ("fcfs", 700.0)
    assert config["enable_prefix_caching"] is True


def test_cli_priority_replay_of_a_trace_with_priorities(tmp_path):
    trace, saved = tmp_path / "t.json", tmp_path / "s.json"
    _write_trace(trace, [{"id": "late", "priority": 5}, {"id": "urgent", "priority": -2},
                         {"id": "normal", "tenant": "B"}], num_slots=1)
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--clock", "iterations", "--scheduling-policy", "priority",
                 "--save-trace", str(saved), "--out", str(out)]) == 0
    records = {r["id"]: r for r in json.loads(saved.read_text())["requests"]}
    order = sorted(records, key=lambda name: records[name]["first_iteration"])
    assert order == ["urgent", "normal", "late"]
    assert (records["late"]["priority"], records["normal"]["tenant"]) == (5, "B")
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        main(["replay", str(trace), "--clock", "iterations", "--scheduling-policy", "nope"])
    assert main(["replay", str(trace), "--clock", "iterations", "--scheduling-policy", "fcfs",
                 "--slo-reject"]) == 2  # slo_reject needs deadline: a clear error


def test_a_workload_carries_the_policy_fields_to_replay_and_bench(tmp_path):
    from slotserve.lab.bench.stats import BenchSampling
    from slotserve.lab.bench.targets import OpenAITarget
    from slotserve.lab.replay import load_input
    from slotserve.lab.workload import load_workload

    path = tmp_path / "w.jsonl"
    lines = [{"prompt": [5, 6, 7, 8], "max_tokens": 3, "priority": 4},
             {"prompt": [5, 6, 7, 9], "max_tokens": 3, "tenant": "B", "priority": -1,
              "slo_ttft_ms": 800}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests, _ = load_input(path)
    assert [(r.tenant, r.priority, r.slo_ttft_ms) for r in requests] == [
        ("default", 4, None), ("B", -1, 800)]
    # The same fields go to the server a measurement runs on (the tenant as `user`).
    workload = load_workload(path)
    assert workload.requests[1].to_dict() == {**lines[1], "arrival": 0.0}
    body = OpenAITarget("http://x")._payload("m", workload.requests[1], BenchSampling())
    assert (body["user"], body["priority"], body["slo_ttft_ms"]) == ("B", -1, 800)
    assert "user" not in OpenAITarget("http://x")._payload("m", workload.requests[0],
                                                            BenchSampling())
    saved = tmp_path / "s.json"
    assert main(["replay", str(path), "--clock", "iterations", "--max-num-seqs", "1",
                 "--scheduling-policy", "priority", "--save-trace", str(saved)]) == 0
    first = {r["id"]: r["first_iteration"] for r in json.loads(saved.read_text())["requests"]}
    assert first["1"] < first["0"]  # priority -1 before 4, though it came second
    path.write_text(json.dumps({"prompt": [5], "max_tokens": 1, "priority": "high"}) + "\n")
    with pytest.raises(ValueError, match="priority must be an integer"):
        load_workload(path)
