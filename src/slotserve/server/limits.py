"""Bounds on what clients may ask (`ServerLimits`) and the ASGI middleware that holds them:
body size and upload time, requests at once, the Host names served, the security headers
of every response, and the echoed X-Request-Id."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from fastapi import FastAPI

from slotserve.server.auth import send_error
from slotserve.server.protocol import APIError
from slotserve.structured.limits import StructuredLimits

if TYPE_CHECKING:
    from slotserve.sampling import SamplingParams
    from slotserve.server import protocol as p

logger = logging.getLogger("slotserve.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_CHARS = 512
DEFAULT_BODY_TIMEOUT_S = 30.0  # seconds for a whole request body (slow uploads get 408)
# Distinct tenants taken from OpenAI's `user` field (no API keys); later names share one.
DEFAULT_MAX_USER_TENANTS = 1024
DEFAULT_MAX_N = 128  # OpenAI's bound on n
DEFAULT_MAX_STOP_TOKEN_IDS = 128
# Log-probabilities one answer may carry: n x max_tokens x max(top logprobs, 1). About 80
# bytes of JSON each: this bound is about 20 MB (n=16 x 256 tokens x top 20 is 81,920).
DEFAULT_MAX_LOGPROBS_VOLUME = 1 << 18
DEFAULT_MAX_PROMPTS = 1024  # prompts in one /v1/completions request
# Host names a server bound to a loopback address always answers (a page elsewhere that
# resolves its own name to 127.0.0.1, DNS rebinding, sends its own name instead).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Every response: scripts, styles, images and connections from the server itself only, no
# framing (the live view is the only page; FastAPI's /docs loads its assets from a CDN
# and keeps no CSP).
SECURITY_HEADERS = (
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; "
     b"object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)
NO_CSP_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc")
# Client-chosen request ids (X-Request-Id): what is safe in a log line and a header.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what clients may ask; None: no bound.

    max_tokens: max_tokens (max_completion_tokens) above it get 400; it also caps the default.
    max_body_bytes: larger request bodies get 413.
    max_connections: HTTP requests served at once; beyond it 503. On HTTP/1.1 a connection
    serves one request at a time, so this bounds the busy connections (idle keep-alive
    connections of a client's pool do not count).
    max_stop_strings / max_stop_chars: more stop strings, or a longer one, get 400 (every
    token is matched against them; a stream holds back as much text as the longest).
    body_timeout_s: a request body not complete this long after the request began gets 408.
    max_user_tenants: without API keys, a request's `user` field names its tenant (fair
    share, per-tenant metrics); the first this many distinct names get their own tenant,
    later ones share tenants.OVERFLOW_TENANT ("other"). 0: the `user` field is ignored. NOTE: a
    bound, as the scheduler and the metrics keep every tenant's state for good.
    structured: caps on a constrained request's schema, regex, grammar, choices and n
    (StructuredLimits; past one: 400 naming the field).
    max_n: completions per request (n); more get 400.
    max_stop_token_ids: more stop_token_ids get 400.
    max_logprobs_volume: a request asking for logprobs gets 400 when prompts x n x max_tokens
    (bounded by the context) x max(top logprobs, 1) is larger (the answer's size and build
    time); one asking for prompt logprobs (prompt_logprobs, echo with logprobs) when its
    prompt tokens x max(top N, 1) is.
    max_prompts: prompts in one /v1/completions request (a list); more get 400.
    default_max_tokens: the max_tokens of a request that names none (None: chat 1024,
    completions 16, OpenAI's legacy default); max_tokens caps it too.
    allowed_hosts: the Host names (a name, `*.domain`, or an IP; any port) requests must
    carry, else 400; None: any.
    chat_template: the Jinja chat template chat requests are rendered with instead of the
    model's (`--chat-template`, read by loader.chat_template.load_chat_template); None: the
    model's.
    """

    max_tokens: int | None = None
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES
    max_connections: int | None = None
    max_stop_strings: int | None = DEFAULT_MAX_STOP_STRINGS
    max_stop_chars: int | None = DEFAULT_MAX_STOP_CHARS
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_user_tenants: int = DEFAULT_MAX_USER_TENANTS
    structured: StructuredLimits = StructuredLimits()
    max_n: int = DEFAULT_MAX_N
    max_stop_token_ids: int | None = DEFAULT_MAX_STOP_TOKEN_IDS
    max_logprobs_volume: int | None = DEFAULT_MAX_LOGPROBS_VOLUME
    default_max_tokens: int | None = None
    allowed_hosts: tuple[str, ...] | None = None
    max_prompts: int = DEFAULT_MAX_PROMPTS
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if not isinstance(self.max_user_tenants, int) or self.max_user_tenants < 0:
            raise ValueError(f"max_user_tenants must be an integer >= 0, got "
                             f"{self.max_user_tenants!r}")
        for name in ("max_tokens", "max_body_bytes", "max_connections", "max_stop_strings",
                     "max_stop_chars", "max_n", "max_stop_token_ids", "max_logprobs_volume",
                     "default_max_tokens", "max_prompts"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None: no limit), got {value}")
        if self.allowed_hosts is not None:
            for pattern in self.allowed_hosts:
                check_host_pattern(pattern)

    def sampling_params(self, body: p.CompletionRequest | p.ChatCompletionRequest,
                        max_context: int | None = None) -> SamplingParams:
        """The body's SamplingParams within these limits (max_tokens: its cap and default;
        n, stop_token_ids, the logprobs volume). APIError (400) naming the field.
        max_context: the most tokens a sequence holds (bounds max_tokens in the volume)."""
        n = 1 if body.n is None else body.n
        if n > self.max_n:
            raise APIError(f"n: at most {self.max_n} completions per request on this server "
                           f"(--max-n), got {n}", param="n", code="n_limit_exceeded")
        count = len(body.stop_token_ids or ())
        if self.max_stop_token_ids is not None and count > self.max_stop_token_ids:
            raise APIError(f"stop_token_ids: at most {self.max_stop_token_ids} on this server "
                           f"(--max-stop-token-ids), got {count}", param="stop_token_ids",
                           code="stop_limit_exceeded")
        params = body.to_sampling_params(self.max_tokens, self.default_max_tokens)
        self._check_logprobs_volume(params, body, max_context)
        return params

    def _check_logprobs_volume(self, params: SamplingParams, body, max_context: int | None
                               ) -> None:
        if params.logprobs is None or self.max_logprobs_volume is None:
            return
        tokens = params.max_tokens if max_context is None else min(params.max_tokens,
                                                                     max_context)
        prompts = getattr(body, "num_prompts", 1)
        volume = prompts * params.n * tokens * max(params.logprobs, 1)
        if volume <= self.max_logprobs_volume:
            return
        param = "top_logprobs" if getattr(body, "top_logprobs", None) else "logprobs"
        times_prompts = f"prompts ({prompts}) x " if prompts > 1 else ""
        raise APIError(f"{param}: {times_prompts}n ({params.n}) x max_tokens ({tokens}) x top "
                       f"logprobs ({max(params.logprobs, 1)}) = {volume} log-probabilities, "
                       "more than one answer may carry on this server "
                       f"({self.max_logprobs_volume}, --max-logprobs-volume); ask for fewer",
                       param=param,
                       code="logprobs_limit_exceeded")


    @staticmethod
    def check_queueable(prompts: int, n: int, bound: int | None) -> None:
        """APIError (400, param "prompt") when a list of prompts x n sequences passes `bound`,
        the most one request of its tenant could ever have waiting (EngineClient.queue_bound:
        --max-waiting, --max-waiting-per-tenant): it could never be queued whole, so it is
        refused before its prompts are tokenized or admitted (admitted one by one, they would
        fill the queue until the last one got a 429, again on every retry). NOTE: one prompt
        with too large an n is the engine's 400 (AsyncEngine.validate, _check_bounds)."""
        sequences = prompts * n
        if bound is None or prompts == 1 or sequences <= bound:
            return
        raise APIError(f"prompt: {prompts} prompts x n ({n}) = {sequences} sequences can never "
                       f"be queued: this server lets one request of yours have at most {bound} "
                       "waiting (--max-waiting, --max-waiting-per-tenant); send fewer at once",
                       param="prompt", code="prompt_limit_exceeded")

    def check_prompt_logprobs_volume(self, params: SamplingParams, prompt_tokens: int) -> None:
        """APIError (400, param "prompt_logprobs") when the prompt logprobs asked (all
        prompts' tokens x max(top N, 1)) pass max_logprobs_volume."""
        if params.prompt_logprobs is None or self.max_logprobs_volume is None:
            return
        volume = prompt_tokens * max(params.prompt_logprobs, 1)
        if volume > self.max_logprobs_volume:
            raise APIError(f"prompt_logprobs: prompt tokens ({prompt_tokens}) x top logprobs "
                           f"({max(params.prompt_logprobs, 1)}) = {volume} log-probabilities, "
                           "more than one answer may carry on this server "
                           f"({self.max_logprobs_volume}, --max-logprobs-volume); ask for fewer",
                           param="prompt_logprobs", code="logprobs_limit_exceeded")


