"""The ingress side of a replica set: an engine-like object that `build_app` serves.

`ReplicaFront` has what slotserve.server.api asks of an AsyncEngine (`generate`, `abort`,
`healthy`, `num_active`, `stop_accepting`, step listeners, and `.engine` with the
tokenizer, the limits and the counters), so the single-process server's routes, streaming,
errors, auth and limits serve the replicas unchanged. Each request goes to the replica that
the Router picks among those up.

Faults: a replica whose call fails with Ray's actor errors (its process died, or it is
restarting), or whose engine refuses as closed (its loop died, or it drains), is marked down
until a snapshot answers again. A request that got no output yet is retried on another
replica (each replica at most once); one that streamed already fails with RuntimeError (the
client gets a 500 error event). /health stays 200 while one replica is up.

Load: the sequences this ingress has in flight on each replica (admitted, not finished):
the replica's waiting + running as this ingress knows them, exact and without a poll's lag.
A poller (`poll_interval_s`) reads each replica's snapshot: up or down, its counters and its
Prometheus text, which /metrics serves with a `replica` label.

NOTE: the live view shows the sum of the replicas' counters and the ingress's latencies;
it has no per-replica slot strip (the replicas' iteration records stay in the replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from slotserve.engine.async_engine import EngineClosedError
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.outputs import RequestOutput
from slotserve.sampling import SamplingParams
from slotserve.scaleout.router import Router

logger = logging.getLogger("slotserve.scaleout")

POLL_INTERVAL_S = 0.5
SNAPSHOT_TIMEOUT_S = 5.0
ROUTING_RECORDS = 4096  # routing decisions kept for /debug/trace


@dataclass
class ReplicaState:
    """What the ingress knows of one replica."""

    name: str
    handle: object  # a DeploymentHandle
    up: bool = True
    in_flight: int = 0  # sequences admitted here by this ingress, not finished
    served: int = 0  # requests routed here
    snapshot: dict = field(default_factory=dict)


class ReplicaFront:
    """An AsyncEngine look-alike over replicas (see the module doc).

    replicas: name -> DeploymentHandle of an EngineReplica; describe: one replica's
    `describe()` (configs and tokenizer, the same for all).
    """

    def __init__(self, replicas: dict[str, object], describe: dict, router: Router, *,
                 poll_interval_s: float = POLL_INTERVAL_S) -> None:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

        self._replica_errors = (RayActorError, ReplicaUnavailableError,
                                DeploymentUnavailableError)
        self.replicas = {name: ReplicaState(name, h) for name, h in replicas.items()}
        self.router = router
        self.engine = FrontView(describe, self)
        self.poll_interval_s = poll_interval_s
        self._accepting = True
        self._active: dict[str, ReplicaState] = {}  # request id -> where it runs
        self._step_listeners: list = []
        self._poller: asyncio.Task | None = None
        self.routing: deque[dict] = deque(maxlen=ROUTING_RECORDS)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start polling the replicas (call from the serving event loop)."""
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

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

    def add_step_listener(self, callback) -> None:
        """callback([RequestOutput]) for each output passing through (the live view's
        latencies)."""
        self._step_listeners.append(callback)

    def remove_step_listener(self, callback) -> None:
        if callback in self._step_listeners:
            self._step_listeners.remove(callback)

    # ------------------------------------------------------------------ requests
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       **request_fields) -> AsyncIterator[RequestOutput]:
        """The request's outputs from the replica the router picks; retried elsewhere if
        that replica fails before its first output.

        request_fields: AsyncEngine.generate's keywords (cache_salt, priority, tenant,
        slo_ttft_ms, slo_tpot_ms), passed through to the replica's engine.
        """
        if not self._accepting:
            raise EngineClosedError("the server is shutting down")
        self.engine.tokenize(prompt_ids)  # NOTE: bad ids are a 400 here, not in a replica
        tried: set[str] = set()
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
                    self._notify(out)
                    yield out
                done = True
                return
            except self._replica_errors as exc:
                self._mark_down(replica, exc)
                if streamed:
                    raise RuntimeError(f"replica {replica.name} failed while serving this "
                                       "request") from exc
                tried.add(replica.name)
                logger.warning("%s: replica %s failed before the first output; retrying "
                               "elsewhere", request_id, replica.name)
            except Exception as exc:  # the engine's own error (ValueError, 429, ...)
                error = _unwrap(exc)
                if streamed or not isinstance(error, EngineClosedError):
                    raise error from None
                # NOTE: that replica's engine died or drains: another one may serve it
                self._mark_down(replica, error)
                tried.add(replica.name)
                logger.warning("%s: replica %s refused it (%s); retrying elsewhere",
                               request_id, replica.name, error)
            finally:
                replica.in_flight -= params.n
                self._active.pop(request_id, None)
                if not done:
                    call.cancel()  # NOTE: the replica's stream closes: it aborts the request

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

    def _notify(self, out: RequestOutput) -> None:
        for listener in list(self._step_listeners):
            try:
                listener([out])
            except Exception:
                logger.debug("step listener %r failed", listener, exc_info=True)

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
        """Read one replica's snapshot; up if it answers and its engine is healthy."""
        try:
            snapshot = await asyncio.wait_for(replica.handle.snapshot.remote(),
                                              SNAPSHOT_TIMEOUT_S)
        except Exception as exc:  # a dead, restarting or stuck replica
            self._mark_down(replica, exc)
            return
        replica.snapshot = snapshot
        if snapshot["healthy"] and not replica.up:
            logger.info("replica %s is up", replica.name)
        if not snapshot["healthy"]:
            self._mark_down(replica, RuntimeError("engine loop died"))
        replica.up = snapshot["healthy"]

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


