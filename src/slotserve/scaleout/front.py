"""The ingress side of a replica set: an engine-like object that `build_app` serves.

`ReplicaFront` has what slotserve.server.api, the live view and the metrics ask of an
AsyncEngine: `generate`, `abort`, `healthy`, `num_active`, `stop_accepting`, `tokenize`,
`tokenizer`, `model_name`, `max_total_tokens`, `queue_bound` (one replica's waiting bounds
times the replicas), `reset_prefix_cache`, `check_structured` (the grammar compiled here, with
the replicas' tokenizer, on a thread of its own), and the read side
(`snapshot`, `subscribe` / `unsubscribe`, `export_trace`), so the single-process server's
routes, streaming, errors, auth and limits serve the replicas unchanged. Each request goes
to the replica that the Router picks among those up.

Faults: a replica whose call fails with Ray's actor errors (its process died, or it is
restarting), or whose engine refuses as closed (its loop died, or it drains), is marked down
until a snapshot answers again. A request that got no output yet is retried on another
replica (each replica at most once); one that streamed already fails with RuntimeError (the
client gets a 500 error event). /health stays 200 while one replica is up.

Query of death: a replica that dies with a request on it (its actor died: RayActorError; or
its engine loop died: EngineDeadError) may have been killed by that request. Such a request
is retried at most once (MAX_RETRIES_AFTER_A_DEATH); if a second replica dies under it, it
fails with ReplicaDeathError (500) instead of going on to kill the next. Refusals before it
ran there (the replica unavailable or restarting, its engine draining) do not count.

Load: the sequences this ingress has in flight on each replica (admitted, not finished):
the replica's waiting + running as this ingress knows them, exact and without a poll's lag.
A poller (`poll_interval_s`) reads each replica's snapshot: up or down, its EngineSnapshot
and its Prometheus text, which /metrics serves with a `replica` label (each replica's own
metrics: its latency histograms and finished requests by reason).

Read side (see `snapshot`): one EngineSnapshot summed over the replicas that are up, as of
their last poll. Iterations run inside the replicas; each poll also brings a replica's
iteration events since the last one (scaleout.feed), which `subscribe` callbacks (the live
view's LiveFeed) then get, each record tagged with its replica (`"replica": name`), from the
event loop: the live view draws one slot strip per replica (`replica_views`,
`recent_iterations`) and its latency percentiles. `export_trace()` holds the routing
decisions (which replica served which request, and why) and each replica's recent
iteration records; block maps stay in the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from slotserve.engine.async_engine import EngineClosedError, EngineDeadError, queue_bound_of
from slotserve.engine.events import EngineSnapshot
from slotserve.engine.llm_engine import LLMEngine, Prompt
from slotserve.engine.outputs import RequestOutput
from slotserve.engine.sizing import eos_ids
from slotserve.sampling import SamplingParams
from slotserve.scaleout.feed import tag_events
from slotserve.scaleout.router import Router
from slotserve.scaleout.snapshots import idle_snapshot, sum_snapshots
from slotserve.structured import StructuredOutputs
from slotserve.structured.grammar import GrammarCompiler

logger = logging.getLogger("slotserve.scaleout")

POLL_INTERVAL_S = 0.5
MAX_RETRIES_AFTER_A_DEATH = 1  # see "Query of death" in the module doc
SNAPSHOT_TIMEOUT_S = 5.0
GRAMMAR_THREADS = 1  # the pre-check's grammar compiles (as AsyncEngine's, see its NOTE)
ROUTING_RECORDS = 4096  # routing decisions kept for /debug/trace
RECENT_ITERATIONS = 600  # iteration records kept per replica (the page's backfill, the trace)


class ReplicaDeathError(RuntimeError):
    """A second replica died with this request on it: it is not retried again (HTTP 500)."""


@dataclass
class ReplicaState:
    """What the ingress knows of one replica."""

    name: str
    handle: object  # a DeploymentHandle
    up: bool = True
    in_flight: int = 0  # sequences admitted here by this ingress, not finished
    served: int = 0  # requests routed here
    snapshot: dict = field(default_factory=dict)  # EngineReplica.snapshot()'s, last poll
    # Its iteration feed: the tap's instance and cursor, and the records forwarded last.
    instance: str | None = None
    cursor: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_ITERATIONS))


class ReplicaFront:
    """An AsyncEngine look-alike over replicas (see the module doc).

    replicas: name -> DeploymentHandle of an EngineReplica; describe: one replica's
    `describe()` (model config, tokenizer, a first snapshot, and its waiting bounds:
    max_waiting and scheduler_config; the same for all).
    """

    def __init__(self, replicas: dict[str, object], describe: dict, router: Router, *,
                 poll_interval_s: float = POLL_INTERVAL_S) -> None:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

        self._replica_errors = (RayActorError, ReplicaUnavailableError,
                                DeploymentUnavailableError)
        self.replicas = {name: ReplicaState(name, h) for name, h in replicas.items()}
        self.router = router
        self.model_config = describe["model_config"]
        self.tokenizer = describe["tokenizer"]
        self._first_snapshot: EngineSnapshot = describe["snapshot"]
        # One replica's waiting bounds (queue_bound). NOTE: a describe without them (a
        # test's stand-in replica) leaves the queue unbounded here; the replicas still
        # bound their own.
        self._max_waiting: int | None = describe.get("max_waiting")
        self._scheduler_config = describe.get("scheduler_config")
        self.poll_interval_s = poll_interval_s
        self._accepting = True
        self._active: dict[str, ReplicaState] = {}  # request id -> where it runs
        self._subscribers: list = []
        self._poller: asyncio.Task | None = None
        self.routing: deque[dict] = deque(maxlen=ROUTING_RECORDS)
        # The pre-check's grammars: compiled here, as each replica's engine compiles them.
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                        eos_ids(self.model_config, self.tokenizer))
        self._grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS,
                                                thread_name_prefix="slotserve-grammar")

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start polling the replicas (call from the serving event loop)."""
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    def stop_accepting(self) -> None:
        """Refuse new requests (drain); the replicas finish what they run."""
        self._accepting = False

    @property
    def healthy(self) -> bool:
        """True while at least one replica is up."""
        return any(r.up for r in self.replicas.values())

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def model_name(self) -> str:
        return self.model_config.name

    @property
    def max_total_tokens(self) -> int:
        """Longest sequence (prompt + output) a request may reach (the replicas' own)."""
        return self._first_snapshot.max_total_tokens

    def queue_bound(self, tenant: str) -> int | None:
        """The most sequences one request of `tenant` could ever have waiting: one
        replica's bound (AsyncEngine.queue_bound) times the replicas. NOTE: each prompt of
        a list is routed on its own, so a list may spread over every replica; only more
        than all of them can hold is a list that can never be queued. None: unbounded."""
        if self._scheduler_config is None:
            return None
        bound = queue_bound_of(self._max_waiting, self._scheduler_config, tenant)
        return None if bound is None else bound * len(self.replicas)

    async def check_structured(self, spec: StructuredOutputs) -> None:
        """AsyncEngine.check_structured's: `spec` compiled with the replicas' tokenizer on a
        grammar thread of this process (cached); ValueError naming the field if rejected.
        NOTE: a replica compiles it again (its own cache), off its engine thread."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._grammar_pool, self.grammars.compile, spec)

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """The engine's own tokenize (LLMEngine.tokenize: it reads `tokenizer` and
        `model_config`, which the replicas share), here, so bad prompts are a 400 at once."""
        return LLMEngine.tokenize(self, prompt)

    # ------------------------------------------------------------------ read side
    def snapshot(self, include_blocks: bool = False) -> EngineSnapshot:
        """The replicas that are up, as one engine, from their last polled snapshots.

        Summed: slots, KV blocks, counts, counters, tokens, finished requests, tenants'
        service (iteration / iterations: the replicas' together). From the first replica:
        the configuration (model, policies, block size, lengths). Slots are numbered
        replica by replica (replica k's slot i is k * its num_slots + i). NOTE: block_map is
        always None (include_blocks is ignored): block ids are per replica and the block
        tables stay in the replicas. With no replica up: the first replica's configuration,
        its pool all free and every count zero.
        """
        snaps = [r.snapshot["engine"] for r in self.replicas.values()
                 if r.up and "engine" in r.snapshot]
        return sum_snapshots(snaps) if snaps else idle_snapshot(self._first_snapshot)

    def subscribe(self, callback) -> None:
        """callback(IterationEvent) for each replica's iterations, its record tagged with the
        replica (`"replica": name`), in the event loop after each poll (see the module doc)."""
        self._subscribers.append(callback)

    def unsubscribe(self, callback) -> None:
        if callback in self._subscribers:
            self._subscribers.remove(callback)

    def replica_views(self) -> list[dict]:
        """The live view's list of replicas: name, up, num_slots, iteration (last poll)."""
        views = []
        for r in self.replicas.values():
            snap = r.snapshot.get("engine", self._first_snapshot)
            views.append({"name": r.name, "up": r.up, "num_slots": snap.num_slots,
                          "iteration": snap.iteration})
        return views

    def recent_iterations(self, per_replica: int) -> list[dict]:
        """The last `per_replica` iteration records of each replica (tagged), replica by
        replica: the live view's backfill."""
        if per_replica <= 0:
            return []
        return [record for r in self.replicas.values()
                for record in list(r.recent)[-per_replica:]]

    def export_trace(self) -> dict:
        """/debug/trace of a replica set: which replica served which request and why
        (`routing`), and each replica's recent iteration records (`replicas[name]
        ["iterations"]`, tagged). NOTE: the top-level `iterations` stays empty: the
        replicas' records interleave several engines' numbering, which the page's replay
        of one engine's trace cannot read."""
        return {"version": 1, "source": "replicas", "router": self.router.policy,
                "num_slots": self._first_snapshot.num_slots,
                "replicas": {r.name: {"up": r.up, "served": r.served,
                                      "in_flight": r.in_flight,
                                      "iterations": list(r.recent)}
                             for r in self.replicas.values()},
                "routing": list(self.routing), "requests": [], "iterations": []}

    async def reset_prefix_cache(self) -> int:
        """Reset every replica's prefix cache that is up; the cached free blocks dropped in
        all. A replica that fails as down is marked down; EngineClosedError if none reset."""
        targets = [r for r in self.replicas.values() if r.up]
        results = await asyncio.gather(*(r.handle.reset_prefix_cache.remote()
                                         for r in targets), return_exceptions=True)
        dropped, reset = 0, 0
        for replica, result in zip(targets, results):
            if isinstance(result, BaseException):
                error = _unwrap(result) if isinstance(result, Exception) else result
                if not isinstance(error, (*self._replica_errors, EngineClosedError)):
                    raise error
                self._mark_down(replica, error)
                continue
            dropped += result
            reset += 1
        if not reset:
            raise EngineClosedError("no replica is up to reset its prefix cache")
        return dropped

    # ------------------------------------------------------------------ requests
    def incoming(self) -> contextlib.AbstractContextManager:
        """Nothing to announce: each replica's engine takes its requests as they come
        (the router spreads a burst over them)."""
        return contextlib.nullcontext()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       **request_fields) -> AsyncIterator[RequestOutput]:
        """The request's outputs from the replica the router picks; retried elsewhere if
        that replica fails before its first output (after a replica died under it: once,
        see "Query of death" in the module doc).

        request_fields: AsyncEngine.generate's keywords (cache_salt, priority, tenant,
        slo_ttft_ms, slo_tpot_ms), passed through to the replica's engine.
        """
        if not self._accepting:
            raise EngineClosedError("the server is shutting down")
        self.tokenize(prompt_ids)  # NOTE: bad ids are a 400 here, not in a replica
        tried: set[str] = set()
        deaths = 0  # replicas that died with this request on them
        while True:
            replica = self._route(request_id, prompt_ids, tried)
            streamed = done = False
            self._active[request_id] = replica
            replica.in_flight += params.n
            call = replica.handle.options(stream=True).generate.remote(
                request_id, prompt_ids, params, **request_fields)
            try:
                async for out in call:
                    streamed = True
                    yield out
                done = True
                return
            except self._replica_errors as exc:
                self._mark_down(replica, exc)
                if streamed:
                    raise RuntimeError(f"replica {replica.name} failed while serving this "
                                       "request") from exc
                tried.add(replica.name)
                deaths += self._died_under(exc)
                self._check_deaths(request_id, replica, deaths, exc)
                logger.warning("%s: replica %s failed before the first output; retrying "
                               "elsewhere", request_id, replica.name)
            except Exception as exc:  # the engine's own error (ValueError, 429, ...)
                error = _unwrap(exc)
                if streamed or not isinstance(error, EngineClosedError):
                    raise error from None
                # NOTE: that replica's engine died or drains: another one may serve it
                self._mark_down(replica, error)
                tried.add(replica.name)
                deaths += self._died_under(error)
                self._check_deaths(request_id, replica, deaths, error)
                logger.warning("%s: replica %s refused it (%s); retrying elsewhere",
                               request_id, replica.name, error)
            finally:
                replica.in_flight -= params.n
                self._active.pop(request_id, None)
                if not done:
                    call.cancel()  # NOTE: the replica's stream closes: it aborts the request

    @staticmethod
    def _died_under(error: BaseException) -> bool:
        """The replica died while the request was on it (not a refusal before it ran):
        its actor died (Ray's RayActorError) or its engine loop did (EngineDeadError)."""
        from ray.exceptions import RayActorError

        return isinstance(error, (RayActorError, EngineDeadError))

    @staticmethod
    def _check_deaths(request_id: str, replica: ReplicaState, deaths: int,
                      error: BaseException) -> None:
        """ReplicaDeathError once more replicas died under the request than it may be
        retried after (it may be what kills them: a query of death)."""
        if deaths > MAX_RETRIES_AFTER_A_DEATH:
            logger.error("%s: replica %s died with it too (%d replicas in all): not retried "
                         "again", request_id, replica.name, deaths)
            raise ReplicaDeathError(
                f"{deaths} replicas died while serving this request (the last: "
                f"{replica.name}); it is not retried again, as it may be what kills "
                "them") from error

    def _route(self, request_id: str, prompt_ids: list[int], tried: set[str]) -> ReplicaState:
        loads = {r.name: r.in_flight for r in self.replicas.values()
                 if r.up and r.name not in tried}
        if not loads:
            raise EngineClosedError("no replica is up to serve this request")
        choice = self.router.pick(prompt_ids, loads)
        replica = self.replicas[choice.replica]
        replica.served += 1
        self.routing.append({"request_id": request_id, "replica": choice.replica,
                             "reason": choice.reason, "time": time.time(),
                             "retry": bool(tried)})
        return replica

    def abort(self, request_id: str) -> None:
        """Abort on the replica that runs it (its stream ends with finish_reason abort)."""
        replica = self._active.get(request_id)
        if replica is not None:
            replica.handle.abort.remote(request_id)

    # ------------------------------------------------------------------ health
    def _mark_down(self, replica: ReplicaState, exc: BaseException) -> None:
        if replica.up:
            logger.warning("replica %s is down: %s", replica.name, type(exc).__name__)
        replica.up = False
        self.router.forget(replica.name)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(r) for r in self.replicas.values()))
            await asyncio.sleep(self.poll_interval_s)

    async def poll(self, replica: ReplicaState) -> None:
        """Read one replica's snapshot and new iterations (forwarded to the subscribers);
        up if it answers and its engine is healthy."""
        try:
            snapshot = await asyncio.wait_for(
                replica.handle.snapshot.remote(replica.cursor, replica.instance),
                SNAPSHOT_TIMEOUT_S)
        except Exception as exc:  # a dead, restarting or stuck replica
            self._mark_down(replica, exc)
            return
        self._forward_iterations(replica, snapshot.pop("iterations", None))
        replica.snapshot = snapshot
        if snapshot["healthy"] and not replica.up:
            logger.info("replica %s is up", replica.name)
        if not snapshot["healthy"]:
            self._mark_down(replica, RuntimeError("engine loop died"))
        replica.up = snapshot["healthy"]

    def _forward_iterations(self, replica: ReplicaState, feed: dict | None) -> None:
        """Hand a replica's new iteration events (IterationTap.since's answer) to the
        subscribers, tagged; a subscriber's error is logged, never stops the poller."""
        if feed is None:
            return
        restarted = replica.instance is not None and feed["instance"] != replica.instance
        if restarted:
            replica.recent.clear()
        replica.instance, replica.cursor = feed["instance"], feed["cursor"]
        if feed["missed"]:
            logger.debug("replica %s: %d iterations were not forwarded (the tap was full)",
                         replica.name, feed["missed"])
        for event in tag_events(feed, replica.name, restarted):
            replica.recent.append(event.record)
            for callback in list(self._subscribers):
                try:
                    callback(event)
                except Exception:
                    logger.exception("an iteration subscriber failed")

    async def wait_all_up(self, timeout_s: float) -> None:
        """Poll until every replica answers (tests; startup); TimeoutError if not."""
        deadline = time.monotonic() + timeout_s
        while True:
            await asyncio.gather(*(self.poll(r) for r in self.replicas.values()))
            if all(r.up for r in self.replicas.values()):
                return
            if time.monotonic() > deadline:
                down = [r.name for r in self.replicas.values() if not r.up]
                raise TimeoutError(f"replicas not up after {timeout_s}s: {down}")
            await asyncio.sleep(0.2)

    def metrics_text(self) -> bytes:
        """The replicas' last Prometheus texts merged, each sample with a `replica` label."""
        from slotserve.scaleout.metrics import merge_replica_metrics

        return merge_replica_metrics({r.name: r.snapshot.get("metrics", "")
                                      for r in self.replicas.values()})


def _unwrap(exc: Exception) -> Exception:
    """The replica's own exception out of Ray's RayTaskError (its message, its type)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc
