"""The OpenAI-compatible HTTP API over an AsyncEngine: `build_app(async_engine, model_name)`.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE streams),
GET /v1/models (and /v1/models/{name}), /health, /metrics (Prometheus), /debug/trace
(the engine's iteration trace), POST /reset_prefix_cache (admin: drop the cached free KV
blocks). The server reads the engine only through its read side (`snapshot()`,
`subscribe()`, `export_trace()`, see engine/events.py).

Every error answers with OpenAI's body {"error": {message, type, param, code}}:
400 bad input (FastAPI's 422 included; max_tokens above the cap, too many or too long stop
strings, a prompt that cannot fit), 401 a missing or wrong key, 404 unknown model (or an
admin route that is off), 413 body too large, 429 queue full (with Retry-After), 503
shutting down, too many requests at once or an unhealthy engine, 500 anything unexpected
(the server keeps serving).

Limits (`ServerLimits`, from the `serve` flags): a cap on max_tokens, a bound on the body
size, a bound on the requests served at once (/health and /metrics stay exempt, so an
operator can still look), bounds on the stop strings (count, length).

Access (`AccessPolicy`, server/auth.py): API keys for /v1 (each names a tenant), an admin
key for the live view, /debug and /metrics. Engine request ids are the server's own
(`cmpl-<hex>` / `chatcmpl-<hex>`); a client's `X-Request-Id` is only echoed in the response
header and logged next to the server's id, so no client can collide with another's request.

NOTE: nothing heavy runs on the event loop: a text prompt is first checked against a cheap
bound (`max_prompt_bytes`: its UTF-8 size against what the longest possible prompt could
span), then tokenized (chat: the template rendered and tokenized) in a small thread pool;
the engine gets token ids.

Graceful shutdown (`Server.begin_drain`, driven by `slotserve serve` on SIGTERM / SIGINT):
new generations get 503 and /health answers 503, running ones go on to their end; whatever
is left when the drain times out is aborted (its client gets a 503 error).

NOTE: a request's first output is awaited before the response starts, streaming or not,
so that admission errors (400 / 429 / 503) are real HTTP statuses rather than events inside
a 200 stream. The client still sees its first token at the same time.

NOTE: a client that goes away aborts its request: while the first output (or, for a
non-streaming request, the whole result) is awaited, the generation races a watcher of the
connection; while streaming, Starlette cancels the stream on disconnect. Either way the
engine stream's `finally` aborts the request and its blocks return at the next iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from slotserve.engine.async_engine import AsyncEngine, EngineClosedError, QueueFullError
from slotserve.engine.outputs import CompletionOutput, RequestOutput
from slotserve.obs.metrics import CONTENT_TYPE, ServerMetrics
from slotserve.sampling import SamplingParams
from slotserve.server import protocol as p
from slotserve.server.auth import AccessControl, AccessPolicy, send_error, tenant_of
from slotserve.server.live import build_live_router
from slotserve.server.protocol import APIError

logger = logging.getLogger("slotserve.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_CHARS = 512
DEFAULT_BODY_TIMEOUT_S = 30.0  # seconds for a whole request body (slow uploads get 408)
# Distinct tenants taken from OpenAI's `user` field (no API keys); later names share one.
DEFAULT_MAX_USER_TENANTS = 1024
OVERFLOW_TENANT = "other"
# Threads that tokenize prompts and render chat templates (off the event loop).
TOKENIZER_THREADS = 2
# How much a tokenizer's normalizer may shrink text (NFC composes 3-byte Hangul jamo, 9
# bytes, into one 3-byte syllable); the pre-check allows this factor more bytes.
NORMALIZATION_SLACK = 4
# The error statuses the spec (/openapi.json) documents, each with OpenAI's error body.
ERROR_RESPONSE = {"model": p.ErrorResponse, "description": "OpenAI's error body"}
GENERATION_ERRORS = {status: ERROR_RESPONSE for status in (400, 404, 413, 429, 500, 503)}
# How long POST /reset_prefix_cache waits for the engine thread (one iteration at most).
RESET_TIMEOUT_S = 60
# Client-chosen request ids (X-Request-Id): what is safe in a log line and a header.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class ClientGone(Exception):
    """The client disconnected before its result was ready."""


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
    later ones share OVERFLOW_TENANT ("other"). 0: the `user` field is ignored. NOTE: a
    bound, as the scheduler and the metrics keep every tenant's state for good.
    """

    max_tokens: int | None = None
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES
    max_connections: int | None = None
    max_stop_strings: int | None = DEFAULT_MAX_STOP_STRINGS
    max_stop_chars: int | None = DEFAULT_MAX_STOP_CHARS
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_user_tenants: int = DEFAULT_MAX_USER_TENANTS

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