def check_host_pattern(pattern: str) -> str:
    """A Host pattern as allowed_hosts takes it: a name or IP, `*.domain` or `*`; else
    ValueError. Returns it lower-cased."""
    text = pattern.strip().lower()
    rest = text[2:] if text.startswith("*.") else text
    if text != "*" and (not rest or "*" in rest or not re.fullmatch(r"[a-z0-9.:_-]+", rest)):
        raise ValueError(f"allowed host {pattern!r}: expected a host name, an IP address, "
                         "*.domain or *")
    return text


def allowed_hosts_for(bind_host: str, patterns: str | None) -> tuple[str, ...] | None:
    """The Host names a server bound to `bind_host` answers (ServerLimits.allowed_hosts).

    patterns: --allowed-hosts (comma-separated; `*` allows any). A server bound to a
    loopback address answers only loopback names (and the patterns); one bound elsewhere
    answers any Host unless patterns are given. Loopback names and the bound address itself
    are always allowed. ValueError for a malformed pattern.
    """
    names = [check_host_pattern(n) for n in (patterns or "").split(",") if n.strip()]
    if "*" in names:
        return None
    if not names and not is_loopback(bind_host):
        return None
    own = () if bind_host in ("", "0.0.0.0", "::") else (bind_host.strip("[]").lower(),)
    return tuple(dict.fromkeys([*LOOPBACK_HOSTS, *own, *names]))


