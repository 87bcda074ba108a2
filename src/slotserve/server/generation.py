"""One request's run on the engine: admission, its outputs, errors as APIError, aborts
when the client leaves, and one log line per finished completion."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request

from slotserve.config import FinishReason
from slotserve.engine.async_engine import EngineClosedError, QueueFullError
from slotserve.engine.outputs import CompletionOutput, RequestOutput
from slotserve.sampling import SamplingParams
from slotserve.server import protocol as p
from slotserve.server.protocol import APIError

if TYPE_CHECKING:
    from slotserve.server.endpoints import Server

logger = logging.getLogger("slotserve.server")


class ClientGone(Exception):
    """The client disconnected before its result was ready."""



class Generation:
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
        """Admit the request and wait for its first output (server/api.py's NOTE says why)."""
        try:
            first = await self._guarded(unless_disconnected(request, self._next()))
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
            await self._guarded(unless_disconnected(request, drain()))
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
        if out.outputs[0].finish_reason != FinishReason.REJECTED:
            return
        logger.info("rejected %s: %s", self.log_name, out.error or "SLO unattainable")
        raise APIError(f"the server cannot meet this request's latency objective now "
                       f"({out.error or 'slo_ttft_ms'}); retry later", 503,
                       "service_unavailable", code="slo_unattainable",
                       headers={"Retry-After": str(self.server.retry_after_s)})

    def _check(self, c: CompletionOutput, error: str | None = None) -> CompletionOutput:
        grammar_rejected = (error or "").startswith("GrammarRejectedToken")
        if c.finish_reason == FinishReason.ERROR and grammar_rejected:
            # NOTE: the request's own constraint is one the grammar engine cannot follow
            raise APIError("the grammar engine could not follow this request's constraint "
                           f"({error}); try a simpler pattern", 400,
                           param="structured_outputs", code="unsupported_constraint")
        if c.finish_reason == FinishReason.ERROR:
            raise APIError("generation failed in the engine", 500, "server_error")
        if c.finish_reason == FinishReason.ABORT:
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


def scheduling_keywords(body: p.CompletionRequest | p.ChatCompletionRequest) -> dict:
    """The request's scheduling fields, as AsyncEngine.generate's keywords."""
    return {"priority": body.priority, "slo_ttft_ms": body.slo_ttft_ms,
            "slo_tpot_ms": body.slo_tpot_ms}


async def unless_disconnected(request: Request, awaitable):
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
