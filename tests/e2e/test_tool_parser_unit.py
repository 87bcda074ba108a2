"""The Hermes-style tool-call parser (vLLM's `hermes`) without a server: whole outputs, and
streaming at every split of the text, which must join to the whole answer."""

from __future__ import annotations

import json

import pytest

from slotserve.server.protocol.tool_parsers import (
    ParsedCall,
    ToolCallStream,
    parse_tool_calls,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARIS = ParsedCall("get_weather", json.dumps({"city": "Paris"}))

CASES = [
    # (model output, content, calls)
    ("It is sunny.", "It is sunny.", []),
    ("It is sunny.\n", "It is sunny.\n", []),
    (CALL, None, [PARIS]),
    (CALL + "\n" + CALL.replace("Paris", "Rome"), None,
     [PARIS, ParsedCall("get_weather", '{"city": "Rome"}')]),
    ("Let me look.\n" + CALL + "\n", "Let me look.\n", [PARIS]),
    # no arguments: {}; a non-ASCII argument stays as it is
    ('<tool_call>{"name": "now"}</tool_call>', None, [ParsedCall("now", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>', None,
     [ParsedCall("f", '{"city": "Zürich"}')]),
    # an unclosed last call is parsed as if closed (vLLM's too)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', None, [PARIS]),
    # not calls: the whole text is the content
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', []),
    ("<tool_call>" + "[" * 100_000, "<tool_call>" + "[" * 100_000, []),
    ("a <tool_c", "a <tool_c", []),
    # a bad block beside a good one: the bad one is content, as written
    (CALL + "<tool_call>oops</tool_call>", "<tool_call>oops</tool_call>", [PARIS]),
    (CALL + " and more text", " and more text", [PARIS]),
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole_output(text, content, calls):
    assert parse_tool_calls(text) == (content, calls)


def streamed(text: str, cuts: list[int]) -> list:
    """The pieces of `text` fed as it grows, cut at `cuts`, then finished."""
    stream, pieces = ToolCallStream(), []
    for cut in cuts:
        pieces += stream.feed(text[:cut], finished=False)
    pieces += stream.feed(text, finished=True)
    return pieces


def joined(pieces: list) -> tuple[str | None, list[ParsedCall]]:
    calls = [p for p in pieces if isinstance(p, ParsedCall)]
    content = "".join(p for p in pieces if isinstance(p, str))
    return (content or None) if calls else content, calls


@pytest.mark.parametrize("text, content, calls", CASES[:11] + CASES[12:])  # not the 100k one
def test_every_split_streams_to_the_whole_answer(text, content, calls):
    """Fed one character at a time, and at every single cut: the pieces join to the whole
    answer's content and calls; nothing of a call ever shows as content."""
    assert joined(streamed(text, list(range(1, len(text))))) == (content, calls)
    for cut in range(1, len(text)):
        pieces = streamed(text, [cut])
        assert joined(pieces) == (content, calls), cut


def test_content_streams_before_the_call_and_a_partial_tag_is_held():
    stream = ToolCallStream()
    assert stream.feed("Let me look. <tool", finished=False) == ["Let me look. "]
    assert stream.feed("Let me look. <tool_call>\n{\"name\"", finished=False) == []
    assert stream.feed("Let me look. " + CALL, finished=False) == [PARIS]
    assert stream.feed("Let me look. " + CALL + "\n", finished=True) == []
    assert stream.num_calls == 1


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown tool-call format"):
        ToolCallStream("mistral")


def test_parallel_tool_calls_false_keeps_the_first_call():
    """vLLM's rule: with parallel_tool_calls false the answer holds the first call only;
    the request's plan carries the bound (the server's streams apply it too)."""
    from slotserve.server.protocol import ChatCompletionRequest

    two = CALL + "\n" + CALL.replace("Paris", "Rome")
    tool = {"type": "function", "function": {"name": "get_weather"}}
    for parallel, expected in ((None, 2), (True, 2), (False, 1)):
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
        request = ChatCompletionRequest.model_validate(body)
        request.use_tool_call_format("hermes")
        content, calls = request.tool_plan().parsed_calls(two)
        assert content is None and len(calls) == expected and calls[0] == PARIS
