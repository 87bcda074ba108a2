"""Structured outputs on the embedded SmolLM2-135M-Instruct: constrained outputs parse and
match, share a batch with a free request that is unchanged by them, and survive preemption."""

from __future__ import annotations

import json
import re

import pytest

from slotserve import SamplingParams
from slotserve.engine.llm import LLM
from slotserve.structured import StructuredOutputs

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICES = ["red", "green", "blue"]
REGEX = r"[0-9]{3}-[a-z]{2,4}"


def prompt(llm, text: str) -> list[int]:
    tok = llm.tokenizer
    chat = [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))


def assert_person(text: str) -> None:
    """Valid against SCHEMA (checked by hand: the schema is small)."""
    value = json.loads(text)
    assert set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150


def json_params(**kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=40, structured_outputs=StructuredOutputs(json=SCHEMA),
                          **kwargs)


def test_constrained_and_free_requests_in_one_batch(smollm2_llm):
    llm = smollm2_llm
    person = prompt(llm, "Describe a person as JSON with a name and an age.")
    color = prompt(llm, "Name a colour.")
    code = prompt(llm, "Make up a product code.")
    free = prompt(llm, "What is the capital of France?")
    free_params = SamplingParams(max_tokens=12, temperature=0.0)
    solo = llm.generate([free], free_params)[0]
    outs = llm.generate([person, color, code, free], [
        json_params(),
        SamplingParams(max_tokens=10, temperature=0.0,
                       structured_outputs=StructuredOutputs(choice=CHOICES)),
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=2,
                       structured_outputs={"regex": REGEX}),
        free_params])
    person_out, color_out, code_out, free_out = (o.outputs[0] for o in outs)
    assert_person(person_out.text)
    assert person_out.finish_reason == "stop"
    assert color_out.text in CHOICES and color_out.finish_reason == "stop"
    assert re.fullmatch(REGEX, code_out.text)
    assert all(t in lp for t, lp in zip(code_out.token_ids, code_out.logprobs))
    assert free_out.token_ids == solo.outputs[0].token_ids
    # greedy constrained decoding is deterministic
    again = llm.generate([person], json_params())[0].outputs[0]
    assert again.token_ids == person_out.token_ids


def test_n_with_seeds_is_reproducible_and_valid(smollm2_llm):
    llm = smollm2_llm
    person = prompt(llm, "Describe a person as JSON with a name and an age.")
    params = json_params(temperature=0.9, seed=11, n=2)
    first = llm.generate([person], params)[0]
    second = llm.generate([person], params)[0]
    assert len(first.outputs) == 2
    assert any(out.finish_reason == "stop" for out in first.outputs)
    for out in first.outputs:
        if out.finish_reason == "stop":  # a length cap may cut a sampled one short
            assert_person(out.text)
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]


def test_streamed_deltas_of_a_constrained_request(smollm2_llm):
    engine = smollm2_llm.engine
    engine.add_request("structured-stream", "Give me a colour.",
                       SamplingParams(max_tokens=10, temperature=0.0,
                                      structured_outputs=StructuredOutputs(choice=CHOICES)))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert final.finished and final.outputs[0].text in CHOICES
    assert "".join(deltas) == final.outputs[0].text


def test_a_bad_schema_is_a_value_error_and_registers_nothing(smollm2_llm):
    engine = smollm2_llm.engine
    bad = SamplingParams(structured_outputs=StructuredOutputs(json={"type": "nope"}), n=2)
    with pytest.raises(ValueError, match=r"structured_outputs\.json: .*nope"):
        engine.add_request("bad-schema", "hi", bad)
    assert not engine.has_request("bad-schema")
    engine.check_integrity()


def test_preemption_gives_the_same_constrained_output(smollm2_llm):
    prompts = [prompt(smollm2_llm, f"Describe {who} as JSON with a name and an age.")
               for who in ("a person", "a teacher", "an old sailor")]
    expected = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, json_params())]
    # 42 prompt + up to 20 output tokens each, in 4-token blocks: two running need 30 of 26
    small = LLM(num_blocks=26, block_size=4, max_num_seqs=3, enable_prefix_caching=False,
                quantization="none")  # as smollm2_llm
    outs = small.generate(prompts, json_params())
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for out in outs:
        assert_person(out.outputs[0].text)
    small.engine.check_integrity()


def test_a_matcher_in_error_fails_only_its_request(smollm2_llm):
    engine = smollm2_llm.engine
    params = SamplingParams(max_tokens=10, temperature=0.0,
                            structured_outputs=StructuredOutputs(choice=CHOICES))
    engine.add_request("broken", "Pick a colour.", params)
    engine.add_request("healthy", "Pick a colour.", params)

    def broken_check():
        raise ValueError("structured output failed: injected")

    engine._sequences["broken"].grammar.check = broken_check
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
    assert finals["broken"].outputs[0].finish_reason == "error"
    assert "injected" in finals["broken"].error
    assert finals["healthy"].outputs[0].text in CHOICES
    engine.check_integrity()


@pytest.mark.slow  # about 40 s on 2 idle cores: up to 400 tokens per schema on SmolLM2
def test_20_random_schemas_through_the_embedded_model(smollm2_llm):
    """20 random schemas (the generator of tests/unit/test_structured_api.py: objects,
    arrays, enums, bounded integers and floats, strings) in one generate call, sampled at
    temperature 1: 16 run at once and 4 wait for slots; every output is complete ("stop"
    within the longest output its schema allows) and validates with jsonschema."""
    import jsonschema
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.unit.test_structured_api import _schemas, max_output_tokens

    @settings(max_examples=1, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                     HealthCheck.data_too_large])
    @given(batch=st.lists(_schemas(), min_size=20, max_size=20,
                          unique_by=lambda schema: json.dumps(schema, sort_keys=True)))
    def check(batch):
        ids = prompt(smollm2_llm, "Describe a person as JSON.")
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_output_tokens(schema),
                                 structured_outputs=StructuredOutputs(json=schema))
                  for i, schema in enumerate(batch)]
        outputs = smollm2_llm.generate([ids] * len(batch), params, use_tqdm=False)
        for schema, output in zip(batch, outputs):
            completion = output.outputs[0]
            assert completion.finish_reason == "stop", (schema, completion.text)
            jsonschema.validate(json.loads(completion.text), schema)
        smollm2_llm.engine.check_integrity()

    check()
