"""A replica set without Ray, for tests of the ingress's read side: in-process AsyncEngines
behind objects that answer like Serve's DeploymentHandles (`handle.method.remote(...)`,
awaited), so a real ReplicaFront (its polls, its iteration feed) and the live view run over
them in one process, in seconds."""

from __future__ import annotations

from slotserve.engine.async_engine import AsyncEngine
from slotserve.scaleout.feed import IterationTap


class _Method:
    """`handle.name.remote(*args)`: a coroutine that calls the replica's method."""

    def __init__(self, function) -> None:
        self.function = function

    def remote(self, *args, **kwargs):
        async def call():
            return self.function(*args, **kwargs)
        return call()


class InProcessReplica:
    """EngineReplica's read side (describe, snapshot with its IterationTap) over an
    AsyncEngine in this process. `restart(engine)` swaps in a new engine and tap, as Serve
    restarting the replica would."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self.describe = _Method(self._describe)
        self.snapshot = _Method(self._snapshot)
        self.restart(async_engine)

    def restart(self, async_engine: AsyncEngine) -> None:
        self.async_engine = async_engine
        self.tap = IterationTap(async_engine)
        self.tap.attach()

    def _describe(self) -> dict:
        engine = self.async_engine.engine
        return {"model_config": engine.model_config, "tokenizer": engine.tokenizer,
                "snapshot": self.async_engine.snapshot()}

    def _snapshot(self, cursor: int = 0, instance: str | None = None) -> dict:
        return {"healthy": self.async_engine.healthy, "engine": self.async_engine.snapshot(),
                "metrics": "", "iterations": self.tap.since(cursor, instance)}


def in_process_front(replicas: dict[str, InProcessReplica], block_size: int,
                     policy: str = "round_robin"):
    """A ReplicaFront (its router: `policy`) over in-process replicas (build it in no
    event loop, or in one: it reads the first replica's describe synchronously here)."""
    from slotserve.scaleout.front import ReplicaFront
    from slotserve.scaleout.router import Router

    first = next(iter(replicas.values()))
    router = Router(list(replicas), block_size, policy)
    return ReplicaFront(replicas, first._describe(), router)
