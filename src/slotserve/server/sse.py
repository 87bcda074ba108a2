"""Streamed answers (server-sent events): the completion and chat chunks as OpenAI sends
them, a forced tool call streamed as tool-call deltas, and the `data:` framing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi.responses import StreamingResponse

from slotserve.engine.outputs import CompletionOutput, RequestOutput
from slotserve.server import protocol as p
from slotserve.server.answers import (
    chat_choice_logprobs,
    chat_finish_reason,
    choice_prompt_logprobs,
    completion_choice_logprobs,
    cut_by_length,
)
from slotserve.server.protocol import APIError

if TYPE_CHECKING:
    from slotserve.server.generation import Generation, Generations


async def completion_chunks(stream: Generations, firsts: list[RequestOutput],
                            body: p.CompletionRequest, tokenizer, model_name: str
                            ) -> AsyncIterator[dict]:
    """A completion's stream chunks (one per choice's new text, logprobs or finish; then
    the usage when include_usage). With echo, each choice's first chunk is its prompt."""
    offsets: dict[int, int] = {}
    plain = PlainChunks(body.logprobs is None and not body.continuous_usage and not body.echo
                        and body.prompt_logprobs is None)

    def chunk(choice: p.CompletionChoice) -> dict:
        return _chunk(p.CompletionResponse(id=stream.request_id, model=model_name,
                                           choices=[choice],
                                           usage=_running_usage(stream, body)),
                      body.include_usage)

    async for c in stream.completions(firsts):
        if c.index not in offsets:
            offsets[c.index] = 0
            if body.echo or body.prompt_logprobs is not None:
                opening, offsets[c.index] = _opening_choice(stream, c, body, tokenizer)
                yield chunk(opening)
        with_logprobs = body.logprobs is not None and c.delta_token_ids
        if not (c.delta_text or with_logprobs or c.finished):
            continue
        if plain.enabled and c.delta_text and not c.finished:
            yield plain.chunk(c.index, c.delta_text, lambda index: chunk(
                p.CompletionChoice(index=index, text="")))
            continue
        logprobs = None
        if body.logprobs is not None:
            ids, lps = _delta_logprobs(c)
            logprobs = p.completion_logprobs(tokenizer, ids, lps, offsets[c.index])
        offsets[c.index] += len(c.delta_text)
        yield chunk(p.CompletionChoice(index=c.index, text=c.delta_text, logprobs=logprobs,
                                       finish_reason=c.finish_reason))
    if body.include_usage:
        yield p.CompletionResponse(id=stream.request_id, model=model_name, choices=[],
                                   usage=stream.usage(stream.finals)).model_dump()


def _opening_choice(stream: Generations, c: CompletionOutput, body: p.CompletionRequest,
                    tokenizer) -> tuple[p.CompletionChoice, int]:
    """A choice's first chunk with echo or prompt_logprobs: the prompt's text (echo), its
    tokens' logprobs (echo with logprobs) and vLLM's prompt_logprobs; and the text offset
    its completion's logprobs start at."""
    text = (stream.generation_of(c.index).prompt_text or "") if body.echo else ""
    logprobs = completion_choice_logprobs(stream, c, body, tokenizer, [], [])
    offset = 0
    if logprobs is not None and logprobs.tokens:
        offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
    return p.CompletionChoice(
        index=c.index, text=text, logprobs=logprobs,
        prompt_logprobs=choice_prompt_logprobs(stream, c.index, body, tokenizer)), offset


