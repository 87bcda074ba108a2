"""A grammar cannot stall the engine (issue 29, items 2 and 10): matchers are copies of one
compiled template and are built off the engine thread; size caps, n and llguidance's limits
refuse costly constraints with a 400 naming the field; the grammar cache is bounded in bytes.

The model is a tiny random-weight Llama with the embedded SmolLM2's vocabulary and
tokenizer (as tests/unit/test_structured_api.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from slotserve.config import engine_config
from slotserve.engine import sequence as seqs
from slotserve.engine.async_engine import AsyncEngine
from slotserve.engine.llm_engine import LLMEngine
from slotserve.sampling import SamplingParams
from slotserve.server.limits import ServerLimits
from slotserve.structured import StructuredOutputs
from slotserve.structured import grammar as grammar_module
from slotserve.structured.grammar import GrammarCompiler
from slotserve.structured.limits import StructuredLimits
from tests.unit.server_fixtures import app_client

VOCAB = 49152  # the embedded SmolLM2's
PROMPT = [1, 2, 3, 4]


# NOTE: the tokenizer, compiler and smollm2_vocab_model fixtures: tests/unit/conftest.py's.


def new_engine(parts) -> LLMEngine:
    cfg, weights, tokenizer = parts
    return LLMEngine(engine_config(max_model_len=256, num_blocks=64, max_num_seqs=8), cfg,
                     weights, tokenizer=tokenizer)


# ------------------------------------------------------------------ compiled templates
def test_matchers_are_independent_copies_of_one_compile(compiler, tokenizer):
    spec = StructuredOutputs(choice=["yes", "no"])
    first, second = compiler.matchers(spec, 2)
    assert first.ll_matcher is not second.ll_matcher
    first.advance(tokenizer.encode("yes"))
    assert first.is_finished and not second.is_finished and second.num_consumed == 0
    second.advance(tokenizer.encode("no"))
    assert second.is_finished
    assert compiler.matcher(spec).num_consumed == 0  # the template never moved


def test_a_regex_past_llguidances_limits_is_refused_fast(compiler):
    """`c{300000}` (11 bytes) made each matcher's first mask cost 0.25 s and fails at its
    second token ("too many expressions"): now refused at compile time, quickly."""
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: .*too many"):
        compiler.compile(StructuredOutputs(regex="c{300000}"))
    assert time.perf_counter() - start < 2.0
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):  # cached: a lookup
        compiler.matchers(StructuredOutputs(regex="c{300000}"), 16)
    assert time.perf_counter() - start < 0.05


def test_parser_limits_are_set():
    limits = grammar_module.parser_limits()
    assert limits.initial_lexer_fuel == grammar_module.PARSER_LIMITS["initial_lexer_fuel"]
    assert limits.max_lexer_states == grammar_module.PARSER_LIMITS["max_lexer_states"]


# ------------------------------------------------------------------ the cache's byte bound
def test_the_cache_is_bounded_in_bytes_least_recent_first(compiler):
    one = compiler.compile(StructuredOutputs(regex="a+")).size_bytes
    small = GrammarCompiler(None, VOCAB, (), cache_size=100, cache_bytes=int(2.5 * one))
    small._ll_tokenizer = compiler.ll_tokenizer
    specs = [StructuredOutputs(regex=r) for r in ("a+", "b+", "c+")]
    for spec in specs:
        small.compile(spec)
    assert list(small._cache) == [("regex", "b+"), ("regex", "c+")]  # "a+" was the oldest
    assert small.cached_bytes <= small.cache_bytes
    small.compile(specs[1])  # "b+" is the most recent now
    small.compile(StructuredOutputs(regex="d+"))
    assert list(small._cache) == [("regex", "b+"), ("regex", "d+")]
    assert small.cached_bytes == sum(grammar_module._entry_bytes(e)
                                     for e in small._cache.values())


def test_an_entry_larger_than_the_bound_is_not_kept(compiler):
    small = GrammarCompiler(None, VOCAB, (), cache_bytes=1024)
    small._ll_tokenizer = compiler.ll_tokenizer
    matcher = small.matcher(StructuredOutputs(regex="[0-9]+"))  # still served
    assert matcher.num_consumed == 0
    assert len(small._cache) == 0 and small.cached_bytes == 0


def test_a_compiled_entrys_size_grows_with_its_grammar(compiler):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                               for i in range(200)}}
    big = compiler.compile(StructuredOutputs(json=schema)).size_bytes
    assert big > 100 * len(json.dumps(schema))
    assert compiler.compile(StructuredOutputs(regex="a")).size_bytes < big / 10


# ------------------------------------------------------------------ prebuilt matchers
def test_the_engine_checks_the_matchers_it_is_handed(smollm2_vocab_model):
    engine = new_engine(smollm2_vocab_model)
    params = SamplingParams(n=2, max_tokens=4, structured_outputs={"choice": ["yes", "no"]})
    built = seqs.build_matchers(engine.grammars, params)
    with pytest.raises(ValueError, match="1 grammar matchers for n=2"):
        engine.add_request("a", PROMPT, params, grammar_matchers=built[:1])
    with pytest.raises(ValueError, match="its own grammar matcher"):
        engine.add_request("b", PROMPT, params, grammar_matchers=[built[0], built[0]])
    other = seqs.build_matchers(engine.grammars, SamplingParams(
        n=2, structured_outputs={"choice": ["maybe"]}))
    with pytest.raises(ValueError, match="for the request's spec"):
        engine.add_request("c", PROMPT, params, grammar_matchers=other)
    with pytest.raises(ValueError, match="needs its grammar matcher"):
        engine.add_request("d", PROMPT, params, grammar_matchers=[None, None])
    engine.add_request("e", PROMPT, params, grammar_matchers=built)
    assert not engine.has_request("a") and engine.has_request("e")


def test_no_matcher_is_built_on_the_engine_thread(smollm2_vocab_model, monkeypatch):
    """AsyncEngine compiles and copies matchers on its grammar threads; the engine thread
    only receives them (the compile of a large spec took it 0.7 s per matcher before)."""
    threads: list[str] = []
    compile_uncached = GrammarCompiler._compile_uncached
    new_matcher = grammar_module.CompiledGrammar.new_matcher

    def recording_compile(self, spec):
        threads.append(threading.current_thread().name)
        return compile_uncached(self, spec)

    def recording_copy(self):
        threads.append(threading.current_thread().name)
        return new_matcher(self)

    monkeypatch.setattr(GrammarCompiler, "_compile_uncached", recording_compile)
    monkeypatch.setattr(grammar_module.CompiledGrammar, "new_matcher", recording_copy)
    engine = AsyncEngine(new_engine(smollm2_vocab_model))
    engine.start()

    async def run() -> list[str]:
        params = SamplingParams(n=3, max_tokens=6, temperature=1.0,
                                structured_outputs={"regex": "[0-9]{2}-[a-z]{2}"})
        finals = {}
        async for out in engine.generate("r", PROMPT, params):
            for c in out.outputs:
                if c.finished:
                    finals[c.index] = c
        return [finals[i].text for i in range(3)]

    try:
        texts = asyncio.run(run())
    finally:
        engine.stop()
    assert all(len(t) <= 5 and t[:2].isdigit() for t in texts), texts
    # 1 compile + 1 probe copy + 3 copies: all on grammar threads
    assert len(threads) >= 4
    assert all(name.startswith("slotserve-grammar") for name in threads), threads


# ------------------------------------------------------------------ size caps
@pytest.mark.parametrize("spec, message", [
    (StructuredOutputs(json={"type": "string", "description": "x" * 200}),
     r"structured_outputs\.json: the JSON schema is \d+ bytes; .* at most 100 "
     r"\(--max-schema-bytes\)"),
    (StructuredOutputs(regex="a" * 101), r"structured_outputs\.regex: .*--max-regex-bytes"),
    (StructuredOutputs(grammar='start: "' + "a" * 100 + '"'),
     r"structured_outputs\.grammar: .*--max-grammar-bytes"),
    (StructuredOutputs(choice=[str(i) for i in range(4)]),
     r"structured_outputs\.choice: 4 choices; .* at most 3 \(--max-choices\)"),
    (StructuredOutputs(choice=["ok", "é" * 6]),
     r"structured_outputs\.choice: choice 1 is 12 bytes; .*--max-choice-bytes"),
])
def test_each_cap_names_its_field(spec, message):
    caps = StructuredLimits(max_schema_bytes=100, max_regex_bytes=100, max_grammar_bytes=100,
                            max_choices=3, max_choice_bytes=10)
    with pytest.raises(ValueError, match=message):
        caps.check(spec)
    StructuredLimits().check(spec)  # the defaults take all of these


def test_caps_must_be_positive_integers():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_constrained_n must be an integer >= 1"):
            StructuredLimits(max_constrained_n=bad)


def test_flags_set_the_caps():
    from slotserve.cli import build_parser
    from slotserve.server.startup import server_limits

    args = build_parser().parse_args(["serve", "--max-schema-bytes", "1K", "--max-regex-bytes",
                                      "64", "--max-grammar-bytes", "2K", "--max-choices", "5",
                                      "--max-choice-bytes", "7", "--max-constrained-n", "4"])
    assert server_limits(args).structured == StructuredLimits(1024, 64, 2048, 5, 7, 4)
    assert server_limits(build_parser().parse_args(["serve"])).structured == StructuredLimits()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-constrained-n", "0"])


# ------------------------------------------------------------------ through the API
CAPS = StructuredLimits(max_schema_bytes=200, max_regex_bytes=50, max_grammar_bytes=60,
                        max_choices=4, max_choice_bytes=8, max_constrained_n=2)


@pytest.fixture(scope="module")
def client(smollm2_vocab_model):
    engine = AsyncEngine(new_engine(smollm2_vocab_model))
    with app_client(engine, limits=ServerLimits(structured=CAPS)) as test_client:
        yield test_client


BIG_SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "integer"}
                                               for i in range(20)}}
WEATHER = {"type": "function", "function": {"name": "w", "parameters": BIG_SCHEMA}}


@pytest.mark.parametrize("route, body, param, words", [
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": BIG_SCHEMA}}},
     "response_format", "response_format.json_schema.schema: the JSON schema is"),
    ("chat", {"tools": [WEATHER], "tool_choice": "required"}, "tools",
     "--max-schema-bytes"),
    ("completions", {"guided_json": BIG_SCHEMA}, "guided_json", "guided_json: the JSON"),
    ("completions", {"guided_regex": "[a-z]" * 20}, "guided_regex",
     "guided_regex: the regex is 100 bytes"),
    ("completions", {"structured_outputs": {"grammar": 'start: "' + "ab" * 40 + '"'}},
     "structured_outputs", "structured_outputs.grammar: the grammar is"),
    ("completions", {"guided_choice": ["a", "b", "c", "d", "e"]}, "guided_choice",
     "guided_choice: 5 choices"),
    ("completions", {"guided_choice": ["a", "much too long"]}, "guided_choice",
     "guided_choice: choice 1 is 13 bytes"),
    ("completions", {"guided_choice": ["a", "b"], "n": 3}, "n",
     "n: 3 completions of a constrained request; this server allows at most 2"),
    ("completions", {"guided_regex": "c{300000}"}, "guided_regex", "guided_regex: "),
])
def test_api_caps_are_400s_naming_the_field(client, route, body, param, words):
    if route == "chat":
        path, base = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        path, base = "/v1/completions", {"prompt": "hi"}
    start = time.perf_counter()
    response = client.post(path, json={**base, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert time.perf_counter() - start < 5.0


def test_within_the_caps_a_constrained_request_runs(client):
    response = client.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 8, "n": 2, "guided_choice": ["yes", "no"]})
    assert response.status_code == 200, response.text
    assert sorted({c["text"] for c in response.json()["choices"]}) <= ["no", "yes"]


# ------------------------------------------------------------------ under --replicas
def test_the_replica_front_pre_checks_constraints_too(smollm2_vocab_model):
    """ReplicaFront compiles with its own GrammarCompiler (the replicas' tokenizer): a
    rejected constraint is a 400 at the ingress, before any replica is asked."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from slotserve.server.api import build_app
    from tests.support.replicas import InProcessReplica, in_process_front

    front = in_process_front({"replica-0": InProcessReplica(AsyncEngine(
        new_engine(smollm2_vocab_model)))}, block_size=16)
    app = build_app(front, "tiny", limits=ServerLimits(structured=CAPS))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        for body, param, words in [
                ({"guided_regex": "c{300000}"}, "guided_regex", "guided_regex: "),
                ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
                ({"guided_choice": ["a", "b"], "n": 3}, "n", "at most 2"),
                ({"guided_json": BIG_SCHEMA}, "guided_json", "--max-schema-bytes")]:
            response = test_client.post("/v1/completions",
                                        json={"prompt": "hi", "max_tokens": 4, **body})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and words in error["message"], error
    assert ("regex", "(ab") in front.grammars._cache  # compiled at the ingress
    assert not front.routing  # no replica was asked


def test_both_engine_clients_have_every_method_the_server_uses():
    """EngineClient (engine/client.py) names what the server asks of an engine; AsyncEngine
    and ReplicaFront each have all of it (the pre-check included)."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from slotserve.engine.client import EngineClient
    from slotserve.scaleout.front import ReplicaFront

    members = [name for name in vars(EngineClient) if not name.startswith("_")]
    assert {"check_structured", "generate", "snapshot"} <= set(members)
    set_in_init = {"ReplicaFront": {"tokenizer"}}  # instance attributes, not on the class
    for cls in (AsyncEngine, ReplicaFront):
        missing = [name for name in members if not hasattr(cls, name)
                   and name not in set_in_init.get(cls.__name__, set())]
        assert not missing, f"{cls.__name__} lacks {missing}"
        assert asyncio.iscoroutinefunction(cls.check_structured)
