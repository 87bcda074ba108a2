"""A Qwen3-style chat template (the shape of Qwen3's tokenizer_config.json one: the tools in
the system turn, `<tool_call>` blocks for an assistant's calls, tool responses folded into a
user turn, and `enable_thinking`) rendered by our sandbox exactly as HF's
`apply_chat_template` renders it; other test modules import the template from here."""

from __future__ import annotations

import jinja2
import pytest

from slotserve.loader.chat_template import (
    compiled_chat_template,
    load_chat_template,
    renders_tool_calls,
    tool_call_format,
)
from slotserve.server.protocol import ChatCompletionRequest
from tests.unit.server_fixtures import tiny_tokenizer

QWEN3_STYLE_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n"
    "</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n"
    "                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def qwen3_style_tokenizer():
    """The tiny byte-level BPE tokenizer (tests/unit/server_fixtures.py) with the template."""
    return tiny_tokenizer(add_bos_token=False, template=QWEN3_STYLE_TEMPLATE)


CALL_ARGUMENTS = '{"city": "Paris"}'
CONVERSATIONS = {
    "plain": [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Hello there"}],
    "tool round trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": CALL_ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"}],
}


def hf_tokenizer(template: str):
    """HF's tokenizer class over the same backend, with the template (the oracle)."""
    from transformers import PreTrainedTokenizerFast

    backend = qwen3_style_tokenizer().backend
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template)


def hf_messages(messages: list[dict]) -> list[dict]:
    """The conversation as HF's templates take it (what vLLM passes too): each call's
    arguments a dict."""
    import json

    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("thinking", [None, False, True])
def test_request_renders_as_hf_apply_chat_template(conversation, tools, thinking):
    """The server's path (request -> template messages and kwargs -> our sandbox) gives
    HF's text, with tools, tool calls, tool responses and enable_thinking."""
    body = {"messages": CONVERSATIONS[conversation]}
    kwargs = {}
    if tools:
        body["tools"] = [WEATHER_TOOL]
        kwargs["tools"] = [WEATHER_TOOL]
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
        kwargs["enable_thinking"] = thinking
    request = ChatCompletionRequest.model_validate(body)
    ours = qwen3_style_tokenizer().apply_chat_template(
        request.template_messages(renders_tool_calls(QWEN3_STYLE_TEMPLATE)),
        add_generation_prompt=True, **request.template_kwargs())
    theirs = hf_tokenizer(QWEN3_STYLE_TEMPLATE).apply_chat_template(
        hf_messages(CONVERSATIONS[conversation]), add_generation_prompt=True, tokenize=False,
        **kwargs)
    assert ours == theirs
    assert ours.endswith("<think>\n\n</think>\n\n") == (thinking is False)
    assert ("<tools>" in ours) == tools
    if conversation == "tool round trip":
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in ours
        assert "<tool_response>\nsunny, 21 C\n</tool_response>" in ours


def test_template_without_tool_format_gets_calls_as_text():
    """A template that shows no tool_calls (ChatML): an earlier call is written into the
    assistant turn as JSON, as before."""
    request = ChatCompletionRequest.model_validate({"messages": CONVERSATIONS["tool round trip"]})
    chatml = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert not renders_tool_calls(chatml) and tool_call_format(chatml) is None
    assert renders_tool_calls(QWEN3_STYLE_TEMPLATE)
    assert tool_call_format(QWEN3_STYLE_TEMPLATE) == "hermes"
    messages = request.template_messages(renders_tool_calls(chatml))
    assert messages[1] == {"role": "assistant",
                           "content": '{"name": "get_weather", "arguments": {"city": "Paris"}}'}


def test_load_chat_template_file_inline_and_errors(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(QWEN3_STYLE_TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(path)) == QWEN3_STYLE_TEMPLATE
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert load_chat_template(inline) == inline
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for m in messages %}")
    with pytest.raises(ValueError, match="empty"):
        load_chat_template("\n")


def test_chat_template_flag_is_read_and_checked_at_parse_time(tmp_path):
    from slotserve.cli import build_parser

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}", encoding="utf-8")
    args = build_parser().parse_args(["serve", "--chat-template", str(path)])
    assert args.chat_template == "{{ messages[0].content }}"
    args = build_parser().parse_args(["serve", "--chat-template", "{{ 'x' }}"])
    assert args.chat_template == "{{ 'x' }}"
    assert build_parser().parse_args(["serve"]).chat_template is None
    for bad in (str(tmp_path / "nope.jinja"), "{% if %}"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--chat-template", bad])


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # escape to Python's classes
    "{{ messages.append(1) }}",  # mutate what the server passes
    "{{ extra.update({'a': 1}) }}",
])
def test_rendering_stays_sandboxed(template):
    """The immutable sandbox (as HF's): no attribute escapes, no mutation of the request's
    values (chat_template_kwargs are data the client chooses)."""
    with pytest.raises(jinja2.exceptions.SecurityError):
        compiled_chat_template(template).render(messages=[], extra={})