# --------------------------------------------------------------------------- the view
class FrontView:
    """Stands for the LLMEngine where the server reads one: the tokenizer and tokenize()
    (LLMEngine's own), the limits, and the replicas' summed counters."""

    def __init__(self, describe: dict, front: ReplicaFront) -> None:
        self.model_config = describe["model_config"]
        self.tokenizer = describe["tokenizer"]
        self.scheduler = _SummedScheduler(describe, front)
        self.kv = _SummedKV(describe, front)
        self.stats = _SummedStats(front)
        self.trace = RoutingTrace(front, describe)

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        return LLMEngine.tokenize(self, prompt)  # NOTE: needs tokenizer and model_config


def _total(front: ReplicaFront, key: str) -> int:
    return sum(r.snapshot.get(key, 0) for r in front.replicas.values() if r.up)


class _SummedScheduler:
    def __init__(self, describe: dict, front: ReplicaFront) -> None:
        self.config = describe["scheduler_config"]
        self.max_total_tokens = describe["max_total_tokens"]
        self._front = front

    num_running = property(lambda self: _total(self._front, "running"))
    num_waiting = property(lambda self: _total(self._front, "waiting"))
    num_preemptions = property(lambda self: _total(self._front, "preemptions"))
    iteration = property(lambda self: _total(self._front, "iteration"))


class _SummedKV:
    def __init__(self, describe: dict, front: ReplicaFront) -> None:
        self.block_size = describe["block_size"]
        self._per_replica = describe["num_blocks"]
        self._front = front
        self.block_tables: dict = {}  # NOTE: the block map stays in the replicas

    @property
    def num_blocks(self) -> int:
        return self._per_replica * sum(r.up for r in self._front.replicas.values())

    @property
    def num_free_blocks(self) -> int:
        return _total(self._front, "kv_free")

    @property
    def usage(self) -> float:
        return 1 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


class _SummedStats:
    def __init__(self, front: ReplicaFront) -> None:
        self._front = front

    generation_tokens = property(lambda self: _total(self._front, "generation_tokens"))
    prompt_tokens = property(lambda self: _total(self._front, "prompt_tokens"))


class RoutingTrace:
    """/debug/trace of a replica set: which replica served which request and why (the
    iteration records stay in the replicas). Trace listeners are kept, never called."""

    def __init__(self, front: ReplicaFront, describe: dict) -> None:
        self._front = front
        self._describe = describe
        self._listeners: list = []
        self._lock = threading.Lock()

    def add_listener(self, callback) -> None:
        with self._lock:
            self._listeners.append(callback)

    def remove_listener(self, callback) -> None:
        with self._lock:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def export(self) -> dict:
        front = self._front
        return {"version": 1, "source": "replicas", "router": front.router.policy,
                "replicas": {r.name: {"up": r.up, "served": r.served,
                                      "in_flight": r.in_flight}
                             for r in front.replicas.values()},
                "routing": list(front.routing), "requests": [], "iterations": []}
