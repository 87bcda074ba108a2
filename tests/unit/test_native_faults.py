"""A native library's panic fails only its request (issue 29, item 16).

A Rust panic in llguidance or tokenizers reaches Python as pyo3's PanicException, a
BaseException that `except Exception` lets through: in the forward's isolation, the output
processing, a queued command or step() it must be handled like any fault. Injected here
both as a BaseException subclass of our own and as a real PanicException (tokenizers
panics on a padding length past its capacity). KeyboardInterrupt and its kind still go
through: they ask the process to stop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from slotserve.core.outputs import RunnerOutput
from slotserve.engine.async_engine import AsyncEngine
from slotserve.engine.isolation import execute_isolated, is_fault
from slotserve.sampling import SamplingParams
from tests.conftest import random_prompts, tiny_engine
from tests.unit.server_fixtures import started

NUM_BLOCKS = 64
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CULPRIT = "r2"
TIMEOUT = 60


class FakePanic(BaseException):
    """Like pyo3's PanicException: a BaseException, not an Exception."""


def real_panic() -> None:
    """Raise a real pyo3 PanicException from tokenizers ("capacity overflow")."""
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.enable_padding(pad_id=0, pad_token="[UNK]", length=2**62)
    tokenizer.encode("a")


def real_panic_type() -> type[BaseException]:
    try:
        real_panic()
    except BaseException as exc:  # noqa: BLE001 - what it is, is the point
        return type(exc)
    raise AssertionError("tokenizers did not panic")


def fake_panic() -> None:
    raise FakePanic("native code panicked")


PANICS = {"fake": fake_panic, "real": real_panic}


def new_engine(tiny_llama):
    return tiny_engine(tiny_llama, num_blocks=NUM_BLOCKS, max_num_seqs=4,
                       max_num_batched_tokens=40)


def workload() -> dict[str, list[int]]:
    return {f"r{i}": p for i, p in enumerate(random_prompts(5, min_len=5, max_len=40, seed=9))}


def run_offline(engine, prompts: dict) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, PARAMS)
    finals = {}
    for _ in range(300):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == NUM_BLOCKS
    return finals


@pytest.fixture(scope="module")
def clean(tiny_llama):
    return {rid: out.token_ids for rid, out in run_offline(new_engine(tiny_llama),
                                                          workload()).items()}


def assert_only_culprit_failed(finals: dict, clean: dict) -> None:
    assert set(finals) == set(clean)
    for request_id, out in finals.items():
        if request_id == CULPRIT:
            assert out.finish_reason == "error", out
        else:
            assert out.finish_reason == "length" and out.error is None, out
            assert out.token_ids == clean[request_id], request_id


def test_the_real_panic_is_a_base_exception_only():
    panic = real_panic_type()
    assert panic.__name__ == "PanicException" and not issubclass(panic, Exception)
    assert is_fault(panic("x")) and is_fault(FakePanic()) and is_fault(ValueError())


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit, GeneratorExit,
                                  asyncio.CancelledError])
def test_a_stop_request_is_not_a_fault_and_is_not_bisected(stop):
    @dataclass
    class Plan:
        seqs: list
        iteration: int = 0

    calls = []

    class Runner:
        def execute(self, plan):
            calls.append(plan)
            raise stop()

    assert not is_fault(stop())
    with pytest.raises(stop):
        execute_isolated(Runner(), Plan(seqs=["a", "b", "c"]))
    assert len(calls) == 1  # re-raised at once, no retry in halves


@pytest.mark.parametrize("kind", PANICS)
def test_a_panic_in_the_forward_fails_only_its_request(tiny_llama, clean, monkeypatch, kind):
    engine = new_engine(tiny_llama)
    execute, calls = engine.runner.execute, []

    def panicking(plan):
        calls.append(len(plan.seqs))
        if any(s.request_id == CULPRIT and s.num_output_tokens >= 2 for s in plan.seqs):
            PANICS[kind]()
        return execute(plan)

    monkeypatch.setattr(engine.runner, "execute", panicking)
    finals = run_offline(engine, workload())
    assert_only_culprit_failed(finals, clean)
    assert finals[CULPRIT].token_ids == clean[CULPRIT][:2]
    assert "Panic" in finals[CULPRIT].error
    assert any(n > 1 for n in calls)  # the panicking batch was retried in halves


def test_a_panic_with_only_its_request_in_the_batch_fails_it_without_a_retry(tiny_llama):
    engine = new_engine(tiny_llama)

    class PanickingRunner:
        def execute(self, plan):
            fake_panic()

    result, culprits = execute_isolated(PanickingRunner(), _one_seq_plan(engine))
    assert result == RunnerOutput(sampled={}) and len(culprits) == 1
    assert isinstance(culprits[0][1], FakePanic)


def _one_seq_plan(engine):
    engine.add_request("only", [5, 6, 7], PARAMS)
    return engine.scheduler.schedule()


