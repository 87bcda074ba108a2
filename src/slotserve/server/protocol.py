"""OpenAI API schemas (pydantic) and the conversions between them and the engine's types.

Requests validate strictly (no "5" for 5, no true for 1) and accept unknown fields, as
vLLM does, logging each ignored field name once (`IgnoredFields`). `to_sampling_params()`
turns a request into SamplingParams and raises `APIError` (HTTP 400) naming the offending
field; logprob helpers shape the engine's `list[dict[token_id, logprob]]` into OpenAI's two
response formats.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from slotserve.sampling import SamplingParams
from slotserve.structured import StructuredOutputs, from_response_format

# Chat requests without max_tokens / max_completion_tokens generate up to this many tokens;
# the engine also stops at the context limit (max_model_len), with finish_reason "length".
DEFAULT_CHAT_MAX_TOKENS = 1024
# Completions without max_tokens: 16, the OpenAI legacy default.
DEFAULT_COMPLETION_MAX_TOKENS = 16
MIN_LOGPROB = -9999.0
# Ignored request fields: the first this many distinct names are logged, each cut to this
# many characters (a client choosing the names cannot flood the log).
MAX_LOGGED_IGNORED_FIELDS = 64
MAX_IGNORED_FIELD_CHARS = 64

logger = logging.getLogger("slotserve.server")


class APIError(Exception):
    """An error answered with OpenAI's error body: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code)).model_dump()


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------- requests
class IgnoredFields:
    """Request fields the server ignored, each name logged once per process at WARNING
    (vLLM's message); requests that carry them are served as usual.

    NOTE: bounded: the first `max_names` distinct names (each cut to `max_chars`) are
    logged, then one line says that later ones are not. Thread-safe.
    """

    def __init__(self, max_names: int = MAX_LOGGED_IGNORED_FIELDS,
                 max_chars: int = MAX_IGNORED_FIELD_CHARS) -> None:
        self.max_names = max_names
        self.max_chars = max_chars
        self.logged: set[str] = set()
        self._full_noted = False
        self._lock = threading.Lock()

    def note(self, names: Iterable[str]) -> None:
        """Log the names not logged before (within the bound)."""
        new: list[str] = []
        now_full = False
        with self._lock:
            for name in names:
                name = name[:self.max_chars]
                if name in self.logged:
                    continue
                if len(self.logged) >= self.max_names:
                    now_full, self._full_noted = not self._full_noted, True
                    break
                self.logged.add(name)
                new.append(name)
        if new:  # NOTE: repr() escapes control characters (no forged log lines)
            logger.warning("The following fields were present in the request but ignored: "
                           "{%s}", ", ".join(map(repr, new)))
        if now_full:
            logger.warning("more than %d distinct ignored request fields: later ones are not "
                           "logged", self.max_names)


IGNORED_FIELDS = IgnoredFields()


