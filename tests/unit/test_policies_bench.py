"""benchmarks/policies.py's pieces: the goodput arithmetic (against Request.met_slo), the
schedules, the real-time driver's accounting on a tiny random model, and a miniature run of
all three comparisons (report, text, plot)."""

from __future__ import annotations

import json

import pytest

from benchmarks import policies as pb
from slotserve.request import Request, RequestStatus
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine

VOCAB = 512


def _request(status: RequestStatus, token_times: list[float], slo_ttft_ms, slo_tpot_ms):
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=8), slo_ttft_ms=slo_ttft_ms,
                      slo_tpot_ms=slo_tpot_ms)
    request.times.arrival = 0.0
    for t in token_times:
        request.append_token(9, t)
    request.status = status
    return request


@pytest.mark.parametrize("status, token_times, slo_ttft_ms, slo_tpot_ms", [
    (RequestStatus.FINISHED_LENGTH, [0.5, 0.6, 0.7], 500.0, 100.0),  # both met, at the edge
    (RequestStatus.FINISHED_LENGTH, [0.51, 0.6], 500.0, None),  # TTFT missed
    (RequestStatus.FINISHED_STOPPED, [0.1, 0.3, 0.5], 500.0, 150.0),  # TPOT 200 ms: missed
    (RequestStatus.FINISHED_STOPPED, [0.1], 500.0, 1.0),  # one token: TPOT met
    (RequestStatus.FINISHED_LENGTH, [9.0, 9.1], None, None),  # no SLO: met
    (RequestStatus.FINISHED_ABORTED, [0.1, 0.2], 500.0, 150.0),  # aborted: never met
    (RequestStatus.FINISHED_REJECTED, [], 500.0, 150.0),
])
def test_met_slo_agrees_with_request(status, token_times, slo_ttft_ms, slo_tpot_ms):
    request = _request(status, token_times, slo_ttft_ms, slo_tpot_ms)
    got = pb.met_slo(request.finish_reason, request.times.ttft, request.times.tpot,
                     slo_ttft_ms, slo_tpot_ms)
    assert got == request.met_slo


def test_goodput_at_interpolates_the_90_percent_crossing():
    assert pb.goodput_at([1.0, 2.0, 3.0], [1.0, 0.95, 0.85]) == pytest.approx((2.5,
                                                                              "interpolated"))
    assert pb.goodput_at([1.0, 2.0], [0.8, 0.5]) == (0.0, "below the sweep")
    assert pb.goodput_at([1.0, 2.0], [0.99, 0.91]) == (2.0, "at least")
    with pytest.raises(ValueError, match="equal length"):
        pb.goodput_at([1.0], [0.9, 0.8])


def test_share_of_tokens_and_of_vtc_cost():
    got = pb.share({"A": 100, "B": 0}, {"A": 0, "B": 50}, "B", w_in=1.0, w_out=2.0)
    assert got == {"tokens": pytest.approx(50 / 150), "cost": pytest.approx(100 / 200)}
    assert pb.share({}, {}, "B") == {"tokens": None, "cost": None}


def test_flood_schedule_sends_four_times_the_rate_over_the_same_span():
    sched = pb.flood_schedule(b_rate=2.0, count_b=50, vocab=VOCAB, seed=3)
    a = [x for x in sched if x.tenant == "A"]
    b = [x for x in sched if x.tenant == "B"]
    assert (len(a), len(b)) == (200, 50)
    assert len({x.id for x in sched}) == len(sched)
    span_a, span_b = max(x.at for x in a), max(x.at for x in b)
    assert 0.6 < span_a / span_b < 1.6  # same expected span (Poisson noise)
    assert all(pb.CHAT.prompt_min <= len(x.prompt) <= pb.CHAT.prompt_max for x in sched)
    assert all(0 < t < VOCAB for x in sched for t in x.prompt)


def test_mixed_schedule_same_requests_at_every_rate_with_class_slos():
    slos = pb.Slos(100.0, 10.0, 1000.0, 20.0)
    slow = pb.mixed_schedule(1.0, 40, 0.25, slos, VOCAB, seed=1)
    fast = pb.mixed_schedule(2.0, 40, 0.25, slos, VOCAB, seed=1)
    assert [x.prompt for x in slow] == [x.prompt for x in fast]
    assert [x.at for x in fast] == pytest.approx([x.at / 2 for x in slow])
    kinds = {x.kind for x in slow}
    assert kinds == {"interactive", "batch"}
    for x in slow:
        shape = pb.BATCH if x.kind == "batch" else pb.INTERACTIVE
        assert x.max_tokens == shape.max_tokens
        assert shape.prompt_min <= len(x.prompt) <= shape.prompt_max
        expected = (1000.0, 20.0) if x.kind == "batch" else (100.0, 10.0)
        assert (x.slo_ttft_ms, x.slo_tpot_ms) == expected


