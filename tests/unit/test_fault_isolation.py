"""Fault isolation in the engine loop: no request can fail another, and the loop never dies
silently (issue 14).

Faults are injected with monkeypatch at each point of an iteration: the runner (before the
forward, after all its side effects, in the sampler), the output processing, the trace,
the commands, the dispatch, the step listeners and the scheduler. Innocent requests must
finish with exactly the tokens of a clean run (greedy and seeded sampling), the culprit with
finish_reason "error", and every KV block must be free afterwards.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from slotserve.engine.async_engine import (
    MAX_CONSECUTIVE_STEP_FAULTS,
    AsyncEngine,
    EngineClosedError,
    EngineDeadError,
)
from slotserve.engine.llm_engine import LLMEngine
from slotserve.sampling import SamplingParams
from tests.conftest import random_prompts, tiny_engine
from tests.unit.server_fixtures import started

NUM_BLOCKS = 64
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=11,
                        ignore_eos=True)
CULPRIT = "r2"
TIMEOUT = 60  # seconds: a hang fails the test instead of blocking it


class InjectedFault(RuntimeError):
    pass


def new_engine(tiny_llama) -> LLMEngine:
    # A small token budget: prefills are chunked, so a failed iteration mixes prefill
    # chunks (no sampling), last chunks and decodes; 4 slots for 6 requests: some wait.
    return tiny_engine(tiny_llama, num_blocks=NUM_BLOCKS, max_num_seqs=4,
                       max_num_batched_tokens=40)


def workload() -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = random_prompts(6, min_len=5, max_len=60, seed=4)
    return {f"r{i}": (p, SEEDED if i % 2 else GREEDY) for i, p in enumerate(prompts)}


def run(engine: LLMEngine, requests: dict) -> dict:
    """Run every request to the end (checking the invariants after each step); the final
    output of each."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, f"{out.request_id} finished twice"
                finals[out.request_id] = out
        engine.check_integrity()
    assert not engine.has_unfinished_requests(), "the engine did not finish"
    assert engine.kv.num_free_blocks == NUM_BLOCKS
    return finals


@pytest.fixture(scope="module")
def clean(tiny_llama):
    """The tokens of a run without faults."""
    finals = run(new_engine(tiny_llama), workload())
    assert all(out.finish_reason == "length" for out in finals.values())
    return {rid: out.token_ids for rid, out in finals.items()}


def assert_isolated(finals: dict, clean: dict, culprits: set[str], tokens_before: int) -> None:
    assert set(finals) == set(clean)
    for request_id, out in finals.items():
        if request_id in culprits:
            assert out.finish_reason == "error" and "InjectedFault" in out.error, out
            # what it generated before the fault was its clean run's
            assert out.token_ids == clean[request_id][:tokens_before]
        else:
            assert out.finish_reason == "length" and out.error is None, out
            assert out.token_ids == clean[request_id], request_id


# --------------------------------------------------------------------------- the runner
def faulty_execute(execute, culprits: set[str], mode: str, after_tokens: int, calls: list):
    """runner.execute that raises for plans holding a culprit once it has after_tokens
    outputs: before the forward, or after all of its side effects (K/V written, sampled)."""
    def wrapped(plan):
        calls.append([s.request_id for s in plan.seqs])
        hit = any(s.request_id in culprits and s.num_output_tokens >= after_tokens
                  for s in plan.seqs)
        if hit and mode == "before":
            raise InjectedFault("before the forward")
        result = execute(plan)
        if hit:
            raise InjectedFault("after the forward and sampling")
        return result
    return wrapped


@pytest.mark.parametrize("mode", ["before", "after"])
@pytest.mark.parametrize("culprits", [{CULPRIT}, {"r1", "r2"}])
def test_a_runner_fault_fails_only_its_culprits(tiny_llama, clean, monkeypatch, mode, culprits):
    engine = new_engine(tiny_llama)
    calls: list = []
    monkeypatch.setattr(engine.runner, "execute",
                        faulty_execute(engine.runner.execute, culprits, mode, 2, calls))
    finals = run(engine, workload())
    assert_isolated(finals, clean, culprits, tokens_before=2)
    # the failed iteration was retried in smaller groups: some plan held a culprit and others
    assert any(len(c) > 1 and culprits & set(c) for c in calls)
    assert engine.stats.finished_by_reason == {"length": 6 - len(culprits),
                                               "error": len(culprits)}


