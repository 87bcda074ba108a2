"""Replay: the real scheduler on a virtual clock (slotserve.lab.replay).

The toy cost model reproduces the seed; replay and the engine take the same decisions step by
step; the cost model's fit recovers known coefficients; W replays in well under a second;
the CLI writes bench-format results and traces the timeline draws; calibrate and plan run.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque

import numpy as np
import pytest

from slotserve.cli import main
from slotserve.config import ModelConfig
from slotserve.core.kv_manager import KVCacheManager
from slotserve.lab.replay import (
    FEATURES,
    FakeRunner,
    LinearCost,
    ReplayRequest,
    ReplaySettings,
    StepFeatures,
    UnitCost,
    load_profile,
    replay,
    requests_from_trace,
    scale_rate,
    with_poisson,
)
from slotserve.lab.replay.calibrate import WARM_UP, CalibrationGrid, calibrate
from slotserve.lab.replay.plan import SLO, search
from slotserve.lab.replay.simulator import sampling_params_for
from slotserve.lab.simulate import SEED_TOY, summarize
from slotserve.lab.workload import generate_workload
from tests.conftest import random_prompts, tiny_engine, tiny_hf_model

ENGINE = dict(kernels="reference", max_model_len=512)


def seed_toy_requests() -> list[ReplayRequest]:
    # A 1-token prompt: its one prefill iteration samples the first token, as in the seed.
    return [ReplayRequest(r.id, 1, r.output_tokens) for r in SEED_TOY]


# ---------------------------------------------------------------------- the seed, unit cost
@pytest.mark.parametrize("policy, iterations, busy, percent", [
    ("static", 12, 22, 61), ("continuous", 8, 22, 92)])
def test_unit_cost_reproduces_the_seed(policy, iterations, busy, percent):
    result = replay(seed_toy_requests(), ReplaySettings(batching=policy, max_num_seqs=3),
                    UnitCost(), check=True)
    s = summarize(result.trace)
    assert (s["iterations"], s["busy_slot_iterations"], s["slot_iterations"]) == (
        iterations, busy, 3 * iterations)
    assert round(100 * s["utilisation"]) == percent
    assert result.duration == iterations  # one unit per iteration


def test_unit_cost_bench_numbers_by_hand():
    # 4-token prompt, 3 tokens out: prefill + first token at t=1, decodes at t=2, t=3.
    result = replay([ReplayRequest("a", 4, 3)], ReplaySettings(), UnitCost())
    b = result.bench_result()
    assert (b.duration_s, b.completed, b.total_output_tokens) == (3.0, 1, 3)
    assert b.output_throughput == pytest.approx(1.0)
    assert b.ttft_ms.p50 == pytest.approx(1000) and b.tpot_ms.p50 == pytest.approx(1000)
    assert b.e2e_ms.p50 == pytest.approx(3000) and b.iterations == 3


# ---------------------------------------------------------------------- same decisions
def _requests(count: int, shared_prefix: int = 0, arrivals=None, seed: int = 0,
              long: bool = False):
    prompts = random_prompts(count, min_len=3, max_len=40, seed=seed)
    prefix = random_prompts(1, min_len=shared_prefix, max_len=shared_prefix, seed=99)[0] \
        if shared_prefix else []
    lengths = [(20 if long else 1) + (7 * i) % 13 for i in range(count)]
    arrivals = arrivals or [0.0] * count
    return [ReplayRequest(f"r{i}", len(prefix + p), n, t, tuple(prefix + p))
            for i, (p, n, t) in enumerate(zip(prompts, lengths, arrivals))]


def _drive_engine(engine, requests):
    """The engine loop of `slotserve bench`, on the fake runner's clock; returns the plans."""
    plans = []
    schedule = engine.scheduler.schedule

    def recording():
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recording
    clock = getattr(engine.runner, "clock", None)
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    while pending or engine.has_unfinished_requests():
        while pending and (clock is None or pending[0].arrival <= clock.now):
            r = pending.popleft()
            engine.add_request(r.id, list(r.prompt_token_ids), sampling_params_for(r))
        if not engine.has_unfinished_requests():
            clock.advance_to(pending[0].arrival)
            continue
        engine.step()
        engine.check_integrity()
    return [p for p in plans if not p.is_empty]