def test_priority_schedule_marks_high_priority_lower():
    sched = pb.priority_schedule(5.0, 60, 0.25, VOCAB, seed=0)
    assert {(x.kind, x.priority) for x in sched} == {("high", 0), ("low", 1)}


def test_drive_counts_every_token_and_the_backlogged_service(tiny_llama):
    engine = tiny_engine(tiny_llama, max_num_seqs=2, scheduling_policy="fair",
                         max_num_batched_tokens=64)
    sched = pb.flood_schedule(b_rate=50.0, count_b=2, vocab=VOCAB, seed=0)
    result = pb.drive(engine, sched, backlog_tenants=("A", "B"))
    assert sorted(r.id for r in result.records) == sorted(x.id for x in sched)
    assert all(r.finish_reason == "length" and r.output_tokens == pb.CHAT.max_tokens
               and r.ttft is not None for r in result.records)
    for tenant in ("A", "B"):
        mine = [x for x in sched if x.tenant == tenant]
        assert result.prompt_tokens[tenant] == sum(len(x.prompt) for x in mine)
        assert result.output_tokens[tenant] == sum(x.max_tokens for x in mine)
        assert 0 <= result.backlogged_prompt[tenant] <= result.prompt_tokens[tenant]
        assert 0 <= result.backlogged_output[tenant] <= result.output_tokens[tenant]
    # 10 requests for 2 slots arriving within ~0.1 s: both tenants wait at the start.
    assert result.backlogged_seconds > 0
    assert sum(result.backlogged_prompt.values()) > 0
    assert len(result.step_seconds) > 0 and result.duration > 0
    engine.check_integrity()
    with pytest.raises(ValueError, match="unique"):
        pb.drive(engine, sched[:1] * 2)


def test_miniature_run_of_all_three_comparisons(tmp_path, monkeypatch, tiny_llama):
    def factory(tiny, settings):
        def make(policy):
            return tiny_engine(tiny_llama, max_num_seqs=settings.slots,
                               max_num_batched_tokens=settings.budget,
                               scheduling_policy=policy)
        return make, VOCAB, "tiny"

    monkeypatch.setattr(pb, "engine_factory", factory)
    settings = pb.Settings(slots=4, flood_b_requests=1, goodput_loads=(1.0, 2.0),
                           goodput_requests=3, priority_requests=4, calibration_requests=2)
    report = pb.run_all(settings, log=lambda msg: None)
    assert set(report["targets"]) == {"flood", "goodput"}
    # The simulated half ran the same comparisons; every ranking figure is compared.
    assert set(report["simulated"]["targets"]) == {"flood", "goodput"}
    figures = {row["figure"] for row in report["agreement"]}
    assert {"flood: B TTFT p50 ms", "goodput: goodput at 90% req/s",
            "priority: high TTFT p50 ms"} <= figures
    assert all(row["agrees"] in (True, False, None) for row in report["agreement"])
    assert set(report["flood"]["runs"]) == {"fcfs", "fair"}
    assert set(report["priority"]["runs"]) == {"fcfs", "priority"}
    for policy in ("fcfs", "deadline"):
        points = report["goodput"]["points"][policy]
        assert [p["load"] for p in points] == [1.0, 2.0]
        assert all(p["requests"] == 3 and 0 <= p["attainment"] <= 1 for p in points)
    assert all(report[name]["calibration"]["capacity_rps"] > 0
               for name in ("flood", "goodput", "priority"))
    json.dumps(report)  # the JSON report must be serialisable
    text = pb.format_report(report)
    assert "flooding tenant" in text and "goodput at 90%" in text and "priority:" in text
    assert "measured vs simulated" in text
    png = tmp_path / "goodput.png"
    pb.plot_goodput(report["goodput"], str(png))
    assert png.stat().st_size > 1000


# ---------------------------------------------------------------------- the simulated half
def _profile():
    from slotserve.lab.replay import load_profile

    return load_profile(pb.REPO / pb.DEFAULT_PROFILE)


