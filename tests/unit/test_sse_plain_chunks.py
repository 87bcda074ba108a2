"""server/sse.PlainChunks: a text-only chunk copied from a template equals the chunk the
pydantic models build (but for `created`, the template's)."""

from __future__ import annotations

import pytest

from slotserve.server import protocol as p
from slotserve.server.sse import PlainChunks, _chunk


def chat_chunk(index: int, text: str, include_usage: bool) -> dict:
    return _chunk(p.ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[
        p.ChatChunkChoice(index=index, delta=p.DeltaMessage(content=text))]), include_usage)


def completion_chunk(index: int, text: str, include_usage: bool) -> dict:
    return _chunk(p.CompletionResponse(id="cmpl-1", model="m", choices=[
        p.CompletionChoice(index=index, text=text)]), include_usage)


@pytest.mark.parametrize("build", [chat_chunk, completion_chunk], ids=["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_plain_chunk_equals_the_models_chunk(build, include_usage):
    plain = PlainChunks(enabled=True)
    calls = []

    def template(index: int) -> dict:
        calls.append(index)
        return build(index, "", include_usage)

    for index, text in [(0, "Hello"), (2, " wörld\n"), (0, '"}')]:
        got = plain.chunk(index, text, template)
        expected = build(index, text, include_usage)
        expected["created"] = got["created"]
        assert got == expected
    assert calls == [0]  # the models build one chunk per stream


def test_copies_do_not_share_their_choices():
    plain = PlainChunks(enabled=True)
    first = plain.chunk(0, "a", lambda i: chat_chunk(i, "", False))
    second = plain.chunk(1, "b", lambda i: chat_chunk(i, "", False))
    assert first["choices"][0] == {"index": 0, "delta": {"content": "a"}, "logprobs": None,
                                   "finish_reason": None}
    assert second["choices"][0]["delta"] == {"content": "b"}