def build_app(async_engine: AsyncEngine, model_name: str, *, aliases: tuple[str, ...] = (),
              metrics: ServerMetrics | None = None, retry_after_s: int = 1,
              limits: ServerLimits | None = None,
              access: AccessPolicy | None = None) -> FastAPI:
    """The FastAPI app serving `async_engine` as `model_name` (also accepting `aliases`).

    The caller starts and stops the engine; the app stops admitting requests (503) when
    it shuts down. Each app has its own metrics registry unless `metrics` is given.
    limits: default ServerLimits() (a 1 MiB body bound, the stop bounds, nothing else).
    access: default AccessPolicy() (no keys: everything open).
    """
    limits = limits or ServerLimits()
    access = access or AccessPolicy()
    if metrics is None:
        metrics = ServerMetrics(async_engine, tenants=sorted({t.name for _, t in access.api_keys}))
        metrics.attach()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        async_engine.stop_accepting()

    app = FastAPI(title="slotserve", lifespan=lifespan)
    app.state.server = Server(async_engine, model_name, aliases, metrics, retry_after_s,
                              limits, user_tenants=not access.keys_required)
    _add_error_handlers(app)
    _add_routes(app)
    app.include_router(build_live_router(async_engine))
    _add_limit_middleware(app, limits)
    # NOTE: outermost (added last): a request without a valid key is refused before its
    # body is read or it takes one of --max-connections.
    app.add_middleware(AccessControl, policy=access)
    app.add_middleware(EchoRequestId)
    return app


