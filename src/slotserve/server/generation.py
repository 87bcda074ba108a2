"""One request's run on the engine: admission, its outputs, errors as APIError, aborts
when the client leaves, and one log line per finished completion (`Generation`); the
prompts of one /v1/completions request run as one (`Generations`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

from fastapi import Request

from slotserve.core.scheduling_fields import SchedulingFields
from slotserve.engine.async_engine import EngineClosedError, QueueFullError
from slotserve.engine.client import EngineClient
from slotserve.engine.outputs import CompletionOutput, ErrorKind, RequestOutput
from slotserve.sampling import SamplingParams
from slotserve.server import protocol as p
from slotserve.server.protocol import APIError

logger = logging.getLogger("slotserve.server")


class ClientGone(Exception):
    """The client disconnected before its result was ready."""



class Generation:
    """One request's engine stream, with errors mapped to APIError and one log line per
    finished completion.

    engine: the engine client; retry_after_s: the Retry-After of a 429 or an SLO's 503.
    request_id: the server's own (the engine's id). tenant: whose request it is (from the
    API key; "default" without keys). client_id: the client's X-Request-Id (logged only).
    scheduling: the request's priority, tenant, SLOs and cache salt (SchedulingFields,
    checked; None: the defaults for `tenant`), EngineClient.generate's keywords.
    prompt_text: the prompt as text (echo), when known.
    """

    def __init__(self, engine: EngineClient, retry_after_s: int, request_id: str,
                 prompt_ids: list[int], params: SamplingParams, prompt_param: str,
                 tenant: str = "default", client_id: str | None = None,
                 scheduling: SchedulingFields | None = None,
                 prompt_text: str | None = None) -> None:
        self.retry_after_s = retry_after_s
        self.request_id = request_id
        self.params = params
        self.prompt_param = prompt_param
        self.tenant = tenant
        self.client_id = client_id
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        scheduling = scheduling or SchedulingFields(tenant=tenant)
        self.outputs = engine.generate(request_id, prompt_ids, params,
                                       **scheduling.keywords())
        # With params.prompt_logprobs: completion 0's, once its prefill is done
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_logprob_ranks: list[int | None] | None = None
        self.prompt_tokens = 0
        # NOTE: choice 0's, as the usage counts the prompt once (its siblings may find
        # more of it cached: choice 0 computed it)
        self.cached_tokens = 0
        self.tokens_so_far: dict[int, int] = {}  # choice index -> tokens generated
        self.started = False  # the first output came
        self.ended = False  # the engine stream ended (see `is_open`)
        self.finals: list[CompletionOutput] = []

    async def start(self, request: Request) -> RequestOutput:
        """Admit the request and wait for its first output (server/api.py's NOTE says why)."""
        try:
            return await unless_disconnected(request, self.admit())
        except ClientGone:
            self.log_left_before_first_token()
            raise

    def log_left_before_first_token(self) -> None:
        """The log line of a request whose client left before its first output."""
        logger.info("aborted %s: the client left before the first token", self.log_name)

    async def admit(self) -> RequestOutput:
        """`start` without watching the connection (the caller does)."""
        first = await self._guarded(self._next())
        self._check_rejected(first)  # NOTE: before any response starts: a real 503
        self.prompt_tokens = len(first.prompt_token_ids)
        self.cached_tokens = first.num_cached_tokens  # NOTE: final once a token came
        self.started = True
        return first

    async def collect(self, request: Request, first: RequestOutput) -> list[CompletionOutput]:
        """Run to the end (aborting if the client leaves); the final completions by index."""
        try:
            await unless_disconnected(request, self.drain(first))
        finally:
            await self.aclose()
        return sorted(self.finals, key=lambda c: c.index)

    async def drain(self, first: RequestOutput) -> None:
        """Run to the end (the caller watches the connection and closes the stream)."""
        async for _ in self.completions(first):
            pass

    async def completions(self, first: RequestOutput) -> AsyncIterator[CompletionOutput]:
        """Every output's completion, first included; raises APIError on a failure.

        NOTE: with prompt logprobs, a completion other than 0 is held back until completion
        0's first output brings them (it computes them for all), so that every choice's
        first piece can carry them (echo with logprobs)."""
        held: list[CompletionOutput] = []
        out = first
        while True:
            self._check_rejected(out)  # n > 1: a later completion (streaming: an error event)
            self._count(out)
            c = self._check(out)
            if self._waits_for_prompt_logprobs(c):
                held.append(c)
            else:
                yield c
                while held:
                    yield held.pop(0)
            try:
                out = await self._guarded(self._next())
            except StopAsyncIteration:
                for c in held:  # NOTE: only if completion 0 never brought them
                    yield c
                return

    def _waits_for_prompt_logprobs(self, c: CompletionOutput) -> bool:
        return (self.params.prompt_logprobs is not None and self.prompt_logprobs is None
                and c.index != 0)

    def _count(self, out: RequestOutput) -> None:
        """Note an output's tokens so far, (choice 0) its prompt tokens found cached and the
        prompt logprobs."""
        c = out.outputs[0]
        self.tokens_so_far[c.index] = len(c.token_ids)
        if c.index == 0:
            self.cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
            self.prompt_logprob_ranks = out.prompt_logprob_ranks

    async def _next(self) -> RequestOutput:
        """The engine stream's next output. NOTE: an async generator that raises (its end's
        StopAsyncIteration, its error, a cancellation thrown into it) has finished."""
        try:
            return await anext(self.outputs)
        except BaseException:
            self.ended = True
            raise

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
        """The engine stream has not ended (not refused, finished, failed nor closed).
        NOTE: kept here, as every read of the stream goes through `_next` and `aclose`
        (Python 3.12's inspect.getasyncgenstate would say it too; we support 3.10)."""
        return not self.ended

    def _check_rejected(self, out: RequestOutput) -> None:
        """APIError 503 if the scheduler rejected the request (deadline policy, slo_reject:
        its first token could no longer come within its TTFT SLO)."""
        if out.error_kind is ErrorKind.SLO_UNATTAINABLE:
            raise self._api_error(out, ErrorKind.SLO_UNATTAINABLE)

    def _check(self, out: RequestOutput) -> CompletionOutput:
        """The output's completion; APIError if it ended without its answer (by its
        error kind), and a log line once it finished."""
        c = out.outputs[0]
        if out.error_kind is not None:
            raise self._api_error(out, out.error_kind)
        if c.finished:
            self.finals.append(c)
            _log_finished(self.request_id, self.log_who, self.prompt_tokens, c, self.params.n)
        return c

    def _api_error(self, out: RequestOutput, kind: ErrorKind) -> APIError:
        """The API error (HTTP status, or the SSE error event once a stream started) of an
        output that ended without its answer."""
        match kind:
            case ErrorKind.GRAMMAR_FAILURE:
                # NOTE: the request's own constraint is one the grammar engine cannot follow
                return APIError("the grammar engine could not follow this request's "
                                f"constraint ({out.error}); try a simpler pattern", 400,
                                param="structured_outputs", code="unsupported_constraint")
            case ErrorKind.SLO_UNATTAINABLE:
                reason = out.error or "slo_ttft_ms"
                logger.info("rejected %s: %s", self.log_name, reason)
                return APIError("the server cannot meet this request's latency objective "
                                f"now ({reason}); retry later", 503, "service_unavailable",
                                code="slo_unattainable",
                                headers={"Retry-After": str(self.retry_after_s)})
            case ErrorKind.ABORTED:
                return APIError("the request was aborted (the server is shutting down)", 503,
                                "service_unavailable")
        return APIError("generation failed in the engine", 500, "server_error")

    async def aclose(self) -> None:
        """End the engine stream: aborts the request unless every completion finished."""
        try:
            await self.outputs.aclose()
        finally:
            self.ended = True
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
                           headers={"Retry-After": str(self.retry_after_s)}) from exc
        except EngineClosedError as exc:
            raise APIError(str(exc), 503, "service_unavailable") from exc
        except ValueError as exc:
            error = p.invalid_request(str(exc), {"prompt": self.prompt_param})
            raise error from exc
        except RuntimeError as exc:  # the engine failed (its loop goes on)
            raise APIError(str(exc), 500, "server_error") from exc