def test_a_sampler_fault_of_one_request_fails_only_it(tiny_llama, clean, monkeypatch):
    """The issue's case: the sampler chokes on one request, after the whole batch's forward
    has written its K/V."""
    engine = new_engine(tiny_llama)
    sampler = engine.runner.sampler

    def choking(logits, seqs):
        if any(s.request_id == CULPRIT and s.num_output_tokens >= 3 for s in seqs):
            raise InjectedFault("bad sampling parameter")
        return sampler(logits, seqs)

    monkeypatch.setattr(engine.runner, "sampler", choking)
    assert_isolated(run(engine, workload()), clean, {CULPRIT}, tokens_before=3)


def test_a_fault_of_every_iteration_fails_every_request_and_nothing_leaks(tiny_llama,
                                                                        monkeypatch):
    engine = new_engine(tiny_llama)
    calls: list = []
    monkeypatch.setattr(engine.runner, "execute",
                        faulty_execute(engine.runner.execute, set(workload()), "before", 0,
                                       calls))
    finals = run(engine, workload())
    assert {out.finish_reason for out in finals.values()} == {"error"}
    assert all(out.token_ids == [] for out in finals.values())


def test_a_fault_of_the_whole_batch_only_is_retried_and_fails_nobody(tiny_llama, clean,
                                                                     monkeypatch):
    """A fault no single request causes (e.g. out of memory for the whole batch)."""
    engine = new_engine(tiny_llama)
    execute = engine.runner.execute

    def too_big(plan):
        if len(plan.seqs) >= 4:
            raise InjectedFault("out of memory")
        return execute(plan)

    monkeypatch.setattr(engine.runner, "execute", too_big)
    assert_isolated(run(engine, workload()), clean, set(), tokens_before=0)


# --------------------------------------------------------------------------- processing
@pytest.mark.parametrize("at", ["running", "finished"])
def test_a_fault_building_one_output_fails_only_it(tiny_llama, clean, monkeypatch, at):
    engine = new_engine(tiny_llama)
    process = engine._process

    def faulty(seq):
        request = seq.request
        if request.request_id == CULPRIT and (
                request.is_finished if at == "finished" else len(request.output_token_ids) >= 4):
            raise InjectedFault("detokenizer")
        return process(seq)

    monkeypatch.setattr(engine, "_process", faulty)
    finals = run(engine, workload())
    assert_isolated(finals, clean, {CULPRIT}, tokens_before=4 if at == "running" else MAX_TOKENS)
    assert not engine.has_request(CULPRIT)


def test_a_failing_subscriber_harms_no_request(tiny_llama, clean):
    engine = new_engine(tiny_llama)

    def listener(event):
        raise InjectedFault("metrics")

    engine.subscribe(listener)
    assert_isolated(run(engine, workload()), clean, set(), tokens_before=0)


def test_a_failing_add_request_leaves_nothing_behind(tiny_llama, monkeypatch):
    engine = new_engine(tiny_llama)
    arrived = engine.trace.request_arrived
    seen = []

    def second_fails(request_id, *args):
        seen.append(request_id)
        if len(seen) == 2:
            raise InjectedFault("trace")
        return arrived(request_id, *args)

    monkeypatch.setattr(engine.trace, "request_arrived", second_fails)
    with pytest.raises(InjectedFault):
        engine.add_request("multi", [5, 6, 7], SamplingParams(n=3, max_tokens=2))
    assert not engine.scheduler.requests and not engine.has_request("multi")
    engine.check_integrity()
    monkeypatch.undo()
    finals = run(engine, {"multi": ([5, 6, 7], SamplingParams(max_tokens=2))})
    assert finals["multi"].finish_reason in ("stop", "length")


def test_fail_all_ends_everything_and_frees_every_block(tiny_llama):
    engine = new_engine(tiny_llama)
    for request_id, (prompt, params) in workload().items():
        engine.add_request(request_id, prompt, params)
    for _ in range(3):
        engine.step()
    engine.abort_request("r5")
    outputs = engine.fail_all("engine error: test")
    reasons = {out.request_id: out.finish_reason for out in outputs}
    assert set(reasons) == set(workload()) and reasons.pop("r5") == "abort"
    assert set(reasons.values()) == {"error"}
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.kv.num_free_blocks == NUM_BLOCKS


