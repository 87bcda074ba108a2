"""The response envelope the completion and chat schemas share: same keys, same order."""

from __future__ import annotations

import pydantic
import pytest

from slotserve.server import protocol as p

ENVELOPE = ["id", "object", "created", "model", "choices", "usage"]


@pytest.mark.parametrize("cls, obj", [
    (p.CompletionResponse, "text_completion"),
    (p.ChatCompletionResponse, "chat.completion"),
    (p.ChatCompletionChunk, "chat.completion.chunk"),
])
def test_every_response_has_the_envelope_in_openai_order(cls, obj):
    data = cls(id="x", model="m", choices=[], usage=p.UsageInfo.of(1, 2)).model_dump()
    assert list(data) == ENVELOPE and data["object"] == obj
    assert isinstance(data["created"], int)


def test_only_the_chat_response_requires_usage():
    assert p.CompletionResponse(id="x", model="m", choices=[]).usage is None
    assert p.ChatCompletionChunk(id="x", model="m", choices=[]).usage is None
    with pytest.raises(pydantic.ValidationError):
        p.ChatCompletionResponse(id="x", model="m", choices=[])


def test_choices_keep_their_own_type():
    with pytest.raises(pydantic.ValidationError):
        p.ChatCompletionChunk(id="x", model="m", choices=[{"index": 0, "text": "t"}])
