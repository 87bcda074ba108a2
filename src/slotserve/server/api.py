"""The OpenAI-compatible HTTP API over an AsyncEngine: `build_app(async_engine, model_name)`.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (stateless;
JSON or SSE streams),
GET /v1/models (and /v1/models/{name}), /health, /metrics (Prometheus), /debug/trace
(the engine's iteration trace), POST /reset_prefix_cache (admin: drop the cached free KV
blocks). The server reads the engine only through its read side (`snapshot()`,
`subscribe()`, `export_trace()`, see engine/events.py).

Every error answers with OpenAI's body {"error": {message, type, param, code}}:
400 bad input (FastAPI's 422 included; max_tokens above the cap, too many or too long stop
strings or stop_token_ids, n or the logprobs volume past their caps, a priority outside
the key's range, a prompt that cannot fit, input nested too deeply (RecursionError), a
foreign Host header), 401 a missing or wrong key, 403 a cross-site admin POST, 404 unknown
model (or an admin route that is off), 413 body too large, 429 queue full (with
Retry-After), 503 shutting down, too many requests at once or an unhealthy engine, 500
anything unexpected (the server keeps serving).

Limits (`ServerLimits`, from the `serve` flags): a cap on max_tokens and its default, a
bound on the body size, a bound on the requests served at once (/health and /metrics stay
exempt, so an operator can still look), bounds on the stop strings (count, length), on
stop_token_ids, n and the logprobs an answer carries; the Host names served (loopback
names only on a loopback address, unless --allowed-hosts). Every response carries a strict
Content-Security-Policy (self only), X-Frame-Options: DENY and nosniff.

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

This module builds the app (routes, error handlers, middleware); the rest lives by concern:
endpoints.py (`Server`, the endpoints' logic), generation.py (one request's engine stream),
answers.py (whole answers), sse.py (streamed answers), limits.py (`ServerLimits` and the
middleware), tenants.py (`user` tenants), auth.py (access), protocol/ (the schemas).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from slotserve.engine.client import EngineClient
from slotserve.obs.metrics import CONTENT_TYPE, ServerMetrics
from slotserve.server import protocol as p
from slotserve.server.auth import AccessControl, AccessPolicy, check_priority
from slotserve.server.endpoints import Server
from slotserve.server.generation import ClientGone
from slotserve.server.limits import (
    EchoRequestId,
    ServerLimits,
    add_limit_middleware,
    add_outer_middleware,
)
from slotserve.server.live import build_live_router
from slotserve.server.protocol import APIError
from slotserve.server.protocol.responses_api import ResponsesRequest

__all__ = ["Server", "ServerLimits", "build_app"]

logger = logging.getLogger("slotserve.server")

# The error statuses the spec (/openapi.json) documents, each with OpenAI's error body.
ERROR_RESPONSE = {"model": p.ErrorResponse, "description": "OpenAI's error body"}
GENERATION_ERRORS = {status: ERROR_RESPONSE for status in (400, 404, 413, 429, 500, 503)}


def build_app(async_engine: EngineClient, model_name: str, *, aliases: tuple[str, ...] = (),
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
        metrics = ServerMetrics(async_engine, model_name=model_name,
                                tenants=sorted({t.name for _, t in access.api_keys}))
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
    add_limit_middleware(app, limits)
    # NOTE: outermost (added last): a request without a valid key is refused before its
    # body is read or it takes one of --max-connections.
    app.add_middleware(AccessControl, policy=access)
    app.add_middleware(EchoRequestId)
    add_outer_middleware(app, limits)  # NOTE: the Host check and the security headers
    return app


# --------------------------------------------------------------------------- routes
def _add_routes(app: FastAPI) -> None:
    def server() -> Server:
        return app.state.server

    @app.post("/v1/completions", responses=GENERATION_ERRORS)
    async def completions(body: p.CompletionRequest, request: Request):
        check_priority(request, body.priority)
        return await server().completions(body, request)

    @app.post("/v1/chat/completions", responses=GENERATION_ERRORS)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        check_priority(request, body.priority)
        return await server().chat(body, request)

    @app.post("/v1/responses", responses=GENERATION_ERRORS)
    async def responses(body: ResponsesRequest, request: Request):
        check_priority(request, body.priority)
        return await server().responses(body, request)

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
        if not server().engine.healthy:
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

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, exc: RecursionError):
        # NOTE: only input nests this deep (a tool call's arguments "[[[[...", a schema):
        # the request is refused, the server goes on
        logger.warning("refused %s: its input nests too deeply (%s)", request.url.path, exc)
        return _error_response(APIError("the request nests too deeply to be read (JSON "
                                        "arrays, objects or a schema)", 400,
                                        code="nesting_too_deep"))

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
