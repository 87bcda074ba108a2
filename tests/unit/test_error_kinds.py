"""RequestOutput.error_kind: the engine says why a request ended without its answer where the
failure happens, and the server answers by that kind, never by the error's words (issue 33).
"""

from __future__ import annotations

import asyncio

import pytest

from slotserve.engine.outputs import CompletionOutput, ErrorKind, RequestOutput, error_kind_of
from slotserve.sampling import SamplingParams
from slotserve.server.generation import Generation
from slotserve.server.protocol import APIError
from slotserve.structured.grammar import GrammarRejectedToken
from tests.conftest import random_prompts, tiny_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class InjectedFault(RuntimeError):
    pass


def run_to_end(engine, request_ids: list[str], abort: str | None = None) -> dict:
    """Add the requests, step to the end (aborting `abort` after the first step); the final
    output of each."""
    for request_id, prompt in zip(request_ids, random_prompts(len(request_ids), seed=3),
                                  strict=True):
        engine.add_request(request_id, prompt, GREEDY)
    finals = {}
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        if step == 1 and abort is not None:
            engine.abort_request(abort)
        finals.update({out.request_id: out for out in engine.step() if out.finished})
    assert not engine.has_unfinished_requests()
    return finals


# --------------------------------------------------------------------------- the engine
def test_each_failure_gets_its_kind_where_it_happens(tiny_llama, monkeypatch):
    """A grammar engine's refusal while building the output: grammar_failure; a runner fault
    of one request: internal; an abort: aborted; the others end with their answer (None)."""
    engine = tiny_engine(tiny_llama, num_blocks=64, max_num_seqs=8)
    process, execute = engine._process, engine.runner.execute

    def refusing_grammar(seq):
        if seq.request.request_id == "grammar" and len(seq.request.output_token_ids) >= 2:
            # NOTE: the words say "internal": the kind must not come from them
            raise GrammarRejectedToken("internal: the grammar rejected a sampled token")
        return process(seq)

    def failing_runner(plan):
        if any(s.request_id == "runner" and s.num_output_tokens >= 2 for s in plan.seqs):
            raise InjectedFault("GrammarRejectedToken in the words only")
        return execute(plan)

    monkeypatch.setattr(engine, "_process", refusing_grammar)
    monkeypatch.setattr(engine.runner, "execute", failing_runner)
    finals = run_to_end(engine, ["grammar", "runner", "aborted", "fine"], abort="aborted")
    kinds = {rid: (out.finish_reason, out.error_kind) for rid, out in finals.items()}
    assert kinds == {"grammar": ("error", ErrorKind.GRAMMAR_FAILURE),
                     "runner": ("error", ErrorKind.INTERNAL),
                     "aborted": ("abort", ErrorKind.ABORTED),
                     "fine": ("length", None)}


def test_a_runner_fault_that_is_a_grammar_refusal_is_grammar_failure(tiny_llama, monkeypatch):
    """The runner's isolation finds the culprit; its exception's type gives the kind."""
    engine = tiny_engine(tiny_llama, num_blocks=64, max_num_seqs=4)
    execute = engine.runner.execute

    def refusing(plan):
        if any(s.request_id == "culprit" for s in plan.seqs):
            raise GrammarRejectedToken("the mask allowed what the matcher refused")
        return execute(plan)

    monkeypatch.setattr(engine.runner, "execute", refusing)
    finals = run_to_end(engine, ["culprit", "other"])
    assert finals["culprit"].error_kind is ErrorKind.GRAMMAR_FAILURE
    assert finals["culprit"].finish_reason == "error"
    assert finals["other"].error_kind is None and finals["other"].finish_reason == "length"


def test_failing_a_request_from_outside_is_internal(tiny_llama):
    """AsyncEngine fails a request whose command or dispatch raised: internal."""
    engine = tiny_engine(tiny_llama, num_blocks=64)
    engine.add_request("a", random_prompts(1)[0], GREEDY)
    engine.step()
    engine.fail_request("a", "engine error: boom")
    (out,) = [o for o in engine.step() if o.request_id == "a"]
    assert out.finish_reason == "error" and out.error_kind is ErrorKind.INTERNAL


@pytest.mark.parametrize(("finish_reason", "fault", "kind"), [
    ("stop", None, None), ("length", None, None), (None, None, None),
    ("abort", None, ErrorKind.ABORTED), ("rejected", None, ErrorKind.SLO_UNATTAINABLE),
    ("error", None, ErrorKind.INTERNAL),
    ("error", ErrorKind.GRAMMAR_FAILURE, ErrorKind.GRAMMAR_FAILURE)])
def test_error_kind_of_a_finish_reason(finish_reason, fault, kind):
    assert error_kind_of(finish_reason, fault) == kind


def test_an_output_built_without_a_kind_gets_its_finish_reasons():
    """NOTE: another EngineClient's error output must not read as an answer."""
    failed = CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")
    assert RequestOutput("r", None, [1], [failed]).error_kind is ErrorKind.INTERNAL
    done = CompletionOutput(index=0, text="", token_ids=[5], finish_reason="stop")
    assert RequestOutput("r", None, [1], [done]).error_kind is None


# --------------------------------------------------------------------------- the server
class OneOutput:
    """An engine client whose stream is one output."""

    def __init__(self, out: RequestOutput) -> None:
        self.out = out

    async def generate(self, *args, **kwargs):
        yield self.out


def api_error_of(kind: ErrorKind | None, finish_reason: str, error: str | None) -> APIError:
    """The APIError the server raises for an output of this kind (admission, then the
    completions, as a request runs)."""
    completion = CompletionOutput(index=0, text="", token_ids=[], finish_reason=finish_reason)
    out = RequestOutput("r", None, [1], [completion], error=error, error_kind=kind)
    generation = Generation(OneOutput(out), 7, "r", [1], GREEDY, "prompt")

    async def drive() -> None:
        first = await generation.admit()
        async for _ in generation.completions(first):
            pass

    with pytest.raises(APIError) as raised:
        asyncio.run(drive())
    return raised.value


@pytest.mark.parametrize(("kind", "status", "code"), [
    (ErrorKind.GRAMMAR_FAILURE, 400, "unsupported_constraint"),
    (ErrorKind.SLO_UNATTAINABLE, 503, "slo_unattainable"),
    (ErrorKind.ABORTED, 503, None),
    (ErrorKind.INTERNAL, 500, None)])
def test_the_server_answers_by_the_kind(kind, status, code):
    # NOTE: every message names another kind: only error_kind may decide
    error = api_error_of(kind, "error", "GrammarRejectedToken: slo: aborted")
    assert (error.status, error.code) == (status, code), error
    if kind is ErrorKind.GRAMMAR_FAILURE:
        assert error.param == "structured_outputs"
    if status == 503 and kind is ErrorKind.SLO_UNATTAINABLE:
        assert error.headers == {"Retry-After": "7"}


def test_an_answer_is_no_error_whatever_its_words():
    completion = CompletionOutput(index=0, text="ok", token_ids=[5], finish_reason="stop")
    out = RequestOutput("r", None, [1], [completion], error="GrammarRejectedToken")
    generation = Generation(OneOutput(out), 7, "r", [1], GREEDY, "prompt")

    async def drive() -> list:
        first = await generation.admit()
        return [c async for c in generation.completions(first)]

    assert [c.text for c in asyncio.run(drive())] == ["ok"]
