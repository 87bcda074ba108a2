"""OpenAI's Responses API (POST /v1/responses), stateless: the request body, its conversion
to a chat request (the chat path renders, generates and stops it), and the response object.

Nothing is stored: `previous_response_id` and `store: true` are 400s naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationError

from slotserve.server.protocol.errors import APIError
from slotserve.server.protocol.request_model import RequestModel
from slotserve.server.protocol.requests import (
    ChatCompletionRequest,
    CommonRequest,
    ModelNamed,
    SamplingFields,
)


class InputText(RequestModel):
    field_prefix = "input.content."

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(RequestModel):
    """A message of the conversation (EasyInputMessage or a message item)."""

    field_prefix = "input."

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def as_chat(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class FunctionCallItem(RequestModel):
    """A function call of an earlier turn, as the client sends it back."""

    field_prefix = "input."

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None

    def as_chat(self) -> dict:
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": self.call_id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments}}]}


class FunctionCallOutputItem(RequestModel):
    """A function's result for an earlier call."""

    field_prefix = "input."

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None

    def as_chat(self) -> dict:
        return {"role": "tool", "content": self.output}


class FunctionTool(RequestModel):
    """A function tool (the Responses API's flat shape)."""

    field_prefix = "tools."
    unused_fields = frozenset({"description"})

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters, "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items()
                                                 if v is not None}}


class NamedFunctionChoice(RequestModel):
    field_prefix = "tool_choice."

    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    """text.format: plain text, any JSON object, or a JSON schema (structured outputs)."""

    field_prefix = "text.format."
    unused_fields = frozenset({"description"})

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> dict | None:
        """The chat request's response_format (None: plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.schema_ is None:
            raise APIError("text.format.schema is required with type json_schema",
                           param="text.format.schema")
        return {"type": "json_schema", "json_schema": {
            "name": self.name or "response", "schema": self.schema_,
            **({"strict": self.strict} if self.strict is not None else {})}}


class TextConfig(RequestModel):
    field_prefix = "text."
    refused_fields: ClassVar[dict[str, tuple]] = {"verbosity": ("medium",)}

    format: TextFormat | None = None


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem
# The chat request's field names -> this API's (errors name the field the client sent).
CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                     "response_format": "text.format", "structured_outputs": "text.format"}


# Chat's and completions' names of what this API names otherwise, sent to it: a 400 saying
# so, never a value quietly dropped.
CHAT_NAMES = {**CHAT_TO_RESPONSES, "max_tokens": "max_output_tokens",
              "guided_json": "text.format"}


class ResponsesRequest(ModelNamed, SamplingFields):
    """POST /v1/responses (stateless). The sampling and scheduling extensions chat reads
    (SamplingFields: seed, stop, top_k, penalties, logit_bias, priority, ...) work as there."""

    refused_fields: ClassVar[dict[str, tuple]] = {
        "previous_response_id": (), "store": (False,), "background": (False,),
        "conversation": (), "prompt": (), "reasoning": (), "include": ([],),
        "truncation": ("disabled",), "max_tool_calls": (), "top_logprobs": (0,),
        "prompt_cache_retention": (), "n": (1,), "best_of": (1,), "logprobs": (False,),
        "echo": (False,), **dict.fromkeys(CHAT_NAMES, ()),
        # chat's other constraints and template variables, and what chat refuses too
        "guided_regex": (), "guided_choice": (), "guided_grammar": (),
        "chat_template_kwargs": (), **CommonRequest.refused_fields,
    }

    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        """APIError (400) naming the first refused field (previous_response_id, store: true,
        ...) or a text config's refused field."""
        refused = self.refused or (self.text.refused if self.text is not None else [])
        if not refused:
            return
        name = refused[0] if self.refused else f"text.{refused[0]}"
        why = (" (this server stores no responses: send the whole conversation as input)"
               if name in ("previous_response_id", "store", "conversation", "background")
               else f" (this API's is {CHAT_NAMES[name]})" if name in CHAT_NAMES
               else " (a response holds one answer)" if name in ("n", "best_of")
               else "")
        raise APIError(f"{name} is not supported by this server{why}", param=name,
                       code="unsupported_field")

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request that runs this one (same sampling, template, tools, schema), for
        a body that passed check()."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += [item.as_chat() for item in self.input]
        if not messages:
            raise APIError("input must hold at least one message", param="input")
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "temperature": self.temperature,
            "top_p": self.top_p, "max_completion_tokens": self.max_output_tokens,
            "user": self.user, "stream": bool(self.stream),
            **self.model_dump(include=set(SamplingFields.model_fields) & self.model_fields_set)}
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        if self.tools:
            body["tools"] = [tool.as_chat() for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice.name}}
        else:
            body["tool_choice"] = self.tool_choice
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise APIError(f"input: {exc.errors()[0].get('msg')}", param="input") from exc


def new_response_id() -> str:
    """`resp_<hex>`, OpenAI's form (item ids share the hex: msg_, fc_, call_)."""
    return f"resp_{uuid.uuid4().hex}"


def renamed(error: APIError) -> APIError:
    """A chat-path error in this API's terms (messages -> input, ...)."""
    param = error.param or ""
    head, _, tail = param.partition(".")
    new = CHAT_TO_RESPONSES.get(param) or CHAT_TO_RESPONSES.get(head)
    if new is None:
        return error
    new_param = f"{new}.{tail}" if tail and param not in CHAT_TO_RESPONSES else new
    message = error.message.replace(param, new_param, 1) if param else error.message
    message = message.replace("response_format.json_schema.schema", "text.format.schema", 1)
    return APIError(message, error.status, error.type, new_param, error.code, error.headers)


# --------------------------------------------------------------------------- the answer
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int) -> ResponseUsage:
        return cls(input_tokens=input_tokens, output_tokens=output_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                   total_tokens=input_tokens + output_tokens)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The Response object (what the official client's `Response` parses)."""

    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=lambda: float(int(time.time())))
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputMessage | FunctionCallOutput] = Field(default_factory=list)
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] = Field(default_factory=list)
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = False
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    previous_response_id: None = None
    store: bool = False
    usage: ResponseUsage | None = None

    @classmethod
    def for_request(cls, response_id: str, model: str, body: ResponsesRequest,
                    status: str) -> ResponseObject:
        """The response's fields that echo the request (its output and usage still empty)."""
        text = {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)} if (
            body.text is not None and body.text.format is not None) else None
        choice = body.tool_choice
        return cls(id=response_id, model=model, status=status,
                   instructions=body.instructions, max_output_tokens=body.max_output_tokens,
                   temperature=body.temperature, top_p=body.top_p,
                   tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
                   tool_choice=choice.model_dump() if isinstance(choice, BaseModel)
                   else choice or ("auto" if body.tools else "none"),
                   metadata=body.metadata or {}, **({"text": text} if text else {}))
