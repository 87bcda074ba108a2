"""Whole (non-streamed) answers built from a request's finished completions, and the shape
of a chat choice: its message (text or a forced tool call), finish reason and logprobs.

NOTE: `whole_answer` builds and serializes an answer in a worker thread: with logprobs one
can be megabytes of JSON (n=16 x 256 tokens x top 20 is about 6 MB), which on the event
loop would stall every other request and /health while it is built.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi.responses import Response
from pydantic import BaseModel

from slotserve.config import FinishReason
from slotserve.engine.outputs import CompletionOutput
from slotserve.server import protocol as p

if TYPE_CHECKING:
    from slotserve.server.generation import Generation, Generations


async def whole_answer(build: Callable[..., BaseModel], *args) -> Response:
    """The JSON response of `build(*args)` (a response model), built and serialized to
    bytes in a worker thread (see the module NOTE)."""
    def render() -> bytes:
        return build(*args).model_dump_json().encode()

    return Response(await asyncio.to_thread(render), media_type="application/json")


def completion_response(stream: Generations, finals: list[CompletionOutput],
                        body: p.CompletionRequest, tokenizer, model_name: str
                        ) -> p.CompletionResponse:
    choices = [p.CompletionChoice(
        index=c.index, text=_echoed(stream, c, body) + c.text, finish_reason=c.finish_reason,
        logprobs=completion_choice_logprobs(stream, c, body, tokenizer, c.token_ids,
                                            c.logprobs),
        prompt_logprobs=choice_prompt_logprobs(stream, c.index, body, tokenizer))
        for c in finals]
    return p.CompletionResponse(id=stream.request_id, model=model_name,
                                choices=choices, usage=stream.usage(finals))


def _echoed(stream: Generations, c: CompletionOutput, body: p.CompletionRequest) -> str:
    """The prompt's text when the request asks for echo, else ""."""
    return (stream.generation_of(c.index).prompt_text or "") if body.echo else ""


def completion_choice_logprobs(stream: Generations, c: CompletionOutput,
                               body: p.CompletionRequest, tokenizer, token_ids: list[int],
                               logprobs, echo: bool = True) -> p.CompletionLogprobs | None:
    """A completion choice's logprobs of `token_ids` (None unless asked); with echo (and
    `echo` true: the choice's first piece), the prompt tokens' before them."""
    if body.logprobs is None:
        return None
    result = p.completion_logprobs(tokenizer, token_ids, logprobs or [])
    if not (echo and body.echo):
        return result
    prompt = stream.generation_of(c.index)
    entries = prompt.prompt_logprobs or [None] * len(prompt.prompt_ids)
    return p.join_logprobs(p.echo_logprobs(tokenizer, prompt.prompt_ids, entries,
                                           body.logprobs), result)


def choice_prompt_logprobs(stream: Generations, index: int, body: p.CompletionRequest,
                           tokenizer) -> list | None:
    """vLLM's prompt_logprobs of a choice (None unless the request set prompt_logprobs)."""
    prompt = stream.generation_of(index)
    if body.prompt_logprobs is None or prompt.prompt_logprobs is None:
        return None
    return p.prompt_logprobs(tokenizer, prompt.prompt_ids, prompt.prompt_logprobs,
                             prompt.prompt_logprob_ranks, body.prompt_logprobs)


def chat_response(stream: Generation, finals: list[CompletionOutput],
                  body: p.ChatCompletionRequest, tokenizer, model_name: str
                  ) -> p.ChatCompletionResponse:
    plan = body.tool_plan()
    choices = [p.ChatChoice(
        index=c.index, message=assistant_message(c, plan),
        finish_reason=chat_finish_reason(c, plan),
        logprobs=chat_choice_logprobs(tokenizer, c.token_ids, c.logprobs, body))
        for c in finals]
    return p.ChatCompletionResponse(id=stream.request_id, model=model_name,
                                    choices=choices, usage=stream.usage(finals))


def chat_choice_logprobs(tokenizer, token_ids: list[int], logprobs,
                         body: p.ChatCompletionRequest) -> p.ChatLogprobs | None:
    """A chat choice's logprobs when the request asked for them (else None)."""
    if not body.logprobs:
        return None
    return p.chat_logprobs(tokenizer, token_ids, logprobs or [], body.top_logprobs or 0)


def assistant_message(c: CompletionOutput, plan: p.ToolPlan | None) -> p.AssistantMessage:
    """The message of a finished choice: a tool call (content null) when the request forced
    one, complete or cut short (ToolPlan.answer_call); with tool_choice "auto", the calls
    found in the text and the content around them; its text otherwise."""
    if plan is not None and plan.call_format is not None:
        content, calls = plan.parsed_calls(c.text)
        return p.AssistantMessage(content=content, tool_calls=[p.ToolCall(
            function=p.FunctionCall(name=call.name, arguments=call.arguments))
            for call in calls] or None)
    call = plan.answer_call(c.text, cut_by_length(c)) if plan is not None else None
    if call is None:  # NOTE: "required" cut before a name: no call, and no wrapper as text
        return p.AssistantMessage(content=c.text if plan is None else None)
    name, arguments = call
    return p.AssistantMessage(content=None, tool_calls=[p.ToolCall(
        function=p.FunctionCall(name=name, arguments=arguments))])


def cut_by_length(c: CompletionOutput) -> bool:
    """The choice ended at max_tokens or the context (finish_reason "length")."""
    return c.finish_reason == FinishReason.LENGTH


def chat_finish_reason(c: CompletionOutput, plan: p.ToolPlan | None) -> str | None:
    """"tool_calls" for a complete forced call, or a text with calls (tool_choice "auto"),
    that ended by itself (OpenAI's reason)."""
    ended_by_itself = c.finish_reason == FinishReason.STOP
    if plan is not None and plan.call_format is not None:
        called = ended_by_itself and plan.parsed_calls(c.text)[1]
        return "tool_calls" if called else c.finish_reason
    if plan is not None and ended_by_itself and plan.call_of(c.text) is not None:
        return "tool_calls"
    return c.finish_reason

