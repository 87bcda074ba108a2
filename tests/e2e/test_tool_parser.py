"""tool_choice "auto" with the official openai client: the embedded SmolLM2 served with a
Qwen3-style `--chat-template` (tools in the system turn, Hermes `<tool_call>` blocks), as a
user of vLLM's `--tool-call-parser hermes` would send it. A few-shot conversation of calls
makes the model write one (greedy, fp32: the same text every run); the server parses it into
OpenAI's tool_calls, whole and streamed; chat_template_kwargs reaches the template."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.conftest import ENGINE_FLAGS, MODEL_NAME, launch_server
from tests.support.launch import cli_flags
from tests.unit.test_chat_template_qwen3 import QWEN3_STYLE_TEMPLATE, WEATHER_TOOL

CITIES = ["Paris", "Rome", "Oslo", "Lima"]


def earlier_call(city: str, i: int) -> list[dict]:
    """A user's question and the assistant's call, as a client sends them back."""
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{i}", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": city})}}]}]


FEW_SHOT = [m for i, city in enumerate(CITIES) for m in earlier_call(city, i)]
ASK_BERLIN = FEW_SHOT + [{"role": "user", "content": "What is the weather in Berlin?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool-parser")
    template = folder / "qwen3_style.jinja"
    template.write_text(QWEN3_STYLE_TEMPLATE, encoding="utf-8")
    proc = launch_server(folder, *cli_flags(**ENGINE_FLAGS), "--chat-template", str(template))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def ask(server, messages=ASK_BERLIN, **kwargs):
    kwargs.setdefault("max_tokens", 60)
    return server.client().chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[WEATHER_TOOL], temperature=0, **kwargs)


def test_auto_tool_call_is_parsed(server):
    for choice in ({}, {"tool_choice": "auto"}):  # NOTE: "auto" is OpenAI's default
        out = ask(server, **choice)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls"
        assert message.content is None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call")
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Berlin"}


def test_streamed_call_equals_the_whole_answer(server):
    whole = ask(server).choices[0].message.tool_calls[0].function
    chunks = list(ask(server, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call")
    assert (calls[0].function.name, calls[0].function.arguments) == (whole.name,
                                                                      whole.arguments)
    assert not "".join(d.content or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_the_clients_stream_helper_accumulates_the_call(server):
    """openai's `chat.completions.stream` helper builds the final message from our deltas."""
    with server.client().chat.completions.stream(
            model=MODEL_NAME, messages=ASK_BERLIN, tools=[WEATHER_TOOL], temperature=0,
            max_tokens=60) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Berlin"}


def test_round_trip_with_the_tool_result(server):
    """The call and its result sent back (the template shows them structured); the model
    answers in text, or calls again: either way a well-formed answer."""
    call = ask(server).choices[0].message.tool_calls[0]
    messages = ASK_BERLIN + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    out = ask(server, messages=messages)
    message = out.choices[0].message
    assert (message.content is not None) or message.tool_calls
    # /tokenize renders as the chat request does (--chat-template, tools, tool calls)
    tokenized = httpx.post(server.url + "/tokenize", json={
        "messages": messages, "tools": [WEATHER_TOOL]}, timeout=60)
    assert tokenized.status_code == 200
    assert tokenized.json()["count"] == out.usage.prompt_tokens


def test_plain_answer_and_enable_thinking(server):
    """chat_template_kwargs {"enable_thinking": false} reaches the template (the empty
    think block after the generation prompt): the model then answers in text, which stays
    the content, with no tool_calls."""
    off = ask(server, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = off.choices[0].message
    assert message.tool_calls is None and message.content
    assert off.choices[0].finish_reason in ("stop", "length")
    assert off.usage.prompt_tokens > ask(server).usage.prompt_tokens


def test_tool_choice_none_and_forced_still_work(server):
    out = ask(server, tool_choice="none")
    assert out.choices[0].message.tool_calls is None
    forced = ask(server, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = forced.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(
        json.loads(call.function.arguments), dict)


def test_streamed_logprobs_cover_each_token_once(server):
    """With logprobs, the streamed pieces carry each generated token's logprob once (a call
    parsed at once and its finish come from one output), as the whole answer lists them."""
    whole = ask(server, logprobs=True, top_logprobs=2)
    chunks = list(ask(server, stream=True, logprobs=True, top_logprobs=2))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert whole.choices[0].message.tool_calls
    assert streamed == [t.token for t in whole.choices[0].logprobs.content]
    assert len(streamed) == whole.usage.completion_tokens