def is_loopback(host: str) -> bool:
    """`host` is localhost or a loopback IP address."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name
        return False


def structured_limits(args) -> StructuredLimits:
    """The StructuredLimits the structured-output flags of `slotserve serve` describe."""
    return StructuredLimits(max_schema_bytes=args.max_schema_bytes,
                            max_regex_bytes=args.max_regex_bytes,
                            max_grammar_bytes=args.max_grammar_bytes,
                            max_choices=args.max_choices,
                            max_choice_bytes=args.max_choice_bytes,
                            max_constrained_n=args.max_constrained_n)


def add_limit_middleware(app: FastAPI, limits: ServerLimits) -> None:
    """The concurrency bound inside the body bound (Starlette: the last added is outermost).

    NOTE: a request takes one of the --max-connections places only once its whole body has
    arrived (within body_timeout_s), so clients that dribble their bodies (slow loris) cannot
    hold the places that other clients' requests need.
    """
    if limits.max_connections is not None:
        app.add_middleware(ConcurrencyLimit, max_requests=limits.max_connections)
    if limits.max_body_bytes is not None:
        app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes,
                           timeout_s=limits.body_timeout_s)


def add_outer_middleware(app: FastAPI, limits: ServerLimits) -> None:
    """The Host check, then the security headers outside it: add these last (outermost), so
    every answer has the headers and no route, key check included, serves a foreign Host."""
    if limits.allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed_hosts=limits.allowed_hosts)
    app.add_middleware(SecurityHeaders)


class HostCheck:
    """ASGI middleware: 400 (OpenAI's error body) for a request whose Host header names no
    allowed host (ServerLimits.allowed_hosts; any port). It stops DNS rebinding: a page on
    another site whose name resolves to this machine sends that name as the Host.

    NOTE: Starlette's TrustedHostMiddleware does this check but answers in plain text.
    """

    def __init__(self, app, allowed_hosts: tuple[str, ...]) -> None:
        self.app = app
        self.exact = frozenset(h for h in allowed_hosts if not h.startswith("*."))
        self.suffixes = tuple(h[1:] for h in allowed_hosts if h.startswith("*."))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # NOTE: AccessControl refuses websockets
            return await self.app(scope, receive, send)
        host = request_host(scope)
        if host is not None and (host in self.exact or host.endswith(self.suffixes)):
            return await self.app(scope, receive, send)
        logger.warning("refused %s: Host %r is not served here (--allowed-hosts)",
                       scope["path"], host)
        await send_error(send, APIError(
            "this server does not answer for that Host header (--allowed-hosts)", 400,
            code="host_not_allowed"))


def request_host(scope) -> str | None:
    """The Host header's host name (lower-case, no port, IPv6 without brackets); None if
    absent or malformed."""
    for name, value in scope.get("headers", ()):
        if name == b"host":
            if b"@" in value:  # NOTE: urlsplit would read "evil@localhost" as localhost
                return None
            try:
                parts = urlsplit("//" + value.decode("latin-1"))
                _ = parts.port  # NOTE: raises ValueError for a malformed port
            except ValueError:
                return None
            return parts.hostname or None
    return None


class SecurityHeaders:
    """ASGI middleware: SECURITY_HEADERS on every response (no Content-Security-Policy on
    FastAPI's /docs pages, whose assets come from a CDN)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        extra = SECURITY_HEADERS
        if scope["path"] in NO_CSP_PATHS:
            extra = tuple(h for h in SECURITY_HEADERS if h[0] != b"content-security-policy")

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                names = {h[0] for h in extra}
                headers = [h for h in message.get("headers", ()) if h[0] not in names]
                message = {**message, "headers": [*headers, *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class EchoRequestId:
    """ASGI middleware: a client's `X-Request-Id` (safe characters only) comes back in the
    response's `X-Request-Id` header. It is never used as the engine's request id."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        wanted = client_request_id(scope) if scope["type"] == "http" else None
        if wanted is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0] != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", wanted.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def client_request_id(scope) -> str | None:
    """The client's X-Request-Id when it is safe to log and echo; else None."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _REQUEST_ID.fullmatch(text) else None
    return None


class ConcurrencyLimit:
    """ASGI middleware: 503 while `max_requests` HTTP requests are being served.

    /health and /metrics are exempt. NOTE: one event loop runs every request, so the
    counter needs no lock.
    """

    EXEMPT = ("/health", "/metrics")

    def __init__(self, app, max_requests: int) -> None:
        self.app = app
        self.max_requests = max_requests
        self.active = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.EXEMPT:
            return await self.app(scope, receive, send)
        if self.active >= self.max_requests:
            logger.warning("refused %s: %d requests in progress (--max-connections)",
                           scope["path"], self.active)
            return await send_error(send, APIError(
                f"the server is at its limit of {self.max_requests} requests at once "
                "(--max-connections); retry later", 503, "service_unavailable",
                code="too_many_connections", headers={"Retry-After": "1"}))
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`.

    A declared Content-Length over the bound is refused before reading; otherwise the body
    is read (counting, up to the bound) and handed on whole. NOTE: after the body, `receive`
    is the server's again, so the app still hears http.disconnect (aborts rely on it).
    """

    def __init__(self, app, max_bytes: int, timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await send_error(send, self._too_large(declared))
        try:
            body = await asyncio.wait_for(_read_body(receive, self.max_bytes), self.timeout_s)
        except asyncio.TimeoutError:
            logger.warning("refused %s: the body took over %.0f s (--body-timeout)",
                           scope["path"], self.timeout_s)
            return await send_error(send, APIError(
                f"the request body did not arrive within {self.timeout_s:g} s "
                "(--body-timeout)", 408, code="request_timeout"))
        if body is None:  # the client left while sending
            return None
        if len(body) > self.max_bytes:
            return await send_error(send, self._too_large(None))
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self, size: int | None) -> APIError:
        size_text = f" ({size} bytes)" if size is not None else ""
        return APIError(f"the request body{size_text} is larger than this server accepts: "
                        f"{self.max_bytes} bytes (--max-body-bytes)", 413,
                        code="request_too_large")


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _read_body(receive, max_bytes: int) -> bytes | None:
    """The whole body, or its first max_bytes + 1 bytes (stops there); None on disconnect."""
    chunks, size = [], 0
    while size <= max_bytes:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """An ASGI receive that gives `body` once, then defers to `receive`."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay
