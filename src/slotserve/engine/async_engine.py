"""AsyncEngine: the engine loop in a background thread, one async stream per request.

The event loop never waits on a forward pass: requests and aborts are queued as commands
that the engine thread applies at the next iteration boundary, and outputs travel back
with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from slotserve.engine.llm_engine import LLMEngine, Prompt
from slotserve.engine.outputs import RequestOutput
from slotserve.sampling import SamplingParams

logger = logging.getLogger("slotserve.engine")


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (HTTP 429)."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    remaining: int  # completions not finished yet (n of them)

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Thread-safe front of an LLMEngine for the server."""

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None) -> None:
        """max_waiting: if given, sets the engine's SchedulerConfig.max_waiting (the bound
        AsyncEngine enforces); by default the engine's config holds it already."""
        self.engine = engine
        if max_waiting is not None:
            self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _queued
        self._queued = 0  # added, not yet seen by the engine thread
        self._stopping = False
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="slotserve-engine", daemon=True)
        self._step_listeners: list = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (graceful shutdown)."""
        self._accepting = False

    def add_step_listener(self, callback) -> None:
        """callback(list[RequestOutput]) after every iteration, in the engine thread."""
        self._step_listeners.append(callback)

    def remove_step_listener(self, callback) -> None:
        if callback in self._step_listeners:
            self._step_listeners.remove(callback)

    @property
    def max_waiting(self) -> int | None:
        """The bound on waiting requests (None: unbounded): SchedulerConfig.max_waiting."""
        return self.engine.scheduler_config.max_waiting

    @max_waiting.setter
    def max_waiting(self, value: int | None) -> None:
        scheduler = self.engine.scheduler
        scheduler.config = replace(scheduler.config, max_waiting=value)

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._streams)

    # ------------------------------------------------------------------ requests
    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Tokenize and check the request can ever fit; ValueError if not. Thread-safe."""
        _, ids = self.engine.tokenize(prompt)
        limit = self.engine.scheduler.max_total_tokens
        if len(ids) >= limit:
            raise ValueError(
                f"prompt has {len(ids)} tokens, but this server fits at most {limit} tokens "
                "per sequence; the prompt and at least one output token must fit")
        return ids

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (each carries deltas); aborts it if the consumer leaves."""
        stream = self._open(request_id, prompt, params)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.outputs[0].finished:
                    stream.remaining -= 1
                finished = stream.remaining == 0
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    def _open(self, request_id: str, prompt: Prompt, params: SamplingParams) -> _Stream:
        if not self._accepting or self._stopping:
            raise EngineClosedError("the server is shutting down")
        ids = self.validate(prompt, params)
        text = prompt if isinstance(prompt, str) else None
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop(), params.n)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            waiting = self.engine.scheduler.num_waiting + self._queued
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise QueueFullError(f"{waiting} requests are waiting (--max-waiting)")
            self._streams[request_id] = stream
            self._queued += 1
        self._commands.put(("add", request_id, (text, ids), params))
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort by the next iteration boundary; its blocks return then."""
        self._commands.put(("abort", request_id, None, None))
        self._wakeup.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while not self._stopping:
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # NOTE: the loop survives; the requests in flight fail
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            self._dispatch(outputs)
            for listener in list(self._step_listeners):
                listener(outputs)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, request_id, prompt, params = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(request_id, prompt, params)
            else:
                self.engine.abort_request(request_id)

    def _add(self, request_id: str, prompt: tuple, params: SamplingParams) -> None:
        text, ids = prompt
        with self._lock:
            self._queued -= 1
            stream = self._streams.get(request_id)
        if stream is None:
            return  # the client left before the engine saw the request
        try:
            self.engine.add_request(request_id, ids, params, prompt_text=text)
        except ValueError as exc:
            stream.put(exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)

    def _fail_all(self, exc: Exception) -> None:
        """A step raised outside the forward: end every request, keep the thread alive."""
        self.engine.abort_all()
        with contextlib.suppress(Exception):  # NOTE: a second fault must not kill the thread
            self.engine.step()  # drains the abort outputs; the streams get the error below
        with self._lock:
            for stream in self._streams.values():
                stream.put(RuntimeError(f"engine error: {exc}"))
