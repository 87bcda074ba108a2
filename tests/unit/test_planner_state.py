"""What "auto" speculation has learnt travels with a trace (issue 35's replay): the decode
step's cost and the pooled acceptance are saved where a trace starts (`planner_state`) and
a replay of the trace plans from them, as the engine did then, not from nothing.
"""

from __future__ import annotations

import json
import random

import pytest

from slotserve.config import SchedulerConfig
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.scheduler import Scheduler
from slotserve.lab.replay import LinearCost, ReplayRequest, ReplaySettings, replay
from slotserve.sampling import SamplingParams
from slotserve.spec.config import parse
from slotserve.spec.planner import FIRST, FRESH, SPAN, DecodeStepCost, PooledAcceptance, Speculator
from tests.conftest import run_to_end, tiny_engine
from tests.unit.test_spec_engine import repetitive_prompts

AUTO = json.dumps({"method": "ngram", "num_speculative_tokens": "auto",
                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})


def _knee_seconds(rows: int, drafted: bool) -> float:
    """A decode step of a small model on a CPU: the weights once, then compute past 8 rows,
    and a verification's bookkeeping."""
    return 0.010 + 0.0002 * rows + 0.001 * max(0, rows - 8) + (0.0005 if drafted else 0.0)


def _observations(count: int, seed: int) -> list[tuple[int, float, bool]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        rows, drafted = rng.randint(1, 40), rng.random() < 0.4
        out.append((rows, _knee_seconds(rows, drafted) * rng.uniform(0.95, 1.05), drafted))
    return out


def _prices(cost: DecodeStepCost) -> list[float]:
    return [cost.seconds(n) for n in range(1, 65)] + [cost.verify_extra]


def test_a_restored_decode_cost_prices_and_learns_as_the_original():
    original = DecodeStepCost()
    for rows, seconds, drafted in _observations(41, seed=3):  # NOTE: between two refits
        original.observe(rows, seconds, drafted)
    copy = DecodeStepCost()
    copy.restore(json.loads(json.dumps(original.state())))
    assert original.hinge is not None and copy.hinge == pytest.approx(original.hinge)
    assert _prices(copy) == pytest.approx(_prices(original), rel=1e-9)
    for rows, seconds, drafted in _observations(30, seed=4) + [(4, 1.0, False)]:  # a stall
        original.observe(rows, seconds, drafted)
        copy.observe(rows, seconds, drafted)
        assert _prices(copy) == pytest.approx(_prices(original), rel=1e-9)


def test_a_restored_pool_rates_and_learns_as_the_original():
    rng = random.Random(5)
    original, copy = PooledAcceptance(), PooledAcceptance()
    events = [(rng.randint(1, 8), rng.choice((FIRST, FRESH, SPAN))) for _ in range(60)]
    for drafts, state in events[:40]:
        original.observe(drafts, rng.randint(0, drafts), state)
    copy.restore(json.loads(json.dumps(original.state())))
    for drafts, state in events[40:]:
        accepted = rng.randint(0, drafts)
        original.observe(drafts, accepted, state)
        copy.observe(drafts, accepted, state)
        assert [copy.rate(s) for s in (FIRST, FRESH, SPAN)] == pytest.approx(
            [original.rate(s) for s in (FIRST, FRESH, SPAN)], rel=1e-12)


def _scheduler(speculative: str | None = AUTO) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    return Scheduler(config, KVCacheManager(64, 16),
                     speculator=None if speculative is None else Speculator(parse(speculative)))


def _learnt_state() -> dict:
    scheduler = _scheduler()
    for rows, seconds, drafted in _observations(24, seed=6):
        scheduler.decode_cost.observe(rows, seconds, drafted)
    for _ in range(30):
        scheduler.speculator.pooled.observe(4, 4, FIRST)
    scheduler.speculator.dry_iterations = 5
    return scheduler.planner_state()


@pytest.mark.parametrize("path, value, named", [
    (("decode_cost",), None, "decode_cost"),
    (("pooled_acceptance",), [1, 2], "pooled_acceptance"),
    (("decode_cost", "line"), [1.0, 2.0], "line"),
    (("decode_cost", "line"), [1.0, 2.0, float("nan"), 0.0, 0.0], "line"),
    (("decode_cost", "line"), [-1.0, 2.0, 3.0, 0.0, 0.0], "line"),
    (("decode_cost", "bins"), [[3, "yes", 1.0, 3.0, 0.01]], "bins"),
    (("decode_cost", "bins"), [[3, False, 0.0, 0.0, 0.0]], "bins"),
    (("decode_cost", "hinge"), [0.01, 0.0, -1.0, 8.0], "hinge"),
    (("decode_cost", "verify_extra"), "0.1", "verify_extra"),
    (("decode_cost", "since_fit"), -2, "since_fit"),
    (("decode_cost", "line"), [1.0, 4.0, -0.5, 16.0, -2.0], "line"),
    (("decode_cost", "bins"), [[0, False, 1.0, 0.0, 0.01]], "bins"),
    (("decode_cost", "bins"), [[4, False, 1.0, 0.5, 0.01]], "bins"),
    (("decode_cost", "bins"), [[4, False, 1.0, 4.0, -0.01]], "bins"),
    (("decode_cost", "bins"), [[4, False, 1.0, 4.0, 0.01], [4, False, 2.0, 8.0, 0.02]],
     "twice"),
    (("dry_iterations",), 2.5, "dry_iterations"),
    (("pooled_acceptance", FRESH), [3.0, float("inf")], FRESH),
    (("pooled_acceptance", SPAN), [-1.0, 0.0], "pooled"),
])
def test_a_malformed_planner_state_is_refused_naming_it_and_changes_nothing(path, value,
                                                                             named):
    state = _learnt_state()
    target = state
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    scheduler = _scheduler()
    before = scheduler.planner_state()
    with pytest.raises(ValueError, match=named):
        scheduler.restore_planner_state(state)
    assert scheduler.planner_state() == before


def test_a_scheduler_restored_from_a_state_reports_that_state():
    state = json.loads(json.dumps(_learnt_state()))
    scheduler = _scheduler()
    scheduler.restore_planner_state(state)
    assert json.loads(json.dumps(scheduler.planner_state())) == state
    off = _scheduler(None)
    off.restore_planner_state(state)  # NOTE: speculation off: nothing to plan
    assert off.planner_state() is None


@pytest.fixture(scope="module")
def warmed(tiny_llama):
    """An engine with auto speculation after a first batch, its state then, and the trace
    of the second batch."""
    engine = tiny_engine(tiny_llama, speculative_config=AUTO, max_num_seqs=4)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    prompts = repetitive_prompts(8, seed=7)
    run_to_end(engine, [(f"a{i}", p, params) for i, p in enumerate(prompts[:4])])
    state = json.loads(json.dumps(engine.scheduler.planner_state()))
    engine.trace.clear()
    run_to_end(engine, [(f"b{i}", p, params) for i, p in enumerate(prompts[4:])])
    return engine, state, json.loads(json.dumps(engine.export_trace()))


def test_a_trace_cleared_between_runs_carries_the_planner_state_it_started_from(warmed):
    engine, state, trace = warmed
    assert state["decode_cost"]["bins"], "the first batch taught the step cost nothing"
    assert trace["planner_state"] == state
    assert trace["planner_state"] != engine.scheduler.planner_state()  # it learnt since


def test_a_trace_that_lost_its_first_iterations_carries_no_planner_state(tiny_llama):
    engine = tiny_engine(tiny_llama, speculative_config=AUTO, max_num_seqs=2,
                         trace_capacity=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    engine.trace.clear()
    run_to_end(engine, [("a", repetitive_prompts(1)[0], params)])
    assert len(engine.export_trace()["iterations"]) == 4
    assert "planner_state" not in engine.export_trace()


def test_an_engine_without_speculation_records_no_planner_state(tiny_llama):
    engine = tiny_engine(tiny_llama, max_num_seqs=2)
    engine.trace.clear()
    run_to_end(engine, [("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))])
    assert "planner_state" not in engine.export_trace()


def test_a_replay_from_a_learnt_state_drafts_as_a_warm_engine_would():
    """Cold, the first guess is priced at the Beta(1, 1) prior's 0.5; after 30 verifications
    that accepted every first guess the pool says ~0.97, so the same offer is taken longer."""
    offered = tuple((t, 8, 8) for t in range(1, 40, 9))
    requests = [ReplayRequest("r", 32, 40, verifications=offered)]
    settings = ReplaySettings(max_num_seqs=4, speculative_config=AUTO)
    clock = LinearCost(0.010, {"decode_seqs": 0.0002, "prefill_tokens": 1e-5,
                               "attention_pairs": 0.0, "sampled_rows": 0.0})

    def first_drafts(planner_state):
        result = replay(requests, settings, clock, planner_state=planner_state)
        return next(s["proposed"] for it in result.trace["iterations"] for s in it["slots"]
                    if s and s.get("proposed"))

    learnt = _learnt_state()
    assert first_drafts(learnt) > first_drafts(None)


def test_a_recorded_state_is_not_restored_on_the_toy_clock():
    """The engine's state prices steps in seconds; the toy clock counts iterations."""
    from slotserve.lab.replay import UnitCost
    from slotserve.lab.replay.simulator import planner_state_for

    learnt = _learnt_state()
    assert planner_state_for(UnitCost(), learnt) is None
    clock = LinearCost(0.010, {"decode_seqs": 0.0002, "prefill_tokens": 1e-5,
                               "attention_pairs": 0.0, "sampled_rows": 0.0})
    assert planner_state_for(clock, learnt) is learnt
    assert planner_state_for(clock, None) is None