class _RequestModel(BaseModel):
    """A request body or a part of one: strict types; fields it does not declare, and the
    declared ones in `unused_fields` when set, are ignored and reported to IGNORED_FIELDS
    (as `<field_prefix><name>`)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    unused_fields: ClassVar[frozenset[str]] = frozenset()
    field_prefix: ClassVar[str] = ""

    @model_validator(mode="wrap")
    @classmethod
    def _report_ignored(cls, data: Any, handler):
        model = handler(data)  # NOTE: an invalid body is a 400; nothing to report
        if isinstance(data, dict):
            ignored = [name for name, value in data.items() if name not in cls.model_fields
                       or (name in cls.unused_fields and value is not None)]
            if ignored:
                IGNORED_FIELDS.note(f"{cls.field_prefix}{name}" for name in ignored)
        return model


class StreamOptions(_RequestModel):
    """include_usage: a last chunk with the usage; continuous_usage_stats (vLLM's, with
    include_usage): every chunk also carries the usage so far."""

    field_prefix = "stream_options."

    include_usage: bool = False
    continuous_usage_stats: bool = False


PRIORITY_BOUND = 2**31 - 1  # |priority| at most this (vLLM's is an int32 in practice)
MAX_USER_CHARS = 256  # OpenAI's `user` (a tenant name: a metrics label, a log field)


class _Request(_RequestModel):
    """Fields both endpoints share (vLLM's names for the extensions)."""

    model: str | None = None  # None: the served model (vLLM's leniency)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    min_p: float | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    min_tokens: int | None = None  # extension: no stop (EOS, stop strings) before this many
    presence_penalty: float | None = None  # only 0 / absent
    frequency_penalty: float | None = None  # only 0 / absent
    logit_bias: dict[str, float] | None = None  # only empty / absent
    # extension (vLLM's): requests with different salts never share prefix-cache blocks
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Scheduling (--scheduling-policy). priority: vLLM's, lower first (only `priority` and
    # `fair`'s order within a tenant read it). slo_ttft_ms / slo_tpot_ms: extensions, this
    # request's SLOs in milliseconds over the server's --slo-ttft-ms / --slo-tpot-ms.
    # user: OpenAI's end-user id, the request's tenant when the server has no API keys.
    priority: int = Field(default=0, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)
    slo_ttft_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    slo_tpot_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)

    def _sampling_params(self, max_tokens: int, logprobs: int | None,
                         renames: dict[str, str], max_tokens_cap: int | None) -> SamplingParams:
        self._reject_unsupported()
        _check_cap(max_tokens, max_tokens_cap, renames.get("max_tokens", "max_tokens"))
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
                min_tokens=0 if self.min_tokens is None else self.min_tokens,
                logprobs=logprobs, n=1 if self.n is None else self.n)
        except ValueError as exc:
            raise invalid_request(str(exc), renames) from exc

    def check_stop(self, max_strings: int | None, max_chars: int | None) -> None:
        """APIError (400, param "stop") past the server's bounds on stop strings: their
        count and each one's length (every generated token is matched against them, and the
        stream holds back as much text as the longest one)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if max_strings is not None and len(stops) > max_strings:
            raise APIError(f"stop: at most {max_strings} stop strings on this server "
                           f"(--max-stop-strings), got {len(stops)}", param="stop",
                           code="stop_limit_exceeded")
        longest = max(map(len, stops), default=0)
        if max_chars is not None and longest > max_chars:
            raise APIError(f"stop: each stop string may have at most {max_chars} characters "
                           f"on this server (--max-stop-chars), got one of {longest}",
                           param="stop", code="stop_limit_exceeded")

    def _reject_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported (use 0 or leave it out)", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every stream chunk carries the usage so far (include_usage and
        continuous_usage_stats, as vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class _StructuredFields(_RequestModel):
    """The ways to constrain the output (exactly one at most): OpenAI's `response_format`,
    vLLM's `structured_outputs` ({json | regex | choice | grammar | json_object}) and its
    older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_spec(self) -> tuple[StructuredOutputs | None, str | None]:
        """(what the output must match, the request field that says so); (None, None) when
        unconstrained. APIError (400) naming the field when it is malformed or when more than
        one field constrains the output."""
        found = []
        for param in ("response_format", "structured_outputs", *_GUIDED):
            value = getattr(self, param)
            if value is None:
                continue
            try:
                spec = _structured_from(param, value)
            except ValueError as exc:
                raise APIError(_renamed(str(exc), param), param=param) from exc
            if spec is not None:
                found.append((spec, param))
        if len(found) > 1:
            names = ", ".join(param for _, param in found)
            raise APIError(f"only one of response_format, structured_outputs and guided_* "
                           f"may constrain the output; got {names}", param=found[1][1])
        return found[0] if found else (None, None)


# guided_* field -> the StructuredOutputs field it sets (vLLM's older names)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _structured_from(param: str, value: Any) -> StructuredOutputs | None:
    if param == "response_format":
        return from_response_format(value)
    if param == "structured_outputs":
        return StructuredOutputs.from_dict(value)
    return StructuredOutputs(**{_GUIDED[param]: value})