@pytest.mark.parametrize("kind", PANICS)
def test_a_panic_building_one_output_fails_only_it(tiny_llama, clean, monkeypatch, kind):
    """As a grammar matcher or a detokenizer panicking in the output processing."""
    engine = new_engine(tiny_llama)
    process = engine._process

    def panicking(seq):
        if seq.request.request_id == CULPRIT and len(seq.request.output_token_ids) >= 3:
            PANICS[kind]()
        return process(seq)

    monkeypatch.setattr(engine, "_process", panicking)
    assert_only_culprit_failed(run_offline(engine, workload()), clean)
    assert not engine.has_request(CULPRIT)


# --------------------------------------------------------------------------- AsyncEngine
@pytest.fixture
def served(tiny_llama):
    with started(AsyncEngine(new_engine(tiny_llama))) as engine:
        yield engine


async def generate(engine: AsyncEngine, request_id: str, prompt):
    """The final output, or the exception the stream raised."""
    async def consume():
        final = None
        async for out in engine.generate(request_id, prompt, PARAMS):
            final = out
        return final

    try:
        return await asyncio.wait_for(consume(), TIMEOUT)
    except RuntimeError as exc:
        return exc


async def generate_all(engine: AsyncEngine, prompts: dict) -> dict:
    results = await asyncio.gather(*(generate(engine, rid, p) for rid, p in prompts.items()))
    return dict(zip(prompts, results))


