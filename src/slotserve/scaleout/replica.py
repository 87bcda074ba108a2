"""One engine replica: an AsyncEngine in a Ray Serve deployment (imports Ray).

Each replica is its own Serve application (`replica-0`, `replica-1`, ...) with one Serve
replica, so the ingress's router, not Serve's, decides which engine serves a request; Serve
restarts a replica whose actor dies (`EngineReplica.__init__` runs again: a cold cache).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ray import serve

from slotserve.sampling import SamplingParams

# NOTE: the engine bounds its own queue (--max-waiting: 429); Serve must not refuse first.
MAX_ONGOING_REQUESTS = 100_000


@dataclass(frozen=True)
class ReplicaSpec:
    """How to build one replica's engine (picklable: it travels to the replica's process)."""

    model: str | None
    engine_kwargs: dict
    threads: int
    max_waiting: int | None = None


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=2,
                  health_check_timeout_s=30, graceful_shutdown_timeout_s=5)
class EngineReplica:
    """An LLMEngine on `spec.threads` torch threads, streaming RequestOutputs."""

    def __init__(self, spec: ReplicaSpec, name: str) -> None:
        import torch

        from slotserve.engine.async_engine import AsyncEngine
        from slotserve.engine.llm import engine_config
        from slotserve.engine.llm_engine import LLMEngine
        from slotserve.obs.metrics import ServerMetrics
        from slotserve.scaleout.feed import IterationTap

        kwargs = dict(spec.engine_kwargs)
        if spec.max_waiting is not None:
            kwargs["max_waiting"] = spec.max_waiting
        def build() -> LLMEngine:
            engine = LLMEngine.from_config(engine_config(spec.model, **kwargs))
            # NOTE: after from_config, which sets one thread per core the process may use.
            torch.set_num_threads(spec.threads)
            return engine

        # NOTE: built in the engine thread, the only one that runs torch (launch's NOTE)
        self.async_engine = AsyncEngine.launch(build)
        self.name = name
        self.model_config = self.async_engine.engine.model_config
        self.metrics = ServerMetrics(self.async_engine)
        self.metrics.attach()
        self.tap = IterationTap(self.async_engine)
        self.tap.attach()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       **request_fields):
        """The request's outputs as the engine streams them (cancelling the call aborts it);
        request_fields: AsyncEngine.generate's keywords (cache_salt, tenant, priority, ...)."""
        async for out in self.async_engine.generate(request_id, prompt_ids, params,
                                                    **request_fields):
            yield out

    def abort(self, request_id: str) -> None:
        self.async_engine.abort(request_id)

    def stop_accepting(self) -> None:
        self.async_engine.stop_accepting()

    async def reset_prefix_cache(self) -> int:
        """Drop this engine's cached free blocks (AsyncEngine.reset_prefix_cache); how many."""
        return await self.async_engine.reset_prefix_cache()

    def describe(self) -> dict:
        """What the ingress needs to front this engine: the model config (tokenize's vocab),
        the tokenizer, a first snapshot (the limits, block size, slots) and the waiting
        bounds (max_waiting, the scheduler config's per-tenant ones: queue_bound)."""
        return {"model_config": self.model_config, "tokenizer": self.async_engine.tokenizer,
                "snapshot": self.async_engine.snapshot(), "threads": self._threads(),
                "pid": os.getpid(), "max_waiting": self.async_engine.max_waiting,
                "scheduler_config": self.async_engine.engine.scheduler_config}

    def snapshot(self, cursor: int = 0, instance: str | None = None) -> dict:
        """healthy, engine (the engine's EngineSnapshot now: frozen, picklable, no block
        map), metrics (this replica's Prometheus text) and iterations (the engine's
        iteration events after the ingress's `cursor`: IterationTap.since)."""
        return {"healthy": self.async_engine.healthy, "engine": self.async_engine.snapshot(),
                "metrics": self.metrics.render().decode(),
                "iterations": self.tap.since(cursor, instance)}

    def check_health(self) -> None:
        """Serve's health check: a dead engine loop gets the replica restarted."""
        if not self.async_engine.healthy:
            raise RuntimeError(f"{self.name}: the engine loop died")

    def __del__(self) -> None:
        engine = getattr(self, "async_engine", None)
        if engine is not None:
            engine.stop_accepting()
            engine.stop(timeout=2.0)

    @staticmethod
    def _threads() -> int:
        import torch

        return torch.get_num_threads()

