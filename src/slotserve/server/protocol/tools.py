"""Tools in a chat request: the definitions, the forced tool_choice, the calls a client
sends back, and the plan that constrains the output to a call."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

from pydantic import Field

from slotserve.server.protocol.errors import APIError
from slotserve.server.protocol.request_model import RequestModel
from slotserve.server.protocol.tool_parsers import parse_tool_calls
from slotserve.structured import StructuredOutputs


class FunctionCallIn(RequestModel):
    field_prefix = "messages.tool_calls.function."

    name: str
    arguments: str


class ToolCallIn(RequestModel):
    """A tool call of an earlier assistant turn, as a client sends it back."""

    field_prefix = "messages.tool_calls."

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def as_text(self) -> str:
        try:
            arguments = json.loads(self.function.arguments)
        except (ValueError, RecursionError):  # NOTE: "[" * 200000 nests too deep to parse
            arguments = self.function.arguments
        return json.dumps({"name": self.function.name, "arguments": arguments},
                          ensure_ascii=False)

    def as_template_dict(self) -> dict[str, Any]:
        """The call as HF's chat templates take it (vLLM's too): the arguments parsed into a
        dict (a template writes them with `tojson`); arguments that are not a JSON object
        stay text."""
        try:
            arguments = json.loads(self.function.arguments)
        except (ValueError, RecursionError):
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        call: dict[str, Any] = {"type": "function", "function": {
            "name": self.function.name, "arguments": arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call


class FunctionDefinition(RequestModel):
    """A function the model may call; the whole definition is given to the chat template
    (a template with a tools section shows name, description and parameters)."""

    field_prefix = "tools.function."

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(RequestModel):
    field_prefix = "tools."

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    field_prefix = "tool_choice.function."

    name: str


class NamedToolChoice(RequestModel):
    field_prefix = "tool_choice."

    type: Literal["function"]
    function: NamedFunction


AUTO_TOOLS_UNSUPPORTED = ("tool_choice 'auto' (the default with tools) is not supported for "
                          "this model (its chat template defines no tool-call format); use "
                          "'required', a named function or 'none'")


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a request's tool calls are produced.

    Forced (tool_choice "required" or a named function): the output is constrained to
    `spec`. name: the named function: the output is its arguments. None ("required"): the
    output is {"name": ..., "arguments": ...} for one of the tools.
    tool_choice "auto": `spec` and `name` are None, `call_format` names the chat template's
    tool-call format (tool_parsers.py): the model writes text, calls in that format or not,
    and the calls found in it become the answer's tool_calls.
    """

    spec: StructuredOutputs | None
    name: str | None
    call_format: str | None = None
    max_calls: int | None = None  # parallel_tool_calls false: 1 (the first call found)

    def parsed_calls(self, text: str) -> tuple[str | None, list]:
        """tool_choice "auto": (content, calls) of a finished output (tool_parsers'
        rules), at most `max_calls` of them."""
        content, calls = parse_tool_calls(text, self.call_format)
        return content, calls[:self.max_calls]

    def call_of(self, text: str) -> tuple[str, str] | None:
        """(function name, arguments as JSON text) of a finished output; None when the text
        is not a complete call (the output was cut short)."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if self.name is not None:  # NOTE: the text as generated (and as it was streamed)
            return self.name, text
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        return value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False)

    def answer_call(self, text: str, cut_by_length: bool) -> tuple[str, str] | None:
        """(function name, arguments) of a forced call's output, finished or cut short (as
        OpenAI answers a call cut by max_tokens, finish_reason "length"): the complete
        call; else a named function's arguments as generated, or, cut by length,
        "required"'s arguments as far as generated once its name is written; None where no
        name was written (or "required" ended otherwise: no call; its {"name": ...} wrapper
        is never the answer's text)."""
        call = self.call_of(text)
        if call is not None or self.call_format is not None:
            return call
        if self.name is not None:
            return self.name, text
        cut = _CUT_NAME.match(text) if cut_by_length else None
        if cut is None:
            return None
        arguments = _CUT_ARGUMENTS.match(cut[2])
        return json.loads(f'"{cut[1]}"'), arguments[1] if arguments else ""


# A "required" call cut short: {"name": "<complete>", "arguments": <as far as generated>
# (the grammar writes the schema's properties in order: name, then arguments).
_CUT_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"(.*)\Z', re.DOTALL)
_CUT_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*(.*)\Z', re.DOTALL)


def _parameters(function: FunctionDefinition) -> dict:
    """A function's argument schema (no `parameters`: any JSON object)."""
    return function.parameters if function.parameters is not None else {"type": "object"}


def tool_plan(tools: list[ToolDefinition] | None,
              choice: str | NamedToolChoice | None,
              call_format: str | None = None) -> ToolPlan | None:
    """How the request's tool calls are produced, or None (no tools, or tool_choice "none").

    call_format: the tool-call format of the chat template the request is rendered with
    (None: it defines none). APIError (400) for tool_choice "auto" without one, and for a
    tool_choice that names no tool."""
    if not tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    functions = {tool.function.name: tool.function for tool in tools}
    if len(functions) != len(tools):
        raise APIError("tools: two tools have the same function name", param="tools")
    if choice in (None, "auto"):  # NOTE: OpenAI's default with tools is "auto"
        if call_format is None:
            raise APIError(AUTO_TOOLS_UNSUPPORTED, param="tool_choice")
        return ToolPlan(None, None, call_format)
    if isinstance(choice, NamedToolChoice):
        function = functions.get(choice.function.name)
        if function is None:
            raise APIError(f"tool_choice names the function {choice.function.name!r}, "
                           f"which is not among the tools ({', '.join(functions)})",
                           param="tool_choice")
        return ToolPlan(_tool_spec(_parameters(function)), function.name)
    calls = [{"type": "object", "properties": {"name": {"enum": [name]},
                                               "arguments": _parameters(function)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, function in functions.items()]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return ToolPlan(_tool_spec(schema), None)


def _tool_spec(schema: dict) -> StructuredOutputs:
    try:
        return StructuredOutputs(json=schema)
    except ValueError as exc:
        raise APIError(f"tools: a function's parameters are not a JSON schema: {exc}",
                       param="tools") from exc
