"""Tool calls in a model's free text (tool_choice "auto"), as vLLM's tool parsers find them.

One format so far, "hermes" (vLLM's `hermes` parser: Qwen2.5, Qwen3, Hermes and others):

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallStream` reads a choice's text as it grows and says what is safe to send: content
(text outside calls) and complete calls. The whole answer is the same stream fed the
finished text at once, so a streamed answer's pieces always join to the whole answer's.

Rules (one set for both):
- text before the first `<tool_call>` is content, as generated; a possible start of the tag
  at the end of the text so far is held back until it is known;
- each `<tool_call>...</tool_call>` whose inside is a JSON object with a string "name" and an
  object "arguments" (or none: {}) is a call; any other block is content, as written;
- after the first call, whitespace between and after blocks is dropped (other text is
  content); a block still open when the output ends is parsed as if closed (vLLM's too);
- no call at all: the content is the whole text, unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
FORMATS = ("hermes",)


@dataclass(frozen=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass
class ToolCallStream:
    """One choice's text -> content pieces and calls, as the text grows (hermes format).

    NOTE: `feed` takes the whole text so far each time (CompletionOutput.text), never
    less than before; it returns only what is new.
    """

    format: str = "hermes"
    _sent: int = 0  # text[:_sent] is accounted for (sent, or dropped)
    _calls: int = 0
    _held_space: str = field(default="", repr=False)  # whitespace held after a call

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown tool-call format {self.format!r} (known: {FORMATS})")

    @property
    def num_calls(self) -> int:
        return self._calls

    def feed(self, text: str, finished: bool) -> list[str | ParsedCall]:
        """The new pieces of `text` (the whole output so far): content strings and calls,
        in order. finished: the output is complete (everything left is settled)."""
        pieces: list[str | ParsedCall] = []
        while self._sent < len(text):
            start = text.find(HERMES_START, self._sent)
            if start == -1:
                self._content(text[self._sent:] if finished else
                              _without_partial_tag(text[self._sent:]), pieces, finished)
                break
            self._content(text[self._sent:start], pieces, True)
            end = text.find(HERMES_END, start + len(HERMES_START))
            if end == -1 and not finished:
                break  # NOTE: an open call waits for its end
            close = len(text) if end == -1 else end + len(HERMES_END)
            call = _parse_call(text[start + len(HERMES_START):end if end != -1 else None])
            if call is None:
                pieces.append(text[start:close])
            else:
                self._held_space = ""
                self._calls += 1
                pieces.append(call)
            self._sent = close
        if finished:  # NOTE: whitespace held after a call is dropped
            self._held_space = ""
        return [p for p in pieces if not isinstance(p, str) or p]

    def _content(self, chunk: str, pieces: list[str | ParsedCall], settled: bool) -> None:
        """Text outside calls: sent as it is before the first call; after one, whitespace
        is dropped and other text sent (held while it may still be only whitespace)."""
        self._sent += len(chunk)
        if self._calls == 0:
            pieces.append(chunk)
            return
        held = self._held_space + chunk
        if held.strip():
            pieces.append(held)
            self._held_space = ""
        elif not settled:
            self._held_space = held
        else:
            self._held_space = ""


def parse_tool_calls(text: str, call_format: str = "hermes"
                     ) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished output. No call: (text, []). With calls: the content
    outside them (None when there is none)."""
    pieces = ToolCallStream(call_format).feed(text, finished=True)
    calls = [p for p in pieces if isinstance(p, ParsedCall)]
    if not calls:
        return text, []
    content = "".join(p for p in pieces if isinstance(p, str))
    return content or None, calls


def _parse_call(inside: str) -> ParsedCall | None:
    """The call a block holds: {"name": str, "arguments": object}; None if it is not one."""
    try:
        value = json.loads(inside)
    except (ValueError, RecursionError):  # NOTE: "[" * 10**5 nests too deep to parse
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    try:
        return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))
    except RecursionError:
        return None


def _without_partial_tag(text: str) -> str:
    """`text` less a tail that may be the start of HERMES_START (held back until known)."""
    for size in range(min(len(text), len(HERMES_START) - 1), 0, -1):
        if HERMES_START.startswith(text[-size:]):
            return text[:-size]
    return text