def _renamed(message: str, param: str) -> str:
    """A StructuredOutputs message ("structured_outputs.json: ...") in the request's terms."""
    if param in _GUIDED:
        return message.replace(f"structured_outputs.{_GUIDED[param]}", param, 1)
    return message


def structured_error(message: str, param: str) -> APIError:
    """The grammar engine rejected a request's constraint (ValueError "structured_outputs.
    <kind>: ..."): a 400 naming the request field that carried it."""
    prefix, _, rest = message.partition(":")
    if param == "response_format" and prefix == "structured_outputs.json":
        message = f"response_format.json_schema.schema:{rest}"
    elif param in _GUIDED:
        message = _renamed(message, param)
    elif param == "structured_outputs" or not prefix.startswith("structured_outputs"):
        pass
    else:  # tools: the schema built from the tools' parameters
        message = f"{param}: the function parameters schema was rejected:{rest}"
    return APIError(message, param=param)


def with_structured(params: SamplingParams, spec: StructuredOutputs | None) -> SamplingParams:
    """`params` constrained to `spec` (unchanged when None)."""
    if spec is None:
        return params
    return dataclasses.replace(params, structured_outputs=spec)


class CompletionRequest(_Request, _StructuredFields):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a list of one of those."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def engine_prompt(self) -> str | list[int]:
        """The one prompt to run (batches of prompts are refused: send one request each)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError("a batch of prompts is not supported; send one prompt per "
                               "request", param="prompt")
            prompt = prompt[0]
        return prompt

    def to_sampling_params(self, max_tokens_cap: int | None = None) -> SamplingParams:
        """SamplingParams, or APIError (400) naming the field; max_tokens_cap: the server's
        bound on max_tokens (it also caps the default)."""
        if self.echo:
            raise APIError("echo is not supported", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of not in (None, 1, self.n):
            raise APIError("best_of is not supported (leave it out or set it to n)",
                           param="best_of")
        max_tokens = self.max_tokens
        if max_tokens is None or "max_tokens" not in self.model_fields_set:
            max_tokens = _capped(DEFAULT_COMPLETION_MAX_TOKENS, max_tokens_cap)
        params = self._sampling_params(max_tokens, self.logprobs, {}, max_tokens_cap)
        return with_structured(params, self.structured_spec()[0])


class TextPart(_RequestModel):
    field_prefix = "messages.content."

    type: Literal["text"]
    text: str


class FunctionCallIn(_RequestModel):
    field_prefix = "messages.tool_calls.function."

    name: str
    arguments: str


class ToolCallIn(_RequestModel):
    """A tool call of an earlier assistant turn, as a client sends it back."""

    field_prefix = "messages.tool_calls."

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def as_text(self) -> str:
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return json.dumps({"name": self.function.name, "arguments": arguments},
                          ensure_ascii=False)


class ChatMessage(_RequestModel):
    field_prefix = "messages."
    unused_fields = frozenset({"name"})  # NOTE: the chat template is given role and content

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools

    def as_template_dict(self) -> dict[str, str]:
        """{role, content} with text parts joined (what chat templates expect). An assistant
        turn's tool calls, which templates without a tool format cannot show, are written
        as the JSON the model was constrained to ({"name": ..., "arguments": {...}})."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        if self.tool_calls and not content:
            content = "\n".join(call.as_text() for call in self.tool_calls)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class FunctionDefinition(_RequestModel):
    field_prefix = "tools.function."
    unused_fields = frozenset({"description"})  # NOTE: only the parameters constrain the output

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_RequestModel):
    field_prefix = "tools."

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_RequestModel):
    field_prefix = "tool_choice.function."

    name: str


class NamedToolChoice(_RequestModel):
    field_prefix = "tool_choice."

    type: Literal["function"]
    function: NamedFunction