class Generations:
    """The prompts of one /v1/completions request, run as one answer: a Generation per
    prompt (n completions each); choice index = prompt index x n + completion index
    (OpenAI's order). Admission is all or nothing: if one prompt is refused (a 429 when
    the prompts x n sequences pass the waiting bound), the others are aborted."""

    def __init__(self, request_id: str, generations: list[Generation]) -> None:
        self.request_id = request_id
        self.generations = generations
        self.params = generations[0].params

    @property
    def n(self) -> int:
        return self.params.n

    def generation_of(self, index: int) -> Generation:
        """The Generation of the prompt whose choice `index` is."""
        return self.generations[index // self.n]

    @property
    def finals(self) -> list[CompletionOutput]:
        return [self._renumbered(i, c) for i, g in enumerate(self.generations)
                for c in g.finals]

    async def start(self, request: Request) -> list[RequestOutput]:
        """Admit every prompt and wait for each one's first output (as Generation.start)."""
        try:
            return await unless_disconnected(request, self._admit_all())
        except ClientGone:
            for generation in self.generations:
                if not generation.started:  # NOTE: a started one logs its abort in aclose
                    generation.log_left_before_first_token()
            await self.aclose()
            raise
        except BaseException:
            await self.aclose()
            raise

    async def _admit_all(self) -> list[RequestOutput]:
        if len(self.generations) == 1:
            return [await self.generations[0].admit()]
        tasks = [asyncio.ensure_future(g.admit()) for g in self.generations]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        failed = [t.exception() for t in tasks if not t.cancelled() and t.exception()]
        if failed:
            raise failed[0]
        return [t.result() for t in tasks]

    async def collect(self, request: Request, firsts: list[RequestOutput]
                      ) -> list[CompletionOutput]:
        """Run every prompt to the end; the final completions by (renumbered) index."""
        try:
            await unless_disconnected(request, asyncio.gather(
                *(g.drain(first) for g, first in zip(self.generations, firsts))))
        finally:
            await self.aclose()
        return sorted(self.finals, key=lambda c: c.index)

    async def completions(self, firsts: list[RequestOutput]
                          ) -> AsyncIterator[CompletionOutput]:
        """Every prompt's completions as they come, renumbered (see the class)."""
        if len(self.generations) == 1:  # NOTE: the common case: no tasks, no copies
            async for c in self.generations[0].completions(firsts[0]):
                yield c
            return
        streams = [self._numbered(i, g.completions(first))
                   for i, (g, first) in enumerate(zip(self.generations, firsts))]
        async for c in merged(streams):
            yield c

    async def _numbered(self, prompt_index: int, completions: AsyncIterator[CompletionOutput]
                        ) -> AsyncIterator[CompletionOutput]:
        async for c in completions:
            yield self._renumbered(prompt_index, c)

    def _renumbered(self, prompt_index: int, c: CompletionOutput) -> CompletionOutput:
        if prompt_index == 0:
            return c
        return dataclasses.replace(c, index=prompt_index * self.n + c.index)

    def usage(self, finals: list[CompletionOutput]) -> p.UsageInfo:
        """Every prompt's tokens, once each, and every completion's."""
        return p.UsageInfo.of(sum(g.prompt_tokens for g in self.generations),
                              sum(len(c.token_ids) for c in finals),
                              sum(g.cached_tokens for g in self.generations))

    def usage_so_far(self) -> p.UsageInfo:
        return p.UsageInfo.of(sum(g.prompt_tokens for g in self.generations),
                              sum(sum(g.tokens_so_far.values()) for g in self.generations),
                              sum(g.cached_tokens for g in self.generations))

    async def aclose(self) -> None:
        for g in self.generations:
            await g.aclose()


async def merged(streams: list[AsyncIterator]) -> AsyncIterator:
    """The items of several async iterators as they come; the first error ends it (and
    closes them all)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        except BaseException as exc:  # NOTE: handed to the consumer, which raises it
            await queue.put(exc)
            return
        await queue.put(done)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


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
