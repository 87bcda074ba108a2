"""The request bodies: /v1/completions, /v1/chat/completions, /tokenize, /detokenize,
and their conversion to the engine's SamplingParams."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, model_validator

from slotserve.config import MAX_SLO_MS
from slotserve.sampling import SamplingParams
from slotserve.server.protocol.errors import APIError, invalid_request
from slotserve.server.protocol.request_model import RequestModel
from slotserve.server.protocol.structured import StructuredFields, with_structured
from slotserve.server.protocol.tools import (
    NamedToolChoice,
    ToolCallIn,
    ToolDefinition,
    ToolPlan,
    tool_plan,
)

# Chat requests without max_tokens / max_completion_tokens generate up to this many tokens;
# the engine also stops at the context limit (max_model_len), with finish_reason "length".
DEFAULT_CHAT_MAX_TOKENS = 1024
# Completions without max_tokens: 16, the OpenAI legacy default.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class StreamOptions(RequestModel):
    """include_usage: a last chunk with the usage; continuous_usage_stats (vLLM's, with
    include_usage): every chunk also carries the usage so far."""

    field_prefix = "stream_options."

    include_usage: bool = False
    continuous_usage_stats: bool = False


PRIORITY_BOUND = 2**31 - 1  # |priority| at most this (vLLM's is an int32 in practice)
MAX_USER_CHARS = 256  # OpenAI's `user` (a tenant name: a metrics label, a log field)


class ModelNamed(RequestModel):
    """A request that may name the model it is for."""

    model: str | None = None  # None: the served model (vLLM's leniency)


class SamplingFields(RequestModel):
    """The sampling and scheduling fields every generation API reads as chat does (the
    Responses API passes the ones its body sets on to its chat request); vLLM's names for
    the extensions."""

    top_k: int | None = None  # extension
    min_p: float | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM's): token ids that end a choice
    ignore_eos: bool = False  # extension
    min_tokens: int | None = None  # extension: no stop (EOS, stop strings) before this many
    # Penalties and logit shaping (see SamplingParams): OpenAI's, and vLLM's extensions
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string of digits) -> bias
    repetition_penalty: float | None = None  # extension
    allowed_token_ids: list[int] | None = None  # extension
    bad_words: list[str] | None = None  # extension
    skip_special_tokens: bool = True  # extension: special tokens left out of the text
    # extension (vLLM's): requests with different salts never share prefix-cache blocks
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Scheduling (--scheduling-policy). priority: vLLM's, lower first (only `priority` and
    # `fair`'s order within a tenant read it). slo_ttft_ms / slo_tpot_ms: extensions, this
    # request's SLOs in milliseconds over the server's --slo-ttft-ms / --slo-tpot-ms.
    priority: int = Field(default=0, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)
    slo_ttft_ms: float | None = Field(default=None, gt=0, le=MAX_SLO_MS, allow_inf_nan=False)
    slo_tpot_ms: float | None = Field(default=None, gt=0, le=MAX_SLO_MS, allow_inf_nan=False)


class CommonRequest(ModelNamed, SamplingFields):
    """Fields both generation endpoints share (vLLM's names for the extensions)."""

    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    best_of: int | None = None  # 400 unless 1 or n
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # OpenAI's end-user id, the request's tenant when the server has no API keys
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)

    # Known fields this server does not implement: a 400 naming the field unless absent, null
    # or the value that changes nothing (see RequestModel.refused_fields).
    refused_fields: ClassVar[dict[str, tuple]] = {
        "use_beam_search": (False,), "length_penalty": (1, 1.0), "early_stopping": (False,),
        "include_stop_str_in_output": (False,), "truncate_prompt_tokens": (),
        "spaces_between_special_tokens": (True,),
        "guided_whitespace_pattern": (), "logits_processors": (), "logits_processor_pattern": (),
        "return_tokens_as_token_ids": (False,), "return_token_ids": (False,),
        "bad_words_token_ids": (), "detokenize": (True,),
    }

    def _sampling_params(self, max_tokens: int, logprobs: int | None,
                         renames: dict[str, str], max_tokens_cap: int | None) -> SamplingParams:
        self._reject_unsupported()
        if self.best_of not in (None, 1, self.n):
            raise APIError("best_of is not supported (leave it out or set it to n)",
                           param="best_of")
        _check_cap(max_tokens, max_tokens_cap, renames.get("max_tokens", "max_tokens"))
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                min_tokens=0 if self.min_tokens is None else self.min_tokens,
                logprobs=logprobs, n=1 if self.n is None else self.n,
                skip_special_tokens=self.skip_special_tokens, **self._shaping_fields())
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

    def _shaping_fields(self) -> dict:
        """The penalties and logit shaping the body sets, as SamplingParams keywords."""
        fields = {"presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty,
                  "repetition_penalty": self.repetition_penalty, "logit_bias": self.logit_bias,
                  "allowed_token_ids": self.allowed_token_ids, "bad_words": self.bad_words}
        return {name: value for name, value in fields.items() if value is not None}

    def _reject_unsupported(self) -> None:
        if self.refused:
            name = self.refused[0]
            harmless = self.refused_fields[name]
            allowed = " or ".join(f"{v!r}".lower() if isinstance(v, bool) else repr(v)
                                  for v in harmless[:1])
            raise APIError(f"{name} is not supported by this server (leave it out"
                           f"{' or set it to ' + allowed if allowed else ''})", param=name,
                           code="unsupported_field")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every stream chunk carries the usage so far (include_usage and
        continuous_usage_stats, as vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(CommonRequest, StructuredFields):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a list of either
    (one choice per prompt and per n, OpenAI's order: prompt i's j-th is choice i x n + j).

    echo: the answer's text starts with the prompt's (with logprobs: the prompt tokens'
    logprobs too, the first one null, as OpenAI's). prompt_logprobs (vLLM's): the top N at
    every prompt position, in each choice's `prompt_logprobs`. echo with max_tokens 0
    (OpenAI's and vLLM's way to score a text): the prompt, and its logprobs when asked, is
    the whole answer; nothing is generated (`echo_only`).
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    refused_fields: ClassVar[dict[str, tuple]] = {
        **CommonRequest.refused_fields, "add_special_tokens": (True,), "prompt_embeds": ()}
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool | None = False
    prompt_logprobs: int | None = None  # extension (vLLM's)
    suffix: str | None = None

    def engine_prompts(self, max_prompts: int | None = None) -> list[str | list[int]]:
        """The prompts to run, each a string or a list of token ids. APIError (400, param
        "prompt") for an empty list or more than `max_prompts` prompts."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError("prompt must not be empty (a string, token ids, or a list of "
                           "either)", param="prompt")
        if not isinstance(prompt[0], (str, list)):
            return [prompt]  # one prompt of token ids
        if max_prompts is not None and len(prompt) > max_prompts:
            raise APIError(f"prompt: at most {max_prompts} prompts per request on this server "
                           f"(--max-prompts), got {len(prompt)}", param="prompt",
                           code="prompt_limit_exceeded")
        return list(prompt)

    @property
    def num_prompts(self) -> int:
        """How many prompts the body holds (before any check)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return len(prompt)
        return 1

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt (and its logprobs), no output.

        NOTE: the engine runs such a request with max_tokens 1 (its prefill computes the
        prompt's logprobs) and the answer leaves that token out (text, logprobs, usage)."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def echo_logprobs(self) -> bool:
        """The answer carries the prompt tokens' logprobs (echo with logprobs)."""
        return bool(self.echo) and self.logprobs is not None

    def _prompt_logprobs(self) -> int | None:
        """The top N the engine computes at each prompt position: prompt_logprobs, and
        echo's logprobs (the larger of the two when both are asked)."""
        wanted = [n for n in (self.prompt_logprobs,
                              self.logprobs if self.echo_logprobs else None) if n is not None]
        return max(wanted) if wanted else None

    def to_sampling_params(self, max_tokens_cap: int | None = None,
                           default_max_tokens: int | None = None) -> SamplingParams:
        """SamplingParams, or APIError (400) naming the field; max_tokens_cap: the server's
        bound on max_tokens (it also caps the default); default_max_tokens: the max_tokens
        of a request that names none (None: DEFAULT_COMPLETION_MAX_TOKENS)."""
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        max_tokens = self.max_tokens
        if max_tokens is None or "max_tokens" not in self.model_fields_set:
            max_tokens = _capped(default_max_tokens or DEFAULT_COMPLETION_MAX_TOKENS,
                                 max_tokens_cap)
        if max_tokens == 0:
            max_tokens = self._echo_only_max_tokens()
        params = self._sampling_params(max_tokens, self.logprobs, {}, max_tokens_cap)
        params = with_prompt_logprobs(params, self.prompt_logprobs)  # NOTE: checks it first
        params = with_prompt_logprobs(params, self._prompt_logprobs())
        return with_structured(params, self.structured_spec()[0])

    def _echo_only_max_tokens(self) -> int:
        """The engine's max_tokens for max_tokens 0 (see echo_only): 1, with echo; else
        APIError (400) naming max_tokens, or min_tokens when it asks for output."""
        if not self.echo:
            raise APIError("max_tokens must be at least 1 (0 only with echo: the prompt "
                           "scored, nothing generated)", param="max_tokens")
        if self.min_tokens:
            raise APIError(f"min_tokens must be 0 with max_tokens 0 (echo without "
                           f"generation), got {self.min_tokens}", param="min_tokens")
        return 1


class TextPart(RequestModel):
    field_prefix = "messages.content."

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "text"):
            raise ValueError(f"content parts of type {str(data['type'])[:32]!r} are not "
                             "supported: this server reads text parts only")
        return data


class ChatMessage(RequestModel):
    field_prefix = "messages."
    unused_fields = frozenset({"name"})  # NOTE: the chat template is given role and content

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # NOTE: the list first: a part that is not text is named in the error (not "Input
    # should be a valid string", the other branch's)
    content: list[TextPart] | str | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        """Every turn but the assistant's (which may hold only tool calls) has content, as
        OpenAI requires."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def as_template_dict(self, structured_tool_calls: bool = False) -> dict[str, Any]:
        """{role, content} with text parts joined (what chat templates expect).

        An assistant turn's tool calls: with `structured_tool_calls` (a template that shows
        them, e.g. Qwen's) as HF's and vLLM's templates take them, `tool_calls` with each
        call's arguments parsed into a dict, and a tool turn's `tool_call_id`; otherwise
        (a template without a tool format) written into the content as the JSON the model
        was constrained to ({"name": ..., "arguments": {...}}).
        """
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        if structured_tool_calls:
            message: dict[str, Any] = {"role": role, "content": content or ""}
            if self.tool_calls:
                message["tool_calls"] = [call.as_template_dict() for call in self.tool_calls]
            if self.tool_call_id is not None:
                message["tool_call_id"] = self.tool_call_id
            return message
        if self.tool_calls and not content:
            content = "\n".join(call.as_text() for call in self.tool_calls)
        return {"role": role, "content": content or ""}


# chat_template_kwargs (vLLM's): extra variables for the chat template, e.g. Qwen3's
# {"enable_thinking": false}. Bounded: this many bytes as compact JSON, this deep.
MAX_CHAT_TEMPLATE_KWARGS_BYTES = 16 * 1024
MAX_CHAT_TEMPLATE_KWARGS_DEPTH = 8
# The template's own variables: set by the server (or by other request fields), never by
# chat_template_kwargs.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "add_generation_prompt", "tools", "documents", "chat_template", "tokenize",
    "continue_final_message", "bos_token", "eos_token", "raise_exception", "strftime_now"})
_TEMPLATE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def check_chat_template_kwargs(kwargs: dict[str, Any]) -> None:
    """APIError (400, param "chat_template_kwargs") unless every key is a template variable
    name (an identifier, not one of RESERVED_TEMPLATE_VARIABLES) and the whole is at most
    MAX_CHAT_TEMPLATE_KWARGS_BYTES of JSON, nested at most MAX_CHAT_TEMPLATE_KWARGS_DEPTH."""
    def refuse(why: str) -> APIError:
        return APIError(f"chat_template_kwargs: {why}", param="chat_template_kwargs")

    for key in kwargs:
        if not _TEMPLATE_VARIABLE.fullmatch(key):
            raise refuse(f"{key[:64]!r} is not a template variable name (letters, digits "
                         "and _, not starting with a digit, at most 64 characters)")
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise refuse(f"{key!r} is set by the server, not by chat_template_kwargs")
    if _depth(kwargs) > MAX_CHAT_TEMPLATE_KWARGS_DEPTH:
        raise refuse(f"nested more than {MAX_CHAT_TEMPLATE_KWARGS_DEPTH} levels deep")
    size = len(json.dumps(kwargs, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass"))
    if size > MAX_CHAT_TEMPLATE_KWARGS_BYTES:
        raise refuse(f"at most {MAX_CHAT_TEMPLATE_KWARGS_BYTES} bytes of JSON, got {size}")


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in a JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = (item.values() if isinstance(item, dict) else item
                    if isinstance(item, list) else None)
        if children is None:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_CHAT_TEMPLATE_KWARGS_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


class ChatCompletionRequest(CommonRequest, StructuredFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    refused_fields: ClassVar[dict[str, tuple]] = {
        **CommonRequest.refused_fields, "add_special_tokens": (False,), "echo": (False,),
        "prompt_logprobs": (),
        "add_generation_prompt": (True,), "continue_final_message": (False,),
        "chat_template": (), "documents": (),
        "mm_processor_kwargs": (), "functions": (), "function_call": (),
        "modalities": (["text"],), "audio": (), "reasoning_effort": (), "verbosity": (),
        "web_search_options": (),
    }
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM's)
    # false: at most one tool call in the answer (tool_choice "auto": the first the model
    # wrote, as vLLM's maybe_filter_parallel_tool_calls; a forced call is one anyway)
    parallel_tool_calls: bool | None = None
    # The tool-call format of the template this request is rendered with (the server sets
    # it, `use_tool_call_format`): tool_choice "auto" parses calls in it from the output.
    _tool_call_format: str | None = PrivateAttr(default=None)

    def use_tool_call_format(self, name: str | None) -> None:
        """The server's chat template defines tool calls in format `name` (None: none)."""
        self._tool_call_format = name

    def to_sampling_params(self, max_tokens_cap: int | None = None,
                           default_max_tokens: int | None = None) -> SamplingParams:
        """SamplingParams, or APIError (400) naming the field (as CompletionRequest's;
        default_max_tokens None: DEFAULT_CHAT_MAX_TOKENS)."""
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
            max_tokens = _capped(default_max_tokens or max_tokens, max_tokens_cap)
        params = self._sampling_params(max_tokens, logprobs, renames, max_tokens_cap)
        return with_structured(params, plan.spec if plan is not None else spec)

    def constraint_param(self) -> str | None:
        """The request field whose constraint the output follows (for error messages)."""
        plan = self.tool_plan()
        if plan is not None and plan.spec is not None:
            return "tools"
        return self.structured_spec()[1]

    def tool_plan(self) -> ToolPlan | None:
        """How the output becomes tool calls, or None (see tools.tool_plan)."""
        plan = tool_plan(self.tools, self.tool_choice, self._tool_call_format)
        if plan is not None and self.parallel_tool_calls is False:
            plan = dataclasses.replace(plan, max_calls=1)
        return plan

    @property
    def chat_max_tokens(self) -> int:
        """max_completion_tokens, else max_tokens, else DEFAULT_CHAT_MAX_TOKENS."""
        for value in (self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return value
        return DEFAULT_CHAT_MAX_TOKENS

    def template_messages(self, structured_tool_calls: bool = False) -> list[dict[str, Any]]:
        """The messages as the chat template gets them (see ChatMessage.as_template_dict)."""
        return [m.as_template_dict(structured_tool_calls) for m in self.messages]

    def template_kwargs(self) -> dict[str, Any]:
        """The template's variables beyond messages: `tools` (as HF's and vLLM's templates
        take them, when the request has tools) and chat_template_kwargs (checked: APIError
        400 naming the field)."""
        kwargs = dict(self.chat_template_kwargs or {})
        check_chat_template_kwargs(kwargs)
        if self.tools and self.tool_choice != "none":
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return kwargs


def with_prompt_logprobs(params: SamplingParams, top_n: int | None) -> SamplingParams:
    """`params` computing the prompt's logprobs (top_n at each position); unchanged when
    None. APIError (400, param "prompt_logprobs") for a bad value."""
    if top_n is None:
        return params
    try:
        return dataclasses.replace(params, prompt_logprobs=top_n)
    except ValueError as exc:
        raise invalid_request(str(exc)) from exc


def _capped(default: int, cap: int | None) -> int:
    return default if cap is None else min(default, cap)


def _check_cap(max_tokens: int, cap: int | None, param: str) -> None:
    """A max_tokens above the server's cap is refused (400), not silently lowered."""
    if cap is not None and isinstance(max_tokens, int) and max_tokens > cap:
        raise APIError(f"{param} must be at most {cap} on this server (--max-tokens-cap), "
                       f"got {max_tokens}", param=param, code="max_tokens_exceeded")


class TokenizeRequest(ModelNamed):
    """POST /tokenize (vLLM's): a `prompt`, or `messages` rendered with the chat template
    (with `tools` and `chat_template_kwargs` as a chat request renders them)."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("send exactly one of prompt and messages", param="prompt")

    def template_kwargs(self) -> dict[str, Any]:
        """The template's variables beyond messages (as ChatCompletionRequest's)."""
        kwargs = dict(self.chat_template_kwargs or {})
        check_chat_template_kwargs(kwargs)
        if self.tools:
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return kwargs


class DetokenizeRequest(ModelNamed):
    """POST /detokenize (vLLM's)."""

    tokens: list[int]