AUTO_TOOLS_UNSUPPORTED = ("tool_choice 'auto' is not supported for this model; use 'required' "
                          "or a named function")


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a request's tool call is produced: the output is constrained to `spec`.

    name: the named function (tool_choice {"type": "function", ...}): the output is its
    arguments. None (tool_choice "required"): the output is {"name": ..., "arguments": ...}
    for one of the tools.
    """

    spec: StructuredOutputs
    name: str | None

    def call_of(self, text: str) -> tuple[str, str] | None:
        """(function name, arguments as JSON text) of a finished output; None when the text
        is not a complete call (the output was cut short)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.name is not None:  # NOTE: the text as generated (and as it was streamed)
            return self.name, text
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        return value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False)


def _parameters(function: FunctionDefinition) -> dict:
    """A function's argument schema (no `parameters`: any JSON object)."""
    return function.parameters if function.parameters is not None else {"type": "object"}


class ChatCompletionRequest(_Request, _StructuredFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def to_sampling_params(self, max_tokens_cap: int | None = None) -> SamplingParams:
        """SamplingParams, or APIError (400) naming the field (as to CompletionRequest's)."""
        spec, _ = self.structured_spec()
        plan = self.tool_plan()
        if plan is not None and spec is not None:
            raise APIError("a tool call and response_format / structured_outputs cannot be "
                           "asked together", param="tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        renames = {"logprobs": "top_logprobs",
                   "max_tokens": "max_completion_tokens" if self.max_completion_tokens
                   is not None else "max_tokens"}
        max_tokens = self.chat_max_tokens
        if self.max_completion_tokens is None and self.max_tokens is None:
            max_tokens = _capped(max_tokens, max_tokens_cap)
        params = self._sampling_params(max_tokens, logprobs, renames, max_tokens_cap)
        return with_structured(params, plan.spec if plan is not None else spec)

    def constraint_param(self) -> str | None:
        """The request field whose constraint the output follows (for error messages)."""
        if self.tool_plan() is not None:
            return "tools"
        return self.structured_spec()[1]

    def tool_plan(self) -> ToolPlan | None:
        """The forced tool call, or None (no tools, or tool_choice "none"). APIError (400) for
        tool_choice "auto" (this server has no tool-call parser for free text) and for a
        tool_choice that names no tool."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise APIError("tool_choice needs tools", param="tool_choice")
            return None
        if choice == "none":
            return None
        if choice in (None, "auto"):  # NOTE: OpenAI's default with tools is "auto"
            raise APIError(AUTO_TOOLS_UNSUPPORTED, param="tool_choice")
        functions = {tool.function.name: tool.function for tool in self.tools}
        if len(functions) != len(self.tools):
            raise APIError("tools: two tools have the same function name", param="tools")
        if isinstance(choice, NamedToolChoice):
            function = functions.get(choice.function.name)
            if function is None:
                raise APIError(f"tool_choice names the function {choice.function.name!r}, "
                               f"which is not among the tools ({', '.join(functions)})",
                               param="tool_choice")
            return ToolPlan(self._tool_spec(_parameters(function)), function.name)
        calls = [{"type": "object", "properties": {"name": {"enum": [name]},
                                                   "arguments": _parameters(function)},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, function in functions.items()]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return ToolPlan(self._tool_spec(schema), None)

    @staticmethod
    def _tool_spec(schema: dict) -> StructuredOutputs:
        try:
            return StructuredOutputs(json=schema)
        except ValueError as exc:
            raise APIError(f"tools: a function's parameters are not a JSON schema: {exc}",
                           param="tools") from exc

    @property
    def chat_max_tokens(self) -> int:
        """max_completion_tokens, else max_tokens, else DEFAULT_CHAT_MAX_TOKENS."""
        for value in (self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return value
        return DEFAULT_CHAT_MAX_TOKENS

    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_dict() for m in self.messages]


def _capped(default: int, cap: int | None) -> int:
    return default if cap is None else min(default, cap)


def _check_cap(max_tokens: int, cap: int | None, param: str) -> None:
    """A max_tokens above the server's cap is refused (400), not silently lowered."""
    if cap is not None and isinstance(max_tokens, int) and max_tokens > cap:
        raise APIError(f"{param} must be at most {cap} on this server (--max-tokens-cap), "
                       f"got {max_tokens}", param=param, code="max_tokens_exceeded")


def invalid_request(message: str, renames: dict[str, str] | None = None) -> APIError:
    """A 400 from a ValueError whose message starts with the field name (SamplingParams')."""
    first = message.split(" ", 1)[0].rstrip(":")
    known = set(SamplingParams.__dataclass_fields__) | {"prompt"}
    first = first if first in known else first.split(".", 1)[0]  # "structured_outputs.json"
    param = first if first in known else None
    if param is not None and renames and param in renames:
        param = renames[param]
        message = f"{param} {message.split(' ', 1)[1]}" if " " in message else message
    return APIError(message, param=param)


# --------------------------------------------------------------------------- responses
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache (not computed again)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int,
           cached_tokens: int | None = None) -> UsageInfo:
        """cached_tokens: None leaves prompt_tokens_details out."""
        details = None if cached_tokens is None else PromptTokensDetails(
            cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=details)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class _Response(BaseModel):
    """The envelope of every completion and chat response and stream chunk.

    NOTE: subclasses narrow `object`, `choices` and `usage`; a redeclared field keeps the
    position it has here, so every response's JSON keys come in this (OpenAI's) order.
    """

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list
    usage: UsageInfo | None = None


