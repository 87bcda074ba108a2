"""OpenAI API schemas (pydantic) and the conversions between them and the engine's types.

Requests validate strictly (no "5" for 5, no true for 1) and accept unknown fields, as
vLLM does, logging each ignored field name once (`IgnoredFields`, request_model.py).
`to_sampling_params()` turns a request into SamplingParams and raises `APIError` (HTTP 400)
naming the offending field; logprob helpers shape the engine's `list[dict[token_id,
logprob]]` into OpenAI's two response formats.

Modules: errors (APIError and OpenAI's error body), request_model (the strict base),
requests (the request bodies), structured (output constraints), tools (tool definitions and
the forced call), responses (the response bodies), logprobs. Import the names from here.
"""

from slotserve.server.protocol.errors import APIError, ErrorInfo, ErrorResponse, invalid_request
from slotserve.server.protocol.logprobs import (
    MIN_LOGPROB,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    prompt_logprobs,
    token_bytes,
    token_text,
)
from slotserve.server.protocol.request_model import IGNORED_FIELDS, IgnoredFields, RequestModel
from slotserve.server.protocol.requests import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    MAX_USER_CHARS,
    PRIORITY_BOUND,
    ChatCompletionRequest,
    ChatMessage,
    CommonRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelNamed,
    StreamOptions,
    TextPart,
    TokenizeRequest,
)
from slotserve.server.protocol.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    DetokenizeResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptTokensDetails,
    TokenizeResponse,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    UsageInfo,
    new_id,
)
from slotserve.server.protocol.structured import (
    StructuredFields,
    structured_error,
    with_structured,
)
from slotserve.server.protocol.tool_parsers import (
    ParsedCall,
    ToolCallStream,
    parse_tool_calls,
)
from slotserve.server.protocol.tools import (
    AUTO_TOOLS_UNSUPPORTED,
    FunctionCallIn,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCallIn,
    ToolDefinition,
    ToolPlan,
    tool_plan,
)

__all__ = [
    "AUTO_TOOLS_UNSUPPORTED", "DEFAULT_CHAT_MAX_TOKENS", "DEFAULT_COMPLETION_MAX_TOKENS",
    "IGNORED_FIELDS", "MAX_USER_CHARS", "MIN_LOGPROB", "PRIORITY_BOUND",
    "APIError", "AssistantMessage", "ChatChoice", "ChatChunkChoice", "ChatCompletionChunk",
    "ChatCompletionRequest", "ChatCompletionResponse", "ChatLogprobs", "ChatMessage",
    "ChatTokenLogprob", "CommonRequest", "CompletionChoice", "CompletionLogprobs",
    "CompletionRequest", "CompletionResponse", "DeltaMessage", "DetokenizeRequest",
    "DetokenizeResponse", "ErrorInfo", "ErrorResponse", "FunctionCall", "FunctionCallIn",
    "FunctionDefinition", "IgnoredFields", "ModelCard", "ModelList", "ModelNamed",
    "NamedFunction", "NamedToolChoice", "ParsedCall", "PromptLogprob", "PromptTokensDetails",
    "RequestModel",
    "StreamOptions", "StructuredFields", "TextPart", "TokenizeRequest", "TokenizeResponse",
    "ToolCall", "ToolCallDelta", "ToolCallIn", "ToolCallStream", "ToolDefinition", "ToolPlan",
    "TopLogprob",
    "UsageInfo", "chat_logprobs", "completion_logprobs", "echo_logprobs", "invalid_request",
    "join_logprobs", "new_id", "parse_tool_calls", "prompt_logprobs",
    "structured_error", "token_bytes", "token_text", "tool_plan", "with_structured",
]
