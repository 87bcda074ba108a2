"""AsyncEngine: the engine loop in a background thread, one async stream per request.

The event loop never waits on a forward pass: requests, aborts and admin actions (a
prefix-cache reset) are queued as commands (frozen dataclasses: `AddRequest`,
`AbortRequest`, `CallInEngine`) that the engine thread applies at the next iteration
boundary, and outputs travel back with `loop.call_soon_threadsafe`.

The read side passes through: `snapshot()`, `subscribe()`, `export_trace()`, `tokenize()`
are the engine's (see engine/events.py); nobody above needs `.engine`.

Fault isolation (NOTE: no request, client or tenant may harm another):
- LLMEngine.step fails only the requests that make the forward or sampling raise, and
  only the request whose output could not be built;
- a fault is any exception, a native library's panic (pyo3's PanicException, a
  BaseException) included (`isolation.is_fault`);
- a fault applying one command fails that request; one subscriber's fault is logged; a
  stream that cannot take an output (its event loop is gone) loses its request only;
- a fault that escapes step() (schedule, update) fails the requests in flight, and the
  loop goes on;
- the loop dies only if recovering fails, the engine's invariants break, or
  MAX_CONSECUTIVE_STEP_FAULTS iterations in a row raise: then `healthy` is False, every
  waiting caller gets EngineDeadError at once and new `generate` calls raise it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from slotserve.config import SchedulerConfig, tenant_waiting_bound
from slotserve.core.context_fit import check_fits_context
from slotserve.core.scheduling_fields import SchedulingFields, given_or_loose
from slotserve.engine.events import EngineSnapshot
from slotserve.engine.isolation import is_fault
from slotserve.engine.llm_engine import LLMEngine, Prompt
from slotserve.engine.outputs import RequestOutput
from slotserve.engine.sequence import build_matchers
from slotserve.sampling import SamplingParams
from slotserve.structured import StructuredOutputs

logger = logging.getLogger("slotserve.engine")

# Threads that compile structured-output grammars. NOTE: each compile is bounded by the
# server's size caps and llguidance's limits; one thread bounds the CPU that a client sending
# many distinct schemas takes from the engine's forward passes to one core.
GRAMMAR_THREADS = 1
MAX_CONSECUTIVE_STEP_FAULTS = 3  # iterations in a row whose step() raised: the engine is dead
# From idle, the first iteration waits for a burst to arrive whole (AsyncEngine.
# _settle_arrivals): polling every BURST_POLL_S while the server tokenizes requests, then
# BURST_QUIET_S for stragglers; BURST_MAX_S in all (NOTE: also the most one request's
# tokenizing can delay another's first iteration).
BURST_POLL_S = 0.001
BURST_QUIET_S = 0.01
BURST_MAX_S = 0.1


def queue_bound_of(max_waiting: int | None, config: SchedulerConfig,
                   tenant: str) -> int | None:
    """The most sequences one request of `tenant` could ever have waiting in one engine: the
    smaller of the server's bound (`max_waiting`) and the tenant's (`tenant_waiting_bound`);
    None: unbounded. NOTE: a server bound of 0 refuses every request for now (429), not for
    ever, so it bounds nothing here."""
    bounds = [b for b in (max_waiting or None, tenant_waiting_bound(config, tenant))
              if b is not None]
    return min(bounds, default=None)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (HTTP 429)."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


class EngineDeadError(EngineClosedError):
    """The engine loop stopped after a fault it could not recover from (HTTP 503)."""


def freeze_heap() -> None:
    """Collect, then freeze every object alive now (the model, the tokenizer, torch's and
    the libraries' own) out of the garbage collector's sight, as vLLM does after start-up.

    NOTE: a collection of the oldest generation scans every tracked object; with the
    start-up heap in it (~190k objects with a tiny model and SmolLM2's tokenizer) one took
    130-160 ms on this 2-core CPU and came once in ~100 steps at 256 sequences: a step
    200 ms long, a TPOT p99. Frozen, it scanned what serving allocated: ~1 ms. Objects
    frozen are still freed when their last reference goes; only a cycle among them that
    becomes garbage later is never collected until the next call (start-up objects live as
    long as the server).

    NOTE: what an earlier call froze is unfrozen first, so a process that builds engine
    after engine (the benchmarks, a fresh engine per run, each call before a run) collects
    the ones it let go. Frozen for good, each engine a W run had used stayed (+0.65 GB a
    run: `benchmarks.speculative` reached 24 GB in its last cell and was killed).
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    remaining: int  # completions not finished yet (n of them)

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    """In the streams' event loop: each output into its stream's queue."""
    for stream, out in items:
        stream.queue.put_nowait(out)


# ---------------------------------------------------------------------- commands
# What the event loop's side asks of the engine thread, applied at the next iteration
# boundary (AsyncEngine._apply). NOTE: frozen: a command is built once, then only read by
# the engine thread.
@dataclass(frozen=True)
class AddRequest:
    """Add a request whose stream is open (`_open` checked and counted it)."""

    request_id: str
    prompt_text: str | None  # the prompt as text, when it came as text
    prompt_ids: list[int]
    params: SamplingParams
    scheduling: SchedulingFields  # NOTE: checked when built, in the caller's thread
    matchers: list | None  # the grammar matchers, one per completion (None: unconstrained)
    # NOTE: when the server took the request (time.monotonic), not when the engine's thread
    # applies it: a request that waits in the queue through a long iteration waits in its
    # TTFT (the trace's, the metrics'), as vLLM stamps its arrival in the API server.
    arrival: float

    def __str__(self) -> str:
        return f"add {self.request_id}"


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request (all its completions); its blocks return at once."""

    request_id: str

    def __str__(self) -> str:
        return f"abort {self.request_id}"


@dataclass(frozen=True)
class CallInEngine:
    """Run `fn()` in the engine thread; its result or exception settles `done` in `loop`."""

    fn: Callable[[], object]
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def __str__(self) -> str:
        return f"call {getattr(self.fn, '__name__', self.fn)!s}"


Command = AddRequest | AbortRequest | CallInEngine


class AsyncEngine:
    """Thread-safe front of an LLMEngine for the server."""

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None) -> None:
        """max_waiting: the bound on waiting sequences (see `max_waiting`); by default the
        engine config's (`SchedulerConfig.max_waiting`, the `--max-waiting` flag)."""
        self.engine = engine
        # The bound on waiting SEQUENCES (None: unbounded). A request with n completions
        # counts n, from the moment `generate` admits it (before the engine thread has seen
        # it) until the scheduler runs each completion; preempted completions waiting to
        # resume count too. A request that would take the count past the bound is refused
        # with QueueFullError (HTTP 429); one whose n alone exceeds a positive bound can
        # never be admitted: ValueError (HTTP 400). NOTE: AsyncEngine's own field: the
        # scheduler never refuses a request for it.
        self.max_waiting: int | None = (engine.config.scheduler.max_waiting
                                        if max_waiting is None else max_waiting)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams, _queued_adds, _queued_seqs, _fatal
        self._queued_adds: dict[str, int] = {}  # request id -> AddRequests not applied yet
        self._queued_seqs = 0  # sequences (n per request) added, not yet seen by the engine
        # The same per tenant, for SchedulerConfig.max_waiting_per_tenant (`_check_bounds`).
        self._queued_by_tenant: dict[str, int] = {}
        self._incoming = 0  # requests the server is preparing (`incoming`)
        self._stopping = False
        self._accepting = True
        self._fatal: EngineDeadError | None = None  # set once, when the loop dies
        self._step_faults = 0  # consecutive iterations whose step() raised
        self._thread = threading.Thread(target=self._run, name="slotserve-engine", daemon=True)
        # Compiles grammars and builds matchers, off the event loop and the engine thread.
        self._grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS,
                                                thread_name_prefix="slotserve-grammar")

    @classmethod
    def launch(cls, build: Callable[[], LLMEngine], max_waiting: int | None = None
               ) -> AsyncEngine:
        """Build the engine in the engine thread and start its loop there; returns once
        `build()` returned (and raises what it raised). `start()` is then a no-op.

        NOTE: the engine thread must be the only thread that runs torch's parallel ops.
        libgomp keeps one thread team per thread that opens a parallel region; once the
        process holds more OpenMP threads than cores, every team's workers sleep between
        regions instead of spinning, and each of a step's many small ops pays a wake-up.
        Measured (SmolLM2 bf16, 2 cores): one parallel op in the main thread before the
        engine thread ran made every step 1.6-1.8x slower (13.6 -> 22.3 ms at batch 1, 31
        -> 56 ms at 32). Loading the weights is such an op, so the server builds the engine
        here rather than in its main thread.
        NOTE: once built, what is alive is frozen for the garbage collector (`freeze_heap`).
        """
        built: queue.SimpleQueue = queue.SimpleQueue()

        def build_then_run() -> None:
            try:
                async_engine = cls(build(), max_waiting)
            except BaseException as exc:  # NOTE: the caller waits on `built`: never hang it
                built.put(exc)
                return
            async_engine._thread = threading.current_thread()
            freeze_heap()
            built.put(async_engine)
            async_engine._run()

        threading.Thread(target=build_then_run, name="slotserve-engine", daemon=True).start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return result

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread (a no-op if `launch` started it)."""
        if self._thread.ident is None:
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (graceful shutdown)."""
        self._accepting = False

    @property
    def healthy(self) -> bool:
        """False once the engine loop has died (it serves nothing more; /health: 503)."""
        if self._fatal is not None:
            return False
        started = self._thread.ident is not None
        return not started or self._thread.is_alive() or self._stopping

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._streams)

    @contextlib.contextmanager
    def incoming(self):
        """Held by the server while it tokenizes a request for `generate`: the engine,
        starting its first iteration after idle, waits for such requests
        (`_settle_arrivals`), so a burst runs as one. NOTE: only the tokenizing (bounded by
        the prompt's size), not a grammar's compilation: a request refused after a long
        preparation would hold other tenants' first iterations (BURST_MAX_S at most)."""
        with self._lock:
            self._incoming += 1
        try:
            yield
        finally:
            with self._lock:
                self._incoming -= 1

    # ------------------------------------------------------------------ read side
    def snapshot(self, include_blocks: bool = False) -> EngineSnapshot:
        """The engine's `snapshot()` (any thread)."""
        return self.engine.snapshot(include_blocks)

    def subscribe(self, callback) -> None:
        """The engine's `subscribe()`: callback(IterationEvent) in the engine thread."""
        self.engine.subscribe(callback)

    def unsubscribe(self, callback) -> None:
        self.engine.unsubscribe(callback)

    def export_trace(self) -> dict:
        return self.engine.export_trace()

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """The engine's tokenizer over a prompt (thread-safe)."""
        return self.engine.tokenize(prompt)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_config.name

    @property
    def max_total_tokens(self) -> int:
        """Longest sequence (prompt + output) a request may reach."""
        return self.engine.max_total_tokens

    async def reset_prefix_cache(self) -> int:
        """Drop the cached free blocks at the next iteration boundary (running requests keep
        theirs); returns how many. EngineClosedError if the engine does not run."""
        self._raise_if_dead()
        if self._stopping or not self._thread.is_alive():
            raise EngineClosedError("the engine is not running")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._commands.put(CallInEngine(self.engine.reset_prefix_cache, done, loop))
        self._wakeup.set()
        return await done

    # ------------------------------------------------------------------ requests
    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Tokenize and check the request can ever fit; ValueError if not. Thread-safe."""
        _, ids = self.engine.tokenize(prompt)
        check_fits_context(len(ids), self.engine.max_total_tokens)
        bound = self.max_waiting
        if bound and params.n > bound:  # NOTE: a bound of 0 refuses everything: 429, not 400
            raise ValueError(f"n={params.n} completions can never be queued: this server "
                             f"queues at most {bound} sequences (--max-waiting)")
        return ids

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams, *,
                       scheduling: SchedulingFields | None = None,
                       cache_salt: str | None = None, priority: int = 0,
                       tenant: str = "default", slo_ttft_ms: float | None = None,
                       slo_tpot_ms: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (each carries deltas); aborts it if the consumer leaves.

        scheduling: the request's priority, tenant, SLOs and cache salt for the scheduling
        policy and the prefix cache (core/scheduling_fields.py; see
        `LLMEngine.add_request`), passed through as is. cache_salt, priority, tenant,
        slo_ttft_ms, slo_tpot_ms: the same one by one, only without `scheduling`; ValueError
        naming the field if malformed. A request the `deadline` policy rejects (slo_reject)
        finishes with finish_reason "rejected".
        """
        scheduling = given_or_loose(scheduling, SchedulingFields(
            priority, tenant, slo_ttft_ms, slo_tpot_ms, cache_salt))
        matchers = await self._build_matchers(params)
        stream = self._open(request_id, prompt, params, scheduling, matchers)
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

    def _open(self, request_id: str, prompt: Prompt, params: SamplingParams,
              scheduling: SchedulingFields | None = None,
              matchers: list | None = None) -> _Stream:
        arrival = time.monotonic()
        self._raise_if_dead()
        if not self._accepting or self._stopping:
            raise EngineClosedError("the server is shutting down")
        ids = self.validate(prompt, params)
        scheduling = scheduling or SchedulingFields()
        text = prompt if isinstance(prompt, str) else None
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop(), params.n)
        with self._lock:
            self._raise_if_dead()  # NOTE: under the lock that _die sweeps the streams with
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._check_bounds(scheduling.tenant, params.n)
            self._streams[request_id] = stream
            self._queued_adds[request_id] = self._queued_adds.get(request_id, 0) + 1
            self._queued_seqs += params.n
            tenant = scheduling.tenant
            self._queued_by_tenant[tenant] = self._queued_by_tenant.get(tenant, 0) + params.n
        self._commands.put(AddRequest(request_id, text, ids, params, scheduling, matchers,
                                      arrival))
        self._wakeup.set()
        return stream

    def queue_bound(self, tenant: str) -> int | None:
        """The most sequences one request of `tenant` could ever have waiting (--max-waiting,
        --max-waiting-per-tenant x its weight); None: unbounded. A request with more can
        never be queued whole: a 400, not a 429 (the server checks a prompt list with it)."""
        return queue_bound_of(self.max_waiting, self.engine.scheduler_config, tenant)

    def _check_bounds(self, tenant: str, n: int) -> None:
        """QueueFullError if n more waiting sequences would pass the server's bound or the
        tenant's (max_waiting_per_tenant x its weight). NOTE: the messages name bounds only,
        never how many sequences wait: that count is other tenants' business. Under _lock."""
        bound = self.max_waiting
        if bound is not None and self.engine.num_waiting + self._queued_seqs + n > bound:
            raise QueueFullError(f"the server's waiting queue is full (at most {bound} "
                                 "sequences, --max-waiting)")
        tenant_bound = tenant_waiting_bound(self.engine.scheduler_config, tenant)
        if tenant_bound is None:
            return
        if n > tenant_bound:  # NOTE: can never be queued: a 400, not a 429
            raise ValueError(f"n={n} completions can never be queued: your requests may "
                             f"have at most {tenant_bound} sequences waiting for a slot "
                             "(--max-waiting-per-tenant)")
        mine = self.engine.num_waiting_of(tenant) + self._queued_by_tenant.get(tenant, 0)
        if mine + n > tenant_bound:
            raise QueueFullError(f"your waiting requests are at their bound ({tenant_bound} "
                                 "sequences waiting for a slot, --max-waiting-per-tenant)")

    async def check_structured(self, spec: StructuredOutputs) -> None:
        """Compile `spec` for this engine's tokenizer on a grammar thread (cached: the
        request's own matchers are then copies); ValueError naming the field if the grammar
        engine rejects it; EngineClosedError once the engine stops."""
        self._raise_if_closed()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._grammar_pool, self.engine.grammars.compile, spec)

    async def _build_matchers(self, params: SamplingParams) -> list | None:
        """The request's grammar matchers, built on a grammar thread (None: unconstrained).

        NOTE: never on the engine thread: compiling a large spec takes up to a second, and
        every other request's next token would wait for it.
        """
        if params.structured_outputs is None:
            return None
        self._raise_if_closed()  # NOTE: a closed engine compiles nothing
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._grammar_pool, build_matchers,
                                          self.engine.grammars, params)

    def _raise_if_closed(self) -> None:
        """EngineDeadError / EngineClosedError unless the engine admits new requests."""
        self._raise_if_dead()
        if not self._accepting or self._stopping:
            raise EngineClosedError("the server is shutting down")

    def _raise_if_dead(self) -> None:
        if self._fatal is not None:
            raise EngineDeadError(str(self._fatal))

    def abort(self, request_id: str) -> None:
        """Abort by the next iteration boundary; its blocks return then."""
        self._commands.put(AbortRequest(request_id))
        self._wakeup.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # NOTE: never a silent death: callers must not hang
            logger.critical("the engine loop died", exc_info=exc)
            self._die(exc)
            return
        self._end_streams(EngineClosedError, "the server is shutting down")

    def _loop(self) -> None:
        """Iterations until stop(); raises only when the engine cannot go on."""
        idle = True
        while not self._stopping:
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                idle = True
                self._wakeup.wait(0.5)
                self._wakeup.clear()
                continue
            if idle:
                self._settle_arrivals()
                idle = False
            outputs, fault = self._step()
            self._deliver(outputs)
            if fault is not None:
                self._end_streams(RuntimeError, fault, self._orphaned)
                if self._step_faults >= MAX_CONSECUTIVE_STEP_FAULTS:
                    raise EngineDeadError(f"{self._step_faults} engine iterations in a row "
                                          f"failed; the last: {fault}")

    def _settle_arrivals(self) -> None:
        """Before the first iteration after idle: while the server tokenizes more requests
        (`incoming`) or more arrive, take them in; then, if more than the first came, wait
        BURST_QUIET_S for stragglers. BURST_MAX_S in all.

        NOTE: many clients at once reach the engine one request at a time, as the server
        parses and tokenizes each (1-8 ms apart on 2 cores). Without this the first few
        prompts ran alone, and those requests then decoded through the rest's prefill (held
        first tokens keep a burst's requests from that only among those already arrived,
        core/scheduler.py): the outliers of the burst's TPOT. A request arriving alone
        (nothing else incoming) does not wait.
        """
        deadline = time.monotonic() + BURST_MAX_S
        burst = False
        while not self._stopping and time.monotonic() < deadline:
            if not self._commands.empty():
                self._apply_commands()
                burst = True
            elif self._incoming > 0:
                burst = True
                self._wakeup.clear()
                self._wakeup.wait(BURST_POLL_S)
            elif not burst:
                return
            else:
                self._wakeup.clear()
                left = deadline - time.monotonic()
                if not (self._wakeup.wait(max(0.0, min(BURST_QUIET_S, left)))
                        or not self._commands.empty()):
                    return

    def _step(self) -> tuple[list[RequestOutput], str | None]:
        """One engine step: (outputs, None), or on a fault that escaped step()'s isolation,
        (the error results of every request in flight, the error message).

        Raises (the loop dies) if failing the requests raises or leaves the engine broken.
        """
        try:
            outputs = self.engine.step()
        except BaseException as exc:  # NOTE: a native panic too (isolation.is_fault)
            if not is_fault(exc):
                raise
            self._step_faults += 1
            logger.exception("engine iteration failed (%d in a row): failing the requests in "
                             "flight", self._step_faults)
            message = f"engine error: {type(exc).__name__}: {exc}"
            outputs = self.engine.fail_all(message)
            self.engine.check_integrity()
            return outputs, message
        self._step_faults = 0
        return outputs, None

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._apply(command)
            except BaseException as exc:  # NOTE: costs this command's request only
                if not is_fault(exc):
                    raise
                logger.exception("applying %s failed", command)
                if isinstance(command, AddRequest):
                    self._fail_streams([command.request_id],
                                       f"engine error: {type(exc).__name__}: {exc}")

    def _apply(self, command: Command) -> None:
        match command:
            case AddRequest():
                self._add(command)
            case AbortRequest(request_id=request_id):
                self.engine.abort_request(request_id)
            case CallInEngine():
                self._call(command)
            case _:
                raise TypeError(f"not an engine command: {command!r}")

    @staticmethod
    def _call(command: CallInEngine) -> None:
        """Run the command's fn() in the engine thread; its result (or exception) goes to
        its `done` future."""
        fn, done, loop = command.fn, command.done, command.loop

        def settle(method, value) -> None:
            if not done.done():
                method(value)

        try:
            result = fn()
        except BaseException as exc:
            error = exc if isinstance(exc, Exception) else RuntimeError(
                f"{type(exc).__name__}: {exc}")  # NOTE: the server's handlers catch Exception
            loop.call_soon_threadsafe(settle, done.set_exception, error)
            raise
        loop.call_soon_threadsafe(settle, done.set_result, result)

    def _add(self, command: AddRequest) -> None:
        request_id, params, tenant = command.request_id, command.params, command.scheduling.tenant
        with self._lock:
            self._queued_seqs -= params.n
            left_of_tenant = self._queued_by_tenant.pop(tenant) - params.n
            if left_of_tenant:
                self._queued_by_tenant[tenant] = left_of_tenant
            left = self._queued_adds.pop(request_id) - 1
            if left:
                self._queued_adds[request_id] = left
            stream = self._streams.get(request_id)
        if stream is None:
            return  # the client left before the engine saw the request
        try:
            self.engine.add_request(request_id, command.prompt_ids, params,
                                    arrival=command.arrival, prompt_text=command.prompt_text,
                                    grammar_matchers=command.matchers,
                                    scheduling=command.scheduling)
        except ValueError as exc:
            stream.put(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Dispatch; if that raises, the requests whose outputs may be lost fail (only they)."""
        try:
            self._dispatch(outputs)
        except BaseException as exc:
            if not is_fault(exc):
                raise
            logger.exception("dispatching the outputs failed")
            ids = list(dict.fromkeys(out.request_id for out in outputs))
            self._fail_streams(ids, f"engine error: {type(exc).__name__}: {exc}")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """One wake-up per event loop per iteration, with all its streams' outputs.

        NOTE: a wake-up per output (64 per step at 64 slots) made the event loop's thread
        preempt the two compute threads that often; now the loop takes them all at once.
        """
        with self._lock:
            targets = [(out, self._streams.get(out.request_id)) for out in outputs]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out, stream in targets:
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except Exception:  # the loop is closed: nobody can read these streams any more
                for _, out in items:
                    logger.warning("the stream of %s is gone; aborting it", out.request_id,
                                   exc_info=True)
                    with self._lock:
                        self._streams.pop(out.request_id, None)
                    self.engine.abort_request(out.request_id)

    def _fail_streams(self, request_ids: list[str], message: str) -> None:
        """End these requests in the engine and send their streams the error (each guarded)."""
        for request_id in request_ids:
            with contextlib.suppress(Exception):
                self.engine.fail_request(request_id, message)
            with self._lock:
                stream = self._streams.get(request_id)
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.put(RuntimeError(message))

    def _orphaned(self, request_id: str) -> bool:
        """The stream waits on a request that the engine no longer has nor has yet to add."""
        return request_id not in self._queued_adds and not self.engine.has_request(request_id)

    def _end_streams(self, error: type[Exception], message: str, which=None) -> None:
        """Put error(message) into every stream, or those whose request id `which` selects.

        NOTE: after a final output it is never read; before one, it ends the caller's wait.
        """
        with self._lock:
            streams = [s for rid, s in self._streams.items() if which is None or which(rid)]
        for stream in streams:
            with contextlib.suppress(Exception):
                stream.put(error(message))

    def _die(self, exc: BaseException) -> None:
        """The loop cannot go on: refuse everything, fail every waiting caller at once."""
        fatal = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"the engine stopped after an internal error: {type(exc).__name__}: {exc}")
        with self._lock:
            self._fatal = fatal
            self._accepting = False
        self._end_streams(EngineDeadError, str(fatal))
        with contextlib.suppress(Exception):  # free what it can (nothing runs any more)
            self.engine.fail_all(str(fatal))