class CompletionResponse(_Response):  # also each stream chunk of a completion
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: new_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(BaseModel):
    """One piece of a streamed tool call (OpenAI's shape: the first carries id, type and
    the function's name; the later ones more of its arguments)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "slotserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_RequestModel):
    """POST /tokenize (vLLM's): a `prompt`, or `messages` rendered with the chat template."""


    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("send exactly one of prompt and messages", param="prompt")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_RequestModel):
    """POST /detokenize (vLLM's)."""


    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- logprobs
@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: vocabulary character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for.

    Byte-level BPE spellings ("ĠParis") map back exactly; other vocabularies fall back to
    the UTF-8 of the token decoded alone.
    """
    spelling = tokenizer.id_to_token(token_id) if tokenizer is not None else None
    if spelling is None:
        return b""
    decoder = _byte_decoder()
    if all(ch in decoder for ch in spelling):
        return bytes(decoder[ch] for ch in spelling)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


def token_text(tokenizer, token_id: int) -> str:
    """A token as text (U+FFFD where it holds part of a UTF-8 character)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                        offset: int = 0) -> CompletionLogprobs:
    """The legacy completions shape. offset: text position of the first token."""
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs):
        text = token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.token_logprobs.append(_logprob(entry, token_id))
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        result.top_logprobs.append({token_text(tokenizer, t): _finite(lp) for t, lp in ranked})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                  top_n: int) -> ChatLogprobs:
    """The chat shape: each sampled token with its `top_n` most likely alternatives."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(ChatTokenLogprob(
            **_top_logprob(tokenizer, token_id, _logprob(entry, token_id)),
            top_logprobs=[TopLogprob(**_top_logprob(tokenizer, t, lp)) for t, lp in ranked]))
    return ChatLogprobs(content=content)


def _top_logprob(tokenizer, token_id: int, logprob: float) -> dict:
    logprob = _finite(logprob)
    raw = token_bytes(tokenizer, token_id) if tokenizer is not None else b""
    return {"token": token_text(tokenizer, token_id), "logprob": logprob, "bytes": list(raw)}


def _logprob(entry: dict[int, float], token_id: int) -> float:
    return _finite(entry.get(token_id, MIN_LOGPROB))


def _finite(logprob: float) -> float:
    """JSON has no -inf: clamp to MIN_LOGPROB (vLLM's convention)."""
    return max(logprob, MIN_LOGPROB)
