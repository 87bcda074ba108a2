"""Bounds on what clients may ask (`ServerLimits`) and the ASGI middleware that holds them:
body size and upload time, requests at once, and the echoed X-Request-Id."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass

from fastapi import FastAPI

from slotserve.server.auth import send_error
from slotserve.server.protocol import APIError
from slotserve.structured.limits import StructuredLimits

logger = logging.getLogger("slotserve.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_CHARS = 512
DEFAULT_BODY_TIMEOUT_S = 30.0  # seconds for a whole request body (slow uploads get 408)
# Distinct tenants taken from OpenAI's `user` field (no API keys); later names share one.
DEFAULT_MAX_USER_TENANTS = 1024
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
    """

    max_tokens: int | None = None
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES
    max_connections: int | None = None
    max_stop_strings: int | None = DEFAULT_MAX_STOP_STRINGS
    max_stop_chars: int | None = DEFAULT_MAX_STOP_CHARS
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_user_tenants: int = DEFAULT_MAX_USER_TENANTS
    structured: StructuredLimits = StructuredLimits()

    def __post_init__(self) -> None:
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if not isinstance(self.max_user_tenants, int) or self.max_user_tenants < 0:
            raise ValueError(f"max_user_tenants must be an integer >= 0, got "
                             f"{self.max_user_tenants!r}")
        for name in ("max_tokens", "max_body_bytes", "max_connections", "max_stop_strings",
                     "max_stop_chars"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None: no limit), got {value}")


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