async def chat_chunks(stream: Generation, first: RequestOutput, body: p.ChatCompletionRequest,
                      tokenizer, model_name: str) -> AsyncIterator[dict]:
    """A chat completion's stream chunks: each choice opens with the role, then its content
    (or forced tool call) pieces and finish; then the usage when include_usage."""
    def chunk(choice: p.ChatChunkChoice) -> dict:
        return _chunk(p.ChatCompletionChunk(id=stream.request_id, model=model_name,
                                            choices=[choice],
                                            usage=_running_usage(stream, body)),
                      body.include_usage)

    for index in range(stream.params.n):  # OpenAI opens each choice with the role
        yield chunk(p.ChatChunkChoice(index=index,
                                      delta=p.DeltaMessage(role="assistant", content="")))
    plan = body.tool_plan()
    completions = stream.completions(first)
    if plan is not None:
        completions = _tool_call_deltas(completions, plan)
    plain = PlainChunks(plan is None and not body.logprobs and not body.continuous_usage)
    # NOTE: tool-call pieces: several may come from one output (a finish after the last
    # piece, calls parsed at once) and text may be held back; each token's logprobs go out
    # once, with the first piece after it.
    logprobs_sent: dict[int, int] = {}
    async for c in completions:
        if isinstance(c, _ToolCallPiece):
            out = c.output
            start = logprobs_sent.get(out.index, 0)
            logprobs_sent[out.index] = len(out.token_ids)
            ids, lps = out.token_ids[start:], (out.logprobs or [])[start:]
            logprobs = chat_choice_logprobs(tokenizer, ids, lps, body) if ids else None
            yield chunk(c.choice(logprobs))
            continue
        if plain.enabled and c.delta_text:
            yield plain.chunk(c.index, c.delta_text, lambda index: chunk(
                p.ChatChunkChoice(index=index, delta=p.DeltaMessage(content=""))))
        elif c.delta_text or (body.logprobs and c.delta_token_ids):
            ids, lps = _delta_logprobs(c)
            logprobs = chat_choice_logprobs(tokenizer, ids, lps, body)
            yield chunk(p.ChatChunkChoice(index=c.index,
                                          delta=p.DeltaMessage(content=c.delta_text),
                                          logprobs=logprobs))
        if c.finished:
            yield chunk(p.ChatChunkChoice(index=c.index, delta=p.DeltaMessage(),
                                          finish_reason=c.finish_reason))
    if body.include_usage:
        yield p.ChatCompletionChunk(id=stream.request_id, model=model_name, choices=[],
                                    usage=stream.usage(stream.finals)).model_dump()


class PlainChunks:
    """The chunks that carry only new text (no logprobs, tool calls, finish or running
    usage), copied from one chunk the models built, with the text put in: a chunk per token
    per stream is the server's commonest output, and building each through pydantic cost
    more than the rest of its path. NOTE: equal to the models' chunk (tested) but for
    `created`, which is the first chunk's (as OpenAI's own chunks of a stream share it)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._template: dict | None = None

    def chunk(self, index: int, text: str, build) -> dict:
        """The chunk of `text` for choice `index`; build(index) -> a chunk with text "" made
        the models' way (called once)."""
        if self._template is None:
            self._template = build(index)
        choice = self._template["choices"][0]
        field = "delta" if "delta" in choice else "text"
        new_choice = {**choice, "index": index,
                      field: {"content": text} if field == "delta" else text}
        return {**self._template, "choices": [new_choice]}


@dataclass
class _ToolCallPiece:
    """A streamed piece of a forced tool call: `delta` for one choice's call."""

    output: CompletionOutput
    delta: p.ToolCallDelta | None
    finish_reason: str | None
    content: str | None = None  # tool_choice "auto": text around the calls

    def choice(self, logprobs: p.ChatLogprobs | None) -> p.ChatChunkChoice:
        tool_calls = [self.delta] if self.delta is not None else None
        return p.ChatChunkChoice(index=self.output.index,
                                 delta=p.DeltaMessage(content=self.content,
                                                      tool_calls=tool_calls),
                                 logprobs=logprobs, finish_reason=self.finish_reason)


async def _tool_call_deltas(completions: AsyncIterator[CompletionOutput], plan: p.ToolPlan
                            ) -> AsyncIterator[_ToolCallPiece]:
    """A forced tool call streamed as OpenAI streams one: a first delta with the call's id,
    type and function name, then the arguments' text as it comes, then the finish reason.

    Named function: the output is the arguments, streamed as generated. tool_choice
    "required": the output is {"name": ..., "arguments": ...}, so each choice is held back
    until it finishes, then sent whole (the name must be known first). tool_choice "auto":
    content as it is known to be content, each call whole as soon as it is complete
    (`_parsed_pieces`).
    """
    if plan.call_format is not None:
        async for piece in _parsed_pieces(completions, plan):
            yield piece
        return
    opened: set[int] = set()
    async for c in completions:
        first_piece = c.index not in opened
        if plan.name is not None:
            if first_piece:
                opened.add(c.index)
                yield _ToolCallPiece(c, p.ToolCallDelta(
                    index=0, id=p.new_id("call"), type="function",
                    function=p.FunctionCall(name=plan.name, arguments="")), None)
            if c.delta_text:
                yield _ToolCallPiece(c, p.ToolCallDelta(
                    index=0, function=p.FunctionCall(arguments=c.delta_text)), None)
        elif c.finished:
            call = plan.answer_call(c.text, cut_by_length(c))
            if call is not None:  # NOTE: cut before a name: nothing (never the wrapper)
                yield _ToolCallPiece(c, p.ToolCallDelta(
                    index=0, id=p.new_id("call"), type="function",
                    function=p.FunctionCall(name=call[0], arguments=call[1])), None)
        if c.finished:
            yield _ToolCallPiece(c, None, chat_finish_reason(c, plan))