def test_sim_engine_matches_the_replay_simulator():
    # SimEngine is the replay simulator's loop with policy fields: under FCFS (which the
    # replay simulator runs) both give every request the same virtual token times.
    from slotserve.lab.replay import ReplayRequest, ReplaySettings, replay

    settings = pb.Settings(slots=4, budget=128)
    sched = pb.flood_schedule(b_rate=2.0, count_b=3, vocab=VOCAB, seed=1)
    engine = pb.SimEngine(pb.config_for("fcfs", settings), _profile())
    result = pb.drive(engine, sched)
    config = pb.config_for("fcfs", settings)
    requests = [ReplayRequest(a.id, len(a.prompt), a.max_tokens, a.at, tuple(a.prompt))
                for a in sched]
    replayed = replay(requests,
                      ReplaySettings(max_num_seqs=4, max_num_batched_tokens=128,
                                     max_model_len=config.scheduler.max_model_len),
                      _profile())
    outcomes = {o.id: o for o in replayed.outcomes}
    assert len(result.records) == len(sched)
    for record in result.records:
        assert record.ttft == pytest.approx(outcomes[record.id].ttft)
        assert record.tpot == pytest.approx(outcomes[record.id].tpot)
    assert result.duration == pytest.approx(replayed.duration)  # both clocks start at 0
    engine.check_integrity()


def test_sim_engine_runs_policies_on_its_virtual_clock():
    # Deadline slack and SLOs are in simulated seconds: a run is deterministic and
    # independent of the host's speed, and its latencies are the profile's, not wall time.
    settings = pb.Settings(slots=4)
    slos = pb.Slos(2000.0, 500.0, 20000.0, 1000.0)
    sched = pb.mixed_schedule(3.0, 12, 0.25, slos, VOCAB, seed=2)
    runs = [pb.drive(pb.SimEngine(pb.config_for("deadline", settings), _profile()), sched)
            for _ in range(2)]
    assert [(r.id, r.ttft, r.tpot) for r in runs[0].records] == \
        [(r.id, r.ttft, r.tpot) for r in runs[1].records]
    assert all(r.finish_reason == "length" for r in runs[0].records)
    # The profile's fixed cost alone is 161 ms an iteration: simulated time, not host time.
    assert sum(runs[0].step_seconds) >= 0.16 * len(runs[0].step_seconds)
    assert runs[0].duration >= max(a.at for a in sched)


def test_better_of_and_agreement():
    assert pb.better_of({"fcfs": 10.0, "fair": 4.0}, higher_better=False) == "fair"
    assert pb.better_of({"fcfs": 0.5, "deadline": 0.9}, higher_better=True) == "deadline"
    assert pb.better_of({"fcfs": 1.0, "deadline": 0.99}, higher_better=True) == "tie"
    assert pb.better_of({"fcfs": None, "deadline": 0.99}, higher_better=True) is None
    measured = {"priority": {"runs": {"fcfs": {"high": {"ttft_p50_ms": 900.0}},
                                      "priority": {"high": {"ttft_p50_ms": 100.0}}}}}
    agrees = {"priority": {"runs": {"fcfs": {"high": {"ttft_p50_ms": 4000.0}},
                                    "priority": {"high": {"ttft_p50_ms": 800.0}}}}}
    disagrees = {"priority": {"runs": {"fcfs": {"high": {"ttft_p50_ms": 100.0}},
                                       "priority": {"high": {"ttft_p50_ms": 800.0}}}}}
    (row,) = pb.agreement(measured, agrees)
    assert row["figure"] == "priority: high TTFT p50 ms" and row["agrees"] is True
    assert row["measured_better"] == row["simulated_better"] == "priority"
    (row,) = pb.agreement(measured, disagrees)
    assert row["agrees"] is False and row["simulated_better"] == "fcfs"


def test_simulate_only_loads_no_model(monkeypatch, tmp_path):
    def no_model(tiny, settings):
        raise AssertionError("--simulate-only must not load a model")

    monkeypatch.setattr(pb, "engine_factory", no_model)
    out = tmp_path / "sim.json"
    report = pb.main(["--simulate-only", "--slots", "4", "--flood-b-requests", "2",
                      "--goodput-loads", "1", "2", "--goodput-requests", "4",
                      "--priority-requests", "4", "--calibration-requests", "4",
                      "--out", str(out), "--plot", str(tmp_path / "g.png")])
    assert "model" not in report and "agreement" not in report
    sim = report["simulated"]
    assert set(sim) >= {"flood", "goodput", "priority", "targets", "predicted_engine_seconds"}
    assert sim["predicted_engine_seconds"] > 0
    assert sim["flood"]["runs"]["fair"]["failed"] == 0
    assert json.loads(out.read_text())["simulated"]["goodput"]["loads"] == [1.0, 2.0]
    assert (tmp_path / "g.png").stat().st_size > 1000
