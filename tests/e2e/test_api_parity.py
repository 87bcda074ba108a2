"""Issue 34 items 3-5 end to end, with the official `openai` client on one real server (the
embedded SmolLM2): prompt lists on /v1/completions, echo with logprobs and prompt_logprobs,
and the stateless /v1/responses (create, streaming helper, structured output, a forced
function call, the stateful fields refused)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.conftest import ENGINE_FLAGS, MODEL_NAME, running_server
from tests.support.launch import cli_flags


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("parity"), *cli_flags(**ENGINE_FLAGS),
                        "--max-prompts", "8") as proc:
        yield proc


def complete(client, **kwargs):
    return client.completions.create(model=MODEL_NAME, temperature=0, **kwargs)


# --------------------------------------------------------------------------- completions
def test_prompt_lists_give_one_choice_per_prompt_and_n(server, client):
    prompts = ["The capital of France is", "One, two, three,"]
    batch = complete(client, prompt=prompts, n=2, max_tokens=5)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    singles = [complete(client, prompt=p, max_tokens=5) for p in prompts]
    for i, single in enumerate(singles):
        assert {batch.choices[2 * i].text, batch.choices[2 * i + 1].text} == {
            single.choices[0].text}
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompts[0]}).json()["tokens"]
    by_ids = complete(client, prompt=[ids, ids], max_tokens=5)
    assert [c.text for c in by_ids.choices] == [singles[0].choices[0].text] * 2


def test_streamed_prompt_lists_carry_each_choice_index(client):
    prompts = ["Roses are", "The sky is"]
    text: dict[int, str] = {}
    for chunk in complete(client, prompt=prompts, max_tokens=4, stream=True):
        for choice in chunk.choices:
            text[choice.index] = text.get(choice.index, "") + choice.text
    whole = complete(client, prompt=prompts, max_tokens=4)
    assert text == {c.index: c.text for c in whole.choices}


@pytest.mark.parametrize("prompt", [[], ["a"] * 9])
def test_empty_and_too_long_prompt_lists_are_400s(client, prompt):
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, prompt=prompt, max_tokens=1)
    assert err.value.body["param"] == "prompt"


def test_echo_with_logprobs_scores_the_prompt(client):
    """lm-eval's loglikelihood request: echo, logprobs=1, the prompt's logprobs."""
    prompt = "The capital of France is Paris"
    out = complete(client, prompt=prompt, max_tokens=1, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == out.usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:out.usage.prompt_tokens]) == prompt
    # vLLM's prompt_logprobs (extra_body) agree with echo's
    vllm = complete(client, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0})
    entries = vllm.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == out.usage.prompt_tokens
    for entry, expected in zip(entries[1:], lp.token_logprobs[1:]):
        (only,) = entry.values()
        assert only["logprob"] == pytest.approx(expected, abs=1e-5)


# --------------------------------------------------------------------------- responses
def test_responses_create_equals_the_chat_path(client):
    response = client.responses.create(model=MODEL_NAME, input="Name three colours.",
                                       instructions="Answer briefly.", max_output_tokens=12,
                                       temperature=0)
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "Name three colours."}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status in ("completed", "incomplete") and response.id.startswith("resp_")


def test_responses_messages_with_input_text_parts(client):
    response = client.responses.create(model=MODEL_NAME, max_output_tokens=6, temperature=0,
                                       input=[{"role": "user", "content": [
                                           {"type": "input_text", "text": "Say hi."}]}])
    plain = client.responses.create(model=MODEL_NAME, max_output_tokens=6, temperature=0,
                                    input=[{"role": "user", "content": "Say hi."}])
    assert response.output_text == plain.output_text


def test_responses_stream_helper_and_raw_stream(client):
    kwargs = dict(model=MODEL_NAME, input="Count to five.", max_output_tokens=10,
                  temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == whole.output_text == final.output_text
    kinds = [event.type for event in client.responses.create(**kwargs, stream=True)]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]


def test_responses_structured_output(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string",
                                                          "enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL_NAME, input="Pick a colour.", max_output_tokens=20, temperature=0,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert json.loads(response.output_text)["colour"] in ("red", "green", "blue")
    with pytest.raises(openai.BadRequestError) as err:  # the chat path's pre-check
        client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=5, text={
            "format": {"type": "json_schema", "name": "bad",
                       "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}})
    assert err.value.body["param"].startswith("text.format")


def test_responses_forced_function_call(client):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"], "additionalProperties": False}}]
    response = client.responses.create(
        model=MODEL_NAME, input="What is the weather in Paris?", tools=tools,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
        temperature=0)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    with client.responses.stream(model=MODEL_NAME, input="Weather in Rome?", tools=tools,
                                 tool_choice="required", max_output_tokens=40,
                                 temperature=0) as stream:
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_weather"
    # "required" cut short: a function call as far as generated, never its wrapper as text
    cut = client.responses.create(model=MODEL_NAME, input="Weather in Rome?", tools=tools,
                                  tool_choice="required", max_output_tokens=10, temperature=0)
    (item,) = cut.output
    assert cut.status == "incomplete" and item.type == "function_call", item
    assert item.name == "get_weather" and item.status == "incomplete"
    with client.responses.stream(model=MODEL_NAME, input="Weather in Rome?", tools=tools,
                                 tool_choice="required", max_output_tokens=2,
                                 temperature=0) as stream:  # cut before the name
        texts = [e.delta if e.type.endswith(".delta") else e.text for e in stream
                 if e.type.startswith("response.output_text.")]
        final = stream.get_final_response()
    assert texts == [""] and final.output[0].type == "message", (texts, final.output)
    with pytest.raises(openai.BadRequestError) as err:  # "auto": a 400, as on chat
        client.responses.create(model=MODEL_NAME, input="x", tools=tools,
                                max_output_tokens=5)
    assert err.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("kwargs,param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    # chat's names of what this API names otherwise, and more than one answer
    ({"extra_body": {"max_tokens": 5}}, "max_tokens"),
    ({"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
    ({"extra_body": {"n": 2}}, "n"),
    # a sampling extension's bad value, named as on chat; chat's refusals and other fields
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"extra_body": {"include_stop_str_in_output": True}}, "include_stop_str_in_output"),
    ({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),
])
def test_responses_stateful_and_bad_fields_are_400s(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL_NAME, input="hi", **kwargs)
    assert err.value.body["param"] == param


def test_responses_sampling_extensions_work_as_on_chat(client):
    """seed, stop, top_k, logit_bias, penalties (vLLM's fields, in extra_body) change the
    answer exactly as on chat: never dropped."""
    fields = {"seed": 7, "stop": [" and"], "top_k": 20, "logit_bias": {"13": -100},
              "presence_penalty": 1.5, "repetition_penalty": 1.2}
    question = "List some colours of the rainbow."
    response = client.responses.create(model=MODEL_NAME, input=question, temperature=1.0,
                                       max_output_tokens=24, extra_body=fields)
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=24, temperature=1.0, extra_body=fields,
        messages=[{"role": "user", "content": question}])
    plain = client.responses.create(model=MODEL_NAME, input=question, temperature=1.0,
                                    max_output_tokens=24, extra_body={"seed": 7})
    assert response.output_text == chat.choices[0].message.content
    assert response.output_text != plain.output_text


def test_chat_best_of_other_than_n_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, max_tokens=3, n=2,
                                       extra_body={"best_of": 5},
                                       messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "best_of"
    ok = client.chat.completions.create(model=MODEL_NAME, max_tokens=3, n=2,
                                        extra_body={"best_of": 2}, temperature=0,
                                        messages=[{"role": "user", "content": "hi"}])
    assert len(ok.choices) == 2