async def _parsed_pieces(completions: AsyncIterator[CompletionOutput], plan: p.ToolPlan
                         ) -> AsyncIterator[_ToolCallPiece]:
    """tool_choice "auto": each choice's text through a ToolCallStream (the whole answer's
    parser, so the pieces join to the whole answer): content deltas, a delta per call
    (id, name and all its arguments), then the finish reason."""
    streams: dict[int, p.ToolCallStream] = {}
    calls_sent: dict[int, int] = {}
    async for c in completions:
        parser = streams.setdefault(c.index, p.ToolCallStream(plan.call_format))
        for piece in parser.feed(c.text, c.finished):
            if isinstance(piece, str):
                yield _ToolCallPiece(c, None, None, content=piece)
                continue
            index = calls_sent.get(c.index, 0)
            if plan.max_calls is not None and index >= plan.max_calls:
                continue  # NOTE: parallel_tool_calls false: as the whole answer, the first
            calls_sent[c.index] = index + 1
            yield _ToolCallPiece(c, p.ToolCallDelta(
                index=index, id=p.new_id("call"), type="function",
                function=p.FunctionCall(name=piece.name, arguments=piece.arguments)), None)
        if c.finished:
            yield _ToolCallPiece(c, None, chat_finish_reason(c, plan))


def _running_usage(stream: Generation | Generations,
                   body: p.CompletionRequest | p.ChatCompletionRequest) -> p.UsageInfo | None:
    """A content chunk's usage: the usage so far with continuous_usage_stats, else None."""
    return stream.usage_so_far() if body.continuous_usage else None


def _chunk(response, include_usage: bool) -> dict:
    """A stream chunk as OpenAI sends them: deltas list only what they carry, and "usage"
    is null in every chunk but the last when include_usage is set (absent otherwise; with
    continuous_usage_stats every chunk carries the usage so far)."""
    data = response.model_dump()
    for choice in data["choices"]:
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            if "tool_calls" in choice["delta"]:  # OpenAI's pieces carry only what is new
                choice["delta"]["tool_calls"] = [_without_nulls(call) for call in
                                                 choice["delta"]["tool_calls"]]
    if not include_usage:
        data.pop("usage", None)
    return data


def _without_nulls(value: dict) -> dict:
    """`value` without its null entries, nested dicts included."""
    return {k: _without_nulls(v) if isinstance(v, dict) else v for k, v in value.items()
            if v is not None}


def _delta_logprobs(c: CompletionOutput) -> tuple[list[int], list[dict[int, float]]]:
    """The new tokens of an output and their logprobs (the output carries all so far)."""
    ids = c.delta_token_ids
    if not c.logprobs or not ids:
        return ids, []
    return ids, c.logprobs[len(c.token_ids) - len(ids):]


def sse_response(chunks: AsyncIterator[dict], stream: Generation | Generations
                 ) -> StreamingResponse:
    return StreamingResponse(_sse_lines(chunks, stream), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse_lines(chunks: AsyncIterator[dict], stream: Generation | Generations
                     ) -> AsyncIterator[str]:
    """`data: {json}` events, an error event if the generation fails, then `data: [DONE]`."""
    try:
        async for data in chunks:
            yield f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
    except APIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    finally:
        await chunks.aclose()
        await stream.aclose()  # NOTE: aborts the request if the stream ended early
    yield "data: [DONE]\n\n"