# --------------------------------------------------------------------------- routes
def _add_routes(app: FastAPI) -> None:
    def server() -> Server:
        return app.state.server

    @app.post("/v1/completions", responses=GENERATION_ERRORS)
    async def completions(body: p.CompletionRequest, request: Request):
        return await server().completions(body, request)

    @app.post("/v1/chat/completions", responses=GENERATION_ERRORS)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        return await server().chat(body, request)

    @app.post("/tokenize", responses={400: ERROR_RESPONSE, 404: ERROR_RESPONSE})
    async def tokenize(body: p.TokenizeRequest) -> p.TokenizeResponse:
        return await server().tokenize(body)

    @app.post("/detokenize", responses={400: ERROR_RESPONSE, 404: ERROR_RESPONSE})
    async def detokenize(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        return await server().detokenize(body)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return server().models()

    @app.get("/v1/models/{model_id:path}", responses={404: ERROR_RESPONSE})
    async def model(model_id: str) -> p.ModelCard:
        server().check_model(model_id)
        return server().models().data[0]

    # NOTE: HEAD answers like GET without a body (probes and aiperf use it)
    @app.api_route("/health", methods=["GET", "HEAD"], responses={503: ERROR_RESPONSE})
    async def health() -> dict:
        if server().draining:  # NOTE: load balancers stop sending traffic here
            raise APIError("the server is shutting down", 503, "service_unavailable")
        if not getattr(server().engine, "healthy", True):
            raise APIError("the engine is not healthy", 503, "service_unavailable")
        return {"status": "ok"}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(server().metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/trace")
    async def trace() -> dict:
        return server().engine.export_trace()

    @app.post("/reset_prefix_cache", responses={503: ERROR_RESPONSE})
    async def reset_prefix_cache() -> dict:
        return await server().reset_prefix_cache()


# --------------------------------------------------------------------------- errors
def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(APIError(str(exc.detail), exc.status_code, kind))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return _error_response(APIError(f"internal error: {type(exc).__name__}: {exc}", 500,
                                        "server_error"))


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's validation errors (422) as OpenAI's 400, naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(f"the body is not valid JSON: {first.get('msg')}")
    param = _field_path(first)
    if not param:  # the body as a whole
        if first.get("type") == "missing":
            return APIError("the request needs a JSON body")
        return APIError("the body must be a JSON object (Content-Type: application/json)")
    message = f"{param}: {first.get('msg')}"
    others = len({_field_path(e) for e in errors} - {param})
    if others:
        message += f" (and {others} more invalid field{'s' if others > 1 else ''})"
    return APIError(message, param=param)


def _field_path(error: dict) -> str:
    """loc ('body', 'messages', 0, 'content', 'str', ...) -> 'messages.0.content': a union's
    member names ('str', 'list[int]', ...) end the path."""
    path = []
    for part in map(str, error.get("loc", ())[1:]):
        if part in ("str", "int", "float", "bool") or "[" in part:
            break
        path.append(part)
    return ".".join(path)


# --------------------------------------------------------------------------- limits
def _add_limit_middleware(app: FastAPI, limits: ServerLimits) -> None:
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


# --------------------------------------------------------------------------- serving
class Server:
    """The endpoints' logic, over one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, model_name: str, aliases: tuple[str, ...],
                 metrics: ServerMetrics, retry_after_s: int,
                 limits: ServerLimits | None = None, user_tenants: bool = True) -> None:
        """user_tenants: a request's `user` field names its tenant (no API keys are set)."""
        self.engine = engine
        self.model_name = model_name
        self.accepted_names = {model_name, *aliases}
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.limits = limits or ServerLimits()
        self.draining = False
        self.user_tenants = UserTenants(self.limits.max_user_tenants if user_tenants else 0)
        # NOTE: weak, so a generation that ends by any path (error, disconnect, ...) leaves.
        self._generations: weakref.WeakSet[_Generation] = weakref.WeakSet()
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS,
                                                  thread_name_prefix="slotserve-tokenize")
        # NOTE: computed here, at startup, not on the event loop at the first request.
        self.max_prompt_bytes = self._max_prompt_bytes()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_prompt_tokens(self) -> int:
        """A prompt must leave room for one output token."""
        return self.engine.max_total_tokens - 1

    def _max_prompt_bytes(self) -> int | None:
        """The most UTF-8 bytes a prompt of max_prompt_tokens tokens can span (None: no
        tokenizer). A token stands for at most `max_token_bytes` bytes of normalized text and
        normalization shrinks text by at most NORMALIZATION_SLACK, so longer text surely has
        too many tokens and is refused without tokenizing it."""
        if self.tokenizer is None:
            return None
        return self.max_prompt_tokens * self.tokenizer.max_token_bytes * NORMALIZATION_SLACK

    def models(self) -> p.ModelList:
        limit = self.engine.max_total_tokens
        return p.ModelList(data=[p.ModelCard(id=self.model_name, max_model_len=limit)])

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names:
            raise APIError(f"The model `{name}` does not exist. This server serves "
                           f"`{self.model_name}`.", 404, param="model", code="model_not_found")

    async def reset_prefix_cache(self) -> dict:
        """Ask the engine thread to drop the cached free blocks (at the next iteration
        boundary); running requests keep theirs. 503 if the engine does not answer."""
        try:
            dropped = await asyncio.wait_for(self.engine.reset_prefix_cache(),
                                             RESET_TIMEOUT_S)
        except (EngineClosedError, asyncio.TimeoutError) as exc:
            raise APIError(f"the prefix cache was not reset: {exc or 'no answer'}", 503,
                           "service_unavailable") from exc
        logger.info("prefix cache reset: %d cached free blocks dropped", dropped)
        return {"status": "ok", "blocks_dropped": dropped}

    # ---------------------------------------------------------------- shutdown
    def begin_drain(self) -> None:
        """Graceful shutdown starts: new generations get 503, /health answers 503; the
        running ones go on (wait for `num_in_flight` to reach 0)."""
        self.draining = True
        self.engine.stop_accepting()

    @property
    def num_in_flight(self) -> int:
        """Generations admitted and not ended (their engine streams are open)."""
        return self.engine.num_active

    def abort_in_flight(self) -> int:
        """Abort every generation still running (the drain timed out); their clients get
        a 503 error. Call from the event loop's thread. Returns how many."""
        generations = [g for g in self._generations if g.is_open]
        for generation in generations:
            self.engine.abort(generation.request_id)
        return len(generations)

    # ---------------------------------------------------------------- endpoints
    def _generation(self, prefix: str, prompt_ids: list[int], params: SamplingParams,
                    prompt_param: str, request: Request,
                    body: p.CompletionRequest | p.ChatCompletionRequest) -> _Generation:
        generation = _Generation(self, p.new_id(prefix), prompt_ids, params, prompt_param,
                                 tenant=self.user_tenants.tenant(tenant_of(request), body.user),
                                 client_id=client_request_id(request.scope),
                                 cache_salt=body.cache_salt, scheduling=_scheduling(body))
        self._generations.add(generation)
        return generation

    def _sampling_params(self, body: p.CompletionRequest | p.ChatCompletionRequest
                         ) -> SamplingParams:
        self.check_model(body.model)
        body.check_stop(self.limits.max_stop_strings, self.limits.max_stop_chars)
        return body.to_sampling_params(self.limits.max_tokens)

    async def completions(self, body: p.CompletionRequest, request: Request):
        params = self._sampling_params(body)
        await self._check_structured(params, body.structured_spec()[1])
        ids = await self._prompt_ids(body.engine_prompt())
        stream = self._generation("cmpl", ids, params, "prompt", request, body)
        first = await stream.start(request)
        if body.stream:
            return _sse(self._completion_chunks(stream, first, body), stream)
        finals = await stream.collect(request, first)
        return self._completion_response(stream, finals, params)

    async def chat(self, body: p.ChatCompletionRequest, request: Request):
        params = self._sampling_params(body)
        await self._check_structured(params, body.constraint_param())
        ids = await self._chat_ids(body)
        stream = self._generation("chatcmpl", ids, params, "messages", request, body)
        first = await stream.start(request)
        if body.stream:
            return _sse(self._chat_chunks(stream, first, body), stream)
        finals = await stream.collect(request, first)
        return self._chat_response(stream, finals, body)

    async def _check_structured(self, params: SamplingParams, param: str | None) -> None:
        """Compile the request's grammar (off the event loop; cached, so the engine's own
        compile is a lookup): a rejected schema, regex or grammar is a 400 naming the
        request's field before the request is admitted."""
        spec = params.structured_outputs
        grammars = getattr(getattr(self.engine, "engine", None), "grammars", None)
        if spec is None or grammars is None:
            return
        try:
            await self._off_loop(grammars.compile, spec)
        except ValueError as exc:
            raise p.structured_error(str(exc), param or "structured_outputs") from exc

    # ---------------------------------------------------------------- tokenize
    async def tokenize(self, body: p.TokenizeRequest) -> p.TokenizeResponse:
        """vLLM's /tokenize: the prompt's token ids (messages: the chat template's)."""
        self.check_model(body.model)
        body.check()
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer", param="prompt")
        if body.messages is not None:
            messages = [m.as_template_dict() for m in body.messages]
            self._check_text_size(sum(len(m["content"].encode("utf-8", "surrogatepass"))
                                      for m in messages), "messages")
            try:
                ids = await self._off_loop(self.tokenizer.encode_chat, messages,
                                           add_generation_prompt=body.add_generation_prompt)
            except Exception as exc:  # a template may raise on an unusual conversation
                raise APIError(f"messages: the chat template failed: {exc}",
                               param="messages") from exc
        else:
            self._check_text_size(len(body.prompt.encode("utf-8", "surrogatepass")), "prompt")
            ids = await self._off_loop(self.tokenizer.encode, body.prompt,
                                       add_special_tokens=body.add_special_tokens)
        return p.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_total_tokens,
                                  tokens=ids)

    async def detokenize(self, body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        """vLLM's /detokenize: the text of token ids (special tokens kept)."""
        self.check_model(body.model)
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"tokens: {bad} is not a token id of this model (0..{vocab - 1})",
                           param="tokens")
        text = await self._off_loop(self.tokenizer.decode, body.tokens,
                                    skip_special_tokens=False)
        return p.DetokenizeResponse(prompt=text)

    # ---------------------------------------------------------------- prompts
    async def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids; text is tokenized off the event loop, after the
        cheap size check. APIError (400, param "prompt") if it cannot fit."""
        if not isinstance(prompt, str):
            self._check_token_count(len(prompt), "prompt")
            return prompt
        self._check_text_size(len(prompt.encode("utf-8", "surrogatepass")), "prompt")
        try:
            _, ids = await self._off_loop(self.engine.tokenize, prompt)
        except ValueError as exc:
            raise p.invalid_request(str(exc)) from exc
        self._check_token_count(len(ids), "prompt")
        return ids

    async def _chat_ids(self, body: p.ChatCompletionRequest) -> list[int]:
        """The conversation's prompt ids: the template rendered and tokenized off the event
        loop (Tokenizer.encode_chat, the offline LLM.chat's path too), after a size check on
        the messages' text (a template shows each message's content)."""
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer, so no chat template; use "
                           "/v1/completions with token ids", param="messages")
        messages = body.template_messages()
        self._check_text_size(sum(len(m["content"].encode("utf-8", "surrogatepass"))
                                  for m in messages), "messages")
        try:
            ids = await self._off_loop(self.tokenizer.encode_chat, messages,
                                       add_generation_prompt=True)
        except Exception as exc:  # a template may raise on an unusual conversation
            raise APIError(f"messages: the chat template failed: {exc}",
                           param="messages") from exc
        self._check_token_count(len(ids), "messages")
        return ids

    async def _off_loop(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool,
                                          functools.partial(fn, *args, **kwargs))

    def _check_text_size(self, num_bytes: int, param: str) -> None:
        bound = self.max_prompt_bytes
        if bound is not None and num_bytes > bound:
            raise APIError(
                f"{param} is too long: {num_bytes} bytes of text is more than "
                f"{self.max_prompt_tokens} tokens (this server's limit per sequence, less one "
                "output token) can hold", param=param, code="context_length_exceeded")

    def _check_token_count(self, num_tokens: int, param: str) -> None:
        if num_tokens > self.max_prompt_tokens:
            limit = self.max_prompt_tokens + 1
            raise APIError(
                f"{param} has {num_tokens} tokens, but this server fits at most {limit} "
                "tokens per sequence; the prompt and at least one output token must fit",
                param=param, code="context_length_exceeded")

    # ---------------------------------------------------------------- non-streaming
    def _completion_response(self, stream: _Generation, finals: list[CompletionOutput],
                             params: SamplingParams) -> p.CompletionResponse:
        choices = [p.CompletionChoice(
            index=c.index, text=c.text, finish_reason=c.finish_reason,
            logprobs=None if params.logprobs is None else
            p.completion_logprobs(self.tokenizer, c.token_ids, c.logprobs or []))
            for c in finals]
        return p.CompletionResponse(id=stream.request_id, model=self.model_name,
                                    choices=choices, usage=stream.usage(finals))

    def _chat_response(self, stream: _Generation, finals: list[CompletionOutput],
                       body: p.ChatCompletionRequest) -> p.ChatCompletionResponse:
        plan = body.tool_plan()
        choices = [p.ChatChoice(
            index=c.index, message=_assistant_message(c, plan),
            finish_reason=_chat_finish_reason(c, plan),
            logprobs=self._chat_logprobs(c.token_ids, c.logprobs, body)) for c in finals]
        return p.ChatCompletionResponse(id=stream.request_id, model=self.model_name,
                                        choices=choices, usage=stream.usage(finals))

    def _chat_logprobs(self, token_ids: list[int], logprobs, body: p.ChatCompletionRequest
                       ) -> p.ChatLogprobs | None:
        if not body.logprobs:
            return None
        return p.chat_logprobs(self.tokenizer, token_ids, logprobs or [],
                               body.top_logprobs or 0)

    # ---------------------------------------------------------------- streaming
    async def _completion_chunks(self, stream: _Generation, first: RequestOutput,
                                 body: p.CompletionRequest) -> AsyncIterator[dict]:
        offsets: dict[int, int] = {}
        async for c in stream.completions(first):
            with_logprobs = body.logprobs is not None and c.delta_token_ids
            if not (c.delta_text or with_logprobs or c.finished):
                continue
            logprobs = None
            if body.logprobs is not None:
                ids, lps = _delta_logprobs(c)
                logprobs = p.completion_logprobs(self.tokenizer, ids, lps, offsets.get(c.index, 0))
            offsets[c.index] = offsets.get(c.index, 0) + len(c.delta_text)
            choice = p.CompletionChoice(index=c.index, text=c.delta_text, logprobs=logprobs,
                                        finish_reason=c.finish_reason)
            yield _chunk(p.CompletionResponse(id=stream.request_id, model=self.model_name,
                                              choices=[choice],
                                              usage=_running_usage(stream, body)),
                         body.include_usage)
        if body.include_usage:
            yield p.CompletionResponse(id=stream.request_id, model=self.model_name, choices=[],
                                       usage=stream.usage(stream.finals)).model_dump()

    async def _chat_chunks(self, stream: _Generation, first: RequestOutput,
                           body: p.ChatCompletionRequest) -> AsyncIterator[dict]:
        def chunk(choice: p.ChatChunkChoice) -> dict:
            return _chunk(p.ChatCompletionChunk(id=stream.request_id, model=self.model_name,
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
        async for c in completions:
            if isinstance(c, _ToolCallPiece):
                yield chunk(c.choice(self._chat_logprobs(*_delta_logprobs(c.output), body)))
                continue
            if c.delta_text or (body.logprobs and c.delta_token_ids):
                ids, lps = _delta_logprobs(c)
                yield chunk(p.ChatChunkChoice(index=c.index,
                                              delta=p.DeltaMessage(content=c.delta_text),
                                              logprobs=self._chat_logprobs(ids, lps, body)))
            if c.finished:
                yield chunk(p.ChatChunkChoice(index=c.index, delta=p.DeltaMessage(),
                                              finish_reason=c.finish_reason))
        if body.include_usage:
            yield p.ChatCompletionChunk(id=stream.request_id, model=self.model_name, choices=[],
                                        usage=stream.usage(stream.finals)).model_dump()


def _assistant_message(c: CompletionOutput, plan: p.ToolPlan | None) -> p.AssistantMessage:
    """The message of a finished choice: a tool call (content null) when the request forced
    one and the output is a complete call, or a named function's arguments cut short (as
    OpenAI answers with finish_reason "length"); its text otherwise."""
    call = plan.call_of(c.text) if plan is not None else None
    if call is None and plan is not None and plan.name is not None:
        call = plan.name, c.text
    if call is None:
        return p.AssistantMessage(content=c.text)
    name, arguments = call
    return p.AssistantMessage(content=None, tool_calls=[p.ToolCall(
        function=p.FunctionCall(name=name, arguments=arguments))])


def _chat_finish_reason(c: CompletionOutput, plan: p.ToolPlan | None) -> str | None:
    """"tool_calls" for a complete forced call that ended by itself (OpenAI's reason)."""
    if plan is not None and c.finish_reason == "stop" and plan.call_of(c.text) is not None:
        return "tool_calls"
    return c.finish_reason


@dataclass
class _ToolCallPiece:
    """A streamed piece of a forced tool call: `delta` for one choice's call."""

    output: CompletionOutput
    delta: p.ToolCallDelta | None
    finish_reason: str | None
    content: str | None = None  # "required" cut short: the text, as the answer would carry

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
    until it finishes, then sent whole (the name must be known first).
    """
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
            call = plan.call_of(c.text)
            if call is not None:
                yield _ToolCallPiece(c, p.ToolCallDelta(
                    index=0, id=p.new_id("call"), type="function",
                    function=p.FunctionCall(name=call[0], arguments=call[1])), None)
            else:
                yield _ToolCallPiece(c, None, None, content=c.text)
        if c.finished:
            yield _ToolCallPiece(c, None, _chat_finish_reason(c, plan))


def _running_usage(stream: _Generation, body: p.CompletionRequest | p.ChatCompletionRequest
                   ) -> p.UsageInfo | None:
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


def _sse(chunks: AsyncIterator[dict], stream: _Generation) -> StreamingResponse:
    return StreamingResponse(_sse_lines(chunks, stream), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse_lines(chunks: AsyncIterator[dict], stream: _Generation) -> AsyncIterator[str]:
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


# --------------------------------------------------------------------------- one generation
class _Generation:
    """One request's engine stream, with errors mapped to APIError and one log line per
    finished completion.

    request_id: the server's own (the engine's id). tenant: whose request it is (from the
    API key; "default" without keys). client_id: the client's X-Request-Id (logged only).
    cache_salt: the request's, for the engine's prefix cache.
    """

    def __init__(self, server: Server, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, prompt_param: str, tenant: str = "default",
                 client_id: str | None = None, cache_salt: str | None = None,
                 scheduling: dict | None = None) -> None:
        self.server = server
        self.request_id = request_id
        self.params = params
        self.prompt_param = prompt_param
        self.tenant = tenant
        self.client_id = client_id
        self.outputs = server.engine.generate(request_id, prompt_ids, params,
                                              cache_salt=cache_salt, tenant=tenant,
                                              **(scheduling or {}))
        self.prompt_tokens = 0
        # NOTE: choice 0's, as the usage counts the prompt once (its siblings may find
        # more of it cached: choice 0 computed it)
        self.cached_tokens = 0
        self.tokens_so_far: dict[int, int] = {}  # choice index -> tokens generated
        self.started = False  # the first output came
        self.finals: list[CompletionOutput] = []

    async def start(self, request: Request) -> RequestOutput:
        """Admit the request and wait for its first output (see the module NOTE)."""
        try:
            first = await self._guarded(_unless_disconnected(request, self._next()))
        except ClientGone:
            logger.info("aborted %s: the client left before the first token", self.log_name)
            raise
        self._check_rejected(first)  # NOTE: before any response starts: a real 503
        self.prompt_tokens = len(first.prompt_token_ids)
        self.cached_tokens = first.num_cached_tokens  # NOTE: final once a token came
        self.started = True
        return first

    async def collect(self, request: Request, first: RequestOutput) -> list[CompletionOutput]:
        """Run to the end (aborting if the client leaves); the final completions by index."""
        async def drain() -> None:
            async for _ in self.completions(first):
                pass

        try:
            await self._guarded(_unless_disconnected(request, drain()))
        finally:
            await self.aclose()
        return sorted(self.finals, key=lambda c: c.index)

    async def completions(self, first: RequestOutput) -> AsyncIterator[CompletionOutput]:
        """Every output's completion, first included; raises APIError on a failure."""
        self._count(first)
        yield self._check(first.outputs[0], first.error)
        while True:
            try:
                out = await self._guarded(self._next())
            except StopAsyncIteration:
                return
            self._check_rejected(out)  # n > 1: a later completion (streaming: an error event)
            self._count(out)
            yield self._check(out.outputs[0], out.error)

    def _count(self, out: RequestOutput) -> None:
        """Note an output's tokens so far and (choice 0) its prompt tokens found cached."""
        c = out.outputs[0]
        self.tokens_so_far[c.index] = len(c.token_ids)
        if c.index == 0:
            self.cached_tokens = out.num_cached_tokens

    async def _next(self) -> RequestOutput:
        return await anext(self.outputs)

    @property
    def log_name(self) -> str:
        """The request as log lines name it: `<id> [tenant T, X-Request-Id C]`."""
        return f"{self.request_id}{self.log_who}"

    @property
    def log_who(self) -> str:
        """` [tenant T]`, with `, X-Request-Id C` when the client named its request."""
        client = f", X-Request-Id {self.client_id}" if self.client_id else ""
        return f" [tenant {self.tenant}{client}]"

    @property
    def is_open(self) -> bool:
        """The engine stream has not ended (not refused, finished, failed nor closed)."""
        return self.outputs.ag_frame is not None

    def _check_rejected(self, out: RequestOutput) -> None:
        """APIError 503 if the scheduler rejected the request (deadline policy, slo_reject:
        its first token could no longer come within its TTFT SLO)."""
        if out.outputs[0].finish_reason != "rejected":
            return
        logger.info("rejected %s: %s", self.log_name, out.error or "SLO unattainable")
        raise APIError(f"the server cannot meet this request's latency objective now "
                       f"({out.error or 'slo_ttft_ms'}); retry later", 503,
                       "service_unavailable", code="slo_unattainable",
                       headers={"Retry-After": str(self.server.retry_after_s)})

    def _check(self, c: CompletionOutput, error: str | None = None) -> CompletionOutput:
        if c.finish_reason == "error" and (error or "").startswith("GrammarRejectedToken"):
            # NOTE: the request's own constraint is one the grammar engine cannot follow
            raise APIError("the grammar engine could not follow this request's constraint "
                           f"({error}); try a simpler pattern", 400,
                           param="structured_outputs", code="unsupported_constraint")
        if c.finish_reason == "error":
            raise APIError("generation failed in the engine", 500, "server_error")
        if c.finish_reason == "abort":
            raise APIError("the request was aborted (the server is shutting down)", 503,
                           "service_unavailable")
        if c.finished:
            self.finals.append(c)
            _log_finished(self.request_id, self.log_who, self.prompt_tokens, c, self.params.n)
        return c

    async def aclose(self) -> None:
        """End the engine stream: aborts the request unless every completion finished."""
        await self.outputs.aclose()
        if self.started and len(self.finals) < self.params.n:
            logger.info("aborted %s: %d of %d completions finished (client left or failure)",
                        self.log_name, len(self.finals), self.params.n)
            self.started = False  # log once

    def usage(self, finals: list[CompletionOutput]) -> p.UsageInfo:
        return p.UsageInfo.of(self.prompt_tokens, sum(len(c.token_ids) for c in finals),
                              self.cached_tokens)

    def usage_so_far(self) -> p.UsageInfo:
        """The usage up to the outputs seen (stream_options.continuous_usage_stats)."""
        return p.UsageInfo.of(self.prompt_tokens, sum(self.tokens_so_far.values()),
                              self.cached_tokens)

    async def _guarded(self, awaitable):
        """Await, turning the engine's exceptions into API errors."""
        try:
            return await awaitable
        except QueueFullError as exc:
            raise APIError(f"the server is busy: {exc}; retry later", 429,
                           "rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.server.retry_after_s)}) from exc
        except EngineClosedError as exc:
            raise APIError(str(exc), 503, "service_unavailable") from exc
        except ValueError as exc:
            error = p.invalid_request(str(exc), {"prompt": self.prompt_param})
            raise error from exc
        except RuntimeError as exc:  # the engine failed (its loop goes on)
            raise APIError(str(exc), 500, "server_error") from exc


def _scheduling(body: p.CompletionRequest | p.ChatCompletionRequest) -> dict:
    """The request's scheduling fields, as AsyncEngine.generate's keywords."""
    return {"priority": body.priority, "slo_ttft_ms": body.slo_ttft_ms,
            "slo_tpot_ms": body.slo_tpot_ms}


class UserTenants:
    """Tenants named by OpenAI's `user` field (without API keys), bounded: the first
    `max_tenants` distinct names get their own tenant, later ones share OVERFLOW_TENANT.

    NOTE: used from the event loop only (no lock); the bound protects the scheduler's and
    the metrics' per-tenant state, which is kept for the server's life.
    """

    def __init__(self, max_tenants: int) -> None:
        self.max_tenants = max_tenants
        self.names: set[str] = set()
        self._warned = False

    def tenant(self, key_tenant: str, user: str | None) -> str:
        """The request's tenant: the API key's when keys are set (max_tenants 0), else the
        `user` field's (bounded), else `key_tenant` ("default"). APIError (400, param
        "user") for a name with control characters."""
        if self.max_tenants == 0 or not user:
            return key_tenant
        if not user.isprintable():
            raise APIError("user must be printable text (no control characters)",
                           param="user")
        if user in self.names:
            return user
        if len(self.names) < self.max_tenants:
            self.names.add(user)
            return user
        if not self._warned:
            logger.warning("more than %d distinct `user` values: later ones share tenant %r "
                           "(--max-user-tenants)", self.max_tenants, OVERFLOW_TENANT)
            self._warned = True
        return OVERFLOW_TENANT


async def _unless_disconnected(request: Request, awaitable):
    """Await `awaitable` unless the client disconnects first: then cancel it (which aborts
    the engine request) and raise ClientGone."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientGone()
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection.

    NOTE: the body was read already, so the next ASGI message can only be http.disconnect;
    waiting on it costs nothing (no polling).
    """
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _log_finished(request_id: str, who: str, prompt_tokens: int, c: CompletionOutput,
                  n: int) -> None:
    """`finished <id>[#choice] [tenant T, X-Request-Id C]: prompt ..., <finish reason>`."""
    m = c.metrics
    ttft = f"{m.ttft:.3f}s" if m and m.ttft is not None else "-"
    tpot = f"{m.tpot * 1000:.1f}ms" if m and m.tpot is not None else "-"
    suffix = f"#{c.index}" if n > 1 else ""
    logger.info("finished %s%s%s: prompt %d tokens, output %d tokens, TTFT %s, TPOT %s, %s",
                request_id, suffix, who, prompt_tokens, len(c.token_ids), ttft, tpot,
                c.finish_reason)