def assert_idle(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + TIMEOUT
    while engine.engine.has_unfinished_requests() or engine.num_active:
        assert time.monotonic() < deadline, "requests left in the engine"
        time.sleep(0.01)
    engine.engine.check_integrity()
    assert engine.engine.kv.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("kind", PANICS)
def test_a_panic_adding_a_request_fails_only_it(served, clean, monkeypatch, kind):
    """As llguidance panicking while a completion's matcher is built in add_request."""
    add = served.engine.add_request

    def panicking(request_id, *args, **kwargs):
        if request_id == CULPRIT:
            PANICS[kind]()
        return add(request_id, *args, **kwargs)

    monkeypatch.setattr(served.engine, "add_request", panicking)
    finals = asyncio.run(generate_all(served, workload()))
    assert isinstance(finals.pop(CULPRIT), RuntimeError)
    assert {rid: out.token_ids for rid, out in finals.items()} == {
        rid: ids for rid, ids in clean.items() if rid != CULPRIT}
    assert served.healthy
    assert_idle(served)


def test_a_panic_in_the_forward_through_the_async_engine(served, clean, monkeypatch):
    execute = served.engine.runner.execute

    def panicking(plan):
        if any(s.request_id == CULPRIT and s.num_output_tokens >= 1 for s in plan.seqs):
            real_panic()
        return execute(plan)

    monkeypatch.setattr(served.engine.runner, "execute", panicking)
    finals = asyncio.run(generate_all(served, workload()))
    assert_only_culprit_failed(finals, clean)
    assert served.healthy
    assert_idle(served)


def test_a_panic_escaping_step_fails_the_requests_in_flight_and_the_loop_goes_on(
        served, clean, monkeypatch):
    schedule, panicked = served.engine.scheduler.schedule, []

    def once(*args):
        if not panicked and served.engine.scheduler.requests:
            panicked.append(True)
            fake_panic()
        return schedule(*args)

    monkeypatch.setattr(served.engine.scheduler, "schedule", once)
    first = asyncio.run(generate(served, "first", [5, 6, 7]))
    assert first.finish_reason == "error" and "FakePanic" in first.error
    assert served.healthy
    finals = asyncio.run(generate_all(served, workload()))
    assert {rid: out.token_ids for rid, out in finals.items()} == clean
    assert_idle(served)


def test_a_panic_in_an_admin_call_is_its_callers_error_and_the_loop_goes_on(served, clean,
                                                                          monkeypatch):
    def panicking():
        fake_panic()

    monkeypatch.setattr(served.engine, "reset_prefix_cache", panicking)
    with pytest.raises(RuntimeError, match="FakePanic"):
        asyncio.run(asyncio.wait_for(served.reset_prefix_cache(), TIMEOUT))
    assert served.healthy
    finals = asyncio.run(generate_all(served, workload()))
    assert {rid: out.token_ids for rid, out in finals.items()} == clean


# --------------------------------------------------------------------------- query of death
# Under --replicas, a request that kills its replica (a native crash that takes the process)
# must not go on to kill every replica in turn: ReplicaFront retries a request at most once
# after a replica died under it. Fake replica handles, one behaviour per call.
OUTPUT = object()  # what a replica streams (the front passes it through untouched)


class FakeCall:
    """A streaming call's answer: raises `error` before any output, else yields OUTPUT."""

    def __init__(self, error: BaseException | None) -> None:
        self.error, self.cancelled = error, False

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        if self.error is not None:
            raise self.error
        yield OUTPUT

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """`handle.options(stream=True).generate.remote(...)`: each call fails with the next
    of `errors` (None: it serves)."""

    def __init__(self, *errors: BaseException | None) -> None:
        self.errors, self.calls = list(errors), 0

    def options(self, **kwargs):
        return self

    @property
    def generate(self):
        return self

    def remote(self, *args, **kwargs) -> FakeCall:
        self.calls += 1
        return FakeCall(self.errors.pop(0) if self.errors else None)


def actor_died():
    from ray.exceptions import ActorDiedError

    return ActorDiedError()


def unavailable():
    from ray.serve.exceptions import ReplicaUnavailableError

    return ReplicaUnavailableError("restarting")


def engine_dead():
    from slotserve.engine.async_engine import EngineDeadError

    return EngineDeadError("the engine stopped after an internal error")


def draining():
    from slotserve.engine.async_engine import EngineClosedError

    return EngineClosedError("the server is shutting down")


@pytest.fixture(scope="module")
def describe(tiny_llama):
    engine = new_engine(tiny_llama)
    return {"model_config": engine.model_config, "tokenizer": engine.tokenizer,
            "snapshot": engine.snapshot()}


class InOrderRouter:
    """Picks the first replica by name among those offered (the tests' order)."""

    policy = "in_order"

    def pick(self, prompt_ids, loads):
        from slotserve.scaleout.router import Choice

        return Choice(min(loads), "in order")

    def forget(self, replica: str) -> None:
        pass


def front_over(describe, **handles):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from slotserve.scaleout.front import ReplicaFront

    return ReplicaFront(handles, describe, InOrderRouter())


def outcome(front, request_id: str = "q"):
    """The request's outputs, or the exception it ended with."""
    async def consume():
        return [out async for out in front.generate(request_id, [5, 6, 7], PARAMS)]

    try:
        return asyncio.run(asyncio.wait_for(consume(), TIMEOUT))
    except Exception as exc:  # noqa: BLE001 - the outcome is what is tested
        return exc


@pytest.mark.parametrize("death", [actor_died, engine_dead])
def test_a_request_whose_replica_died_is_retried_once(describe, death):
    front = front_over(describe, a=FakeHandle(death()), b=FakeHandle(None))
    assert outcome(front) == [OUTPUT]
    assert [r["replica"] for r in front.routing] == ["a", "b"]
    assert not front.replicas["a"].up and front.replicas["b"].up


@pytest.mark.parametrize("second", [actor_died, engine_dead])
def test_a_request_that_two_replicas_died_under_is_not_retried_again(describe, second):
    from slotserve.scaleout.front import ReplicaDeathError

    handles = dict(a=FakeHandle(actor_died()), b=FakeHandle(second()), c=FakeHandle(None))
    front = front_over(describe, **handles)
    error = outcome(front)
    assert isinstance(error, ReplicaDeathError) and isinstance(error, RuntimeError)
    assert "2 replicas died" in str(error) and "not retried" in str(error)
    assert handles["c"].calls == 0  # the third replica never saw it
    assert front.replicas["c"].up and front.num_active == 0
    assert all(r.in_flight == 0 for r in front.replicas.values())


def test_refusals_before_the_request_ran_do_not_count_as_deaths(describe):
    """Unavailable (restarting) and draining replicas refused it: it never ran there, so
    one death later it is still retried once, and served."""
    handles = dict(a=FakeHandle(unavailable()), b=FakeHandle(draining()),
                   c=FakeHandle(actor_died()), d=FakeHandle(None))
    front = front_over(describe, **handles)
    assert outcome(front) == [OUTPUT]
    assert [r["replica"] for r in front.routing] == ["a", "b", "c", "d"]


def test_the_death_budget_is_per_request(describe):
    """Each request may be retried once after a death: one request's deaths do not count
    against another's."""
    handles = dict(a=FakeHandle(actor_died(), actor_died()), b=FakeHandle(None, None))
    front = front_over(describe, **handles)
    assert outcome(front, "first") == [OUTPUT]  # a died under it, b served it
    front.replicas["a"].up = True  # Serve restarted it
    assert outcome(front, "second") == [OUTPUT]  # the same again
    assert handles["a"].calls == 2 and handles["b"].calls == 2


def test_a_subscriber_that_panics_harms_no_other_subscriber():
    from slotserve.engine.subscribers import Subscribers

    class Panic(BaseException):  # as pyo3's PanicException: not an Exception
        pass

    seen = []
    subscribers = Subscribers()
    subscribers.add(lambda event: (_ for _ in ()).throw(Panic("boom")))
    subscribers.add(seen.append)
    subscribers.publish("event")
    assert seen == ["event"]
    subscribers.add(lambda event: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        subscribers.publish("event")
