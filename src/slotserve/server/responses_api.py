"""POST /v1/responses, stateless (OpenAI's Responses API) over the chat path: the request
becomes a chat request (protocol/responses_api.py) that the chat path renders, admits,
generates and stops; this module shapes its one completion as a Response object, whole or
as the Responses API's server-sent events (`event: <type>` + `data: {json}`, no [DONE]):

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta ..., response.output_text.done,
    response.content_part.done, response.output_item.done, response.completed (also when
    max_output_tokens cut it: its status is then "incomplete")

A forced tool call (tool_choice "required" or a named function) is a `function_call` output
item instead of the message (its arguments streamed as response.function_call_arguments.delta
for a named function; "required" sends the call whole when it is complete, as the chat path).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi.responses import StreamingResponse

from slotserve.engine.outputs import CompletionOutput, RequestOutput
from slotserve.server import protocol as p
from slotserve.server.answers import cut_by_length
from slotserve.server.protocol import APIError
from slotserve.server.protocol import responses_api as r

if TYPE_CHECKING:
    from slotserve.server.generation import Generation


def response_object(stream: Generation, finals: list[CompletionOutput],
                    body: r.ResponsesRequest, plan: p.ToolPlan | None, model_name: str
                    ) -> r.ResponseObject:
    """The whole answer: one output item (the message or the function call) and the usage."""
    c = finals[0]
    response = _response(stream, body, model_name, _status(c))
    response.output = [_output_item(c, plan, _item_ids(stream), _status(c))]
    response.usage = _usage(stream, finals)
    return response


def _response(stream: Generation, body: r.ResponsesRequest, model_name: str, status: str
              ) -> r.ResponseObject:
    response = r.ResponseObject.for_request(stream.request_id, model_name, body, status)
    if status == "incomplete":
        response.incomplete_details = r.IncompleteDetails(reason="max_output_tokens")
    return response


def _status(c: CompletionOutput) -> str:
    """"incomplete" when the output was cut by max_output_tokens (or the context)."""
    return "incomplete" if cut_by_length(c) else "completed"


def _item_ids(stream: Generation) -> tuple[str, str]:
    """(message or function-call item id, call id), derived from the response's id."""
    suffix = stream.request_id.split("_", 1)[-1]
    return f"msg_{suffix}", f"call_{suffix}"


def _output_item(c: CompletionOutput, plan: p.ToolPlan | None, ids: tuple[str, str],
                 status: str) -> r.OutputMessage | r.FunctionCallOutput:
    call = plan.answer_call(c.text, cut_by_length(c)) if plan is not None else None
    if call is None:  # NOTE: "required" cut before a name: no call, and no wrapper as text
        text = c.text if plan is None else ""
        return r.OutputMessage(id=ids[0], status=status, content=[r.OutputText(text=text)])
    return r.FunctionCallOutput(id=ids[0].replace("msg_", "fc_", 1), call_id=ids[1],
                                name=call[0], arguments=call[1], status=status)


def _usage(stream: Generation, finals: list[CompletionOutput]) -> r.ResponseUsage:
    usage = stream.usage(finals)
    return r.ResponseUsage.of(usage.prompt_tokens, usage.completion_tokens,
                              stream.cached_tokens)


# --------------------------------------------------------------------------- streaming
class _Events:
    """Numbers the events of one stream (sequence_number) and frames them."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.count, **fields}
        self.count += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def response_events(stream: Generation, first: RequestOutput, body: r.ResponsesRequest,
                          plan: p.ToolPlan | None, model_name: str) -> AsyncIterator[str]:
    """The Responses API's events for one streamed response (see the module docstring)."""
    event = _Events()
    start = _response(stream, body, model_name, "in_progress").model_dump()
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    ids = _item_ids(stream)
    if plan is None:
        pieces = _message_events(event, stream, first, ids)
    elif plan.name is not None:
        pieces = _named_call_events(event, stream, first, ids, plan.name)
    else:
        pieces = _required_call_events(event, stream, first, ids, plan)
    async for piece in pieces:
        yield piece
    # NOTE: response.completed also ends a response cut by max_output_tokens (its status
    # says "incomplete"), as vLLM's: the official client's stream helper needs that event
    final = response_object(stream, stream.finals, body, plan, model_name)
    yield event("response.completed", response=final.model_dump())


