"""Structured outputs, forced tool calls and /tokenize against a real `slotserve serve` on
the embedded model, driven by the official openai client (few tokens each); and
`slotserve generate`'s chat default."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import MODEL_NAME, REPO

MESSAGES = [{"role": "user", "content": "Describe a person called Ann, aged 31."}]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"], "additionalProperties": False}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)


def test_json_schema_stream_and_n(server):
    client = server.client()
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=48, temperature=0.8, n=2, seed=1,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=48, temperature=0, stream=True,
        extra_body={"guided_json": PERSON})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_parse_helper_with_a_pydantic_model(server):
    completion = server.client().chat.completions.parse(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=48, temperature=0,
        response_format=Person)
    assert isinstance(completion.choices[0].message.parsed, Person)


def test_named_tool_call_and_its_stream(server):
    client = server.client()
    kwargs = dict(model=MODEL_NAME, messages=WEATHER_QUESTION, max_tokens=32, temperature=0,
                  tools=[WEATHER], tool_choice={"type": "function",
                                                "function": {"name": "get_weather"}})
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    streamed, finish = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or ():
            streamed += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and json.loads(streamed) == arguments


def test_bad_schema_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as error:
        server.client().chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}})
    assert error.value.body["param"] == "response_format"


def test_tokenize_detokenize_round_trip(server):
    text = "The capital of France is Paris."
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL_NAME, "prompt": text})
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) > 3
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]})
    assert back.json() == {"prompt": text}


@pytest.mark.slow
def test_generate_cli_answers_an_instruct_prompt():
    """The embedded model is an instruct model: the chat template is the default."""
    run = subprocess.run([sys.executable, "-m", "slotserve.cli", "generate",
                          "What is the capital of France?", "--max-tokens", "12"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout and "stopped after" not in run.stderr
    raw = subprocess.run([sys.executable, "-m", "slotserve.cli", "generate",
                          "What is the capital of France?", "--max-tokens", "12", "--raw"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert raw.returncode == 0, raw.stderr
    if not raw.stdout.strip():
        assert "stopped after" in raw.stderr and "--raw" in raw.stderr
