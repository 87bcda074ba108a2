"""The yardstick's bounds (benchmarks/perf.py): which steps W runs, and what its matmuls cost.

PERF.md argues from these figures that some targets lie beyond what this machine allows, so
the arithmetic is checked on cases small enough to work out by hand.
"""

from __future__ import annotations

import pytest

from benchmarks.perf import PREFILL_CHUNK, matmul_bound, running_per_step


def test_running_per_step_counts_the_requests_still_decoding():
    # output lengths 3, 1, 2: step 0 samples all three, step 1 two, step 2 only the first
    assert running_per_step([3, 1, 2]) == [3, 2, 1]
    assert running_per_step([1]) == [1]


def test_matmul_bound_charges_prefill_decodes_and_lm_head_rows():
    matmul_ms = {"layers": {1: 10.0, 2: 20.0, PREFILL_CHUNK: 1000.0},
                 "lm_head": {1: 1.0, 2: 2.0, PREFILL_CHUNK: 500.0}}
    # two requests, 3 and 1 output tokens, 512 prompt tokens in all:
    # prefill one chunk 1000 ms; decode forwards: steps 1 and 2 carry one request each
    # (10 + 10 ms); LM-head rows: step 0 two (2 ms), steps 1 and 2 one each (1 + 1 ms)
    assert matmul_bound(matmul_ms, PREFILL_CHUNK, [3, 1]) == pytest.approx(1.024)


def test_matmul_bound_interpolates_between_measured_batch_sizes():
    matmul_ms = {"layers": {1: 10.0, 4: 40.0, PREFILL_CHUNK: 0.0},
                 "lm_head": {1: 0.0, 4: 0.0, PREFILL_CHUNK: 0.0}}
    # three requests of 3 tokens: decode steps 1 and 2 carry three each, 30 ms apiece
    assert matmul_bound(matmul_ms, 0, [3, 3, 3]) == pytest.approx(0.060)


def test_batch1_floor_takes_the_higher_bandwidth_reading_of_a_round():
    """vs_vllm's batch-1 share of the floor: a round's floor is set by the higher of the
    readings before and after it (a reading caught in a host's stall must not lift it)."""
    from types import SimpleNamespace as NS

    from benchmarks.perf import batch1_floor_ms
    from benchmarks.vs_vllm import batch1_vs_floor

    params = 134_515_008
    runs = [NS(tpot_ms=NS(p50=12.0)), NS(tpot_ms=NS(p50=13.0)), NS(tpot_ms=NS(p50=None))]
    server = NS(name="slotserve bf16", results={"batch-1": runs})
    report = batch1_vs_floor([server], [(24.0, 20.0), (12.0, 25.0), (23.0, 23.0)], params)
    first, second = report["rounds"]  # the round without a TPOT is left out
    assert first["floor_ms"] == pytest.approx(batch1_floor_ms(params, 24.0) / 2, abs=1e-3)
    assert second["floor_ms"] == pytest.approx(batch1_floor_ms(params, 25.0) / 2, abs=1e-3)
    assert second["of_floor"] < 1 and second["bandwidth_gbs"] == [12.0, 25.0]
    assert report["median_of_floor"] == pytest.approx(
        (first["of_floor"] + second["of_floor"]) / 2)