async def _message_events(event: _Events, stream: Generation, first: RequestOutput,
                          ids: tuple[str, str]) -> AsyncIterator[str]:
    item_id = ids[0]
    item = r.OutputMessage(id=item_id, status="in_progress", content=[])
    yield event("response.output_item.added", output_index=0, item=item.model_dump())
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield event("response.content_part.added", **where,
                part=r.OutputText(text="").model_dump())
    c = None
    async for c in stream.completions(first):
        if c.delta_text:
            yield event("response.output_text.delta", **where, delta=c.delta_text, logprobs=[])
    part = r.OutputText(text=c.text)
    yield event("response.output_text.done", **where, text=c.text, logprobs=[])
    yield event("response.content_part.done", **where, part=part.model_dump())
    done = r.OutputMessage(id=item_id, status=_status(c), content=[part])
    yield event("response.output_item.done", output_index=0, item=done.model_dump())


async def _named_call_events(event: _Events, stream: Generation, first: RequestOutput,
                             ids: tuple[str, str], name: str) -> AsyncIterator[str]:
    item_id = ids[0].replace("msg_", "fc_", 1)
    item = r.FunctionCallOutput(id=item_id, call_id=ids[1], name=name, arguments="",
                                status="in_progress")
    yield event("response.output_item.added", output_index=0, item=item.model_dump())
    c = None
    async for c in stream.completions(first):
        if c.delta_text:
            yield event("response.function_call_arguments.delta", item_id=item_id,
                        output_index=0, delta=c.delta_text)
    yield event("response.function_call_arguments.done", item_id=item_id, output_index=0,
                arguments=c.text)
    done = r.FunctionCallOutput(id=item_id, call_id=ids[1], name=name, arguments=c.text,
                                status=_status(c))
    yield event("response.output_item.done", output_index=0, item=done.model_dump())


async def _required_call_events(event: _Events, stream: Generation, first: RequestOutput,
                                ids: tuple[str, str], plan: p.ToolPlan) -> AsyncIterator[str]:
    """tool_choice "required": the function's name comes inside the output, so the item is
    sent whole once the output is complete: a function call, cut short or not
    (ToolPlan.answer_call), else an empty message."""
    await stream.drain(first)
    c = stream.finals[0]
    item = _output_item(c, plan, ids, _status(c))
    yield event("response.output_item.added", output_index=0,
                item=item.model_copy(update={"status": "in_progress"}).model_dump())
    if isinstance(item, r.FunctionCallOutput):
        where = {"item_id": item.id, "output_index": 0}
        yield event("response.function_call_arguments.delta", **where, delta=item.arguments)
        yield event("response.function_call_arguments.done", **where, arguments=item.arguments)
    else:
        where = {"item_id": item.id, "output_index": 0, "content_index": 0}
        yield event("response.content_part.added", **where,
                    part=r.OutputText(text="").model_dump())
        # NOTE: no call was written: an empty message (never the call's wrapper), no delta
        yield event("response.output_text.done", **where, text=item.content[0].text,
                    logprobs=[])
        yield event("response.content_part.done", **where, part=item.content[0].model_dump())
    yield event("response.output_item.done", output_index=0, item=item.model_dump())


def events_response(events: AsyncIterator[str], stream: Generation) -> StreamingResponse:
    return StreamingResponse(_event_lines(events, stream), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _event_lines(events: AsyncIterator[str], stream: Generation) -> AsyncIterator[str]:
    """The events, then an `error` event if the generation fails (the Responses API's)."""
    try:
        async for line in events:
            yield line
    except APIError as exc:
        error = {"type": "error", "code": exc.code or exc.type, "message": exc.message,
                 "param": exc.param}
        yield f"event: error\ndata: {json.dumps(error)}\n\n"
    finally:
        await events.aclose()
        await stream.aclose()  # NOTE: aborts the request if the stream ended early