def _decisions(plan, token_values: bool = True):
    seqs = [(s.request_id, list(s.token_ids) if token_values else len(s.token_ids), s.start_pos,
             s.block_table, s.sample, s.kind, s.num_output_tokens) for s in plan.seqs]
    return (plan.iteration, seqs, plan.slots, plan.preempted, plan.num_waiting,
            plan.kv_blocks_used)


CASES = {
    "continuous": (dict(batching="continuous", max_num_seqs=4, max_num_batched_tokens=32),
                   dict(count=10)),
    "static": (dict(batching="static", max_num_seqs=3, max_num_batched_tokens=48),
               dict(count=8)),
    "shared-prefix": (dict(batching="continuous", max_num_seqs=4, max_num_batched_tokens=24),
                      dict(count=8, shared_prefix=40)),
    "preemption": (dict(batching="continuous", max_num_seqs=6, max_num_batched_tokens=64,
                        num_blocks=8), dict(count=10, long=True)),
    "arrivals": (dict(batching="continuous", max_num_seqs=3, max_num_batched_tokens=16),
                 dict(count=9, arrivals=[0, 0, 1.5, 2, 2, 7, 30, 30.5, 31])),
    "stall-free": (dict(batching="continuous", max_num_seqs=4, max_num_batched_tokens=32,
                        max_prefill_tokens_while_decoding=6), dict(count=10)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_with_the_fake_runner_takes_the_same_decisions(tiny_llama, case):
    settings, spec = CASES[case]
    requests = _requests(**spec)
    cost = LinearCost(0.5, {"prefill_tokens": 0.01, "decode_seqs": 0.1,
                            "attention_pairs": 1e-4, "sampled_rows": 0.05})
    engine = tiny_engine(tiny_llama, **ENGINE, **settings)
    engine.runner = FakeRunner(cost)
    engine_plans = _drive_engine(engine, requests)
    sim = replay(requests, ReplaySettings(max_model_len=512, **settings), cost,
                 keep_plans=True, check=True)
    assert [_decisions(p) for p in sim.plans] == [_decisions(p) for p in engine_plans]
    if case == "preemption":
        assert sim.preemptions > 0
    if case == "stall-free":  # the cap binds: iterations with decodes and a 6-token prefill
        mixed = [sum(s.num_tokens for s in p.seqs if s.kind == "prefill")
                 for p in sim.plans if any(s.kind == "decode" for s in p.seqs)]
        assert max(mixed) == 6 and mixed.count(6) > 1
    if case == "shared-prefix":
        assert any(s.start_pos > 0 and s.kind == "prefill" and s.start_pos % 16 == 0
                   for p in sim.plans for s in p.seqs if s.num_output_tokens == 0)
    # The same trace records, but for the clock.
    real, predicted = engine.trace.export(), sim.trace
    keys = ("index", "slots", "num_waiting", "kv_blocks_used", "preempted")
    assert [{k: it[k] for k in keys} for it in predicted["iterations"]] == \
        [{k: it[k] for k in keys} for it in real["iterations"]]
    keys = ("id", "arrival_iteration", "prompt_tokens", "output_tokens", "first_iteration",
            "finish_iteration", "finish_reason")
    assert [{k: r[k] for k in keys} for r in predicted["requests"]] == \
        [{k: r[k] for k in keys} for r in real["requests"]]


def test_the_real_engine_and_its_trace_replay_to_the_same_schedule(tiny_llama):
    # The real runner (tokens differ from the fake's; lengths do not: EOS is ignored).
    settings = dict(batching="continuous", max_num_seqs=4, max_num_batched_tokens=32)
    requests = _requests(10, seed=3)
    engine = tiny_engine(tiny_llama, **ENGINE, **settings)
    engine_plans = _drive_engine(engine, requests)
    replay_settings = ReplaySettings(max_model_len=512, **settings)
    sim = replay(requests, replay_settings, UnitCost(), keep_plans=True)
    assert [_decisions(p, token_values=False) for p in sim.plans] == \
        [_decisions(p, token_values=False) for p in engine_plans]
    # Its trace (prompt lengths and output lengths only) replays to the same slot strips.
    trace = json.loads(json.dumps(engine.trace.export()))
    from_trace, info = requests_from_trace(trace)
    assert info["trace_num_slots"] == 4 and len(from_trace) == 10
    again = replay(from_trace, replay_settings, UnitCost())
    assert [it["slots"] for it in again.trace["iterations"]] == \
        [it["slots"] for it in trace["iterations"]]


# ---------------------------------------------------------------------- the cost model
def _synthetic(n: int, rng: np.random.Generator):
    return [StepFeatures(int(p), int(d), int(a), int(s)) for p, d, a, s in zip(
        rng.integers(0, 512, n), rng.integers(0, 64, n), rng.integers(0, 200_000, n),
        rng.integers(1, 64, n))]


def test_fit_recovers_known_coefficients():
    truth = LinearCost(0.040, {"prefill_tokens": 4e-4, "decode_seqs": 3e-3,
                               "attention_pairs": 2e-8, "sampled_rows": 5e-4})
    features = _synthetic(200, np.random.default_rng(0))
    fit = LinearCost.fit([(f, truth.step_seconds(f)) for f in features])
    assert fit.base == pytest.approx(truth.base, rel=1e-6)
    for name in FEATURES:
        assert fit.coefficients[name] == pytest.approx(truth.coefficients[name], rel=1e-6)
    # With 3% multiplicative noise the fit is close, and so is the predicted total time.
    rng = np.random.default_rng(1)
    noisy = [(f, truth.step_seconds(f) * (1 + 0.03 * rng.standard_normal())) for f in features]
    fit = LinearCost.fit(noisy)
    assert fit.base == pytest.approx(truth.base, rel=0.1)
    assert fit.coefficients["decode_seqs"] == pytest.approx(3e-3, rel=0.1)
    assert fit.residuals(noisy)["total_rel_error"] < 0.02
    assert fit.residuals(noisy)["median_rel_error"] < 0.05


def test_fit_prices_chunks_apart_from_their_tokens():
    # The same prefill tokens in 1 or in 16 chunks: a model without the chunk count prices
    # both alike; the fit recovers each chunk's own cost (the attention's call per chunk).
    truth = LinearCost(0.015, {"prefill_tokens": 3e-4, "decode_seqs": 1e-4,
                               "attention_pairs": 1e-8, "sampled_rows": 4e-4,
                               "chunks": 1.9e-3})
    rng = np.random.default_rng(3)
    features = [StepFeatures(int(t), int(d), int(t) * 40, int(d + s), chunks=int(c))
                for t, d, c, s in zip(rng.integers(32, 512, 120), rng.integers(0, 64, 120),
                                      rng.integers(1, 41, 120), rng.integers(0, 9, 120))]
    fit = LinearCost.fit([(f, truth.step_seconds(f)) for f in features])
    assert fit.coefficients["chunks"] == pytest.approx(1.9e-3, rel=1e-6)
    few, many = StepFeatures(512, 0, 20_000, 0, chunks=1), StepFeatures(512, 0, 20_000, 0,
                                                                        chunks=16)
    assert fit.step_seconds(many) - fit.step_seconds(few) == pytest.approx(15 * 1.9e-3)


def test_a_profile_from_before_chunks_loads_with_them_at_zero(tmp_path):
    old = {"kind": "linear", "version": 1, "base": 0.01,
           "coefficients": {"prefill_tokens": 1e-4, "decode_seqs": 1e-4,
                            "attention_pairs": 1e-8, "sampled_rows": 1e-4}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    model = load_profile(path)
    assert model.coefficients["chunks"] == 0.0
    assert model.step_seconds(StepFeatures(10, 0, 55, 1, chunks=1)) == \
        pytest.approx(0.01 + 10e-4 + 55e-8 + 1e-4)


def test_fit_keeps_coefficients_nonnegative():
    # Data a negative coefficient fits best (bigger prefills look cheaper, as noise can make
    # them look): plain least squares returns it; the fit drops that feature and refits.
    rng = np.random.default_rng(2)
    features = _synthetic(80, rng)
    samples = [(f, 0.5 + 0.004 * f.decode_seqs - 2e-4 * f.prefill_tokens) for f in features]
    free = LinearCost.fit(samples, nonnegative=False)
    assert free.coefficients["prefill_tokens"] == pytest.approx(-2e-4, rel=1e-6)
    fit = LinearCost.fit(samples)
    assert fit.coefficients["prefill_tokens"] == 0.0
    assert min(fit.coefficients.values()) >= 0 and fit.base > 0
    assert fit.coefficients["decode_seqs"] == pytest.approx(0.004, rel=0.3)
    # Collinear twins (every decode sequence is a sampled row) share their cost.
    twins = [(StepFeatures(0, b, b * (30 + 7 * b % 50), b), 0.03 + 0.005 * b)
             for b in range(1, 40)]
    fit = LinearCost.fit(twins)
    assert min(fit.coefficients.values()) >= 0
    assert fit.coefficients["decode_seqs"] + fit.coefficients["sampled_rows"] == \
        pytest.approx(0.005, rel=1e-3)
    assert fit.residuals(twins)["max_rel_error"] < 1e-3


def test_features_of_a_plan():
    result = replay([ReplayRequest("a", 100, 3), ReplayRequest("b", 40, 2)],
                    ReplaySettings(max_num_batched_tokens=64), UnitCost(), keep_plans=True)
    first, second = (StepFeatures.of(p) for p in result.plans[:2])
    # a: 64 of its 100 tokens (no sample); b waits for budget (0 left).
    assert first == StepFeatures(64, 0, 64 * 65 // 2, 0, chunks=1)
    # a: its last 36 (positions 64..99, samples); b: 28 of its 40: two chunks.
    assert second == StepFeatures(64, 0, 36 * 64 + 36 * 37 // 2 + 28 * 29 // 2, 1, chunks=2)
    # a decodes at context 101 beside b's last 12 tokens (28..39, samples): both no longer
    # than ROW_CHUNK_TOKENS, so every token is a row of the decode stack; the rows after a
    # chunk's first re-read what its first read (drafted pairs)
    third = StepFeatures.of(result.plans[2])
    b_pairs = 12 * 28 + 12 * 13 // 2
    assert third == StepFeatures(0, 1 + 12, 101 + b_pairs, 2, draft_pairs=b_pairs - 29,
                                 decode_pairs=101 + 29)
    fourth = StepFeatures.of(result.plans[3])  # two decodes: contexts 102 and 41
    assert fourth == StepFeatures(0, 2, 102 + 41, 2, decode_pairs=102 + 41)
    assert StepFeatures.of(result.plans[3], first_forward=True).first_forward == 1


def test_decode_pairs_count_only_decodes_beside_a_prefill():
    # A decode at context 41 beside a 40-token prefill chunk at 0 (longer than
    # ROW_CHUNK_TOKENS: the general path): the decode's 41 pairs are read from the cache,
    # the chunk's 820 computed among its own rows.
    result = replay([ReplayRequest("a", 40, 4), ReplayRequest("b", 80, 2, arrival=1e-9)],
                    ReplaySettings(max_num_batched_tokens=41), UnitCost(), keep_plans=True)
    mixed = 0
    for plan in result.plans:
        features = StepFeatures.of(plan)
        decodes = [s for s in plan.seqs if s.kind == "decode"]
        assert features.decode_pairs == sum(s.start_pos + 1 for s in decodes)
        if decodes and len(decodes) < len(plan.seqs):
            mixed += 1
            assert 0 < features.decode_pairs < features.attention_pairs
            # ... and they are decodes of the general path (mixed_decodes), not the stack's
            assert features.mixed_decodes == len(decodes) == features.decode_seqs
        else:
            assert features.mixed_decodes == 0
    assert mixed, "the workload must put a decode beside a prefill chunk"


def test_the_replay_prices_an_engines_first_forward_once():
    requests = [ReplayRequest(str(i), 12, 5) for i in range(4)]
    coefficients = {**dict.fromkeys(FEATURES, 1e-4)}
    plain = replay(requests, ReplaySettings(), LinearCost(0.01, {**coefficients,
                                                                 "first_forward": 0.0}))
    started = replay(requests, ReplaySettings(), LinearCost(0.01, {**coefficients,
                                                                   "first_forward": 0.25}))
    assert started.duration == pytest.approx(plain.duration + 0.25)
    # Every request waits for the first forward (one burst, one first iteration).
    assert all(b.ttft == pytest.approx(a.ttft + 0.25)
               for a, b in zip(plain.outcomes, started.outcomes))


def test_profile_round_trip_and_errors(tmp_path):
    model = LinearCost(0.01, dict.fromkeys(FEATURES, 1e-4), {"model": "x"})
    path = tmp_path / "p.json"
    model.save(path)
    again = load_profile(path)
    assert (again.base, again.coefficients, again.meta) == (0.01, model.coefficients,
                                                            {"model": "x"})
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_profile(path)
    path.write_text(json.dumps({"kind": "linear", "version": 1, "base": 0.1,
                                "coefficients": {"prefill_tokens": 1}}))
    with pytest.raises(ValueError, match="missing"):
        load_profile(path)
    with pytest.raises(ValueError, match="samples"):
        LinearCost.fit([(StepFeatures(1, 1, 1, 1), 0.1)])
    # a number a float cannot hold, or a bool, is a ValueError naming the field (a huge
    # int was numpy's TypeError before)
    for field, bad in [("base", 10**400), ("base", True), ("knee", 10**400), ("knee", False)]:
        record = {**model.to_profile(), field: bad}
        path.write_text(json.dumps(record))
        with pytest.raises(ValueError, match=f"{field} must be a finite number"):
            load_profile(path)


# ---------------------------------------------------------------------- speed, inputs
def w_requests() -> list[ReplayRequest]:
    """W's shape: 64 requests, 40-token prompts, W's output lengths (seed 0)."""
    lengths = [r.max_tokens for r in generate_workload(64, prompts="chat").requests]
    return [ReplayRequest(str(i), 40, n) for i, n in enumerate(lengths)]


def test_w_replays_in_well_under_a_second():
    requests = w_requests()
    cost = LinearCost(0.045, {"prefill_tokens": 5e-4, "decode_seqs": 4.5e-3,
                              "attention_pairs": 1e-8, "sampled_rows": 2e-4})
    for slots in (16, 64):
        started = time.perf_counter()
        result = replay(requests, ReplaySettings(max_num_seqs=slots), cost)
        elapsed = time.perf_counter() - started
        assert sum(len(o.token_times) for o in result.outcomes) == 6317
        assert elapsed < 1.0, f"W at {slots} slots replayed in {elapsed:.2f} s"
        # NOTE: W takes ~70 s for real at 16 slots on this machine (RESULTS.md); under 1%
        # of it is 0.7 s.


def test_rate_scaling_and_poisson_retiming():
    requests = [ReplayRequest(str(i), 4, 2, float(i)) for i in range(5)]
    assert [r.arrival for r in scale_rate(requests, 2)] == [0, 0.5, 1, 1.5, 2]
    with pytest.raises(ValueError, match="rate scale"):
        scale_rate(requests, 0)
    online = with_poisson(requests, 4.0)
    assert online[0].arrival == 0 and all(
        a.arrival <= b.arrival for a, b in zip(online, online[1:]))
    assert all(r.arrival == 0 for r in with_poisson(requests, math.inf))


def test_bad_requests_and_refusals():
    with pytest.raises(ValueError, match="output_tokens"):
        ReplayRequest("a", 4, 0)
    with pytest.raises(ValueError, match="arrival"):
        ReplayRequest("a", 4, 1, -1.0)
    with pytest.raises(ValueError, match="unique"):
        replay([ReplayRequest("a", 4, 1)] * 2, ReplaySettings(), UnitCost())
    # Too long for max_model_len: a failed request, as bench counts it; the others run.
    result = replay([ReplayRequest("long", 600, 1), ReplayRequest("ok", 4, 2)],
                    ReplaySettings(max_model_len=512), UnitCost())
    b = result.bench_result()
    assert (b.completed, b.failed) == (1, 1) and "512" in b.errors[0]


# ---------------------------------------------------------------------- CLI, calibrate, plan
def _engine_trace(tiny_llama, path):
    engine = tiny_engine(tiny_llama, **ENGINE, max_num_seqs=4, max_num_batched_tokens=32)
    _drive_engine(engine, _requests(8, seed=5))
    path.write_text(json.dumps(engine.trace.export()))


def test_cli_simulate_trace_writes_bench_results_and_a_drawable_trace(tiny_llama, tmp_path,
                                                                      capsys):
    trace, out, saved = tmp_path / "t.json", tmp_path / "r.json", tmp_path / "s.json"
    _engine_trace(tiny_llama, trace)
    code = main(["replay", str(trace), "--clock", "iterations", "--max-num-seqs", "2",
                 "--out", str(out), "--save-trace", str(saved), "--rate-scale", "2"])
    assert code == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["target"] == "simulator" and row["completed"] == 8
    assert row["config"]["max_num_seqs"] == 2 and row["config"]["cost_model"]["kind"] == "unit"
    for name in ("ttft_ms", "tpot_ms"):
        assert set(row[name]) == {"mean", "p50", "p90", "p99"}
    assert row["duration_s"] > 0 and row["output_throughput"] > 0
    assert main(["timeline", str(saved), "--no-color"]) == 0
    assert "replay" in capsys.readouterr().out
    # Both policies: a compare report.
    assert main(["replay", str(trace), "--clock", "iterations", "--batching", "both",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["mode"] == "compare"


def test_replay_refuses_the_toy_clock_unless_asked(tiny_llama, tmp_path, monkeypatch, capsys):
    """No --profile and no calibration on this machine: an error naming the way out, never
    a prediction in iterations passed off as seconds (also for `simulate --trace`)."""
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SLOTSERVE_CALIBRATION")  # the cache dir's, not the tests' file
    trace = tmp_path / "t.json"
    _engine_trace(tiny_llama, trace)
    for argv in (["replay", str(trace)], ["simulate", "--trace", str(trace)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "no calibration" in err and "slotserve calibrate" in err
    assert main(["replay", str(trace), "--clock", "iterations"]) == 0
    assert "the toy clock" in capsys.readouterr().out


def test_replay_runs_on_the_last_calibration(tiny_llama, tmp_path, monkeypatch, capsys):
    from slotserve.lab.replay.cost_model import FEATURES, LinearCost
    from slotserve.paths import last_calibration_path

    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SLOTSERVE_CALIBRATION")  # the cache dir's, not the tests' file
    last_calibration_path().parent.mkdir(parents=True)
    coefficients = dict.fromkeys(FEATURES, 1e-4)
    LinearCost(base=0.01, coefficients=coefficients).save(last_calibration_path())
    trace, out = tmp_path / "t.json", tmp_path / "r.json"
    _engine_trace(tiny_llama, trace)
    assert main(["simulate", "--trace", str(trace), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert str(last_calibration_path()) in captured.err and "slotserve replay" in captured.err
    (row,) = json.loads(out.read_text())["results"]
    assert row["config"]["cost_model"]["kind"] == "linear"
    assert "predicted s" in captured.out


def test_cli_simulate_rejects_replay_flags_without_a_trace(capsys):
    assert main(["simulate", "--max-num-seqs", "4"]) == 2
    assert "needs --trace" in capsys.readouterr().err
    assert main(["simulate", "--batching", "fair"]) == 2
    assert "--batching must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["simulate", "replay", "plan"])
def test_policy_is_a_deprecated_alias_of_batching(command, capsys):
    """`--policy` (the admission rule's former name, as `serve`'s) sets --batching, with a
    warning on stderr."""
    from slotserve.cli import build_parser

    argv = [command, *(["trace.json"] if command == "replay" else []),
            *(["--slo-ttft-ms", "1", "--slo-tpot-ms", "1"] if command == "plan" else []),
            "--policy", "static"]
    args = build_parser().parse_args(argv)
    assert args.batching == (("static",) if command == "plan" else "static")
    assert "warning: --policy is deprecated; use --batching" in capsys.readouterr().err


def test_calibrate_on_a_tiny_model_fits_and_plan_uses_it(tmp_path, capsys):
    from slotserve.lab.bench.targets import EngineTarget

    hf = tiny_hf_model()
    target = EngineTarget(ModelConfig.from_hf_dict(hf.config.to_dict()),
                          {k: v.detach().clone() for k, v in hf.state_dict().items()},
                          engine_kwargs={"kernels": "reference"}, source="tiny")
    grid = CalibrationGrid(batch_sizes=(1, 4), context_lens=(8, 48), chunk_sizes=(16, 64),
                           decode_steps=3)
    model, samples = calibrate(target, grid)
    assert len(samples) >= 20 and model.meta["fit"]["samples"] == len(samples)
    assert {(s.batch, s.context, s.chunk) for s in samples} == {
        (b, c, k) for b in (1, 4) for c in (8, 48) for k in (16, 64)} | {
        (*WARM_UP, k) for k in (16, 64)}
    # A fresh engine per grid point: its warm-up's first step is its first forward.
    firsts = [s for s in samples if s.features.first_forward]
    assert len(firsts) == 8 and all((s.batch, s.context) == WARM_UP for s in firsts)
    assert all(s.seconds > 0 for s in samples)
    # Every grid point's prefill is chunked by its budget.
    assert all(s.features.prefill_tokens <= s.chunk for s in samples)
    # Each point's mixed phase: its context's prompt prefilled beside decoding prompts
    # (at most max_num_seqs - 1 = 3 of them): on the general path where its chunks are
    # longer than ROW_CHUNK_TOKENS (context 48 at chunk 64), else as rows of the stack.
    mixed = [s for s in samples if s.phase == "mixed" and s.features.mixed_decodes]
    assert {(s.batch, s.context, s.chunk) for s in mixed} == {(1, 48, 64), (4, 48, 64)}
    assert {(s.batch, s.features.mixed_decodes) for s in mixed} == {(1, 1), (4, 3)}
    rows = [s for s in samples if s.phase == "mixed" and s.chunk == 16]
    assert rows and all(s.features.chunks == 0 for s in rows)
    assert model.meta["samples"][0]["phase"] == "warm-up"
    profile = tmp_path / "profile.json"
    model.save(profile)
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"prompt": list(range(3, 3 + 5 + i % 7)),
                                            "max_tokens": 2 + i % 5}) + "\n"
                                for i in range(12)))
    code = main(["plan", "--slo-ttft-ms", "1e6", "--slo-tpot-ms", "1e6", "--workload",
                 str(workload), "--profile", str(profile), "--max-num-seqs", "2,8",
                 "--max-num-batched-tokens", "64", "--rates", "1,inf"])
    assert code == 0
    text = capsys.readouterr().out
    assert "best: --batching continuous --max-num-seqs" in text and "100%" in text


def test_plan_prefers_the_setting_that_meets_a_tight_ttft():
    # Unit cost: TTFT in iterations. 16 requests at once: 16 slots admit all in one go.
    requests = [ReplayRequest(str(i), 4, 6) for i in range(16)]
    slo = SLO(ttft_ms=1500, tpot_ms=1500)
    candidates = search(requests, slo, UnitCost(), max_num_seqs=(2, 16),
                        max_num_batched_tokens=(512,), rates=(math.inf,))
    best = candidates[0]
    assert best.settings.max_num_seqs == 16 and best.attainment == 1.0
    assert best.goodput == pytest.approx(16 / best.result.duration)
    assert candidates[1].attainment == pytest.approx(2 / 16)


def test_kv_manager_is_the_core_one():
    # NOTE: the replay uses the engine's own KV manager and scheduler, not copies.
    result = replay([ReplayRequest("a", 4, 1)], ReplaySettings(), UnitCost(), keep_plans=True)
    assert result.trace["kv_blocks_total"] == ReplaySettings().resolved_num_blocks()
    assert KVCacheManager.__module__ == "slotserve.core.kv_manager"


def test_cli_calibrate_writes_a_profile_simulate_reads(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    tiny_hf_model().save_pretrained(model_dir)
    profile = tmp_path / "profile.json"
    code = main(["calibrate", "--model", str(model_dir), "--kernels", "reference",
                 "--batch-sizes", "1,3", "--context-lens", "8,20", "--chunk-sizes", "16",
                 "--decode-steps", "2", "--out", str(profile)])
    assert code == 0
    text = capsys.readouterr().out
    assert "residuals:" in text and "prefill_tokens" in text and "wrote" in text
    model = load_profile(profile)
    assert model.meta["grid"]["batch_sizes"] == [1, 3] and model.meta["fit"]["samples"] >= 10
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"prompt": [5 + i, 6, 7, 8], "max_tokens": 3,
                                            "arrival": 0.01 * i}) + "\n" for i in range(6)))
    out = tmp_path / "r.json"
    assert main(["replay", str(workload), "--profile", str(profile),
                 "--max-num-seqs", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["completed"] == 6 and row["total_output_tokens"] == 18
    assert row["config"]["cost_model"]["kind"] == "linear"


def test_cli_plan_verify_runs_the_winner_on_the_engine(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    tiny_hf_model().save_pretrained(model_dir)
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"prompt": [5 + i, 6, 7, 8, 9], "max_tokens": 4})
                                + "\n" for i in range(8)))
    code = main(["plan", "--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9", "--workload",
                 str(workload), "--model", str(model_dir), "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "64", "--rates", "inf", "--verify"])
    assert code == 0
    text = capsys.readouterr().out
    assert "verifying: 8 requests" in text and "predicted vs measured" in text
    assert "goodput: predicted" in text and "(100%)" in text