# --------------------------------------------------------------------------- AsyncEngine
@pytest.fixture
def served(tiny_llama):
    with started(AsyncEngine(new_engine(tiny_llama))) as engine:
        yield engine


async def generate(engine: AsyncEngine, request_id: str, prompt, params):
    """The final output, or the exception the stream raised (within TIMEOUT)."""
    async def consume():
        final = None
        async for out in engine.generate(request_id, prompt, params):
            final = out
        return final

    try:
        return await asyncio.wait_for(consume(), TIMEOUT)
    except (RuntimeError, ValueError) as exc:
        return exc


async def generate_all(engine: AsyncEngine, requests: dict) -> dict:
    results = await asyncio.gather(*(generate(engine, rid, prompt, params)
                                     for rid, (prompt, params) in requests.items()))
    return dict(zip(requests, results))


def assert_idle_and_free(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + TIMEOUT
    while engine.engine.has_unfinished_requests() or engine.num_active:
        assert time.monotonic() < deadline, "requests left in the engine"
        time.sleep(0.01)
    engine.engine.check_integrity()
    assert engine.engine.kv.num_free_blocks == NUM_BLOCKS


def test_a_failing_subscriber_harms_no_request_when_served(served, clean):
    def listener(event):
        raise InjectedFault("listener")

    served.subscribe(listener)
    finals = asyncio.run(generate_all(served, workload()))
    assert {rid: out.token_ids for rid, out in finals.items()} == clean
    assert served.healthy
    assert_idle_and_free(served)


def test_a_culprit_fails_alone_through_the_async_engine(served, clean, monkeypatch):
    runner = served.engine.runner
    monkeypatch.setattr(runner, "execute",
                        faulty_execute(runner.execute, {CULPRIT}, "after", 2, []))
    finals = asyncio.run(generate_all(served, workload()))
    assert_isolated(finals, clean, {CULPRIT}, tokens_before=2)
    assert served.healthy
    assert_idle_and_free(served)


def test_a_failing_add_command_fails_only_its_request(served, clean, monkeypatch):
    add = served.engine.add_request

    def faulty(request_id, *args, **kwargs):
        if request_id == CULPRIT:
            raise InjectedFault("add")
        return add(request_id, *args, **kwargs)

    monkeypatch.setattr(served.engine, "add_request", faulty)
    finals = asyncio.run(generate_all(served, workload()))
    assert isinstance(finals.pop(CULPRIT), RuntimeError)
    assert {rid: out.token_ids for rid, out in finals.items()} == \
        {rid: t for rid, t in clean.items() if rid != CULPRIT}
    assert served.healthy
    assert_idle_and_free(served)


def test_a_failing_abort_command_does_not_stop_the_loop(served, clean, monkeypatch):
    def faulty(request_id):
        raise InjectedFault("abort")

    monkeypatch.setattr(served.engine, "abort_request", faulty)

    async def leave_after_the_first_output():
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        async for _ in served.generate("leaver", [5, 6, 7], params):
            break  # the consumer leaves: an abort command, which raises

    async def scenario():
        await asyncio.wait_for(leave_after_the_first_output(), TIMEOUT)
        return await generate_all(served, workload())

    finals = asyncio.run(scenario())
    assert {rid: out.token_ids for rid, out in finals.items()} == clean
    assert served.healthy
    assert_idle_and_free(served)  # the un-aborted request ran to its end


def test_a_failing_dispatch_fails_only_the_requests_it_carried(served, clean, monkeypatch):
    dispatch = served._dispatch
    failed = []

    def faulty(outputs):
        if not failed and any(out.request_id == "lonely" for out in outputs):
            failed.append([out.request_id for out in outputs])
            raise InjectedFault("dispatch")
        return dispatch(outputs)

    monkeypatch.setattr(served, "_dispatch", faulty)

    async def scenario():
        lonely = await generate(served, "lonely", [5, 6, 7], GREEDY)
        return lonely, await generate_all(served, workload())

    lonely, finals = asyncio.run(scenario())
    assert failed == [["lonely"]] and isinstance(lonely, RuntimeError)
    assert "InjectedFault" in str(lonely)
    assert {rid: out.token_ids for rid, out in finals.items()} == clean
    assert served.healthy
    assert_idle_and_free(served)


def test_a_stream_whose_event_loop_closed_loses_only_its_request(served, clean):
    loop = asyncio.new_event_loop()
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    abandoned = served.generate("abandoned", [5, 6, 7], params)
    loop.run_until_complete(asyncio.wait_for(anext(abandoned), TIMEOUT))
    loop.close()  # its next outputs cannot be delivered: the engine aborts it
    finals = asyncio.run(generate_all(served, workload()))
    assert {rid: out.token_ids for rid, out in finals.items()} == clean
    assert_idle_and_free(served)
    assert served.healthy and not served.engine.has_request("abandoned")
    asyncio.run(abandoned.aclose())


def test_a_transient_scheduling_fault_fails_the_requests_in_flight_only(served, clean,
                                                                        monkeypatch):
    schedule = served.engine.scheduler.schedule
    faults = []

    def once(*args):
        if not faults and served.engine.scheduler.requests:
            faults.append(True)
            raise InjectedFault("scheduler")
        return schedule(*args)

    monkeypatch.setattr(served.engine.scheduler, "schedule", once)
    first = asyncio.run(generate(served, "first", [5, 6, 7], GREEDY))
    assert first.finish_reason == "error" and "InjectedFault" in first.error
    assert served.healthy
    finals = asyncio.run(generate_all(served, workload()))
    assert {rid: out.token_ids for rid, out in finals.items()} == clean
    assert_idle_and_free(served)


def is_error(result) -> bool:
    return isinstance(result, RuntimeError) or result.finish_reason == "error"


def test_a_persistent_scheduling_fault_kills_the_engine_without_a_hang(served, monkeypatch):
    def broken(*args):
        raise InjectedFault("scheduler")

    monkeypatch.setattr(served.engine.scheduler, "schedule", broken)
    for i in range(MAX_CONSECUTIVE_STEP_FAULTS):
        assert served.healthy
        result = asyncio.run(generate(served, f"x{i}", [5, 6, 7], GREEDY))
        assert is_error(result), result
    deadline = time.monotonic() + TIMEOUT
    while served.healthy:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    refused = asyncio.run(generate(served, "late", [5, 6, 7], GREEDY))
    assert isinstance(refused, EngineDeadError) and "in a row" in str(refused)
    served.engine.check_integrity()
    assert served.engine.kv.num_free_blocks == NUM_BLOCKS


def test_a_failed_recovery_kills_the_engine_and_every_caller_hears_at_once(served,
                                                                           monkeypatch):
    def broken(*args):
        raise InjectedFault("scheduler")

    monkeypatch.setattr(served.engine.scheduler, "schedule", broken)
    monkeypatch.setattr(served.engine, "fail_all", broken)
    results = asyncio.run(generate_all(served, workload()))
    assert all(isinstance(r, RuntimeError) for r in results.values()), results
    assert any(isinstance(r, EngineDeadError) for r in results.values()), results
    assert not served.healthy
    assert isinstance(asyncio.run(generate(served, "late", [5], GREEDY)), EngineDeadError)


def test_an_exception_escaping_every_guard_kills_the_engine_without_a_hang(served,
                                                                            monkeypatch):
    entered = threading.Event()
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    def broken():
        entered.set()
        raise InjectedFault("engine loop")

    async def scenario():
        outputs = served.generate("victim", [5, 6, 7], params)
        await asyncio.wait_for(anext(outputs), TIMEOUT)  # it is running
        monkeypatch.setattr(served.engine, "has_unfinished_requests", broken)
        try:
            async for _ in outputs:
                pass
        except EngineDeadError as exc:
            return exc

    error = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    assert entered.is_set() and isinstance(error, EngineDeadError)
    assert "InjectedFault" in str(error) and not served.healthy


def test_stop_ends_the_waiting_callers(served):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def scenario():
        outputs = served.generate("long", [5, 6, 7], params)
        await asyncio.wait_for(anext(outputs), TIMEOUT)
        served.stop()
        try:
            async for _ in outputs:
                pass
        except EngineClosedError as exc:
            return exc

    error = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    assert type(error) is EngineClosedError and served.healthy
