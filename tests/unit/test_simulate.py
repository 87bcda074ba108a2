"""The seed's slot model: its toy exactly, the two admission rules, and invariants."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.lab.simulate import POLICIES, SEED_TOY, SimRequest, simulate, summarize


def busy_per_iteration(trace: dict) -> list[int]:
    return [sum(c is not None and c["kind"] != "stalled" for c in it["slots"])
            for it in trace["iterations"]]


def occupants(trace: dict) -> list[list[str | None]]:
    return [[c and c["request"] for c in it["slots"]] for it in trace["iterations"]]


# ---------------------------------------------------------------------------------------
# The seed's toy: 6 requests (lengths 2, 8, 3, 4, 3, 2) on 3 slots
# ---------------------------------------------------------------------------------------


def test_seed_toy_is_the_seed():
    assert [(r.id, r.output_tokens, r.arrival_iteration) for r in SEED_TOY] == [
        ("R1", 2, 0), ("R2", 8, 0), ("R3", 3, 0), ("R4", 4, 0), ("R5", 3, 0), ("R6", 2, 0)]


def test_seed_toy_static_12_iterations_61_percent():
    s = summarize(simulate(SEED_TOY, 3, "static"))
    assert s["iterations"] == 12
    assert (s["busy_slot_iterations"], s["slot_iterations"]) == (22, 36)
    assert s["utilisation"] == pytest.approx(22 / 36)
    assert round(100 * s["utilisation"]) == 61


def test_seed_toy_continuous_8_iterations_92_percent():
    s = summarize(simulate(SEED_TOY, 3, "continuous"))
    assert s["iterations"] == 8
    assert (s["busy_slot_iterations"], s["slot_iterations"]) == (22, 24)
    assert s["utilisation"] == pytest.approx(22 / 24)
    assert round(100 * s["utilisation"]) == 92


# (wait, first, finish) per request, derived by hand from the seed:
# static: R1, R2, R3 run from 0 (finish 0+2-1=1, 0+8-1=7, 0+3-1=2); the batch lasts until
#   R2 is done, so R4, R5, R6 start at 8 (finish 8+4-1=11, 8+3-1=10, 8+2-1=9).
# continuous: R1 leaves after 1 -> R4 takes its slot at 2 (finish 5); R3 leaves after 2 ->
#   R5 at 3 (finish 5); R4 and R5 leave after 5 -> R6 at 6 (finish 7); R2 still 0..7.
EXPECTED = {
    "static": {"R1": (0, 0, 1), "R2": (0, 0, 7), "R3": (0, 0, 2),
               "R4": (8, 8, 11), "R5": (8, 8, 10), "R6": (8, 8, 9)},
    "continuous": {"R1": (0, 0, 1), "R2": (0, 0, 7), "R3": (0, 0, 2),
                   "R4": (2, 2, 5), "R5": (3, 3, 5), "R6": (6, 6, 7)},
}


@pytest.mark.parametrize("policy", POLICIES)
def test_seed_toy_wait_and_finish_per_request(policy):
    requests = summarize(simulate(SEED_TOY, 3, policy))["requests"]
    got = {r["id"]: (r["wait_iterations"], r["first_iteration"], r["finish_iteration"])
           for r in requests}
    assert got == EXPECTED[policy]


def test_seed_toy_busy_slots_per_iteration():
    # The seed: static's "columns 4-8 are running at 1/3" (iterations 3..7 here).
    assert busy_per_iteration(simulate(SEED_TOY, 3, "static")) == [3, 3, 2, 1, 1, 1, 1, 1,
                                                                   3, 3, 2, 1]
    assert busy_per_iteration(simulate(SEED_TOY, 3, "continuous")) == [3] * 6 + [2, 2]


def test_static_never_admits_while_a_request_runs():
    grid = occupants(simulate(SEED_TOY, 3, "static"))
    # R1 leaves after iteration 1, yet its slot stays idle until R2's batch ends.
    assert [row[0] for row in grid] == ["R1", "R1"] + [None] * 6 + ["R4"] * 4
    assert all(row[1] == "R2" for row in grid[:8])
    assert all(set(row) <= {"R1", "R2", "R3", None} for row in grid[:8])


def test_continuous_fills_a_freed_slot_the_next_iteration():
    grid = occupants(simulate(SEED_TOY, 3, "continuous"))
    assert [row[0] for row in grid] == ["R1", "R1", "R4", "R4", "R4", "R4", "R6", "R6"]
    assert [row[2] for row in grid] == ["R3", "R3", "R3", "R5", "R5", "R5", None, None]


def test_num_waiting_counts_the_queue_after_admission():
    trace = simulate(SEED_TOY, 3, "continuous")
    assert [it["num_waiting"] for it in trace["iterations"]] == [3, 3, 2, 1, 1, 1, 0, 0]


def test_prefill_iterations_come_before_decode_in_the_same_slot():
    # Each request first spends 2 iterations prefilling. By hand: R1 0..3, R3 0..4,
    # R4 4..9, R5 5..9, R6 10..13, R2 0..9: 14 iterations, 22 + 6 * 2 = 34 busy cells.
    trace = simulate(SEED_TOY, 3, "continuous", prefill_iterations=2)
    s = summarize(trace)
    assert (s["iterations"], s["busy_slot_iterations"]) == (14, 34)
    finish = {r["id"]: r["finish_iteration"] for r in s["requests"]}
    assert finish == {"R1": 3, "R2": 9, "R3": 4, "R4": 9, "R5": 9, "R6": 13}
    slot0 = [(c["request"], c["kind"]) for c in (it["slots"][0] for it in trace["iterations"])]
    assert slot0[:4] == [("R1", "prefill")] * 2 + [("R1", "decode")] * 2


def test_prefill_cells_carry_the_prompt_split_evenly():
    trace = simulate([SimRequest("a", 1, prompt_tokens=10)], 1, "static", prefill_iterations=3)
    tokens = [it["slots"][0]["tokens"] for it in trace["iterations"]]
    assert tokens == [3, 3, 4, 1]


def test_later_arrivals_wait_for_their_time_and_idle_iterations_are_kept():
    trace = simulate([SimRequest("a", 1), SimRequest("b", 2, arrival_iteration=3)], 2,
                     "continuous")
    assert occupants(trace) == [["a", None], [None, None], [None, None], ["b", None],
                                ["b", None]]
    assert trace["iterations"][3]["start"] == 3.0 and trace["iterations"][3]["end"] == 4.0
    assert summarize(trace)["requests"][1]["wait_iterations"] == 0


def test_trace_format_fields():
    trace = simulate(SEED_TOY, 3, "continuous")
    assert {k: trace[k] for k in ("version", "source", "policy", "num_slots",
                                  "kv_blocks_total")} == {
        "version": 1, "source": "simulator", "policy": "continuous", "num_slots": 3,
        "kv_blocks_total": None}
    assert trace["requests"][0] == {
        "id": "R1", "arrival": 0.0, "arrival_iteration": 0, "prompt_tokens": 0,
        "output_tokens": 2, "first_iteration": 0, "finish_iteration": 1,
        "finish_reason": "length"}
    it = trace["iterations"][6]
    assert it == {"index": 6, "start": 6.0, "end": 7.0,
                  "slots": [{"request": "R6", "kind": "decode", "tokens": 1},
                            {"request": "R2", "kind": "decode", "tokens": 1}, None],
                  "num_waiting": 0, "kv_blocks_used": None, "preempted": []}


def test_no_requests_gives_an_empty_trace():
    trace = simulate([], 2, "continuous")
    assert trace["iterations"] == [] and summarize(trace)["utilisation"] == 0.0


def test_summarize_works_on_an_engine_trace_and_ignores_stalled_cells():
    trace = {
        "version": 1, "source": "engine", "policy": "continuous", "num_slots": 2,
        "kv_blocks_total": 64,
        "requests": [
            {"id": "a", "arrival": 0.01, "arrival_iteration": 0, "prompt_tokens": 5,
             "output_tokens": 2, "first_iteration": 0, "finish_iteration": 2,
             "finish_reason": "stop"},
            {"id": "b", "arrival": 0.02, "arrival_iteration": 1, "prompt_tokens": 7,
             "output_tokens": 4, "first_iteration": 2, "finish_iteration": None,
             "finish_reason": None}],
        "iterations": [
            {"index": 0, "start": 0.0, "end": 0.03, "num_waiting": 0, "kv_blocks_used": 1,
             "preempted": [], "slots": [{"request": "a", "kind": "prefill", "tokens": 5},
                                        None]},
            {"index": 1, "start": 0.03, "end": 0.05, "num_waiting": 1, "kv_blocks_used": 1,
             "preempted": [], "slots": [{"request": "a", "kind": "stalled", "tokens": 0},
                                        None]},
            {"index": 2, "start": 0.05, "end": 0.08, "num_waiting": 0, "kv_blocks_used": 2,
             "preempted": [], "slots": [{"request": "a", "kind": "decode", "tokens": 1},
                                        {"request": "b", "kind": "prefill", "tokens": 7}]},
        ],
    }
    s = summarize(trace)
    assert (s["iterations"], s["busy_slot_iterations"], s["slot_iterations"]) == (3, 3, 6)
    assert s["utilisation"] == pytest.approx(0.5)
    assert s["requests"][1] == {"id": "b", "arrival_iteration": 1, "wait_iterations": 1,
                                "first_iteration": 2, "finish_iteration": None}


# ---------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_slots", [0, -1, 1.5, True, "3"])
def test_bad_num_slots(num_slots):
    with pytest.raises(ValueError, match="num_slots"):
        simulate(SEED_TOY, num_slots, "continuous")


def test_bad_policy():
    with pytest.raises(ValueError, match="policy"):
        simulate(SEED_TOY, 3, "dynamic")


def test_bad_prefill_iterations():
    with pytest.raises(ValueError, match="prefill_iterations"):
        simulate(SEED_TOY, 3, "static", prefill_iterations=-1)


@pytest.mark.parametrize("field, kwargs", [
    ("output_tokens", {"output_tokens": 0}),
    ("output_tokens", {"output_tokens": 2.0}),
    ("arrival_iteration", {"output_tokens": 1, "arrival_iteration": -1}),
    ("prompt_tokens", {"output_tokens": 1, "prompt_tokens": -5}),
])
def test_bad_request_fields(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SimRequest("x", **kwargs)


def test_duplicate_ids():
    with pytest.raises(ValueError, match="id"):
        simulate([SimRequest("a", 1), SimRequest("a", 2)], 1, "static")


def test_requests_must_be_sim_requests():
    with pytest.raises(ValueError, match="requests"):
        simulate([{"id": "a", "output_tokens": 1}], 1, "static")


# ---------------------------------------------------------------------------------------
# Invariants under random arrivals and lengths
# ---------------------------------------------------------------------------------------

specs = st.lists(st.tuples(st.integers(1, 8), st.integers(0, 12)), max_size=10)


@settings(max_examples=150, deadline=None)
@given(specs=specs, num_slots=st.integers(1, 4), policy=st.sampled_from(POLICIES),
       prefill=st.integers(0, 2))
def test_invariants(specs, num_slots, policy, prefill):
    requests = [SimRequest(f"r{i}", n, t) for i, (n, t) in enumerate(specs)]
    trace = simulate(requests, num_slots, policy, prefill_iterations=prefill)
    iterations = trace["iterations"]
    assert json.loads(json.dumps(trace)) == trace
    assert [it["index"] for it in iterations] == list(range(len(iterations)))
    for it in iterations:
        assert len(it["slots"]) == num_slots  # never more than S busy
        held = [c["request"] for c in it["slots"] if c is not None]
        assert len(held) == len(set(held))  # a request holds one slot at most

    records = {r["id"]: r for r in trace["requests"]}
    for request in requests:
        _check_request_cells(trace, request, records[request.id], prefill)

    busy = sum(busy_per_iteration(trace))
    assert busy == sum(r.output_tokens for r in requests) + prefill * len(requests)
    s = summarize(trace)
    assert s["busy_slot_iterations"] == busy
    if requests:
        assert len(iterations) == max(r["finish_iteration"] for r in records.values()) + 1
        assert s["utilisation"] == pytest.approx(busy / (num_slots * len(iterations)))
    _check_fcfs(requests, records)
    _check_waiting_counts(trace, requests, records)
    _check_policy(trace, policy, records)


def _check_request_cells(trace, request, record, prefill):
    """One slot, contiguous iterations, exactly prefill then output_tokens decode cells."""
    cells = [(it["index"], s, c["kind"]) for it in trace["iterations"]
             for s, c in enumerate(it["slots"]) if c is not None and c["request"] == request.id]
    first, finish = record["first_iteration"], record["finish_iteration"]
    assert first >= request.arrival_iteration
    assert [t for t, _, _ in cells] == list(range(first, finish + 1))
    assert len({s for _, s, _ in cells}) == 1
    assert [k for _, _, k in cells] == ["prefill"] * prefill + ["decode"] * request.output_tokens
    assert record["finish_reason"] == "length"


def _check_fcfs(requests, records):
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_iteration)
    firsts = [records[requests[i].id]["first_iteration"] for i in order]
    assert firsts == sorted(firsts)


def _check_waiting_counts(trace, requests, records):
    for it in trace["iterations"]:
        t = it["index"]
        waiting = sum(r.arrival_iteration <= t < records[r.id]["first_iteration"]
                      for r in requests)
        assert it["num_waiting"] == waiting


def _check_policy(trace, policy, records):
    first = {rid: r["first_iteration"] for rid, r in records.items()}
    for it in trace["iterations"]:
        held = [c["request"] for c in it["slots"] if c is not None]
        admitted_now = [rid for rid in held if first[rid] == it["index"]]
        if policy == "static" and admitted_now:
            # NOTE: static admits only into an empty batch: all holders started together,
            # and as many as there are slots for.
            assert len(admitted_now) == len(held)
            assert len(held) == len(it["slots"]) or it["num_waiting"] == 0
        if policy == "continuous" and len(held) < len(it["slots"]):
            # continuous never leaves a slot idle while an arrived request waits.
            assert it["num_waiting"] == 0
